"""Two nodes on one machine, and a node lost: a head and a second node started with `ray start`
(tests/cluster_helpers.py ``nodes``), each its own raylet, CPUs and spool, on 127.0.0.1, storage on the S3
server (tests/s3_helpers.py). The second node is lost the hard way: its raylet, agents and workers SIGKILLed
at once (``Cluster.kill``). Slow (a cluster and a job each): the ``cluster`` mark, run by ``make test-cluster``.
"""

from __future__ import annotations

import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import cluster_helpers
import pyarrow.parquet as pq
import pytest
import requests

from speed.models.checkpoint import newest_complete_checkpoint, read_checkpoint_config
from speed.paths import TRAIN_LOG_FILE, repo_root
from speed.storage import locate
from speed.train.tracking import import_mlflow

pytestmark = [pytest.mark.cluster, pytest.mark.ray, pytest.mark.slow]

JOB_TIMEOUT_S = 600


def _wait(what: str, done: Callable[[], object], job: subprocess.Popen, log: Path, timeout_s: float = 300) -> object:
    """Poll ``done()`` until it is truthy; fail with the job's log when the job ends first or time runs out."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if value := done():
            return value
        if job.poll() is not None:
            pytest.fail(f"the job ended ({job.returncode}) before {what}:\n{log.read_text()[-6000:]}")
        time.sleep(0.5)
    pytest.fail(f"not {what} within {timeout_s:.0f} s:\n{log.read_text()[-6000:]}")


def _start_job(script: str, flags: list[str], env: dict[str, str], log: Path) -> subprocess.Popen:
    """``python jobs/<script> FLAGS`` as a driver of the cluster ($RAY_ADDRESS in ``env``), output in ``log``."""
    with log.open("w") as out:
        command = [sys.executable, str(repo_root() / "jobs" / script), *flags]
        return subprocess.Popen(command, env=env, stdout=out, stderr=subprocess.STDOUT)


def _finish(job: subprocess.Popen, log: Path, timeout_s: float = JOB_TIMEOUT_S) -> str:
    """The job's output once it has exited with status 0 (killed, and failed with its log, past ``timeout_s``)."""
    try:
        job.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        job.kill()
        job.wait()
        pytest.fail(f"the job did not finish within {timeout_s} s:\n{log.read_text()[-6000:]}")
    output = log.read_text()
    assert job.returncode == 0, output[-6000:]
    return output


HANG_AT = 5  # --hang-at-step: the workers stop before step 5, at the step-4 checkpoint (a checkpoint every 2 steps)


def _lose_node_b_at_the_hang(
    cluster: cluster_helpers.Cluster, run_dir: str, cpus: int, job: subprocess.Popen, log: Path
) -> int:
    """Once ``run_dir`` has its complete checkpoint of step ``HANG_AT - 1`` on S3 (where the workers hang: the
    training cannot outrun the test), lose node_b and start node_c (``cpus`` CPUs) in its place; that step."""
    at = HANG_AT - 1

    def newest_step() -> int | None:
        newest = newest_complete_checkpoint(run_dir)
        return read_checkpoint_config(newest)["step"] if newest is not None else None

    _wait(f"the step-{at} checkpoint on S3", lambda: newest_step() == at, job, log)
    killed = cluster.kill("node_b")
    print(f"node_b lost ({len(killed)} processes) with the step-{at} checkpoint on S3")
    cluster.add_node("node_c", cpus)
    return at


def _resumed_once(final: str, steps: int, lost_at: int) -> dict[str, list]:
    """The train log of the run's ``final`` checkpoint, checked: steps 1..``steps`` once each, one restart, from
    the step-``lost_at`` checkpoint the workers hung at."""
    train_log = pq.read_table(locate(f"{final}/{TRAIN_LOG_FILE}").path, filesystem=locate(final).fs).to_pydict()
    assert train_log["step"] == list(range(1, steps + 1))  # no step missing, none twice
    resumed = train_log["restarts"].index(1)  # the steps trained before the loss, then those after
    assert train_log["restarts"] == [0] * resumed + [1] * (steps - resumed), train_log["restarts"]
    assert resumed == lost_at < steps
    return train_log


def _serves_again(url: str, deadline: float) -> float:
    """Seconds from now until ``url`` answers a completion with 200; fails past ``deadline`` (monotonic)."""
    started, answer = time.monotonic(), None
    while time.monotonic() < deadline:
        try:
            answer = requests.post(url + "/v1/completions", json={"prompt": "A dog runs."}, timeout=10)
            if answer.status_code == 200:
                return time.monotonic() - started
        except requests.RequestException as error:
            answer = error
        time.sleep(0.2)
    pytest.fail(f"no answer within {SERVES_AGAIN_S} s of the loss (last: {answer})")


def test_train_loses_a_worker_node_and_resumes_on_a_replacement(tiny_tokenizer, s3_bucket, tmp_path):
    """Two Train workers, one per node; the second node lost while the workers hang at a checkpoint. Ray Train
    2.60 with a fixed worker count restarts the whole group and waits (RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S,
    60 s) for room for both: a replacement node joins, and the run resumes from that checkpoint on S3."""
    storage, tracking, name = f"{s3_bucket}/runs", (tmp_path / "mlruns").as_uri(), "two-nodes"
    flags = ["--preset", "tiny", "--pattern", "2x2", "--limit", "40", "--tokenizer", str(tiny_tokenizer)]
    flags += ["--batch-size", "4", "--max-steps", "16", "--checkpoint-every", "2", "--log-every", "1"]
    flags += ["--warmup-steps", "2", "--num-workers", "2", "--cpus-per-worker", "1", "--max-failures", "2"]
    flags += ["--hang-at-step", str(HANG_AT)]
    flags += ["--storage-path", storage, "--name", name, "--tracking-uri", tracking]
    run_dir, log = f"{storage}/{name}", tmp_path / "pretrain.log"
    with cluster_helpers.nodes(1, node_b=1) as cluster:  # one CPU each: the two workers cannot share a node
        job = _start_job("pretrain.py", flags, cluster.env, log)
        try:
            placed = _wait("two workers", lambda: len(cluster.placement("RayTrainWorker")) == 2, job, log)
            assert placed and cluster.placement("RayTrainWorker") == ["head", "node_b"]
            lost_at = _lose_node_b_at_the_hang(cluster, run_dir, 1, job, log)
            _finish(job, log)
        finally:
            job.kill()
    train_log = _resumed_once(newest_complete_checkpoint(run_dir), 16, lost_at)
    steps = train_log["step"]
    client = import_mlflow().MlflowClient(tracking)
    (run,) = client.search_runs([client.get_experiment_by_name("pretrain").experiment_id])
    history = client.get_metric_history(run.info.run_id, "loss")
    assert run.info.status == "FINISHED" and [m.step for m in history] == steps  # the same run, once per step
    assert [m.value for m in history] == pytest.approx(train_log["loss"], rel=1e-6)


FLUSH_ROWS = 2  # the replicas' size bound: a row group written (on S3, uploaded) at every second answer
SERVES_AGAIN_S = 30.0  # from the node's loss to the next answer


def test_serve_loses_a_replicas_node_under_load(tiny_tokenizer, s3_bucket, tmp_path):
    """Two replicas, one per node, statistics on S3, each node its own spool; the second node lost (its spool
    deleted with it) under jobs/loadtest.py. Every answer the surviving replica gave has its row on S3; of the
    lost replica's, at most what docs/serving.md says a node lost with its disk takes: its buffer (under
    FLUSH_ROWS rows) plus one flush still uploading (FLUSH_ROWS rows). Every other request got an error at once,
    and the app answers again within SERVES_AGAIN_S."""
    from test_serve_app import _free_port, _tiny_checkpoint

    from speed.serve.readers import read_requests

    _tiny_checkpoint(tiny_tokenizer, tmp_path / "ckpt")
    stats, port = f"{s3_bucket}/stats", _free_port()
    url, log, load_log = f"http://127.0.0.1:{port}", tmp_path / "serve.log", tmp_path / "load.log"
    flags = ["--checkpoint", str(tmp_path / "ckpt"), "--port", str(port), "--replicas", "2", "--num-cpus", "1"]
    flags += ["--max-replicas-per-node", "1", "--proxy-location", "HeadOnly", "--stats-path", stats]
    flags += ["--model-name", "tiny", "--stop-timeout-s", "30"]
    for setting in (f"flush_rows={FLUSH_ROWS}", "flush_s=600", "max_tokens=8"):
        flags += ["--set", setting]
    load = ["--url", url, "--concurrency", "2", "--requests", "120", "--max-tokens", "8", "--no-stream"]
    load += ["--time-limit", "180", "--out", str(tmp_path / "load.parquet"), "--json"]
    # Serve's proxy (on the head only: the nodes share the machine's ports) otherwise sends every request it can to
    # the replica on its own node.
    with cluster_helpers.nodes(1, {"RAY_SERVE_PROXY_PREFER_LOCAL_NODE_ROUTING": "0"}, node_b=1) as cluster:
        server = _start_job("serve.py", flags, cluster.env, log)
        try:
            _wait("serving", lambda: "serving " in log.read_text(), server, log)
            assert cluster.placement("ServeReplica:speed:SpeedServer") == ["head", "node_b"]
            loadtest = _start_job("loadtest.py", load, cluster.env, load_log)
            _wait("rows on S3", lambda: read_requests(stats).num_rows >= 8, loadtest, load_log, timeout_s=120)
            cluster.kill("node_b")
            lost_at = time.monotonic()
            shutil.rmtree(cluster.nodes["node_b"].spool)  # the node's disk, gone with it
            again = _serves_again(url, lost_at + SERVES_AGAIN_S)
            print(f"node_b lost; answered again after {again:.1f} s")
            _finish(loadtest, load_log, timeout_s=300)
            survivor = requests.get(url + "/healthz", timeout=10).json()["replica"]
            server.send_signal(signal.SIGTERM)  # jobs/serve.py's stop: the survivor drains, writing its rows
            _finish(server, log, timeout_s=120)
        finally:
            server.kill()
    sent = pq.read_table(tmp_path / "load.parquet").to_pylist()
    answered = [r for r in sent if r["status"] == 200]
    failed = [r for r in sent if r["status"] != 200]
    print(f"{len(answered)} answered, {len(failed)} failed: {sorted({r['error'] for r in failed})}")
    assert len(sent) == 120 and len(answered) >= 60 and len({r["replica"] for r in answered}) == 2
    for row in failed:  # a clear error, at once: never a hang until the client's time limit
        assert row["status"] >= 500 and row["error"] and row["latency_ms"] < 60_000, row
    on_s3 = set(read_requests(stats)["request_id"].to_pylist())  # Parquet alone: this process's spool holds none
    kept = [r["request_id"] for r in answered if r["replica"] == survivor]
    assert kept and set(kept) <= on_s3
    lost = [r["request_id"] for r in answered if r["replica"] != survivor and r["request_id"] not in on_s3]
    print(f"{len(answered) - len(kept)} answered by the lost replica, {len(lost)} of their rows lost")
    assert len(lost) <= 2 * FLUSH_ROWS - 1, lost  # its buffer (< FLUSH_ROWS) and one flush uploading


SWEEP_STEPS = 12  # a checkpoint every 2; the node is lost at the hang (HANG_AT)
TRIAL_ACTOR = "ImplicitFunc"  # the class of a Tune function trainable's actor: a sweep trial's own process


def test_sweep_retries_a_trial_whose_node_is_lost(tiny_tokenizer, s3_bucket, tmp_path):
    """One trial of jobs/sweep.py, all of it on the second node: its Tune actor (the head's memory resource is too
    small for one), its Train controller (on the trial's node) and its Train worker (the head has no CPU). That node
    lost while the worker hangs at a checkpoint, a replacement joins; the sweep's Tune starts the trial again there
    (speed.sweep.failures: a lost node is retried, within --max-failures), its Train run resumes from the
    checkpoint on S3, trains to the end and is measured: its results row says finished after one restart."""
    from speed.sweep.results import RESULTS_FILE
    from speed.sweep.run import TRIAL_DRIVER_RESOURCES

    storage, name, trial = f"{s3_bucket}/sweeps", "lost-node", "00000-2x2-linear"
    flags = ["--preset", "tiny", "--patterns", "2x2", "--schemes", "linear", "--scheduler", "fifo"]
    flags += ["--task", "translate_en_de", "--limit", "40", "--tokenizer", str(tiny_tokenizer), "--batch-size", "4"]
    flags += ["--max-steps", str(SWEEP_STEPS), "--checkpoint-every", "2", "--log-every", "1", "--warmup-steps", "1"]
    flags += ["--max-source-len", "24", "--max-target-len", "24", "--num-workers", "1", "--cpus-per-worker", "1"]
    flags += ["--max-failures", "1", "--measure-limit", "2", "--cost-limit", "1", "--val-limit", "4"]
    flags += ["--max-new-tokens", "4", "--latency-limit", "0", "--storage-path", storage, "--name", name]
    flags += ["--hang-at-step", str(HANG_AT)]
    run_dir, log = f"{storage}/{name}/train/{trial}", tmp_path / "sweep.log"
    head = ("--memory", str(TRIAL_DRIVER_RESOURCES["memory"] // 2))  # no trial's driver fits on the head
    with cluster_helpers.nodes(0, head_flags=head, node_b=2) as cluster:
        job = _start_job("sweep.py", flags, cluster.env, log)
        try:
            _wait("the trial's worker", lambda: cluster.placement("RayTrainWorker") == ["node_b"], job, log)
            assert cluster.placement(TRIAL_ACTOR) == cluster.placement("TrainController") == ["node_b"]
            lost_at = _lose_node_b_at_the_hang(cluster, run_dir, 2, job, log)
            _finish(job, log)
            assert cluster.placement(TRIAL_ACTOR, alive=False) == ["node_b", "node_c"]  # started again, elsewhere
        finally:
            job.kill()
    results = locate(f"{storage}/{name}/{RESULTS_FILE}")
    (row,) = pq.read_table(results.path, filesystem=results.fs).to_pylist()
    assert (row["trial"], row["status"], row["error"], row["steps"]) == (trial, "finished", None, SWEEP_STEPS)
    assert row["restarts"] == 1 and row["accuracy"] is not None and row["speed_cost"] > 0
    _resumed_once(row["checkpoint"], SWEEP_STEPS, lost_at)
