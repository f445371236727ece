"""The real cluster client: `ray start --head` on loopback, `ray job submit jobs/pretrain.py`, check, stop.

The cluster (tests/cluster_helpers.py) gets its own --temp-dir and explicit free
ports, and is stopped by ending exactly the processes it started, found by the
owner mark in their environment (never `ray stop`, which would end every Ray on
the machine).
Jobs run as real processes: stopped with Ctrl-C or SIGKILL, rerun, resumed.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import signal
import subprocess
import sys
import time
from pathlib import Path

import cluster_helpers
import pytest

from speed.checkpoint import load_model, newest_complete_checkpoint
from speed.paths import data_dir, repo_root
from speed.train.local_ray import OWNER_ENV, marked_processes
from speed.train.state import load_training_state

pytestmark = [pytest.mark.ray, pytest.mark.slow]


@pytest.fixture
def local_cluster():
    """A 2-CPU Ray head on 127.0.0.1 (tests/cluster_helpers.py); yields (dashboard address, env for the CLI)."""
    with cluster_helpers.local_cluster(num_cpus=2) as cluster:
        yield cluster


def test_ray_job_submit_pretrains_and_checkpoints(local_cluster, tiny_tokenizer, tmp_path):
    address, env = local_cluster
    storage = tmp_path / "runs"
    flags = ["--preset", "tiny", "--pattern", "2x3", "--limit", "40", "--tokenizer", str(tiny_tokenizer)]
    flags += ["--batch-size", "4", "--max-steps", "4", "--checkpoint-every", "2", "--cpus-per-worker", "1"]
    submit = [cluster_helpers.RAY, "job", "submit", "--address", address, "--working-dir", str(repo_root())]
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
    assert loaded.tokenizer_path is not None and Path(loaded.tokenizer_path).read_bytes() == tiny_tokenizer.read_bytes()


# ----- a run stopped by Ctrl-C or killed resumes from its newest complete checkpoint, leaving no process --------


def _launch(storage: Path, tokenizer: Path, token: str, log: Path, *extra: str) -> subprocess.Popen:
    """``jobs/pretrain.py`` with a private local Ray whose processes carry ``SPEED_RAY_OWNER=token``."""
    flags = ["--preset", "tiny", "--pattern", "2x2", "--limit", "40", "--tokenizer", str(tokenizer)]
    flags += ["--batch-size", "4", "--max-steps", "5000", "--checkpoint-every", "5", "--log-every", "500"]
    flags += ["--cpus-per-worker", "1", "--storage-path", str(storage), *extra]
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"} | {OWNER_ENV: token}
    command = [sys.executable, str(repo_root() / "jobs" / "pretrain.py"), *flags]
    with log.open("w") as out:  # its own session: Ctrl-C reaches its whole process group, as in a terminal
        return subprocess.Popen(command, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)


def _wait(
    condition, what: str, timeout_s: float = 300.0, process: subprocess.Popen | None = None, log: Path | None = None
):
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        value = condition()
        if value:
            return value
        if process is not None and process.poll() is not None:
            tail = "\n".join(log.read_text(errors="replace").splitlines()[-40:]) if log else ""
            raise AssertionError(f"the job ended (status {process.poll()}) before {what}; its log ends:\n{tail}")
        time.sleep(0.5)
    raise AssertionError(f"timed out after {timeout_s:.0f} s waiting for {what}")


def _newest_step(storage: Path) -> int:
    """The step of the newest complete checkpoint in the storage's one run (0 while there is none)."""
    runs = list(storage.glob("pretrain-pretrain-2x2-*"))
    newest = newest_complete_checkpoint(str(runs[0])) if runs else None
    return int(newest.rsplit("_", 1)[1]) if newest else 0


def _steps_on_storage(storage: Path) -> tuple[int, int]:
    """(newest complete checkpoint, newest checkpoint folder, complete or not): at most one interval apart."""
    folders = [int(p.name.rsplit("_", 1)[1]) for p in storage.glob("pretrain-pretrain-2x2-*/checkpoint_[0-9]*")]
    return _newest_step(storage), max(folders, default=0)


def _resumed_at(log: Path) -> int | None:
    found = re.search(r"resumed at step (\d+) from (\S+)", log.read_text())
    return int(found.group(1)) if found else None


def _check_resumed(log: Path, newest: int) -> int:
    """The run resumed from the newest complete checkpoint on storage."""
    resumed = _resumed_at(log)
    assert resumed == newest, f"resumed at {resumed}, newest complete checkpoint {newest}: {log.read_text()[-3000:]}"
    return resumed


def test_a_stopped_run_resumes_from_its_newest_checkpoint_and_leaves_no_process(tiny_tokenizer, tmp_path):
    storage = tmp_path / "runs"
    tokens = [secrets.token_hex(8) for _ in range(3)]
    logs = [tmp_path / f"launch{i}.log" for i in range(3)]

    # 1. Ctrl-C (SIGINT to the job's process group) once a few checkpoints are on storage.
    first = _launch(storage, tiny_tokenizer, tokens[0], logs[0])
    _wait(lambda: _newest_step(storage) >= 10, "checkpoint 10", process=first, log=logs[0])
    os.killpg(first.pid, signal.SIGINT)
    first.wait(timeout=120)
    _wait(lambda: not marked_processes(tokens[0]), "the first run's Ray processes to end", timeout_s=60)

    # 2. The same command resumes from the newest complete checkpoint; then its driver is SIGKILLed.
    newest, folder = _steps_on_storage(storage)
    assert folder - newest <= 5  # at most the checkpoint being written when stopped is lost
    second = _launch(storage, tiny_tokenizer, tokens[1], logs[1])
    _wait(lambda: _resumed_at(logs[1]) is not None, "the second run to resume", process=second, log=logs[1])
    resumed = _check_resumed(logs[1], newest)
    _wait(lambda: _newest_step(storage) >= resumed + 10, "two more checkpoints", process=second, log=logs[1])
    assert marked_processes(tokens[1]), "the second run's Ray processes carry the owner mark"
    second.kill()  # the driver alone: Ray's processes would outlive it
    second.wait(timeout=30)
    _wait(lambda: not marked_processes(tokens[1]), "the killed run's Ray processes to end", timeout_s=60)

    # 3. And again, for six steps: it resumes from the newest complete checkpoint the killed run left.
    newest, folder = _steps_on_storage(storage)
    assert folder - newest <= 5
    third = _launch(storage, tiny_tokenizer, tokens[2], logs[2], "--stop-at-step", str(newest + 6))
    assert third.wait(timeout=600) == 0, logs[2].read_text()[-3000:]
    _check_resumed(logs[2], newest)
    assert f"(step {newest + 6})" in logs[2].read_text()
    _wait(lambda: not marked_processes(tokens[2]), "the finished run's Ray processes to end", timeout_s=60)
