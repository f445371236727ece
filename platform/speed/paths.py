"""Where the project, its local corpora and this node's spool live."""

from __future__ import annotations

import os
from pathlib import Path

DATA_DIR_ENV = "SPEED_DATA_DIR"
SPOOL_DIR_ENV = "SPEED_SPOOL_DIR"
TRAIN_LOG_FILE = "train_log.parquet"  # a training run's per-step log, beside its checkpoints (speed.train.state)


def repo_root() -> Path:
    """The project checkout: the folder holding ``platform/``, ``jobs/`` and ``tests/``."""
    return Path(__file__).resolve().parents[2]


def data_dir() -> Path:
    """The local corpora: ``$SPEED_DATA_DIR`` when set, else ``<repo>/../shared/data``."""
    override = os.environ.get(DATA_DIR_ENV)
    return Path(override).expanduser() if override else repo_root().parent / "shared" / "data"


def spool_dir() -> Path:
    """This node's spool, the local disk where rows bound for an object store wait for their upload
    (``speed.serve.sink``): ``$SPEED_SPOOL_DIR`` when set, else ``$XDG_CACHE_HOME/speed/spool``, else
    ``~/.cache/speed/spool``."""
    override = os.environ.get(SPOOL_DIR_ENV)
    if override:
        return Path(override).expanduser()
    cache = os.environ.get("XDG_CACHE_HOME")
    return (Path(cache).expanduser() if cache else Path.home() / ".cache") / "speed" / "spool"


def checkout_env() -> dict[str, str]:
    """This process's environment with this checkout's ``platform/`` first on ``PYTHONPATH``: a Python started
    with it imports this speed, whatever the virtualenv has installed."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(repo_root() / "platform"), env.get("PYTHONPATH")) if p)
    return env
