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

from speed.models.checkpoint import load_model
from speed.paths import TRAIN_LOG_FILE
from speed.train.config import job_from_args
from speed.train.launch import run_job
from speed.train.state import load_training_state
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


def test_a_resumed_run_on_two_workers_with_a_failure_gives_the_uninterrupted_one_workers_run(
    straight, tiny_tokenizer, tmp_path, monkeypatch
):
    """Three claims of one relaunch (each Train run costs ~20 s): a run stopped at step 3 and resumed with
    ``--resume`` continues to the weights of the uninterrupted run; two workers give the one worker's curve (the
    same global batch split in two); a worker failure mid-run is retried from the newest checkpoint, its steps
    logged once."""
    first = run_job(_job(tmp_path / "a", tiny_tokenizer, "--stop-at-step", "3"))
    assert load_training_state(first.checkpoint).step == 3
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(scratch))  # the driver's temporary folders go here
    flags = ["--resume", first.run_dir, "--num-workers", "2", "--fail-at-step", "5", "--max-failures", "1"]
    resumed = run_job(_job(tmp_path / "b", tiny_tokenizer, *flags))
    assert list(scratch.iterdir()) == []  # the tokenizer copied from the checkpoint (speed-tokenizer-*) is gone
    assert resumed.metrics["step"] == 6 and load_training_state(resumed.checkpoint).step == 6
    # Two workers' averaged gradients round differently from one worker's: equal to float32 rounding.
    for (name, a), b in zip(_weights(straight.checkpoint).items(), _weights(resumed.checkpoint).values()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=name)
    log = _log(resumed.checkpoint)
    # The first run's three steps carried over (restart 1: the relaunch). Rank 1 failed before step 5; Ray
    # restarted both workers from the step-4 checkpoint (restart 2), so step 5 was trained twice but logged once.
    assert log["step"] == [1, 2, 3, 4, 5, 6]
    assert log["restarts"] == [0, 0, 0, 1, 2, 2]
    reference = _log(straight.checkpoint)
    np.testing.assert_allclose(log["loss"], reference["loss"], rtol=1e-4)
    np.testing.assert_allclose(np.array(log["loop_losses"]), np.array(reference["loop_losses"]), rtol=1e-4)
    assert sum(log["tokens"]) == sum(reference["tokens"])
    # The retried workers continued the relaunch's MLflow run (in its storage: steps 4-6) and did not log 5 again.
    client, run = _mlflow_run(resumed)
    assert run.info.status == "FINISHED" and [s for s, _ in _history(client, run, "loss")] == [4, 5, 6]


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
