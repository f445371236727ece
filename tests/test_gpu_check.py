"""The GPU check before a GPU sees it: the decode path imports and runs without Ray, the whole check runs as a
tiny dry run on the CPU without Ray or the data libraries, and without CUDA the check refuses in one line."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from speed.benchmarks.gpu_correctness import agreement
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
import speed.benchmarks.gpu, speed.benchmarks.gpu_timing, speed.benchmarks.gpu_correctness
from speed import DecodeOptions, SpeedT5, Speculation, generate, preset
try:
    import ray
except ImportError:
    pass
else:
    raise SystemExit("ray imported")
torch.manual_seed(0)
model = SpeedT5(preset("tiny", pattern="2x3")).eval()
ids = torch.randint(3, 128, (2, 5))
options = DecodeOptions(method="speed", max_new_tokens=6, speculation=Speculation(branches=1))
fast = generate(model, ids, options=options)
slow = generate(model, ids, options=DecodeOptions(method="sequential", max_new_tokens=6))
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


@pytest.mark.slow  # the whole check, its inner pytest included, in a subprocess: ~40 s on 2 cores
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
    names = ["exactness", "launches", "shapes", "llama", "timing", "agreement", "training", "sharded training"]
    assert list(stages) == names
    assert all(s["ok"] and s["error"] is None and s["skipped"] is None for s in stages.values())
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
    assert shapes["copy_gb_per_s"] > 0 and len(shapes["vs_copy_limit"]) == 6
    assert set(shapes["batch_speedup"]) == {"sequential", "speed_oracle", "speed"}
    for row in shapes["rows"]:  # no negative or impossible figure (each time per token is its run's own split)
        assert row["ms_per_token"] > 0 and row["ttft_ms"] > 0 and row["speedup"] > 0 and row["ratio_vs_limit"] > 0
    for row in timing["rows"]:
        assert row["ms_per_token"] > 0 and row["speedup"] > 0
    launches = stages["launches"]["result"]  # on the CPU: passes counted, no kernels nor CUDA syncs
    assert [(c["variant"], c["kernels"], c["syncs"]) for c in launches] == [("sequential", None, None),
                                                                              ("speed_oracle", None, None)]
    assert launches[0]["passes"] >= 2 * 6 and 0 < launches[1]["passes"] < launches[0]["passes"]  # 2x6: 3 tokens
    llama = stages["llama"]["result"]  # a 2-layer Llama through transformers against our 2x1, same weights
    assert llama["layers"] == 2 and not llama["compiled"] and [r["batch"] for r in llama["rows"]] == [1, 2]
    assert all(r["ours_ms_per_token"] > 0 and r["hf_ms_per_token"] > 0 for r in llama["rows"])
    exactness = stages["exactness"]["result"]
    assert exactness["returncode"] == 0 and exactness["failed"] == []
    assert set(exactness["outcomes"]) == {"SKIPPED"}  # no CUDA here: every test skipped, with its reason
    assert "8/8 stages ok (0 skipped)" in out.stdout and "real shape" in out.stdout
    assert "SPEED / sequential" in out.stdout
    assert "against our 2x1" in out.stdout
    sharded = stages["sharded training"]["result"]  # FSDP at Ouro's form, tiny: the loss falls, a plan beside it
    assert sharded["losses"][-1] < sharded["losses"][0] and sharded["planned_mb"] > 0


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


def test_a_stage_that_does_not_fit_the_budget_is_skipped_and_fails_nothing():
    """``run_check`` over a stage list (another module appends its own): a stage whose ``needs_s`` exceeds what is
    left is skipped with the reason, one that raises is a failure, and only the latter makes the job fail."""
    from speed.benchmarks.gpu import StagePlan, failed, format_report, run_check
    from speed.benchmarks.gpu_setup import TINY

    def boom(size, device, left):
        raise RuntimeError("no kernel for this")

    plans = [
        StagePlan("first", lambda size, device, left: [left], lambda r: True),
        StagePlan("heavy", lambda size, device, left: None, lambda r: True, lambda size: 1e9),
        StagePlan("broken", boom, lambda r: True),
    ]
    seen = []
    report = run_check(TINY, "cpu", 100.0, lambda r: seen.append(len(r.stages)), plans)
    first, heavy, broken = report.stages
    assert first.ok and 0 < first.result[0] <= 100.0 and seen == [1, 2, 3]
    assert not heavy.ok and heavy.skipped.endswith("it needs 1000000000 s") and heavy.error is None
    assert not broken.ok and broken.skipped is None and "no kernel for this" in broken.error
    assert failed(report) == ["broken"]
    assert "1/3 stages ok (1 skipped)" in format_report(report) and "skipped: " in format_report(report)


def test_batch_speedup_is_tokens_per_second_at_the_largest_batch_over_batch_one():
    from speed.benchmarks.gpu_timing import batch_speedup

    rows = [{"batch": b, "variant": v, "ms_per_token": ms} for b, v, ms in
            [(1, "sequential", 10.0), (1, "speed", 5.0), (8, "sequential", 2.0), (32, "sequential", 0.5)]]  # fmt: skip
    assert batch_speedup(rows) == {"sequential": 20.0}  # speed has no row at batch 32
    assert batch_speedup(rows[:2]) == {}


def test_syncs_are_counted_on_cuda_only():
    from speed.benchmarks.gpu_timing import count_syncs

    ran = []
    assert count_syncs(lambda: ran.append(1), "cpu") is None and ran == [1]


@pytest.mark.slow  # two stages at tiny size, in process: ~10 s
def test_some_stages_only(tmp_path, capsys):
    """``--stages``: the named stages alone, in the check's order; an unknown name is a usage error."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("gpu_check_job", repo_root() / "jobs" / "gpu_check.py")
    job = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(job)
    out = tmp_path / "report.json"
    assert job.main(["--device", "cpu", "--tiny", "--stages", "llama,launches", "--out", str(out)]) == 0
    assert [s["name"] for s in json.loads(out.read_text())["stages"]] == ["launches", "llama"]
    with pytest.raises(SystemExit) as stopped:
        job.main(["--device", "cpu", "--tiny", "--stages", "shapes,speed"])
    assert stopped.value.code == 2 and "unknown speed" in capsys.readouterr().err
