"""FSDP (``--strategy fsdp``) through Ray Train on two CPU workers (gloo): its losses are DDP's over 20 steps, a
run stopped and resumed is bit for bit the run straight through, each worker holds about half of DDP's parameter
and optimizer bytes (as the workers measured them), and the sharded checkpoint reads back whole (evaluation,
export). Both families (the resume: the LM's). The module's five runs are shared: each about a minute on two cores.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest
import torch

from speed.models.checkpoint import MODEL_FILE, SHARDED_DIR, load_model
from speed.models.export import export
from speed.paths import TRAIN_LOG_FILE
from speed.train.config import job_from_args
from speed.train.launch import run_job

pytestmark = [pytest.mark.ray, pytest.mark.slow]

STEPS = 20


def _job(storage, tokenizer, family, *extra):
    flags = ["--tokenizer", str(tokenizer), "--num-workers", "2", "--cpus-per-worker", "1", "--no-tracking"]
    flags += ["--batch-size", "4", "--max-steps", str(STEPS), "--checkpoint-every", "10", "--log-every", "5"]
    flags += ["--warmup-steps", "2", "--storage-path", str(storage), "--limit", "40", "--max-source-len", "32"]
    if family == "lm":
        flags += ["--model", "lm", "--preset", "tiny", "--pattern", "1+2x2+1"]
    else:
        flags += ["--preset", "tiny", "--pattern", "2x2", "--max-target-len", "16", "--set", "model.dropout=0.0"]
    return job_from_args("pretrain", [*flags, *extra])


def _log(checkpoint):
    return pq.read_table(f"{checkpoint}/{TRAIN_LOG_FILE}").to_pydict()


@pytest.fixture(scope="module")
def runs(ray_session, tiny_tokenizer, tmp_path_factory):
    """Per family: DDP and FSDP straight through; the LM's FSDP run also stopped at step 10, then resumed."""
    out = {}
    for family in ("lm", "t5"):
        root = tmp_path_factory.mktemp(f"fsdp-{family}")
        ddp = run_job(_job(root / "ddp", tiny_tokenizer, family))
        fsdp = run_job(_job(root / "fsdp", tiny_tokenizer, family, "--strategy", "fsdp"))
        out[family] = {"ddp": ddp, "fsdp": fsdp}
    first = run_job(_job(root / "a", tiny_tokenizer, "lm", "--strategy", "fsdp", "--stop-at-step", "10"))
    out["lm"]["resumed"] = run_job(
        _job(root / "b", tiny_tokenizer, "lm", "--strategy", "fsdp", "--resume", first.run_dir)
    )
    return out


@pytest.mark.parametrize("family", ["lm", "t5"])
def test_fsdp_losses_are_ddps(runs, family):
    ddp, fsdp = _log(runs[family]["ddp"].checkpoint), _log(runs[family]["fsdp"].checkpoint)
    assert ddp["step"] == fsdp["step"] == list(range(1, STEPS + 1))
    np.testing.assert_allclose(fsdp["loss"], ddp["loss"], rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(np.array(fsdp["loop_losses"]), np.array(ddp["loop_losses"]), rtol=1e-4, atol=1e-5)
    assert ddp["loss"][-1] < ddp["loss"][0]


def test_a_resumed_fsdp_run_is_the_run_straight_through(runs):
    straight, resumed = runs["lm"]["fsdp"], runs["lm"]["resumed"]
    assert _log(resumed.checkpoint)["loss"] == _log(straight.checkpoint)["loss"]  # bit for bit
    a, b = load_model(straight.checkpoint).model.state_dict(), load_model(resumed.checkpoint).model.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("family", ["lm", "t5"])
def test_each_fsdp_worker_holds_about_half_of_ddps_bytes(runs, family):
    ddp, fsdp = runs[family]["ddp"].metrics, runs[family]["fsdp"].metrics
    for key in ("worker_parameter_bytes", "worker_optimizer_bytes"):
        assert 0.45 < fsdp[key] / ddp[key] < 0.55, (key, fsdp[key], ddp[key])


@pytest.mark.parametrize("family", ["lm", "t5"])
def test_the_sharded_checkpoint_reads_back_whole(runs, family, tmp_path):
    checkpoint = runs[family]["fsdp"].checkpoint
    assert (Path(checkpoint) / SHARDED_DIR / ".metadata").is_file() and not (Path(checkpoint) / MODEL_FILE).exists()
    loaded = load_model(checkpoint)
    ddp = load_model(runs[family]["ddp"].checkpoint).model.state_dict()
    for name, value in loaded.model.state_dict().items():
        torch.testing.assert_close(value, ddp[name], rtol=1e-4, atol=1e-5, msg=name)
    exported = export(checkpoint, tmp_path / "out")  # jobs/export.py's call
    assert exported.files
