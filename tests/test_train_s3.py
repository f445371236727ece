"""Ray Train on a real S3 API (tests/s3_helpers.py: moto's server, reached through AWS_ENDPOINT_URL as a user
reaches MinIO): a run stopped on S3 resumes there bit-identically; evaluate, compare and finetune take its URIs.
Apart from tests/test_train_ray.py so that the two run side by side (each builds the reference run)."""

from __future__ import annotations

import json

import pytest
import torch
from s3_helpers import create_bucket
from test_train_ray import _job, _log, _weights, straight  # noqa: F401 (straight: the reference run, a fixture)

from speed.paths import TRAIN_LOG_FILE
from speed.storage import locate
from speed.train.config import job_from_args
from speed.train.launch import run_job

pytestmark = pytest.mark.ray


EVAL = ["--task", "translate_en_de", "--max-source-len", "24", "--max-new-tokens", "4", "--limit", "2"]


def _names(uri):
    return {info.base_name for info in locate(uri).entries()}


@pytest.fixture(scope="module")
def on_s3(ray_session, tiny_tokenizer, s3_server):
    """The straight run's job with storage on S3, stopped after step 3, then launched again: it continues there."""
    storage = f"{create_bucket()}/speed"
    stopped = run_job(_job(storage, tiny_tokenizer, "--stop-at-step", "3"))
    return stopped, run_job(_job(storage, tiny_tokenizer))


def test_a_run_stopped_on_s3_resumes_there_bit_identically(on_s3, straight):  # noqa: F811 (the fixture)
    stopped, resumed = on_s3
    storage = resumed.job.run.storage_path
    assert stopped.run_dir == resumed.run_dir == f"{storage}/{resumed.job.run.name}" and storage.startswith("s3://")
    assert (stopped.step, resumed.step) == (3, 6) and resumed.checkpoint == f"{resumed.run_dir}/checkpoint_00000006"
    assert "checkpoint_00000006" in _names(resumed.run_dir)  # and the one before (train.keep_checkpoints)
    assert {"complete", "model.pt", "train_state.pt", TRAIN_LOG_FILE} <= _names(resumed.checkpoint)
    assert any(name.startswith("pretrain-") for name in _names(f"{storage}/data"))  # the prepared shards
    for (name, a), b in zip(_weights(straight.checkpoint).items(), _weights(resumed.checkpoint).values()):
        assert torch.equal(a, b), name
    log = _log(resumed.checkpoint)  # read from S3
    assert log["step"] == [1, 2, 3, 4, 5, 6] and log["restarts"] == [0, 0, 0, 1, 1, 1]
    assert log["loss"] == _log(straight.checkpoint)["loss"]


def test_evaluate_and_compare_take_the_run_on_s3(on_s3):
    from test_cli import _job as job_module

    resumed = on_s3[1]
    summary = job_module("evaluate").main(["--checkpoint", resumed.checkpoint, *EVAL])  # the checkpoint's URI
    out = f"{resumed.checkpoint}/eval/translate_en_de-test"  # the default: beside the checkpoint, on S3
    assert summary["files"]["summary"] == f"{out}/summary.json" and summary["examples"] == 2
    assert {"predictions.parquet", "trace.parquet", "summary.json"} <= _names(out)
    comparison = f"{resumed.job.run.storage_path}/comparison.json"
    assert job_module("compare").main(["--baseline", out, "--system", out, "--samples", "20", "--out", comparison]) == 0
    assert json.loads(locate(comparison).read_text())["accuracy"]["bleu"]["delta"] == 0


@pytest.mark.slow
def test_finetuning_starts_from_the_run_on_s3(on_s3):
    resumed = on_s3[1]
    flags = ["--init-from", resumed.run_dir, "--task", "translate_en_de", "--limit", "16", "--batch-size", "4"]
    flags += ["--max-steps", "2", "--checkpoint-every", "2", "--warmup-steps", "1", "--max-source-len", "24"]
    flags += ["--max-target-len", "24", "--eval-limit", "2", "--set", "eval.max_new_tokens=4"]
    flags += ["--cpus-per-worker", "1", "--storage-path", f"{resumed.job.run.storage_path}/finetune"]
    finetuned = run_job(job_from_args("finetune", flags))  # from the run's newest checkpoint on S3
    assert finetuned.step == 2 and finetuned.job.model == resumed.job.model
    assert finetuned.checkpoint == f"{finetuned.run_dir}/checkpoint_00000002" and finetuned.run_dir.startswith("s3://")
    assert json.loads(locate(f"{finetuned.run_dir}/eval_test/summary.json").read_text()) == finetuned.evaluation
