"""The real job: ``jobs/serve.py`` started as a user starts it (its own Ray), answering, stopped by SIGTERM to its
process or its process group; every answered row is on disk as Parquet when it exits. Apart from
tests/test_serve_app.py (the shared deployment) so that the two run side by side."""

from __future__ import annotations

import os
import re
import secrets
import signal
import subprocess
import sys
import time

import pandas as pd
import pytest
import requests
from test_serve_app import _free_port, _parquet_rows, _tiny_checkpoint

from speed.loadtest.loadgen import LoadConfig, run_load
from speed.paths import repo_root
from speed.serve.readers import read_requests, read_traces

pytestmark = pytest.mark.ray


@pytest.mark.slow
@pytest.mark.parametrize("to", ["process", "group"])
def test_sigterm_stops_jobs_serve_with_every_answered_row_on_disk(tiny_tokenizer, tmp_path, to):
    """``kill`` (the job's process: Serve drains, the replica writes Parquet) or a SIGTERM to the whole process
    group (systemd's default, a terminal: Ray's own processes die at once; the job writes the replicas' logs as
    Parquet before it exits).
    The job requires an API key from ``$SPEED_API_KEY``; it never shows in its output or its files."""
    _tiny_checkpoint(tiny_tokenizer, tmp_path / "ckpt")
    stats, port, key = tmp_path / "stats", _free_port(), secrets.token_hex(16)
    url = f"http://127.0.0.1:{port}"
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env |= {"SPEED_API_KEY": key, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(repo_root() / "platform")}
    command = [sys.executable, "jobs/serve.py", "--checkpoint", str(tmp_path / "ckpt"), "--port", str(port)]
    command += ["--stats-path", str(stats), "--model-name", "tiny", "--num-cpus", "0.5"]
    command += ["--set", "flush_s=600", "--set", "max_source_len=48", "--set", "max_tokens=6"]
    output = tmp_path / "serve.log"
    with open(output, "wb") as log:
        job = subprocess.Popen(
            command, cwd=repo_root(), env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )
    try:
        deadline = time.monotonic() + 600  # a Ray start and a model load on a loaded machine
        while time.monotonic() < deadline and job.poll() is None:
            try:
                if requests.get(url + "/healthz", timeout=10).status_code == 200:
                    break
            except requests.RequestException:
                pass
            time.sleep(1)
        assert job.poll() is None, output.read_text()
        bearer = {"Authorization": f"Bearer {key}"}
        refused = [
            requests.get(url + "/v1/models", timeout=30),
            requests.post(url + "/v1/completions", json={"prompt": "x"}, timeout=30),
            requests.post(url + "/v1/completions", json={"prompt": "x"}, headers={"Authorization": "Bearer no"}),
        ]
        assert [r.status_code for r in refused] == [401, 401, 401]
        assert refused[0].json()["error"]["code"] == "invalid_api_key"
        assert requests.get(url + "/v1/models", headers=bearer, timeout=30).json()["data"][0]["id"] == "tiny"
        prompts = ["A dog runs.", "Two cats sleep.", "Rain falls.", "A man sings.", "Kids play ball.", "Sun."]
        load = run_load(LoadConfig(url=url, concurrency=2, requests=6, max_tokens=6, api_key=key), prompts)
        assert load.summary()["errors"] == 0 and key not in repr(load) + repr(LoadConfig(api_key=key))
        answered = load.table["request_id"].to_pylist()
        started = time.monotonic()
        if to == "process":
            job.send_signal(signal.SIGTERM)
        else:
            os.killpg(job.pid, signal.SIGTERM)
        code = job.wait(timeout=180)
        took = time.monotonic() - started
    finally:
        if job.poll() is None:
            os.killpg(job.pid, signal.SIGKILL)
    text = output.read_text()
    assert code == 0 and "stopping: draining replicas" in text and "stopped in" in text, text
    own = _job_lines(text) if to == "group" else text
    assert "failed" not in own.lower() and "Traceback" not in own, text  # a clean stop reads as one
    assert took < 60, f"the job took {took:.1f} s to stop"  # bounded at 25 s (--stop-timeout-s) plus Ray's exit
    rows = read_requests(str(stats))
    assert sorted(rows["request_id"].to_pylist()) == sorted(answered)  # one row per answered prompt, no more
    assert read_traces(str(stats)).num_rows == 3 * sum(rows["completion_tokens"].to_pylist())
    # Drained or not, the job wrote the replicas' logs as Parquet before it exited: no log left, any reader sees all.
    assert _parquet_rows(str(stats)) == len(answered) and not list((stats / "wal").iterdir())
    assert sorted(pd.read_parquet(stats / "requests")["request_id"]) == sorted(answered)
    files = [p.read_bytes() for p in stats.rglob("*") if p.is_file()]
    assert key not in text and all(key.encode() not in data for data in files)


RAY_NATIVE_LOG = re.compile(r"^\[\d{4}-\d\d-\d\d [\d:,]+ [EWI] \d+ \d+\] ")  # a Ray C++ log line


def _job_lines(text: str) -> str:
    """The job's own output, without what Ray's processes say as the group's signal kills them: a line forwarded
    from a Ray process (``(raylet) The autoscaler failed ... Terminated with signal 15``) with its following lines
    up to a blank line or the job's next ``stopping``/``stopped`` line, and the driver's Ray core logging that it
    can no longer reach them (``task_manager.cc: Failed to push error to driver``). Whether Ray gets those out
    before it dies is a race (one full suite of many printed them)."""
    kept, forwarded = [], False
    for line in text.splitlines():
        plain = re.sub(r"\x1b\[[0-9;]*m", "", line)
        if plain.startswith("(raylet)") or RAY_NATIVE_LOG.match(plain):
            forwarded = True
            continue
        if forwarded and plain.strip() and not plain.startswith(("stopping", "stopped")):
            continue  # the forwarded message's lines, up to a blank line or the job's next word
        forwarded = False
        if plain.strip():
            kept.append(line)
    return "\n".join(kept)


def test_ray_dying_words_are_told_apart_from_the_jobs_own():
    """What a killed Ray prints is set aside, the job's own failure is not."""
    ray_said = (
        "stopping: draining replicas and writing their statistics\n"
        "\x1b[33m(raylet)\x1b[0m The autoscaler failed with the following error:\nTerminated with signal 15\n"
        '  File "monitor.py", line 751, in <module>\n\n'
        "[2026-12-07 01:29:40,864 E 24650 25064] task_manager.cc:1545: Failed to push error to driver for task 3e\n"
        "stopped in 6.5 s"
    )
    assert _job_lines(ray_said) == "stopping: draining replicas and writing their statistics\nstopped in 6.5 s"
    job_said = "stopping: draining replicas\nTraceback (most recent call last):\n  File x\nstopping: failed"
    assert _job_lines(job_said) == job_said


def test_a_directory_it_cannot_read_is_one_line_and_status_2_before_ray_starts(tmp_path):
    bad = tmp_path / "Bad-model"
    bad.mkdir()
    (bad / "config.json").write_text('{"model_type": "gpt2"}')
    job = [sys.executable, str(repo_root() / "jobs" / "serve.py"), "--checkpoint", str(bad)]
    done = subprocess.run([*job, "--stats-path", str(tmp_path / "stats")], capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stderr
    assert done.stderr.strip().splitlines() == [
        "error: config.json: model_type 'gpt2' is not one the platform loads (known: t5, llama, ouro, huginn_raven)"
    ]
    assert not (tmp_path / "stats").exists()  # nothing started, nothing written


@pytest.mark.slow
def test_a_model_and_engine_the_memory_cannot_hold_and_a_misplaced_seed_are_refused_before_ray_starts(
    tmp_path, monkeypatch
):
    """The job checks the directory's weights with the deployment's engine (``--set``) against the memory
    available (faked: ``SPEED_MEMORY_LIMIT``) and ``--initial-state-seed`` against its form before Ray starts:
    one line, status 2, nothing written."""
    from imported_helpers import write_chat_ouro

    from speed.engine.memory import MEMORY_LIMIT_ENV
    from speed.models.pretrained import check_load
    from speed.serve.settings import host_capacity

    directory = str(write_chat_ouro(tmp_path / "Ouro-tiny"))
    engine = ["--set", "max_active=8", "--set", "max_source_len=200", "--set", "max_target_len=100"]
    capacity = host_capacity("cpu", {"max_active": 8, "max_source_len": 200, "max_target_len": 100})
    monkeypatch.setenv(MEMORY_LIMIT_ENV, str(2**40))
    weights, served = check_load(directory), check_load(directory, capacity=capacity)
    monkeypatch.setenv(MEMORY_LIMIT_ENV, str(weights.total + served.allocated // 2))  # the weights fit, not the engine
    job = [sys.executable, str(repo_root() / "jobs" / "serve.py"), "--checkpoint", directory]
    job += ["--stats-path", str(tmp_path / "stats")]
    for extra, says in [(engine, "error: Ouro-tiny as float32 needs "), (["--initial-state-seed", "1"], "only Huginn")]:
        done = subprocess.run([*job, *extra], capture_output=True, text=True, timeout=120)
        assert done.returncode == 2, done.stderr
        lines = done.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("error: ") and says in lines[0], lines
    assert not (tmp_path / "stats").exists()
