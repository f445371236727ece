"""`ray start` for one more node of a cluster on this machine, on 127.0.0.1: ``python ray_join.py --address ...``.

Ray 2.60 ties two things to one switch (``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER``, read at import): off, every
server binds loopback but `ray start --address` refuses to join ("Multi-node Ray clusters are not
supported"); on, it joins but replaces ``--node-ip-address 127.0.0.1`` with the machine's address. This runs
Ray's CLI with the switch on for the join check only and the address kept; the processes it starts (raylet,
agents, workers) inherit the switch off from the environment (tests/cluster_helpers.py ``LOOPBACK_ENV``).
"""

import sys

from ray._private import ray_constants, services

ray_constants.ENABLE_RAY_CLUSTER = True  # the join check in `ray start`
services.resolve_ip_for_localhost = lambda host: host  # keep 127.0.0.1 (and the GCS address) as given

from ray.scripts.scripts import main  # noqa: E402 (after the switch, which its import reads)

sys.exit(main())
