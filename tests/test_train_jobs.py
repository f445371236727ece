"""Training jobs as real processes (``jobs/pretrain.py`` with its private local Ray): stopped with Ctrl-C or
SIGKILL, rerun, resumed from the newest complete checkpoint, leaving no process; that private Ray listens on
loopback only (`ray job submit` of the same job to a real cluster: tests/test_cluster.py)."""

from __future__ import annotations

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

from speed.models.checkpoint import newest_complete_checkpoint
from speed.paths import repo_root
from speed.train.local_ray import OWNER_ENV, PREEMPTION_WATCHER_ENV, end_processes, marked_processes
from speed.train.state import load_training_state

pytestmark = [pytest.mark.ray, pytest.mark.slow]


# ----- a run stopped by Ctrl-C or killed resumes from its newest complete checkpoint, leaving no process --------


@pytest.fixture
def launch(tiny_tokenizer, tmp_path):
    """Starts ``jobs/pretrain.py`` runs of one storage folder; whatever they left running, pass or fail, is ended
    at teardown: each job's process group and every process of its private Ray (found by its owner mark)."""
    storage = tmp_path / "runs"
    started: list[tuple[subprocess.Popen, str]] = []

    def start(*extra: str) -> tuple[subprocess.Popen, Path, str]:
        token = secrets.token_hex(8)
        log = tmp_path / f"launch{len(started)}.log"
        process = _launch(storage, tiny_tokenizer, token, log, *extra)
        started.append((process, token))
        return process, log, token

    yield storage, start
    for process, token in started:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait(timeout=30)
        end_processes(marked_processes(token))
    assert not [t for _, t in started if marked_processes(t)], "a job's Ray processes outlived the test"


def _launch(storage: Path, tokenizer: Path, token: str, log: Path, *extra: str) -> subprocess.Popen:
    """``jobs/pretrain.py`` with a private local Ray whose processes carry ``SPEED_RAY_OWNER=token``."""
    flags = ["--preset", "tiny", "--pattern", "2x2", "--limit", "40", "--tokenizer", str(tokenizer)]
    flags += ["--batch-size", "4", "--max-steps", "5000", "--checkpoint-every", "5", "--log-every", "500"]
    flags += ["--cpus-per-worker", "1", "--storage-path", str(storage), *extra]
    # No $RAY_ADDRESS: the job starts its own Ray; and no loopback switch from the test: the job sets its own.
    # Nor the suite's Ray Train settings: the job's private Ray makes its own (speed.train.local_ray).
    own = ("RAY_ADDRESS", cluster_helpers.LOOPBACK_SWITCH, PREEMPTION_WATCHER_ENV)
    env = {k: v for k, v in os.environ.items() if k not in own}
    env[OWNER_ENV] = token
    command = [sys.executable, str(repo_root() / "jobs" / "pretrain.py"), *flags]
    with log.open("w") as out:  # its own session: Ctrl-C reaches its whole process group, as in a terminal
        return subprocess.Popen(command, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)


def _tail(log: Path | None, lines: int = 40) -> str:
    return "\n".join(log.read_text(errors="replace").splitlines()[-lines:]) if log and log.exists() else ""


def _wait(
    condition,
    what: str,
    timeout_s: float = 180.0,
    process: subprocess.Popen | None = None,
    log: Path | None = None,
    stall_s: float = 90.0,
):
    """Poll ``condition`` until it holds; fail at once, with the log's tail, when the job ends first or its log
    has not grown for ``stall_s`` seconds."""
    deadline = time.time() + timeout_s
    size, grew = -1, time.time()
    while time.time() < deadline:
        value = condition()
        if value:
            return value
        if process is not None and process.poll() is not None:
            raise AssertionError(f"the job ended (status {process.poll()}) before {what}; its log ends:\n{_tail(log)}")
        if log is not None and log.exists() and log.stat().st_size != size:
            size, grew = log.stat().st_size, time.time()
        if log is not None and time.time() - grew > stall_s:
            raise AssertionError(f"the job's log stood still for {stall_s:.0f} s before {what}:\n{_tail(log)}")
        time.sleep(0.5)
    raise AssertionError(f"timed out after {timeout_s:.0f} s waiting for {what}; the log ends:\n{_tail(log)}")


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
    """The step the driver said the run resumes at (``speed.train.launch.train_stage``), None before it said so."""
    found = re.search(r"resuming at step (\d+) from (\S+)", log.read_text())
    return int(found.group(1)) if found else None


def _run_until_stopped(storage: Path, start, stop, at_least: int, watch=None) -> tuple[int, Path, subprocess.Popen]:
    """Starts the job, lets it write checkpoints up to ``at_least`` (calling ``watch(token)`` at every poll
    meanwhile), stops it with ``stop(process)`` and waits for every Ray process of it to end; returns the newest
    complete checkpoint it left (at most the checkpoint being written when stopped is lost), its log and its
    process."""
    process, log, token = start()

    def reached() -> bool:
        if watch is not None:
            watch(token)
        return _newest_step(storage) >= at_least

    _wait(reached, f"checkpoint {at_least}", process=process, log=log)
    assert marked_processes(token), "the run's Ray processes carry the owner mark"
    stop(process)
    _wait(lambda: not marked_processes(token), "the stopped run's Ray processes to end", timeout_s=60, log=log)
    newest, folder = _steps_on_storage(storage)
    assert newest >= at_least and folder - newest <= 5
    return newest, log, process


def _says_it_resumes(log: Path, process: subprocess.Popen, newest: int) -> None:
    resumed = _wait(lambda: _resumed_at(log), "the relaunch to say it resumes", timeout_s=120, process=process, log=log)
    assert resumed == newest, f"resumed at {resumed}, newest complete checkpoint {newest}:\n{_tail(log)}"


def test_a_run_stopped_by_ctrl_c_and_then_killed_resumes_each_time_from_its_newest_checkpoint_leaving_no_process(
    launch,
):
    """One run stopped twice, as a user would: first Ctrl-C (SIGINT to the job's process group, as a terminal
    sends it), then SIGKILL to the relaunched driver alone (Ray's processes would outlive it but for the private
    Ray's watchdog). Each relaunch of the same command says it resumes from the newest complete checkpoint and
    does; the last finishes six steps later. Three launches of the job prove both stops (each costs a Ray start).

    While the first launch trains, every listener of its private Ray is recorded (``speed.train.local_ray``,
    started without $RAY_ADDRESS): the driver, the GCS, the raylet, the agents and the Train workers listen on
    loopback only (before ``speed.cluster.local_ray_options``, 20 of 23 listeners were on every interface), torch's
    TCPStore too, on the rank-0 Train worker (``speed.train.process_group``; before it, on every interface)."""
    storage, start = launch
    seen: set[cluster_helpers.Listener] = set()

    def record_listeners(token: str) -> None:
        seen.update(cluster_helpers.listeners(marked_processes(token)))  # the driver carries the mark too

    def ctrl_c(process: subprocess.Popen) -> None:
        os.killpg(process.pid, signal.SIGINT)
        process.wait(timeout=120)

    def kill(process: subprocess.Popen) -> None:
        process.kill()
        process.wait(timeout=30)

    after_ctrl_c, first_log, _ = _run_until_stopped(storage, start, ctrl_c, 10, watch=record_listeners)
    # By checkpoint 10 every process is up, the Train worker in its training loop. Its title names the actor call it
    # runs: `run_train_fn` returns once the loop's thread starts, and the controller's `poll_status` calls follow.
    names = {s.name for s in seen}
    train_workers = {s.pid for s in seen if s.name.startswith(cluster_helpers.TRAIN_WORKER)}
    assert {"gcs_server", "raylet"} <= names and train_workers, names
    assert not any(n.startswith("ray::Preemption") for n in names), names  # one node: no preemption watcher
    beyond = {s for s in seen if not cluster_helpers.is_loopback(s.ip)}
    assert not beyond, f"beyond loopback: {sorted(beyond)}"
    after_kill, log, killed = _run_until_stopped(storage, start, kill, after_ctrl_c + 10)
    _says_it_resumes(log, killed, after_ctrl_c)  # what the second launch said before it was killed

    again, log, token = start("--stop-at-step", str(after_kill + 6))
    _says_it_resumes(log, again, after_kill)
    assert again.wait(timeout=300) == 0, _tail(log, 80)
    text = log.read_text()
    assert f"from {storage}" in text and f"(step {after_kill + 6})" in text, _tail(log)
    assert load_training_state(newest_complete_checkpoint(str(next(storage.glob("pretrain-*"))))).step == after_kill + 6
    _wait(lambda: not marked_processes(token), "the finished run's Ray processes to end", timeout_s=60, log=log)
