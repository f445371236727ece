"""The code a Ray job runs: this process's ``speed`` package, shipped to every worker of the job.

A job sent with ``ray job submit --working-dir .`` runs its entry point inside a
copy of the submitted folder; the ``jobs/`` scripts put that copy's
``platform/`` first on ``sys.path``, so the driver imports the submitted
``speed``. Ray workers (Train workers, Serve replicas) start elsewhere, on
nodes that may hold another copy of the project or none: ``code_runtime_env``
names the driver's package in the runtime environment's ``py_modules``, so Ray
uploads it once and puts it first on every worker's ``PYTHONPATH``.

A local Ray the project starts (a job without ``$RAY_ADDRESS``, the test
suite's) listens on loopback only: ``ray.init(address="local", ...,
**local_ray_options())``; ``$SPEED_RAY_NODE_IP`` opens it on purpose.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from speed.paths import DATA_DIR_ENV, data_dir

# Set by the job manager for an entry point started by `ray job submit` (ray._private.runtime_env.constants).
JOB_CONFIG_ENV = "RAY_JOB_CONFIG_JSON_ENV_VAR"
LOOPBACK = "127.0.0.1"
NODE_IP_ENV = "SPEED_RAY_NODE_IP"  # a local Ray's node address when not loopback: opened beyond it on purpose


def package_dir() -> Path:
    """The folder of the ``speed`` package this process imported."""
    return Path(__file__).resolve().parent


def submitted_runtime_env() -> dict[str, Any]:
    """The runtime environment the job was submitted with (empty outside a submitted job)."""
    config = os.environ.get(JOB_CONFIG_ENV)
    return (json.loads(config).get("runtime_env") or {}) if config else {}


def code_runtime_env() -> dict[str, Any]:
    """The runtime environment for ``ray.init``: ship this ``speed`` to the workers.

    Empty when the submitter already set ``py_modules``: Ray refuses to merge
    the field, and whoever set it has chosen the code explicitly.
    """
    submitted = submitted_runtime_env()
    if "py_modules" in submitted:
        return {}
    env: dict[str, Any] = {"py_modules": [str(package_dir())]}
    # The shipped copy lives in Ray's runtime resources, where ``<repo>/../shared/data`` does not exist:
    # tell the workers where the driver found the local corpora.
    local = data_dir()
    if local.is_dir() and "env_vars" not in submitted:
        env["env_vars"] = {DATA_DIR_ENV: str(local.resolve())}
    return env


def local_ray_options() -> dict[str, Any]:
    """``ray.init`` options that put every process of a new local Ray (``address="local"``) on loopback: the
    GCS, the raylet, the agents, the workers (Train's, Serve's) all listen on 127.0.0.1 only, unless
    ``$SPEED_RAY_NODE_IP`` names another address of this machine (opened on purpose, to reach it from elsewhere).

    Ray 2.60 binds its servers to the node's address, ``_node_ip_address``, but replaces a loopback one with
    the machine's address (which most then serve on every interface) unless its single-node switch is on:
    ``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0``, which Ray reads once, when ``ray`` is imported (``ray start``
    takes it from the environment: ``tests/cluster_helpers.py``). On loopback this sets the switch in this
    process, so call it just before starting the local Ray: the process is then a single-node driver, which
    must not join a Ray on other machines afterwards (it would tell them its address is 127.0.0.1). With
    ``$SPEED_RAY_NODE_IP`` the switch is left alone and Ray's servers listen on that address or on every
    interface, as Ray's own defaults do.
    """
    from ray._private import ray_constants  # Ray's private module: where the switch read at import lives

    address = os.environ.get(NODE_IP_ENV, "").strip() or LOOPBACK
    if address == LOOPBACK:
        ray_constants.ENABLE_RAY_CLUSTER = False
    return {"_node_ip_address": address}


def start_local_ray(num_cpus: int | None = None) -> None:
    """A private local Ray for a benchmark's Serve app (``jobs/bench_serve.py``, ``jobs/soak.py``): this
    machine's CPUs (or ``num_cpus``), no dashboard, on loopback, this ``speed`` shipped to its workers, and
    the workers at the driver's priority (Ray starts them at niceness 15, so that other work on the machine
    would slow the server and not the client)."""
    import ray

    os.environ.setdefault("RAY_worker_niceness", "0")
    ray.init(
        address="local",
        num_cpus=num_cpus or os.cpu_count(),
        include_dashboard=False,
        log_to_driver=False,
        runtime_env=code_runtime_env(),
        **local_ray_options(),
    )
