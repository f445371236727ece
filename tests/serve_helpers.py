"""Serve on the test session's Ray: one shutdown that returns only once Serve is gone.

``serve.shutdown()`` can return while the controller is still ending: under load its proxies' graceful stop runs
past its 5 s and they are force-killed after the call. A module that then calls ``serve.start`` connects to that
dying controller ("Connecting to existing Serve app"), whose teardown kills the new proxy before it runs
(``ActorDiedError ... killed by ray.kill``, seen in a full run at load 22): every test of that module errors at
setup, and the next module finds a Serve with another port. So each module's teardown waits for the controller
and every proxy to be gone.
"""

from __future__ import annotations

import time

SERVE_GONE_S = 60  # a controller's teardown under a loaded machine (proxies 5 s each, replicas' graceful stops)


def serve_actors() -> list[str]:
    """The names of Serve's live named actors (its controller and proxies) on the connected Ray."""
    import ray.util
    from ray.serve._private.constants import SERVE_NAMESPACE

    return [a["name"] for a in ray.util.list_named_actors(all_namespaces=True) if a["namespace"] == SERVE_NAMESPACE]


def shutdown_serve(timeout_s: float = SERVE_GONE_S) -> None:
    """``serve.shutdown()``, then wait until Serve's controller and proxies have ended; fails past ``timeout_s``."""
    from ray import serve

    serve.shutdown()
    deadline = time.monotonic() + timeout_s
    while left := serve_actors():
        if time.monotonic() > deadline:
            raise TimeoutError(f"Serve's actors still alive {timeout_s:.0f} s after serve.shutdown(): {left}")
        time.sleep(0.2)
