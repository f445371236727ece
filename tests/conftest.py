"""Shared fixtures: one local Ray instance for the whole test session, a tiny tokenizer for training tests.

Ray 2.60 uses token authentication for every local cluster and, on a machine
without one, writes a new token into ``~/.ray/auth_token``. The test session
brings a token of its own (``RAY_AUTH_TOKEN_PATH``, inherited by every Ray
process and job it starts), so tests pass with an empty ``HOME`` and never read
or write the user's ``~/.ray``.
"""

from __future__ import annotations

import os
import secrets
import shutil
import tempfile
from pathlib import Path

import pytest


def pytest_configure(config: pytest.Config) -> None:
    folder = Path(tempfile.mkdtemp(prefix="speed-test-ray-"))
    token = folder / "auth_token"
    token.write_text(secrets.token_hex(32))  # what `ray get-auth-token --generate` writes: 256 random bits
    token.chmod(0o600)
    os.environ.pop("RAY_AUTH_TOKEN", None)  # takes precedence over the path
    os.environ["RAY_AUTH_TOKEN_PATH"] = str(token)
    config.add_cleanup(lambda: shutil.rmtree(folder, ignore_errors=True))


@pytest.fixture(scope="session")
def ray_session():
    """A private local Ray (2 CPUs, no dashboard) shared by every @pytest.mark.ray test; shut down at the end.

    ``address="local"`` always starts a new instance, so a test never joins another
    cluster running on this machine (``ray.init()`` alone would attach to the last
    one started with ``ray start``).
    """
    import ray

    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=True)
    yield ray
    ray.shutdown()


@pytest.fixture(scope="session")
def tiny_tokenizer(tmp_path_factory):
    """A 300-piece SentencePiece model trained on the first 40 pretraining documents (~2 s)."""
    from speed.data import load_records
    from speed.tokenizer import train_tokenizer

    path = tmp_path_factory.mktemp("tokenizer") / "spm.model"
    train_tokenizer(load_records("pretrain", "train", limit=40)["text"], path, vocab_size=300)
    return path


@pytest.fixture
def memory_store():
    """A ``memory://`` URI (fsspec's in-memory file system, through speed.storage) standing in for object
    storage; the store is emptied afterwards."""
    from fsspec.implementations.memory import MemoryFileSystem

    yield "memory://bucket/store"
    MemoryFileSystem.store.clear()
    MemoryFileSystem.pseudo_dirs[:] = [""]


# A real S3 API on loopback (tests/s3_helpers.py): its address is in the environment from the start, so that
# every Ray process and job the session starts inherits it; the ``s3_bucket`` fixture starts the server.
pytest_plugins = ["s3_helpers"]
