"""The platform on a real S3 API: moto's server on loopback (tests/s3_helpers.py), reached through
``AWS_ENDPOINT_URL`` alone, as a user reaches MinIO or S3.

Every loader of a checkpoint or a run takes its URI (the served model, the benchmarks' held-out inputs, the
sweep's latency stage, evaluation); Serve statistics go to S3 and read back (also as the notebooks find
them), and a real replica killed hard loses none of its answered rows (the node's spool keeps them, the
replica that replaces it uploads them); a sweep keeps its trials on S3 and restores from there. The
statistics sink on S3 in plain processes (SIGKILL, a node lost with its disk, a failed upload):
tests/test_serve_parts.py. Training on S3 (a stopped run resumed bit-identically, then evaluated and
finetuned from its URIs): tests/test_train_ray.py.
"""

from __future__ import annotations

import os
import signal
import tempfile
import time

import pytest
import requests
import torch
from ray import tune
from s3_helpers import create_bucket
from serve_helpers import shutdown_serve
from test_serve_app import _free_port, _kill_replica, _tiny_checkpoint, _wait_for_a_new_replica
from test_serve_parts import _parquet_only

from speed import SpeedT5, preset
from speed.analysis.results import discover, local_results, read_tables
from speed.benchmarks.heldout import held_out
from speed.models.checkpoint import load_model, save_model
from speed.serve.readers import read_requests, read_traces
from speed.serve.schemas import REQUEST_SCHEMA
from speed.serve.settings import load_served_model
from speed.serve.sink import StatsSink, write_ahead_logs
from speed.storage import locate
from speed.sweep import SweepConfig, run_sweep
from speed.tokenizer import Tokenizer
from speed.train.config import job_from_args
from speed.train.state import checkpoint_name, mark_complete


def _names(uri: str) -> set[str]:
    return {info.base_name for info in locate(uri).entries()}


@pytest.fixture(scope="module")
def run_on_s3(s3_server, tiny_tokenizer):
    """A run on S3 holding one complete checkpoint of a tiny finetuned-like 2x2 model (uploaded, not trained)."""
    torch.manual_seed(0)
    model = SpeedT5(preset("tiny", vocab_size=Tokenizer.load(tiny_tokenizer).vocab_size, pattern="2x2"))
    run = f"{create_bucket()}/runs/finetune-x"
    checkpoint = f"{run}/{checkpoint_name(4)}"
    job = {"data": {"task": "translate_en_de", "max_source_len": 24}}
    with tempfile.TemporaryDirectory() as local:
        locate(checkpoint).upload(save_model(local, model, tiny_tokenizer, {"job": job, "step": 4}))
    mark_complete(checkpoint, 4)
    return run, checkpoint, model


def test_every_checkpoint_loader_takes_a_run_or_checkpoint_uri(run_on_s3, tiny_tokenizer):
    run, checkpoint, model = run_on_s3
    for where in (run, checkpoint):  # a run: its newest complete checkpoint
        loaded = load_model(where)
        assert loaded.checkpoint == checkpoint and loaded.tokenizer_path == f"{checkpoint}/spm.model"
        assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), loaded.model.state_dict().values()))
    served = load_served_model(run, "cpu")  # jobs/serve.py, jobs/bench_serve.py
    tokenizer = served.tokenizer
    assert served.model.config == model.config and tokenizer.path == f"{checkpoint}/spm.model"
    assert served.family.name == "t5" and served.template is None
    assert tokenizer.encode("a house") == Tokenizer.load(tiny_tokenizer).encode("a house")
    work = held_out(run, "test", 2)  # jobs/bench_levers.py, jobs/bench_sampling.py
    assert work.task == "translate_en_de" and len(work.inputs) == 2 and max(map(len, work.inputs)) <= 24


def test_serve_statistics_go_to_s3_and_read_back(s3_bucket, tmp_path):
    from test_serve_parts import _row, _trace

    storage = f"{s3_bucket}/stats"
    sink = StatsSink(storage, "app#SpeedServer#a", max_records=2, max_seconds=600)
    for i in range(3):
        sink.add(_row(i), _trace(f"cmpl-{i}", 2))
        if sink.due():
            sink.flush()
    sink.flush()
    requests, traces = read_requests(storage), read_traces(storage)
    assert requests.schema == REQUEST_SCHEMA and traces.num_rows == 6
    assert sorted(requests["request_id"].to_pylist()) == ["cmpl-0", "cmpl-1", "cmpl-2"]
    assert len(_names(f"{storage}/requests")) == 2 and write_ahead_logs(storage) == []  # uploaded: logs deleted
    assert not locate(f"{storage}/wal").exists()  # the logs are on this node's disk (its spool), never on S3
    local = local_results(storage, tmp_path / "stats")  # jobs/analysis.py --results s3://...: what notebooks read
    found = discover(local)
    assert local == tmp_path / "stats" and len(found.requests) == 2 and read_tables(found.requests).num_rows == 3


@pytest.mark.ray
@pytest.mark.slow
def test_a_replica_killed_hard_on_s3_loses_no_answered_row(ray_session, tiny_tokenizer, s3_bucket, tmp_path):
    """A real Serve replica whose statistics go to S3, SIGKILLed while every answered row is still buffered
    (no flush yet): read on this node they are all there at once (its spool), and once Serve has replaced the
    replica, the Parquet objects on S3 alone hold them (the new replica uploaded the dead one's logs)."""
    from ray import serve

    from speed.serve.app import start_app
    from speed.serve.settings import AppConfig

    _tiny_checkpoint(tiny_tokenizer, tmp_path / "ckpt")
    stats, app = f"{s3_bucket}/stats", "speed-s3-kill"
    settings = {"max_source_len": 48, "max_tokens": 4, "flush_rows": 100, "flush_s": 600}  # nothing flushed
    url = start_app(AppConfig(
        str(tmp_path / "ckpt"), port=_free_port(), settings=settings, stats_path=stats, model_name="tiny",
        device="cpu", num_cpus=1, name=app,
    ))  # fmt: skip
    try:
        answered = []
        for prompt in ("A dog runs.", "Rain falls.", "Two cats sleep."):
            r = requests.post(url + "/v1/completions", json={"prompt": prompt}, timeout=120)
            assert r.status_code == 200, r.text
            answered.append(r.json()["id"])
        assert _parquet_only(stats).num_rows == 0 and len(write_ahead_logs(stats)) == 2  # all in the spool
        before = _kill_replica(url)
        assert sorted(read_requests(stats)["request_id"].to_pylist()) == sorted(answered)  # none lost
        started = time.monotonic()
        _wait_for_a_new_replica(url, before)
        print(f"replaced in {time.monotonic() - started:.1f} s")
        assert sorted(_parquet_only(stats)["request_id"].to_pylist()) == sorted(answered)  # on S3, uploaded
        assert write_ahead_logs(stats) == [] and read_requests(stats).num_rows == len(answered)  # once each
        assert read_traces(stats).num_rows == 3 * 4 * len(answered)  # 3 loops, 4 tokens (EOS never wins)
    finally:
        serve.delete(app)
        shutdown_serve()  # its replica's CPU back for the sweep below


# ----- a one-trial sweep on S3, interrupted and restored ------------------------------------------------------


class _InterruptWhenTheTrialCompletes(tune.Callback):
    """SIGINT to this process (as Ctrl+C) when the trial completes.

    Not mid-trial: in one Ray session, an interrupted trial's Train workers would keep their CPUs.
    """

    def on_trial_complete(self, iteration, trials, trial, **info) -> None:
        os.kill(os.getpid(), signal.SIGINT)


@pytest.mark.ray
@pytest.mark.slow
def test_a_sweep_keeps_its_trials_on_s3_and_restores_from_there(ray_session, tiny_tokenizer, s3_bucket, capsys):
    flags = ["--preset", "tiny", "--task", "translate_en_de", "--limit", "16", "--tokenizer", str(tiny_tokenizer)]
    flags += ["--batch-size", "4", "--max-steps", "2", "--checkpoint-every", "2", "--warmup-steps", "1"]
    flags += ["--max-source-len", "24", "--max-target-len", "24", "--cpus-per-worker", "2", "--no-tracking"]
    job = job_from_args("finetune", [*flags, "--storage-path", f"{s3_bucket}/sweeps"])
    sweep = SweepConfig(
        patterns=("2x2",), loss_weights=("linear",), scheduler="fifo", measure_limit=2, cost_limit=2, val_limit=4,
        max_new_tokens=4, latency_limit=1, latency_reps=1,
    )  # fmt: skip
    first = run_sweep(sweep, job, callbacks=[_InterruptWhenTheTrialCompletes()])
    assert first.directory.startswith(f"{s3_bucket}/sweeps/")
    (trial,) = first.results.to_pylist()
    assert trial["status"] == "finished"
    assert trial["checkpoint"] == f"{first.directory}/train/{trial['trial']}/checkpoint_00000002"  # the Train run
    assert {"results.parquet", "frontier.parquet", trial["trial"], "train"} <= _names(first.directory)
    result = locate(f"{first.directory}/{trial['trial']}/result.json")
    reported = result.read_text()

    second = run_sweep(sweep, job)  # Tuner.restore from S3: the finished trial is kept, not run again
    assert "resuming s3://" in capsys.readouterr().out
    assert second.directory == first.directory and second.results.to_pylist() == [trial]
    assert result.read_text() == reported  # Tune logged no further result for it
    assert second.latency is not None and "latency.parquet" in _names(second.directory)  # its checkpoint, timed
