"""A real S3 API on loopback: moto's standalone server (``moto[server]``, a test extra) in a subprocess.

The code under test talks HTTP to it through ``pyarrow.fs`` as it would to AWS, told where it is the way
users tell it: ``AWS_ENDPOINT_URL``, with (dummy) credentials and a region in the environment. The plugin
sets these when the session is configured, before any Ray process or job subprocess starts, so every one of
them inherits the address; the server itself starts with the first test that asks for ``s3_bucket`` and is
stopped when the session ends, passed or failed. Each test gets a bucket of its own. Its port is held until
then (bound, not listening, ``SO_REUSEADDR``, which lets the server bind it too): otherwise any process on the
machine asking for a free port (a Ray worker) may be given it in the minutes before the server starts.

    pytest_plugins = ["s3_helpers"]   # tests/conftest.py; then a test takes the ``s3_bucket`` fixture
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pyarrow.fs as pafs
import pytest

HOST = "127.0.0.1"
# What a user sets to reach MinIO or any S3-compatible server (docs/training.md, "Storage"). Credentials are
# dummies the server accepts; the instance metadata service is off, so nothing waits on a lookup that cannot
# answer; anything that would steer requests elsewhere (a profile, an S3-only endpoint) is dropped.
SESSION_ENV = {
    "AWS_ACCESS_KEY_ID": "speed-test",
    "AWS_SECRET_ACCESS_KEY": "speed-test-secret",
    "AWS_DEFAULT_REGION": "us-east-1",
    "AWS_EC2_METADATA_DISABLED": "true",
}
DROPPED_ENV = ("AWS_PROFILE", "AWS_SESSION_TOKEN", "AWS_ENDPOINT_URL_S3", "AWS_REGION", "AWS_CONFIG_FILE")
START_TIMEOUT_S = 60.0


def reserved_port() -> socket.socket:
    """A loopback port kept from everyone but a server that binds it with ``SO_REUSEADDR`` (moto's does): a
    socket bound to it, not listening; close it once the server listens."""
    held = socket.socket()
    held.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    held.bind((HOST, 0))
    return held


_held: list[socket.socket] = []  # the session's S3 port, until its server listens


def endpoint() -> str:
    """The session's S3 endpoint, ``http://127.0.0.1:<port>`` (``AWS_ENDPOINT_URL``)."""
    return os.environ["AWS_ENDPOINT_URL"]


@contextmanager
def moto_server(url: str, log: Path) -> Iterator[subprocess.Popen]:
    """moto's S3-compatible server listening at ``url`` (loopback) while the block runs; its log in ``log``."""
    port = url.rsplit(":", 1)[1]
    with log.open("wb") as out:
        server = subprocess.Popen(
            [sys.executable, "-m", "moto.server", "-H", HOST, "-p", port], stdout=out, stderr=subprocess.STDOUT
        )
    try:
        _wait_listening(int(port), server, log)
        yield server
    finally:
        server.terminate()
        try:
            server.wait(timeout=10)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()


def _wait_listening(port: int, server: subprocess.Popen, log: Path) -> None:
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        if server.poll() is not None:
            raise RuntimeError(f"moto server exited with status {server.returncode}:\n{log.read_text()}")
        with socket.socket() as s:
            if s.connect_ex((HOST, port)) == 0:
                return
        time.sleep(0.1)
    raise RuntimeError(f"moto server did not listen on {HOST}:{port} within {START_TIMEOUT_S:.0f}s")


def create_bucket(name: str | None = None) -> str:
    """Create a bucket (``speed-<random>`` unless named) on the session's server; returns ``s3://<name>``.

    ``S3FileSystem()`` does not read ``AWS_ENDPOINT_URL`` (``FileSystem.from_uri`` does): the endpoint is explicit.
    """
    name = name or f"speed-{uuid.uuid4().hex[:12]}"
    pafs.S3FileSystem(endpoint_override=endpoint(), allow_bucket_creation=True).create_dir(name)
    return f"s3://{name}"


# ----- the pytest plugin ----------------------------------------------------------------------------------


def pytest_configure(config: pytest.Config) -> None:
    for name in DROPPED_ENV:
        os.environ.pop(name, None)
    os.environ.update(SESSION_ENV)
    _held.append(reserved_port())  # the server takes this port when it starts
    os.environ["AWS_ENDPOINT_URL"] = f"http://{HOST}:{_held[0].getsockname()[1]}"


@pytest.fixture(scope="session")
def s3_server(tmp_path_factory) -> Iterator[str]:
    """The session's S3 server, started on first use; yields its endpoint URL."""
    with moto_server(endpoint(), tmp_path_factory.mktemp("s3") / "moto.log"):
        while _held:
            _held.pop().close()
        yield endpoint()


@pytest.fixture
def s3_bucket(s3_server) -> str:
    """A new, empty bucket for this test: ``s3://speed-<random>``."""
    return create_bucket()
