"""The private local Ray's clean-up: marked processes are found, ended, and ended by the watchdog."""

from __future__ import annotations

import os
import secrets
import signal
import subprocess
import sys
import time

import speed.train.local_ray as local_ray
from speed.train.local_ray import OWNER_ENV, end_processes, marked_processes


def _marked_sleeper(token: str) -> subprocess.Popen:
    """A marked ``sleep``, returned once its environment shows in /proc: Popen returns when the exec has closed the
    child's descriptors, a moment before the kernel sets up the new environment (read meanwhile, it is empty)."""
    sleeper = subprocess.Popen(["sleep", "120"], env={**os.environ, OWNER_ENV: token})
    deadline = time.monotonic() + 10
    while f"{OWNER_ENV}={token}".encode() not in open(f"/proc/{sleeper.pid}/environ", "rb").read().split(b"\0"):
        assert time.monotonic() < deadline, "the sleeper's environment never showed"
        time.sleep(0.01)
    return sleeper


def test_marked_processes_are_found_and_ended():
    token = secrets.token_hex(8)
    sleeper, other = _marked_sleeper(token), _marked_sleeper(secrets.token_hex(8))
    try:
        assert marked_processes(token) == [sleeper.pid]  # not the other token's, not this process
        assert marked_processes(token, exclude={sleeper.pid}) == []
        end_processes(marked_processes(token))
        assert sleeper.wait(timeout=10) == -signal.SIGTERM and marked_processes(token) == []
        assert other.poll() is None
    finally:
        other.kill()
        other.wait()


def test_the_watchdog_ends_them_when_the_driver_goes(tmp_path):
    token = secrets.token_hex(8)
    temp_dir = tmp_path / "ray-temp"
    temp_dir.mkdir()
    spared, sleeper = _marked_sleeper(token), _marked_sleeper(token)
    watchdog = subprocess.Popen(
        [sys.executable, local_ray.__file__, token, str(temp_dir), str(spared.pid)], stdin=subprocess.PIPE
    )
    try:
        time.sleep(1.0)
        assert sleeper.poll() is None and temp_dir.is_dir()  # the driver (the open pipe) is still there
        watchdog.stdin.close()  # the driver ends
        assert watchdog.wait(timeout=30) == 0
        assert sleeper.wait(timeout=5) == -signal.SIGTERM and not temp_dir.exists()
        assert spared.poll() is None  # marked before Ray started: not Ray's
    finally:
        for process in (spared, sleeper):
            process.kill()
            process.wait()
