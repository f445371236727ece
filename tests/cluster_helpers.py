"""A real `ray start --head` cluster on loopback for job-API tests, and stopping exactly its processes.

The cluster gets its own --temp-dir, explicit free ports and its own token file
(token authentication on, whatever ~/.ray holds or however empty $HOME is). It is
stopped by ending exactly the processes it started, never with `ray stop`, which
would end every Ray on the machine.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

RAY = str(Path(sys.executable).parent / "ray")


def free_ports(n: int) -> list[int]:
    """``n`` distinct loopback ports free right now."""
    sockets = [socket.socket() for _ in range(n)]
    for s in sockets:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in sockets]
    for s in sockets:
        s.close()
    return ports


def processes_of(marker: str) -> list[int]:
    """Processes whose command line names ``marker`` (a cluster's temp dir), plus all their descendants."""
    parents: dict[int, int] = {}
    roots = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            parents[int(entry.name)] = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        if marker in cmdline:
            roots.append(int(entry.name))
    found, frontier = set(roots), list(roots)
    while frontier:
        pid = frontier.pop()
        children = [child for child, parent in parents.items() if parent == pid and child not in found]
        found.update(children)
        frontier.extend(children)
    return sorted(found)


def _alive(pid: int) -> bool:
    """Running (a zombie, already dead and waiting to be reaped, is not)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def stop_processes_of(marker: str) -> None:
    """SIGTERM the processes of ``marker``, then SIGKILL whatever is left after 5 s."""
    pids = processes_of(marker)
    for pid in pids:
        try:
            os.kill(pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
    deadline = time.time() + 5
    while time.time() < deadline and any(_alive(pid) for pid in pids):
        time.sleep(0.5)
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


@contextlib.contextmanager
def local_cluster(num_cpus: int = 2, keep_pythonpath: bool = True) -> Iterator[tuple[str, dict[str, str]]]:
    """A Ray head on 127.0.0.1 with token auth; yields (dashboard address, environment for the `ray` CLI).

    ``keep_pythonpath=False`` starts the cluster without ``$PYTHONPATH``, so that its
    workers see only what is installed in the virtualenv (and what a job ships).
    """
    temp = tempfile.mkdtemp(prefix="rayjob", dir="/tmp")  # short: Ray's unix socket paths are length-limited
    token = Path(temp) / "auth_token"
    token.write_text(secrets.token_hex(32))
    drop = {"RAY_ADDRESS", "RAY_AUTH_TOKEN"} | (set() if keep_pythonpath else {"PYTHONPATH"})
    env = {k: v for k, v in os.environ.items() if k not in drop}
    env["PATH"] = f"{Path(sys.executable).parent}:{env['PATH']}"  # the job's `python` is this venv's
    # Token auth on explicitly, with a token of this cluster's own: the server and the CLI both read these.
    env["RAY_AUTH_MODE"] = "token"
    env["RAY_AUTH_TOKEN_PATH"] = str(token)
    try:
        # A second try on fresh ports: another Ray on the machine may take a port between our probe and its bind.
        for attempt in (1, 2):
            dashboard, started = _start_head(num_cpus, temp, env)
            if started.returncode == 0:
                break
            output = started.stdout[-3000:] + started.stderr[-3000:]
            print(f"ray start failed ({started.returncode}, attempt {attempt}):\n{output}", file=sys.stderr)
            stop_processes_of(temp)
        else:
            raise RuntimeError("ray start failed twice (its output is above)")
        yield f"http://127.0.0.1:{dashboard}", env
    finally:
        stop_processes_of(temp)
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
