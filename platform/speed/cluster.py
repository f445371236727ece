"""The code a Ray job runs: this process's ``speed`` package, shipped to every worker of the job.

A job sent with ``ray job submit --working-dir .`` runs its entry point inside a
copy of the submitted folder; the ``jobs/`` scripts put that copy's
``platform/`` first on ``sys.path``, so the driver imports the submitted
``speed``. Ray workers (Train workers, Serve replicas) start elsewhere, on
nodes that may hold another copy of the project or none: ``code_runtime_env``
names the driver's package in the runtime environment's ``py_modules``, so Ray
uploads it once and puts it first on every worker's ``PYTHONPATH``.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from speed.paths import DATA_DIR_ENV, data_dir

# Set by the job manager for an entry point started by `ray job submit` (ray._private.runtime_env.constants).
JOB_CONFIG_ENV = "RAY_JOB_CONFIG_JSON_ENV_VAR"


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
