"""The serving benchmark (``speed.benchmarks.serving.run_serve_bench``) run once at its smallest size: a tiny
checkpoint (a T5, then a looped LM) behind both applications on the session's Ray, one round at concurrency 1,
two requests a variant."""

from __future__ import annotations

import pyarrow.compute as pc
import pytest
import torch
from serve_helpers import shutdown_serve

from speed import SpeedT5, preset
from speed.benchmarks.serving import ServeBenchConfig, format_table, run_serve_bench
from speed.config import lm_preset
from speed.models.checkpoint import save_model
from speed.models.looped_lm import LoopedLM
from speed.serve.readers import read_requests
from speed.serve.schemas import BENCH_SERVE_SCHEMA
from speed.tokenizer import EOS_ID, Tokenizer

pytestmark = pytest.mark.ray


@pytest.mark.parametrize("family", ["t5", "lm"])
def test_one_round_rows_count_every_variant(ray_session, tiny_tokenizer, tmp_path, family):
    """Every variant answers the same prompts alike, to max_tokens; the engine's counts per token are M for
    sequential decoding and fewer steps for SPEED; the replicas' statistics rows hold each timed request.
    A looped LM's checkpoint runs the same benchmark (its prompts the task's finetuning prompts)."""

    torch.manual_seed(0)
    vocab = Tokenizer.load(tiny_tokenizer).vocab_size
    build = (SpeedT5, preset) if family == "t5" else (LoopedLM, lm_preset)
    model = build[0](build[1]("tiny", pattern="2x3", vocab_size=vocab)).eval()
    with torch.no_grad():
        model.lm_head.weight[EOS_ID] = 0  # EOS never the argmax: every answer runs to max_tokens
    save_model(tmp_path / "ckpt", model, tiny_tokenizer)
    sizes = {"concurrency": (1,), "rounds": 1, "requests_per_client": 2, "min_requests": 2, "warmup": 1}
    stats = str(tmp_path / "stats")
    # without the cost model: its choice of rows follows measured timings, and this test counts SPEED's steps
    config = ServeBenchConfig(
        str(tmp_path / "ckpt"), max_tokens=6, max_active=2, stats_path=stats, cost_model=False, **sizes
    )
    try:
        result = run_serve_bench(config)
    finally:
        shutdown_serve()  # run_serve_bench deleted its applications; the proxy goes too

    assert result.runs.schema.equals(BENCH_SERVE_SCHEMA) and result.mismatches == 0
    runs = {r["variant"]: r for r in result.runs.to_pylist()}
    assert list(runs) == ["a", "b", "c"]  # no lever set: no variant d
    expected = {"a": ("sequential", 1), "b": ("sequential", 2), "c": ("speed", 2)}
    assert {v: (r["method"], r["max_active"]) for v, r in runs.items()} == expected
    for r in runs.values():
        assert (r["concurrency"], r["round"], r["requests"], r["errors"], r["tokens"]) == (1, 0, 2, 0, 12)
        assert r["tokens_per_s"] == pytest.approx(12 / r["seconds"]) and 0 < r["p50_ms"] <= r["p99_ms"]
    sequential = 3.0 if family == "t5" else 3.0 * 5 / 6  # an LM's first token comes out of its prompt's prefill
    for v in "ab":  # one row per loop and token, one loop per step
        assert runs[v]["steps_per_token"] == runs[v]["rows_per_token"] == pytest.approx(sequential)
    assert 0.5 <= runs["c"]["steps_per_token"] < sequential <= runs["c"]["rows_per_token"]

    assert sorted(pc.unique(result.requests["run"]).to_pylist()) == ["a-c1-r0", "b-c1-r0", "c-c1-r0"]
    served = read_requests(stats)  # warm-up requests too
    timed = set(result.requests["request_id"].to_pylist())
    assert set(served["family"].to_pylist()) == {family}
    assert len(timed) == 6 and timed <= set(served["request_id"].to_pylist())
    assert {(v, c) for v, c in result.summary} == {("a", 1), ("b", 1), ("c", 1)}
    assert set(result.ratios) == {"c_over_a_tokens_per_s_at_1", "c_over_b_tokens_per_s_at_1", "c_over_b_p50_at_1"}
    assert result.ratios["c_over_b_p50_at_1"] == pytest.approx(runs["c"]["p50_ms"] / runs["b"]["p50_ms"])
    assert "answers identical across variants: yes" in format_table(result)


def test_a_shape_replaying_flips_is_served(ray_session, tiny_tokenizer, tmp_path):
    """``ServeBenchConfig.replay``: the replicas serve a random model of a (tiny) Ouro shape instead of the
    checkpoint's, its exits replaying loop-1 agreement 0.5: answers identical across variants, every one to
    max_tokens; sequential decoding (b) teaches each prompt, SPEED (c) replays it: its requests' flip rates are the
    pattern's, and it takes fewer steps a token than sequential decoding."""
    from test_bench_shapes import TINY_OURO

    from speed.benchmarks.replay import FlipPattern, agreement_profile
    from speed.benchmarks.serving import ReplayServing

    torch.manual_seed(0)
    vocab = Tokenizer.load(tiny_tokenizer).vocab_size
    save_model(tmp_path / "ckpt", SpeedT5(preset("tiny", pattern="2x3", vocab_size=vocab)).eval(), tiny_tokenizer)
    shape = TINY_OURO.resolve().replace(vocab_size=512)
    rates = agreement_profile(0.5, 4)
    replay = ReplayServing("tiny-ouro", shape, FlipPattern.from_rates(rates, 4, 64, seed=0), dtype="float32")
    sizes = {"concurrency": (2,), "rounds": 1, "requests_per_client": 2, "min_requests": 4, "warmup": 1}
    config = ServeBenchConfig(str(tmp_path / "ckpt"), max_tokens=8, max_active=2, stats_path=str(tmp_path / "stats"),
                              cost_model=False, replay=replay, **sizes)  # fmt: skip
    try:
        result = run_serve_bench(config)
    finally:
        shutdown_serve()
    assert result.mismatches == 0
    runs = {r["variant"]: r for r in result.runs.to_pylist()}
    assert all((r["requests"], r["errors"], r["tokens"]) == (4, 0, 32) for r in runs.values())
    assert runs["c"]["steps_per_token"] < runs["b"]["steps_per_token"]
    assert set(result.flip_rates) == {"c"}  # sequential decoding without a trace scores no early exit
    flips = result.flip_rates["c"]
    assert flips[-1] == 0.0 and 0.2 <= flips[0] <= 0.8 and flips == sorted(flips, reverse=True)
    assert "(c) flip rate by loop: " in format_table(result)
    for key, s in result.summary.items():  # time per output token after the first, from the streamed answers
        assert 0 < s["tpot_p50_ms"] <= s["tpot_p99_ms"] < s["p50_ms"], key
