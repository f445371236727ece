"""The sampling benchmark: every variant decoded, counted and checked against sequential sampling."""

from __future__ import annotations

import pytest
import torch

from speed.benchmarks.decode import SAMPLING_BENCH_SCHEMA, format_sampling_table, run_sampling_benchmark
from speed.config import preset
from speed.decoding import generate
from speed.model import SpeedT5
from speed.sampling import Sampling


def test_sampling_benchmark_rows():
    torch.manual_seed(0)
    model = SpeedT5(preset("tiny", pattern="2x3")).eval()
    inputs = [[5, 6, 7], [8, 9]]
    table = run_sampling_benchmark(model, inputs, (0.0, 1.0), 6)
    assert table.schema.equals(SAMPLING_BENCH_SCHEMA)
    rows = {(r["method"], r["temperature"], r["guess"]): r for r in table.to_pylist()}
    assert set(rows) == {
        ("sequential", 0.0, ""),
        ("sequential", 1.0, ""),
        ("speed", 0.0, "greedy"),
        ("speed", 1.0, "coupled"),
        ("speed", 1.0, "argmax"),
    }
    assert all(r["identical"] and r["sentences"] == 2 for r in rows.values())
    sampled = sum(
        len(
            generate(
                model, torch.tensor([x]), method="sequential", max_new_tokens=6, sampling=Sampling(1.0, seed=i)
            ).tokens[0]
        )
        for i, x in enumerate(inputs)
    )  # sentence i samples with seed i
    assert rows[("speed", 1.0, "coupled")]["tokens"] == rows[("sequential", 1.0, "")]["tokens"] == sampled
    assert rows[("sequential", 1.0, "")]["passes_per_token"] == 3.0  # M passes per token
    assert 1.0 <= rows[("speed", 1.0, "coupled")]["passes_per_token"] < 3.0
    for (_, temperature, _), r in rows.items():  # against the sequential run at the row's own temperature
        assert r["speedup"] == pytest.approx(rows[("sequential", temperature, "")]["seconds"] / r["seconds"])
    assert "coupled" in format_sampling_table(table)


def test_lever_benchmark_rows_count_every_variant_and_check_it_against_sequential():
    from speed.benchmarks.decode import (
        LEVER_BENCH_SCHEMA,
        LeverSetting,
        format_lever_table,
        parse_levers,
        run_lever_benchmark,
    )
    from speed.engine import Speculation

    torch.manual_seed(0)
    model = SpeedT5(preset("tiny", pattern="2x3")).eval()
    inputs = [[5, 6, 7], [8, 9]]
    levers = parse_levers("b3=branches:3,row_budget:4;lanes=branches:3,branch_depth:3")
    assert levers == {
        "b3": LeverSetting(Speculation(branches=3), row_budget=4),
        "lanes": LeverSetting(Speculation(branches=3, branch_depth=3)),
    }
    table = run_lever_benchmark(model, inputs, levers, 8)
    assert table.schema.equals(LEVER_BENCH_SCHEMA)
    rows = {r["variant"]: r for r in table.to_pylist()}
    assert list(rows) == ["sequential", "shallow", "speed", "b3", "lanes"]
    sequential = [generate(model, torch.tensor([x]), method="sequential", max_new_tokens=8).tokens for x in inputs]
    assert rows["sequential"]["tokens"] == sum(len(t[0]) for t in sequential)
    for name in ("sequential", "speed", "b3", "lanes"):
        assert rows[name]["identical"] and rows[name]["tokens"] == rows["sequential"]["tokens"], name
    assert rows["sequential"]["passes_per_token"] == rows["sequential"]["rows_per_token"] == 3.0  # M per token
    assert rows["shallow"]["passes_per_token"] == 1.0  # one loop
    assert rows["b3"]["settings"] == '{"branches": 3, "row_budget": 4}'
    speed = rows["speed"]["seconds"] / rows["speed"]["tokens"]
    for r in rows.values():  # seconds per token against plain SPEED's
        assert r["vs_speed"] == pytest.approx(r["seconds"] / r["tokens"] / speed)
    assert 1.0 <= rows["speed"]["passes_per_token"] <= 3.0
    assert format_lever_table(table).count("\n") == len(rows) + 1


def test_lever_settings_are_refused_when_misspelled():
    from speed.benchmarks.decode import parse_levers

    for text in ("b=branch:6", "b=branches", "speed=branches:1", "b=branches:1;b=branches:2", "branches:6"):
        with pytest.raises(ValueError):
            parse_levers(text)
    with pytest.raises(ValueError, match=r"'b=branches:-1': branches must be an integer >= 0"):
        parse_levers("b=branches:-1")  # Speculation's own check
    with pytest.raises(ValueError, match=r"b.invalidation: expected one of \['eager', 'final'\]"):
        parse_levers("b=invalidation:lazy")
    final = parse_levers("f=invalidation:final,launch_loop:2")["f"]
    assert final.given() == {"invalidation": "final", "launch_loop": 2}


def test_lm_decode_benchmark_rows():
    """The looped LM's side-by-side run: every variant timed, TTFT apart, our Dx1 against transformers' Llama."""
    from speed.benchmarks.decode_lm import LM_BENCH_SCHEMA, LMBenchConfig, format_lm_table, run_lm_benchmark
    from speed.config import lm_preset

    cfg = LMBenchConfig(lm_preset("tiny", pattern="2x3"), batch=2, prompt_len=5, new_tokens=4, reps=1)
    table = run_lm_benchmark(cfg)
    assert table.schema.equals(LM_BENCH_SCHEMA)
    rows = {r["variant"]: r for r in table.to_pylist()}
    assert set(rows) == {"sequential", "speed", "speed_oracle", "shallow", "ours_deep", "hf_generate"}
    assert [rows[v]["pattern"] for v in ("sequential", "shallow", "ours_deep")] == ["2x3", "2x1", "6x1"]
    assert rows["speed_oracle"]["flushes"] == 0 and rows["sequential"]["tokens"] == 2 * 4
    assert all(r["ttft_ms"] > 0 and r["prompt_len"] == 5 for r in rows.values())
    assert rows["sequential"]["speedup"] == 1.0 and rows["hf_generate"]["speedup"] == 1.0
    assert "TTFT" in format_lm_table(table)


def test_exit_adapters_in_the_decode_and_lever_benchmarks():
    """The decode benchmark's ``speed_exits`` row (fresh adapters: plain SPEED's schedule, their cost alone), and
    the lever benchmark of a model with adapters: its ``speed_no_exits`` row decodes the same tokens without them."""
    from engine_helpers import random_exits

    from speed.benchmarks.decode import BenchConfig, run_benchmark, run_lever_benchmark

    table = run_benchmark(BenchConfig(preset("tiny", pattern="2x3"), new_tokens=6, reps=1, compare_hf=False))
    rows = {r["variant"]: r for r in table.to_pylist()}
    assert {k: rows["speed_exits"][k] for k in ("steps", "rows", "flushes", "tokens")} == {
        k: rows["speed"][k] for k in ("steps", "rows", "flushes", "tokens")
    }
    none = run_benchmark(
        BenchConfig(preset("tiny", pattern="2x3"), new_tokens=4, reps=1, compare_hf=False, exit_rank=None)
    )
    assert "speed_exits" not in none.column("variant").to_pylist()
    torch.manual_seed(0)
    model = random_exits(SpeedT5(preset("tiny", pattern="2x3")).eval(), seed=1)
    levers = {r["variant"]: r for r in run_lever_benchmark(model, [[5, 6, 7], [8, 9], [10, 11, 12]], {}, 8).to_pylist()}
    assert list(levers) == ["sequential", "shallow", "speed", "speed_no_exits"]
    assert levers["speed"]["identical"] and levers["speed_no_exits"]["identical"]
    assert levers["speed"]["rows_per_token"] != levers["speed_no_exits"]["rows_per_token"]  # other drafts
