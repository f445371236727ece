"""The GPU check before a GPU sees it: the decode path imports and runs without Ray, the whole check runs as a
tiny dry run on the CPU without Ray or the data libraries, and without CUDA the check refuses in one line."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from speed.benchmarks.gpu import agreement
from speed.paths import repo_root

# What the GPU machine lacks of this project's dependencies: it has python3, CUDA torch, transformers, pyarrow,
# sentencepiece, sacrebleu, pytest and numpy, and nothing from a package registry.
ABSENT = ("ray", "datasets", "rouge_score", "mlflow")


def without_absent(tmp_path) -> dict[str, str]:
    """An environment whose Python processes (children too) cannot import ``ABSENT``: a ``sitecustomize`` on
    ``PYTHONPATH`` marks them missing in ``sys.modules``, so ``import ray`` fails and a look-up finds nothing."""
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(f"import sys\nsys.modules.update(dict.fromkeys({ABSENT!r}))\n")
    return os.environ | {"PYTHONPATH": os.pathsep.join([str(site), str(repo_root() / "platform")])}


def test_decoding_imports_and_runs_without_ray(tmp_path):
    script = """
import sys
import torch
import speed, speed.models.t5, speed.engine.cache, speed.engine.kernels, speed.engine.sampling, speed.engine
import speed.decode.generate
import speed.models.checkpoint, speed.decode.exactness, speed.train.optim, speed.train.state, speed.benchmarks.decode
import speed.benchmarks.gpu
from speed import SpeedT5, Speculation, generate, preset
try:
    import ray
except ImportError:
    pass
else:
    raise SystemExit("ray imported")
torch.manual_seed(0)
model = SpeedT5(preset("tiny", pattern="2x3")).eval()
ids = torch.randint(3, 128, (2, 5))
fast = generate(model, ids, method="speed", max_new_tokens=6, speculation=Speculation(branches=1))
slow = generate(model, ids, method="sequential", max_new_tokens=6)
assert fast.tokens == slow.tokens
print("decoded", fast.stats.tokens, "of", sum(map(len, slow.tokens)))
"""
    out = subprocess.run(
        [sys.executable, "-c", script], env=without_absent(tmp_path), capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    # A random model may stop early (EOS): SPEED's count of decoded tokens is sequential decoding's, not a constant.
    counted, _, expected = out.stdout.split()[1:]
    assert counted == expected and int(counted) > 0, out.stdout


@pytest.mark.slow  # the whole check, its inner pytest included, in a subprocess: ~15 s
def test_dry_run_on_the_cpu_without_ray(tmp_path):
    """Every stage at tiny size on the CPU, in a process (and a pytest) that cannot import Ray."""
    report_file = tmp_path / "out" / "gpu_check.json"
    out = subprocess.run(
        [sys.executable, "jobs/gpu_check.py", "--device", "cpu", "--tiny", "--out", str(report_file)],
        cwd=repo_root(),
        env=without_absent(tmp_path),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    report = json.loads(report_file.read_text())
    stages = {s["name"]: s for s in report["stages"]}
    assert list(stages) == ["training", "agreement", "timing", "sharded training", "shapes", "exactness"]
    assert all(s["ok"] and s["error"] is None for s in stages.values())
    training = stages["training"]["result"]
    assert training["state_on_device"] and training["state_restored"] and len(training["losses"]) == 2
    assert training["resume_max_abs_diff"] == 0.0  # on the CPU the resumed step is the uninterrupted one
    # one device against itself: every token agrees
    assert [(a["sampling"], a["rate"]) for a in stages["agreement"]["result"]] == [("greedy", 1.0), ("sampled", 1.0)]
    timing = stages["timing"]["result"]
    assert [r["batch"] for r in timing["ratios"]] == [1, 2]
    variants = {r["variant"] for r in timing["rows"]}
    assert {"sequential", "speed", "speed_oracle", "shallow", "ours_deep"} <= variants
    shapes = stages["shapes"]["result"]  # the real-shape benchmark at Ouro's form, tiny: exact, and a bandwidth
    assert [(r["batch"], r["variant"]) for r in shapes["rows"]] == [
        (b, v) for b in (1, 4) for v in ("sequential", "speed_oracle", "speed")
    ]
    assert shapes["summary"]["read_gb_per_s"] > 0 and shapes["summary"]["oracle_speedup"] > 0
    exactness = stages["exactness"]["result"]
    assert exactness["returncode"] == 0 and exactness["failed"] == []
    assert set(exactness["outcomes"]) == {"SKIPPED"}  # no CUDA here: every test skipped, with its reason
    sharded = stages["sharded training"]["result"]  # FSDP at Ouro's form, tiny: the loss falls, a plan beside it
    assert sharded["losses"][-1] < sharded["losses"][0] and sharded["planned_mb"] > 0
    assert "6/6 stages ok" in out.stdout and "real shape" in out.stdout and "SPEED / sequential" in out.stdout


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA: the check would run")
def test_without_cuda_it_says_so_and_exits_2(tmp_path):
    report_file = tmp_path / "gpu_check.json"
    out = subprocess.run(
        [sys.executable, "jobs/gpu_check.py", "--out", str(report_file)],
        cwd=repo_root(),
        env=without_absent(tmp_path),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 2
    assert out.stdout == "" and len(out.stderr.splitlines()) == 1
    assert out.stderr.startswith("error: no CUDA device here")
    assert not report_file.exists()


def test_agreement_counts_tokens_and_prefixes():
    a = agreement("greedy", [[5, 6, 7, 8], [1, 2, 3]], [[5, 6, 9, 8], [1, 2, 3]])
    assert (a.sequences, a.identical, a.positions, a.agreeing) == (2, 1, 7, 6)
    assert a.rate == 6 / 7 and a.mean_prefix == (2 + 3) / 2
