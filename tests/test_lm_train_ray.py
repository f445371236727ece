"""Ray Train runs of a tiny looped LM (``--model lm``): next-token pretraining on packed rows to a checkpoint
that loads as a ``LoopedLM`` and decodes (SPEED == sequential), tracked in MLflow; exact resume, with a
worker failure on the way retried from the last checkpoint; finetuning on prompted pairs with the loss on
the answer, evaluated.

The same guarantees as T5's (tests/test_train_ray.py), on the session's local Ray; each run ~20 s.
"""

from __future__ import annotations

import numpy as np
import pyarrow.parquet as pq
import pytest
import torch

from speed.decode.generate import DecodeOptions, generate
from speed.models.checkpoint import load_model
from speed.models.looped_lm import LoopedLM
from speed.paths import TRAIN_LOG_FILE
from speed.train.config import job_from_args
from speed.train.launch import run_job
from speed.train.state import load_training_state
from speed.train.tracking import import_mlflow, tracking_uri

pytestmark = pytest.mark.ray


def _flags(storage, tokenizer, *extra):
    flags = ["--model", "lm", "--preset", "tiny", "--pattern", "1+2x2+1", "--tokenizer", str(tokenizer)]
    flags += ["--batch-size", "4", "--max-steps", "6", "--checkpoint-every", "2", "--log-every", "1"]
    flags += ["--warmup-steps", "2", "--cpus-per-worker", "1", "--storage-path", str(storage), *extra]
    return flags


def _pretrain(storage, tokenizer, *extra):
    return job_from_args("pretrain", _flags(storage, tokenizer, "--limit", "40", "--max-source-len", "32", *extra))


def _weights(checkpoint):
    return load_model(checkpoint).model.state_dict()


def _log(checkpoint):
    return pq.read_table(f"{checkpoint}/{TRAIN_LOG_FILE}").to_pydict()


def _same_weights(a, b):
    for (name, x), y in zip(_weights(a).items(), _weights(b).values()):
        torch.testing.assert_close(x, y, rtol=1e-5, atol=1e-6, msg=name)


@pytest.fixture(scope="module")
def straight(ray_session, tiny_tokenizer, tmp_path_factory):
    """6 steps of LM pretraining in one go on one worker: the reference run."""
    return run_job(_pretrain(tmp_path_factory.mktemp("lm-straight"), tiny_tokenizer))


def test_the_pretrained_lm_loads_decodes_and_was_tracked(straight):
    loaded = load_model(straight.checkpoint)
    assert isinstance(loaded.model, LoopedLM) and loaded.config["family"] == "lm"
    assert loaded.config["job"]["data"]["task"] == "pretrain" and straight.job.model.pattern == "1+2x2+1"
    prompt = torch.tensor([[5, 6, 7, 8], [9, 10, 0, 0]])
    mask = (prompt != 0).long()
    speed = generate(loaded.model, prompt, mask, DecodeOptions(method="speed", max_new_tokens=8, trace=False))
    sequential = generate(loaded.model, prompt, mask, DecodeOptions(method="sequential", max_new_tokens=8, trace=False))
    assert speed.tokens == sequential.tokens and all(speed.tokens)
    log = _log(straight.checkpoint)
    assert log["step"] == [1, 2, 3, 4, 5, 6] and all(len(x) == 2 for x in log["loop_losses"])  # 2 loops
    assert log["tokens"][0] == 4 * 32  # full packed rows of --max-source-len tokens
    client = import_mlflow().MlflowClient(tracking_uri(straight.job))
    (run,) = client.search_runs([client.get_experiment_by_name("pretrain").experiment_id])
    history = [m.value for m in client.get_metric_history(run.info.run_id, "loss_loop2")]
    np.testing.assert_allclose(history, [x[1] for x in log["loop_losses"]], rtol=1e-6)
    assert run.data.params["model.family"] == "lm"


def test_resume_and_a_retried_worker_failure_give_the_weights_of_an_uninterrupted_run(
    straight, tiny_tokenizer, tmp_path
):
    first = run_job(_pretrain(tmp_path / "a", tiny_tokenizer, "--stop-at-step", "3"))
    assert load_training_state(first.checkpoint).step == 3
    # Resumed from step 3, the worker fails once before step 5: Ray retries it from the step-4 checkpoint.
    flags = ("--resume", first.run_dir, "--fail-at-step", "5", "--max-failures", "1")
    resumed = run_job(_pretrain(tmp_path / "b", tiny_tokenizer, *flags))
    assert load_training_state(resumed.checkpoint).step == 6 and resumed.job.family.name == "lm"
    _same_weights(straight.checkpoint, resumed.checkpoint)
    log = _log(resumed.checkpoint)
    assert log["step"] == [1, 2, 3, 4, 5, 6] and log["restarts"] == [0, 0, 0, 1, 2, 2]
    np.testing.assert_allclose(log["loss"], _log(straight.checkpoint)["loss"], rtol=1e-5)


def test_finetuning_trains_on_the_answers_and_evaluates_speed_against_sequential(straight, tiny_tokenizer, tmp_path):
    flags = _flags(tmp_path, tiny_tokenizer, "--init-from", straight.checkpoint, "--task", "translate_en_de")
    flags += ["--limit", "16", "--max-source-len", "160", "--max-target-len", "64", "--eval-limit", "4"]
    flags += ["--set", "eval.max_new_tokens=6", "--set", "eval.batch_size=2"]
    outcome = run_job(job_from_args("finetune", flags))
    loaded = load_model(outcome.checkpoint)
    assert isinstance(loaded.model, LoopedLM) and loaded.config["chat_template"]["cue"] == "<assistant>"
    log = _log(outcome.checkpoint)
    assert log["step"] == [1, 2, 3, 4, 5, 6]
    summary = outcome.evaluation
    assert summary["examples"] == 4 and set(summary["metrics"]) == {"bleu", "chrf"}
    # Decoded with SPEED and sequentially: any difference would have failed the evaluation (DecodingMismatch).
    assert summary["config"]["check_sequential"] and summary["config"]["bitwise"]
