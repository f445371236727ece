"""A job's private local Ray that leaves nothing behind, even when the driver is killed.

``start()`` starts it on loopback only (``speed.cluster.local_ray_options``; ``$SPEED_RAY_NODE_IP`` opens it) and
marks the driver's environment with ``SPEED_RAY_OWNER=<token>``
before ``ray.init``, so that every process of this Ray (GCS, raylet, dashboard,
runtime-env and dashboard agents, workers) inherits the mark, and gives Ray a
temp folder of its own. A watchdog, this file run as a script in a session of
its own, holds a pipe from the driver: when the driver ends, however it ends
(a clean exit, Ctrl-C, SIGKILL), the pipe closes and the watchdog ends exactly
the marked processes, then removes the temp folder. Ray's own reaper covers
only the driver's process group; its agents and workers can outlive it.

Stdlib only: the watchdog runs as ``python local_ray.py TOKEN TEMP_DIR [SPARED PID...]``
(spared: processes marked before Ray started, the driver and the shell that set
the token). Needs Linux's ``/proc`` to find the marked processes (elsewhere the
watchdog only removes the temp folder).
"""

from __future__ import annotations

import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

OWNER_ENV = "SPEED_RAY_OWNER"  # set by the driver (or by whoever starts it, e.g. a test) before ray.init
GRACE_S = 5.0  # between SIGTERM and SIGKILL
PREEMPTION_WATCHER_ENV = "RAY_TRAIN_ENABLE_PREEMPTION_WATCHER"  # Ray Train 2.60's switch, default on

_watchdog: subprocess.Popen | None = None  # held for the driver's lifetime: its stdin pipe must stay open


def start(num_cpus: int | None = None, runtime_env: dict | None = None) -> str:
    """Start a private local Ray for this driver, with the watchdog; returns the owner token.

    A token already in ``$SPEED_RAY_OWNER`` is kept (a caller that wants to find the
    processes afterwards sets it). ``runtime_env``: the job's, for ``ray.init``.
    """
    import ray

    from speed.cluster import local_ray_options

    token = os.environ.setdefault(OWNER_ENV, secrets.token_hex(8))
    # One node has no other node to be preempted: Ray Train's preemption watcher would only cost every run one more
    # actor process (~4 CPU-seconds of imports each). Read by Ray Train in this driver, so set before any run.
    os.environ.setdefault(PREEMPTION_WATCHER_ENV, "0")
    # Short and under /tmp: Ray's unix socket paths inside it are length-limited.
    temp_dir = tempfile.mkdtemp(prefix="speed-ray-", dir="/tmp" if Path("/tmp").is_dir() else None)
    # Marked before Ray starts (the driver, and the shell or test that set the token): not Ray's, never ended.
    spared = [str(pid) for pid in marked_processes(token)]
    global _watchdog
    _watchdog = subprocess.Popen(
        [sys.executable, __file__, token, temp_dir, *spared],
        stdin=subprocess.PIPE,  # the driver holds the write end until it ends: then the watchdog reads EOF
        start_new_session=True,  # outside the driver's process group: Ctrl-C and Ray's reaper do not reach it
        close_fds=True,
    )
    options = {"num_cpus": num_cpus, "_temp_dir": temp_dir, "log_to_driver": True, "runtime_env": runtime_env}
    ray.init(address="local", **options, **local_ray_options())  # on loopback unless opened
    return token


def marked_processes(token: str, exclude: set[int] = frozenset(), name: str = OWNER_ENV) -> list[int]:
    """Running processes whose initial environment holds ``SPEED_RAY_OWNER=<token>`` (``name=<token>``).

    Never the caller itself nor its ancestors (a shell that exported the token), nor ``exclude``.
    """
    mark = f"{name}={token}".encode()
    exclude = set(exclude) | _ancestry()
    found = []
    for entry in Path("/proc").iterdir() if Path("/proc").is_dir() else ():
        if not entry.name.isdigit() or int(entry.name) in exclude:
            continue
        try:
            if mark in (entry / "environ").read_bytes().split(b"\0") and _running(int(entry.name)):
                found.append(int(entry.name))
        except OSError:  # gone meanwhile, or another user's
            continue
    return sorted(found)


def end_processes(pids: list[int], grace_s: float = GRACE_S) -> None:
    """SIGTERM ``pids``, then SIGKILL those still running after ``grace_s`` seconds."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for pid in pids:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        deadline = time.time() + grace_s
        while sig == signal.SIGTERM and time.time() < deadline and any(_running(p) for p in pids):
            time.sleep(0.2)


def _ancestry() -> set[int]:
    """This process and its ancestors."""
    chain, pid = set(), os.getpid()
    while pid > 1 and pid not in chain:
        chain.add(pid)
        try:
            pid = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            break
    return chain


def _running(pid: int) -> bool:
    """Alive and not a zombie (a zombie is dead, waiting for its parent to collect it)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def _watch(token: str, temp_dir: str, spared: set[int]) -> None:
    """Wait for the driver to end (EOF on stdin), then end its marked processes and remove ``temp_dir``."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    while sys.stdin.buffer.read(4096):
        pass
    time.sleep(1.0)  # a driver that exits cleanly is shutting Ray down itself: let it
    for _ in range(3):  # processes being started while the driver died show up a moment later
        pids = marked_processes(token, exclude=spared)
        if not pids:
            break
        end_processes(pids)
    shutil.rmtree(temp_dir, ignore_errors=True)


if __name__ == "__main__":
    _watch(sys.argv[1], sys.argv[2], {int(pid) for pid in sys.argv[3:]})
