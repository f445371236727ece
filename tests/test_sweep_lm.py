"""A looped LM's sweep for real on the session's local Ray: two trials measured, costed and timed.

A module of its own (not in tests/test_sweep.py), so that pytest-xdist runs it beside the T5 sweep.
"""

from __future__ import annotations

import json

import pytest
from test_sweep import TINY_SWEEP

from speed.sweep import SweepConfig, run_sweep
from speed.train.config import job_from_args

# 1+depth=2+1: 1+1x2+1 and 1+2x1+1
LM_SWEEP = SweepConfig(patterns=("1+depth=2+1",), loss_weights=("linear",), measure_limit=3, cost_limit=2, **TINY_SWEEP)


@pytest.mark.ray
@pytest.mark.slow
def test_a_looped_lm_sweep_measures_and_times_its_layouts(ray_session, tiny_tokenizer, tmp_path):
    """Two LM trials of two steps: every finished trial measured on its prompts, its costs in the LM's layer
    steps (the prelude once, the coda in every exit), the frontier, and the latency stage against the one-loop
    layout of the same prelude and coda."""
    flags = ["--model", "lm", "--preset", "tiny", "--task", "translate_en_de", "--limit", "32"]
    flags += ["--tokenizer", str(tiny_tokenizer), "--batch-size", "4", "--max-steps", "2", "--checkpoint-every", "2"]
    flags += ["--warmup-steps", "1", "--max-source-len", "48", "--max-target-len", "16", "--cpus-per-worker", "2"]
    job = job_from_args("finetune", [*flags, "--storage-path", str(tmp_path), "--no-tracking"])
    outcome = run_sweep(LM_SWEEP, job)
    rows = {r["pattern"]: r for r in outcome.results.to_pylist()}
    assert set(rows) == {"1+1x2+1", "1+2x1+1"} and {r["status"] for r in rows.values()} == {"finished"}
    for pattern, r in rows.items():
        assert r["family"] == "lm" and json.loads(r["job"])["model"]["family"] == "lm"
        assert r["depth"] == {"1+1x2+1": 1 + 2 * 2, "1+2x1+1": 1 + 3}[pattern]  # P + M(N + C)
        n, c = r["n_unique"], 1
        for cost in r["costs"]:
            assert cost["layer_steps_per_token"] == pytest.approx(1 + cost["steps_per_token"] * (n + c))
        assert r["accuracy_metric"] == "bleu" and r["examples"] == 3 and len(r["flip_rate_final"]) == r["n_loops"]
    # The LM's prefill gives each output its first token, so a one-loop decoder takes one step per later token.
    one_loop = rows["1+2x1+1"]
    assert one_loop["speed_cost"] == pytest.approx(1 + one_loop["speed_steps_per_token"] * 3) and one_loop["depth"] == 4
    assert set(outcome.frontier.column("trial").to_pylist()) <= {r["trial"] for r in rows.values()}
    latency = {(r["pattern"], r["variant"]): r for r in outcome.latency.to_pylist()}
    shallow = latency[("1+2x1+1", "sequential")]  # the trained one-loop layout, timed as every pattern's baseline
    assert shallow["ratio_vs_shallow"] == 1.0 and shallow["steps"] == shallow["tokens"] - 2  # 2 inputs, prefilled
    for (pattern, _), r in latency.items():
        if pattern == "1+1x2+1":  # its shallow decoder would be 1+1x1+1, not trained here: no ratio
            assert r["ratio_vs_shallow"] is None
