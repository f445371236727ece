"""The real cluster client: `ray start --head` on loopback, `ray job submit jobs/pretrain.py`, check, stop.

The cluster gets its own --temp-dir and explicit free ports, and is stopped by
ending exactly the processes it started (never `ray stop`, which would end every
Ray on the machine).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from speed.checkpoint import load_model
from speed.paths import data_dir, repo_root
from speed.train.state import load_training_state

pytestmark = [pytest.mark.ray, pytest.mark.slow]

RAY = str(Path(sys.executable).parent / "ray")


def _free_ports(n: int) -> list[int]:
    sockets = [socket.socket() for _ in range(n)]
    for s in sockets:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in sockets]
    for s in sockets:
        s.close()
    return ports


def _processes_of(marker: str) -> list[int]:
    """Processes whose command line names ``marker`` (this cluster's temp dir), plus all their descendants."""
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


def _stop(marker: str) -> None:
    pids = _processes_of(marker)
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


@pytest.fixture
def local_cluster():
    """A 2-CPU Ray head on 127.0.0.1 with explicit ports; yields (dashboard address, env for the CLI)."""
    temp = tempfile.mkdtemp(prefix="rayjob", dir="/tmp")  # short: Ray's unix socket paths are length-limited
    gcs, dashboard, node, objects, client, agent, agent_grpc, env_agent, metrics = _free_ports(9)
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env["PATH"] = f"{Path(sys.executable).parent}:{env['PATH']}"  # the job's `python` is this venv's
    # Ray 2.60 clusters use token auth when a token exists (~/.ray/auth_token); the job CLI only sends
    # it when told to, so both sides are told explicitly.
    env["RAY_AUTH_MODE"] = "token"
    command = [
        RAY, "start", "--head", "--node-ip-address", "127.0.0.1", "--port", str(gcs), "--num-cpus", "2",
        "--include-dashboard", "true", "--dashboard-host", "127.0.0.1", "--dashboard-port", str(dashboard),
        "--node-manager-port", str(node), "--object-manager-port", str(objects),
        "--ray-client-server-port", str(client), "--dashboard-agent-listen-port", str(agent),
        "--dashboard-agent-grpc-port", str(agent_grpc), "--runtime-env-agent-port", str(env_agent),
        "--metrics-export-port", str(metrics), "--temp-dir", temp, "--disable-usage-stats",
    ]  # fmt: skip
    try:
        subprocess.run(command, check=True, env=env, capture_output=True, text=True, timeout=180)
        yield f"http://127.0.0.1:{dashboard}", env
    finally:
        _stop(temp)
        shutil.rmtree(temp, ignore_errors=True)


def test_ray_job_submit_pretrains_and_checkpoints(local_cluster, tiny_tokenizer, tmp_path):
    address, env = local_cluster
    storage = tmp_path / "runs"
    flags = ["--preset", "tiny", "--pattern", "2x3", "--limit", "40", "--tokenizer", str(tiny_tokenizer)]
    flags += ["--batch-size", "4", "--max-steps", "4", "--checkpoint-every", "2", "--cpus-per-worker", "1"]
    submit = [RAY, "job", "submit", "--address", address, "--working-dir", str(repo_root())]
    submit += ["--runtime-env-json", json.dumps({"env_vars": {"SPEED_DATA_DIR": str(data_dir())}})]
    submit += ["--", "python", "jobs/pretrain.py", *flags, "--storage-path", str(storage)]
    done = subprocess.run(submit, env=env, capture_output=True, text=True, timeout=600)
    output = done.stdout + done.stderr
    assert done.returncode == 0 and "succeeded" in output, output[-4000:]

    (run,) = [p for p in storage.iterdir() if p.name.startswith("pretrain-pretrain-2x3-")]
    checkpoints = sorted(p.name for p in run.glob("checkpoint_*") if p.is_dir())
    assert checkpoints == ["checkpoint_00000002", "checkpoint_00000004"]
    final = run / checkpoints[-1]
    assert f"pretrained checkpoint: {final}" in output
    assert load_training_state(final).step == 4
    loaded = load_model(final)
    assert loaded.model.config.pattern == "2x3" and loaded.config["job"]["train"]["max_steps"] == 4
    assert loaded.tokenizer_path is not None and loaded.tokenizer_path.read_bytes() == tiny_tokenizer.read_bytes()
