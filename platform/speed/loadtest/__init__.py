"""Load tools for a running Serve app: the load generator (``loadgen``) and the soak (``soak``); neither is part
of the server."""
