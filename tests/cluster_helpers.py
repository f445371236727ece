"""A real `ray start --head` cluster on loopback for job-API tests, stopped by ending exactly its processes.

The cluster gets its own --temp-dir and explicit free ports, and token
authentication on explicitly, with the test session's token (conftest:
``RAY_AUTH_TOKEN_PATH``), whatever ~/.ray holds or however empty $HOME is. Every
process it starts inherits an owner mark (``speed.train.local_ray``), by which
exactly those processes are ended (never `ray stop`, which would end every Ray
on the machine). It listens on loopback only (``LOOPBACK_ENV``, as in the
clusters/README.md flow).
"""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
import socket
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

from speed.train.local_ray import OWNER_ENV, end_processes, marked_processes

RAY = str(Path(sys.executable).parent / "ray")
# Ray's single-node switch (named for Windows and macOS, honoured on Linux): the node's address is 127.0.0.1, so the
# GCS, the raylet, the agents, the metrics servers and the Ray client server bind loopback. Without it Ray replaces
# `--node-ip-address 127.0.0.1` with the machine's address and most of them bind every interface.
LOOPBACK_SWITCH = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"  # in-process: speed.cluster.loopback_options
LOOPBACK_ENV = {LOOPBACK_SWITCH: "0"}


def free_ports(n: int) -> list[int]:
    """``n`` distinct loopback ports free right now."""
    sockets = [socket.socket() for _ in range(n)]
    for s in sockets:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in sockets]
    for s in sockets:
        s.close()
    return ports


@contextlib.contextmanager
def local_cluster(num_cpus: int = 2, keep_pythonpath: bool = True) -> Iterator[tuple[str, dict[str, str]]]:
    """A Ray head on 127.0.0.1 with token auth; yields (dashboard address, environment for the `ray` CLI).

    Its processes are those whose environment holds ``env[OWNER_ENV]`` (``marked_processes``).

    ``keep_pythonpath=False`` starts the cluster without ``$PYTHONPATH``, so that its
    workers see only what is installed in the virtualenv (and what a job ships).
    """
    temp = tempfile.mkdtemp(prefix="rayjob", dir="/tmp")  # short: Ray's unix socket paths are length-limited
    drop = {"RAY_ADDRESS"} | (set() if keep_pythonpath else {"PYTHONPATH"})
    env = {k: v for k, v in os.environ.items() if k not in drop}
    env["PATH"] = f"{Path(sys.executable).parent}:{env['PATH']}"  # the job's `python` is this venv's
    # Token auth on both sides, told explicitly (the job CLI sends the token only when told to).
    env["RAY_AUTH_MODE"] = "token"
    env |= LOOPBACK_ENV
    token = env[OWNER_ENV] = secrets.token_hex(8)  # every process of this cluster inherits the mark
    try:
        # A second try on fresh ports: another Ray on the machine may take a port between our probe and its bind.
        for attempt in (1, 2):
            dashboard, started = _start_head(num_cpus, temp, env)
            if started.returncode == 0:
                break
            output = started.stdout[-3000:] + started.stderr[-3000:]
            print(f"ray start failed ({started.returncode}, attempt {attempt}):\n{output}", file=sys.stderr)
            end_processes(marked_processes(token))
        else:
            raise RuntimeError("ray start failed twice (its output is above)")
        yield f"http://127.0.0.1:{dashboard}", env
    finally:
        end_processes(marked_processes(token))
        shutil.rmtree(temp, ignore_errors=True)


def _start_head(num_cpus: int, temp: str, env: dict[str, str]) -> tuple[int, subprocess.CompletedProcess]:
    """`ray start --head` on loopback with every port explicit and free; (dashboard port, the finished command)."""
    gcs, dashboard, node, objects, client, agent, agent_grpc, env_agent, metrics = free_ports(9)
    command = [
        RAY, "start", "--head", "--node-ip-address", "127.0.0.1", "--port", str(gcs), "--num-cpus", str(num_cpus),
        "--include-dashboard", "true", "--dashboard-host", "127.0.0.1", "--dashboard-port", str(dashboard),
        "--node-manager-port", str(node), "--object-manager-port", str(objects),
        "--ray-client-server-port", str(client), "--dashboard-agent-listen-port", str(agent),
        "--dashboard-agent-grpc-port", str(agent_grpc), "--runtime-env-agent-port", str(env_agent),
        "--metrics-export-port", str(metrics), "--temp-dir", temp, "--disable-usage-stats",
    ]  # fmt: skip
    return dashboard, subprocess.run(command, env=env, capture_output=True, text=True, timeout=180)
