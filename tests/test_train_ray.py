"""Ray Train runs of a tiny model: exact resume, a worker failure mid-run, two workers vs one (on S3:
tests/test_train_s3.py).

One local Ray for the session (conftest ``ray_session``); every run is a few
steps of ``preset("tiny")`` on 40 pretraining documents, ~20 s each.
"""

from __future__ import annotations

import tempfile

import numpy as np
import pyarrow.parquet as pq
import pytest
import torch

from speed.checkpoint import load_model
from speed.train.config import job_from_args
from speed.train.launch import run_job
from speed.train.state import TRAIN_LOG_FILE, load_training_state
from speed.train.tracking import RUN_TAG, import_mlflow, tracking_uri

pytestmark = pytest.mark.ray


def _job(storage, tokenizer, *extra):
    flags = ["--preset", "tiny", "--pattern", "2x2", "--limit", "40", "--tokenizer", str(tokenizer)]
    flags += ["--batch-size", "4", "--max-steps", "6", "--checkpoint-every", "2", "--log-every", "1"]
    flags += ["--warmup-steps", "2", "--cpus-per-worker", "1", "--storage-path", str(storage), *extra]
    return job_from_args("pretrain", flags)


def _weights(checkpoint):
    return load_model(checkpoint).model.state_dict()


def _log(checkpoint):
    return pq.read_table(f"{checkpoint}/{TRAIN_LOG_FILE}").to_pydict()


@pytest.fixture(scope="module")
def straight(ray_session, tiny_tokenizer, tmp_path_factory):
    """6 steps in one go on one worker: the reference run."""
    return run_job(_job(tmp_path_factory.mktemp("straight"), tiny_tokenizer))


def _mlflow_run(outcome):
    """The one MLflow run of a Train run in its default store (<storage>/mlruns), and a client of that store."""
    client = import_mlflow().MlflowClient(tracking_uri(outcome.job))
    experiment = client.get_experiment_by_name(outcome.job.kind)
    (run,) = client.search_runs([experiment.experiment_id])
    assert run.data.tags[RUN_TAG] == run.info.run_name == outcome.job.run.name
    return client, run


def _history(client, run, key):
    return [(m.step, m.value) for m in client.get_metric_history(run.info.run_id, key)]


def test_the_run_is_tracked_live_in_mlflow(straight):
    client, run = _mlflow_run(straight)
    assert run.info.status == "FINISHED"
    log = _log(straight.checkpoint)  # --log-every 1: every progress line is one step
    steps = [1, 2, 3, 4, 5, 6]
    for i in range(2):  # 2x2: two loops
        history = _history(client, run, f"loss_loop{i + 1}")
        assert [s for s, _ in history] == steps
        np.testing.assert_allclose([v for _, v in history], [x[i] for x in log["loop_losses"]], rtol=1e-6)
    for key in ("loss", "lr", "tokens_per_s", "grad_norm"):
        history = _history(client, run, key)
        assert [s for s, _ in history] == steps
        np.testing.assert_allclose([v for _, v in history], log[key], rtol=1e-6)
    params = run.data.params
    assert params["model.pattern"] == "2x2" and params["train.max_steps"] == "6" and params["kind"] == "pretrain"
    assert params["run.name"] == straight.job.run.name and params["tracking.uri"] == "None"


def test_resume_gives_the_weights_of_an_uninterrupted_run(straight, tiny_tokenizer, tmp_path, monkeypatch):
    first = run_job(_job(tmp_path / "a", tiny_tokenizer, "--stop-at-step", "3"))
    assert load_training_state(first.checkpoint).step == 3
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(scratch))  # the driver's temporary folders go here
    resumed = run_job(_job(tmp_path / "b", tiny_tokenizer, "--resume", first.run_dir))
    assert list(scratch.iterdir()) == []  # the tokenizer copied from the checkpoint (speed-tokenizer-*) is gone
    assert resumed.metrics["step"] == 6 and load_training_state(resumed.checkpoint).step == 6
    for (name, a), b in zip(_weights(straight.checkpoint).items(), _weights(resumed.checkpoint).values()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=name)
    log = _log(resumed.checkpoint)
    assert log["step"] == [1, 2, 3, 4, 5, 6]  # the first run's three steps carried over
    assert log["restarts"] == [0, 0, 0, 1, 1, 1]
    np.testing.assert_allclose(log["loss"], _log(straight.checkpoint)["loss"], rtol=1e-5)


def test_two_workers_with_a_failure_resume_and_match_one_worker(straight, tiny_tokenizer, tmp_path):
    job = _job(tmp_path, tiny_tokenizer, "--num-workers", "2", "--fail-at-step", "4", "--max-failures", "1")
    outcome = run_job(job)
    log = _log(outcome.checkpoint)
    # Rank 1 failed before step 4; Ray restarted both workers from the step-2 checkpoint, so step 3 was
    # trained twice but logged once, and the step count continued.
    assert log["step"] == [1, 2, 3, 4, 5, 6]
    assert log["restarts"] == [0, 0, 1, 1, 1, 1]
    reference = _log(straight.checkpoint)
    # Same global batch split over two workers: the same curve (tiny has no dropout).
    np.testing.assert_allclose(log["loss"], reference["loss"], rtol=1e-4)
    np.testing.assert_allclose(np.array(log["loop_losses"]), np.array(reference["loop_losses"]), rtol=1e-4)
    assert sum(log["tokens"]) == sum(reference["tokens"])
    # The retried workers continued the same MLflow run and did not log step 3 again.
    client, run = _mlflow_run(outcome)
    assert run.info.status == "FINISHED" and [s for s, _ in _history(client, run, "loss")] == [1, 2, 3, 4, 5, 6]


def test_the_settle_term_trains_and_is_reported(straight, tiny_tokenizer, tmp_path):
    settle = "train.settle={kind: consecutive, weight: 2.0, warmup_steps: 4, flip_cost_weighted: true}"
    run = run_job(_job(tmp_path, tiny_tokenizer, "--set", settle))
    assert run.metrics["settle_weight"] == 2.0 and run.metrics["settle_loss"] > 0  # step 6: past the warm-up
    client, tracked = _mlflow_run(run)  # the checkpoint reports' settle term, in MLflow too
    assert _history(client, tracked, "settle_weight") == [(2, 1.0), (4, 2.0), (6, 2.0)]
    assert _history(client, tracked, "settle_loss")[-1] == (6, pytest.approx(run.metrics["settle_loss"]))
    log, plain = _log(run.checkpoint), _log(straight.checkpoint)
    # Step 1 trains with lambda = 0.5 already: the weights and so every later loss differ from the plain run's.
    assert log["loss"][0] == pytest.approx(plain["loss"][0], rel=1e-5)  # the same first batch and weights
    assert any(abs(a - b) > 1e-6 for a, b in zip(log["loss"][1:], plain["loss"][1:]))
    different = [
        not torch.equal(a, b) for a, b in zip(_weights(straight.checkpoint).values(), _weights(run.checkpoint).values())
    ]
    assert any(different)
