"""Decoding and evaluation on a CUDA device: every decode tensor on the model's device, SPEED exact there too.

Skipped, with the reason, where no CUDA device is present; run them on a GPU
machine with ``pytest -m gpu``.
"""

from __future__ import annotations

import importlib.util
import json

import pytest
import torch

from speed import SpeedT5, preset
from speed.checkpoint import save_model
from speed.data import load_records
from speed.decoding import generate
from speed.exactness import LogitRecorder, compare_logits
from speed.paths import repo_root
from speed.sampling import Sampling
from speed.tokenizer import train_tokenizer

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device; this machine has none"),
]


@pytest.mark.parametrize("sampling", [None, Sampling(temperature=1.0, top_p=0.9, seed=3, presence_penalty=0.5)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("pattern", ["2x6", "3x4", "1x5"])
def test_speed_logits_equal_sequential_on_cuda(pattern, dtype, sampling):
    torch.manual_seed(0)
    model = SpeedT5(preset("tiny", pattern=pattern)).eval().to("cuda", dtype)
    for seed in range(4):
        torch.manual_seed(seed)
        ids = torch.randint(3, 128, (seed + 1, 7))  # CPU ids: the model moves them to its device
        reference = LogitRecorder(model)
        ref = generate(reference, ids, method="sequential", max_new_tokens=24, sampling=sampling)
        for launch_loop, invalidation in [(1, "eager"), (2, "final")]:
            candidate = LogitRecorder(model)
            got = generate(
                candidate,
                ids,
                method="speed",
                max_new_tokens=24,
                launch_loop=launch_loop,
                invalidation=invalidation,
                sampling=sampling,
            )
            assert next(iter(candidate.logits.values())).device.type == "cuda"
            assert compare_logits(reference, candidate, ref.tokens, model.n_loops) == []
            assert got.tokens == ref.tokens


def test_evaluate_job_on_cuda(tmp_path):
    ds = load_records("translate_en_de", "train", limit=200)
    tok = train_tokenizer([*ds["source"], *ds["target"]], tmp_path / "spm.model", vocab_size=200, num_extra=10)
    torch.manual_seed(0)
    directory = save_model(tmp_path / "ckpt", SpeedT5(preset("tiny", vocab_size=tok.vocab_size)), tok.path)
    spec = importlib.util.spec_from_file_location("evaluate_job", repo_root() / "jobs" / "evaluate.py")
    job = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(job)
    out = tmp_path / "eval"
    flags = ["--checkpoint", str(directory), "--split", "test", "--limit", "8", "--batch-size", "4"]
    summary = job.main([*flags, "--max-new-tokens", "12", "--check-sequential", "--device", "cuda", "--out", str(out)])
    assert summary["decode"]["identical"] and summary["decode"]["mismatches"] == []
    assert json.loads((out / "summary.json").read_text()) == summary
