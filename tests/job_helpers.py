"""Loading a job script of ``jobs/`` as a module, so a test calls its ``main`` (or a helper) in this process."""

from __future__ import annotations

import importlib.util
from types import ModuleType

from speed.paths import repo_root


def job_module(name: str) -> ModuleType:
    """``jobs/<name>.py`` as a fresh module (``<name>_job``), executed once."""
    spec = importlib.util.spec_from_file_location(f"{name}_job", repo_root() / "jobs" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
