"""The sampling benchmark: every variant decoded, counted and checked against sequential sampling."""

from __future__ import annotations

import pytest
import torch

from speed.benchmarks.sampling import SAMPLING_BENCH_SCHEMA, format_sampling_table, run_sampling_benchmark
from speed.config import preset
from speed.decode.generate import DecodeOptions, generate
from speed.engine.sampling import Sampling
from speed.models.t5 import SpeedT5


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
                model,
                torch.tensor([x]),
                options=DecodeOptions(method="sequential", max_new_tokens=6, sampling=Sampling(1.0, seed=i)),
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


def test_the_sampling_benchmark_takes_a_looped_lm():
    """A looped LM's prompts: every SPEED variant samples what sequential sampling does."""
    from speed.config import lm_preset
    from speed.models.looped_lm import LoopedLM

    torch.manual_seed(0)
    model = LoopedLM(lm_preset("tiny", pattern="1+2x3+1")).eval()
    table = run_sampling_benchmark(model, [[5, 6, 7, 8], [9, 10]], (0.0, 1.0), 5)
    assert table.num_rows == 5 and all(table.column("identical").to_pylist())


def test_lever_benchmark_rows_count_every_variant_and_check_it_against_sequential():
    from speed.benchmarks.levers import (
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
    run = run_lever_benchmark(model, inputs, levers, 8)
    table = run.table
    assert table.schema.equals(LEVER_BENCH_SCHEMA)
    rows = {r["variant"]: r for r in table.to_pylist()}
    assert list(rows) == ["sequential", "shallow", "speed", "b3", "lanes", "oracle"]
    assert rows["oracle"]["passes_per_token"] <= rows["speed"]["passes_per_token"]  # no exit can do better
    assert rows["oracle"]["rows_per_token"] == 3.0  # M rows a token: no flush wastes one
    assert {r["model"] for r in rows.values()} == {"model"} and not any(r["exit_adapters"] for r in rows.values())
    sequential = [
        generate(model, torch.tensor([x]), options=DecodeOptions(method="sequential", max_new_tokens=8)).tokens
        for x in inputs
    ]
    assert run.outputs == {"model": [t[0] for t in sequential]}
    assert rows["sequential"]["tokens"] == sum(len(t[0]) for t in sequential)
    assert all(r["quality"] is None and r["metric"] is None for r in rows.values())  # no references given
    for name in ("sequential", "speed", "b3", "lanes", "oracle"):
        assert rows[name]["identical"] and rows[name]["tokens"] == rows["sequential"]["tokens"], name
    assert rows["sequential"]["passes_per_token"] == rows["sequential"]["rows_per_token"] == 3.0  # M per token
    assert rows["shallow"]["passes_per_token"] == 1.0  # one loop
    assert rows["b3"]["settings"] == '{"branches": 3, "row_budget": 4}'
    speed = rows["speed"]["seconds"] / rows["speed"]["tokens"]
    for r in rows.values():  # seconds per token against plain SPEED's
        assert r["vs_speed"] == pytest.approx(r["seconds"] / r["tokens"] / speed)
    assert 1.0 <= rows["speed"]["passes_per_token"] <= 3.0
    assert all(0 < r["cpu_ms_per_token"] for r in rows.values())
    assert format_lever_table(table).count("\n") == len(rows) + 1


def test_lever_benchmark_compares_checkpoints_with_and_without_adapters_and_scores_their_output():
    """Several models side by side: each its own variants, ratios against its own plain SPEED, and the exit
    adapters' combinations with every lever (``<name>_no_exits``); ``quality`` scores each model's output once."""
    from engine_helpers import random_exits

    from speed.benchmarks.heldout import Quality
    from speed.benchmarks.levers import format_lever_table, parse_levers, run_lever_benchmark

    torch.manual_seed(0)
    a = SpeedT5(preset("tiny", pattern="2x3")).eval()
    b = random_exits(SpeedT5(preset("tiny", pattern="2x3")).eval(), seed=1)
    scored: list[list[list[int]]] = []

    def quality(outputs: list[list[int]]) -> Quality:
        scored.append(outputs)
        return Quality("bleu", float(sum(map(len, outputs))), 1.0, 99.0)  # any function of the outputs

    inputs = [[5, 6, 7], [8, 9], [10, 11, 12]]
    run = run_lever_benchmark({"a": a, "b": b}, inputs, parse_levers("lanes=branches:3,branch_depth:3"), 8, quality)
    rows = {(r["model"], r["variant"]): r for r in run.table.to_pylist()}
    assert list(rows) == [
        ("a", "sequential"), ("a", "shallow"), ("a", "speed"), ("a", "lanes"), ("a", "oracle"),
        ("b", "sequential"), ("b", "shallow"), ("b", "speed"), ("b", "lanes"), ("b", "speed_no_exits"),
        ("b", "lanes_no_exits"), ("b", "oracle"),
    ]  # fmt: skip
    assert [rows["b", v]["exit_adapters"] for v in ("speed", "lanes", "speed_no_exits", "lanes_no_exits")] == [
        True, True, False, False
    ]  # fmt: skip
    lanes = '{"branch_depth": 3, "branches": 3}'
    assert rows["b", "lanes_no_exits"]["settings"] == rows["b", "lanes"]["settings"] == lanes
    for (model, variant), r in rows.items():
        if variant != "shallow":
            assert r["identical"], (model, variant)
            assert r["quality"] == sum(map(len, run.outputs[model])) and r["metric"] == "bleu"
        own = rows[model, "speed"]
        assert r["vs_speed"] == pytest.approx((r["seconds"] / r["tokens"]) / (own["seconds"] / own["tokens"]))
    assert rows["a", "shallow"]["quality"] is None
    assert scored == [run.outputs["a"], run.outputs["b"]]
    assert run.outputs["a"] != run.outputs["b"]  # two different models
    assert rows["b", "speed"]["passes_per_token"] != rows["b", "speed_no_exits"]["passes_per_token"]  # other drafts
    table = format_lever_table(run.table)
    assert table.count("\n") == len(rows) + 1 and "[1.00, 99.00]" in table and "lanes_no_exits" in table


def test_lever_settings_are_refused_when_misspelled():
    from speed.benchmarks.levers import parse_levers

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
    from speed.benchmarks.decode import format_table
    from speed.benchmarks.decode_lm import LM_BENCH_SCHEMA, LMBenchConfig, run_lm_benchmark
    from speed.config import lm_preset

    cfg = LMBenchConfig(lm_preset("tiny", pattern="2x3"), batch=2, prompt_len=5, new_tokens=4, reps=1)
    table = run_lm_benchmark(cfg)
    assert table.schema.equals(LM_BENCH_SCHEMA)
    rows = {r["variant"]: r for r in table.to_pylist()}
    assert set(rows) == {"sequential", "speed", "speed_oracle", "shallow", "ours_deep", "hf_generate"}
    assert [rows[v]["pattern"] for v in ("sequential", "shallow", "ours_deep")] == ["2x3", "2x1", "6x1"]
    assert rows["speed_oracle"]["flushes"] == 0 and rows["sequential"]["tokens"] == 2 * 4
    assert all(r["ttft_ms"] > 0 and r["ms_per_token"] > 0 and r["prompt_len"] == 5 for r in rows.values())
    assert rows["sequential"]["speedup"] == 1.0 and rows["hf_generate"]["speedup"] == 1.0
    assert "TTFT" in format_table(table)


def test_lm_decode_benchmark_figures_are_each_runs_own_split(monkeypatch):
    """TTFT and ms/token are the medians of each run's own split (``first_token_s``, ``decode_s``), never the
    difference of two runs' medians: a one-token run slower than a whole decode (a noisy machine) cannot make a
    figure negative or wrong."""
    import dataclasses
    import time

    from speed.benchmarks import decode_lm
    from speed.config import lm_preset

    real = decode_lm.decoding

    def decoding(model, ids, new, **kw):
        decode = real(model, ids, new, **kw)

        def run():
            if new == 1:
                time.sleep(0.05)  # a first-token-only run, as slow as a busy machine makes it
            return dataclasses.replace(decode(), first_token_s=0.2, decode_s=0.006)  # each run's own split

        return run

    monkeypatch.setattr(decode_lm, "decoding", decoding)
    cfg = decode_lm.LMBenchConfig(lm_preset("tiny", pattern="2x3"), batch=2, prompt_len=5, new_tokens=4, reps=3)
    rows = {r["variant"]: r for r in decode_lm.run_lm_benchmark(dataclasses.replace(cfg, compare_hf=False)).to_pylist()}
    assert set(rows) == {"sequential", "speed", "speed_oracle", "shallow"}
    for r in rows.values():
        assert r["ms_per_token"] == pytest.approx(6.0 / (2 * 3))  # the rest over the tokens after each first
        assert r["ttft_ms"] == pytest.approx(200.0)


def test_the_first_token_clock_splits_a_generate_run():
    """transformers' ``generate`` puts the prompt, then each new token: the split falls at the second put."""
    import time

    from speed.benchmarks.decode_lm import FirstTokenClock

    clock = FirstTokenClock(torch.device("cpu"))
    time.sleep(0.02)
    clock.put(torch.tensor([[5, 6]]))  # the prompt
    time.sleep(0.02)
    clock.put(torch.tensor([7]))  # the first new tokens
    time.sleep(0.03)
    clock.put(torch.tensor([8]))
    clock.end()
    first, rest = clock.split()
    assert 0.04 <= first < rest + 0.04 and rest >= 0.03


def test_exit_adapters_in_the_decode_and_lever_benchmarks():
    """The decode benchmark's ``speed_exits`` row (fresh adapters: plain SPEED's schedule, their cost alone), and
    the lever benchmark of a model with adapters: its ``speed_no_exits`` row decodes the same tokens without them."""
    from engine_helpers import random_exits

    from speed.benchmarks.decode import BenchConfig, run_benchmark
    from speed.benchmarks.levers import run_lever_benchmark

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
    run = run_lever_benchmark(model, [[5, 6, 7], [8, 9], [10, 11, 12]], {}, 8)
    levers = {r["variant"]: r for r in run.table.to_pylist()}
    assert list(levers) == ["sequential", "shallow", "speed", "speed_no_exits", "oracle"]
    assert levers["speed"]["identical"] and levers["speed_no_exits"]["identical"]
    assert levers["speed"]["rows_per_token"] != levers["speed_no_exits"]["rows_per_token"]  # other drafts


def _checkpoint(directory, tokenizer, task: str, adapters_seed: int | None = None) -> str:
    """A tiny 2x3 T5 saved as a finetuning job's checkpoint of ``task`` (not trained), with random exit adapters
    saved beside it when ``adapters_seed`` is given."""
    from engine_helpers import random_exits

    from speed.models.checkpoint import save_exits, save_model
    from speed.tokenizer import Tokenizer

    torch.manual_seed(0)
    model = SpeedT5(preset("tiny", pattern="2x3", vocab_size=Tokenizer.load(tokenizer).vocab_size)).eval()
    save_model(directory, model, tokenizer, {"job": {"data": {"task": task, "max_source_len": 24}}, "step": 1})
    if adapters_seed is not None:
        save_exits(str(directory), random_exits(model, adapters_seed).exit_adapters)
    return str(directory)


def test_the_lever_job_compares_named_checkpoints_on_held_out_text(tiny_tokenizer, tmp_path, capsys):
    """``jobs/bench_levers.py`` with two checkpoints of one task: every variant of each, adapters on and off, the
    task's metric with its interval; checkpoints of different tasks are one error line."""
    import pyarrow.parquet as pq
    from test_cli import _error_line, _job

    plain = _checkpoint(tmp_path / "plain", tiny_tokenizer, "translate_en_de")
    adapted = _checkpoint(tmp_path / "adapted", tiny_tokenizer, "translate_en_de", adapters_seed=1)
    out = tmp_path / "levers.parquet"
    argv = ["--checkpoint", f"plain={plain}", "--checkpoint", f"adapted={adapted}", "--limit", "3"]
    argv += ["--levers", "lanes=branches:2,branch_depth:2", "--max-new-tokens", "5", "--out", str(out)]
    assert _job("bench_levers").main(argv) == 0
    printed = capsys.readouterr().out
    assert "plain 2x3, adapted 2x3, 3 translate_en_de test sentences" in printed
    assert "adapted vs plain: bleu " in printed and "difference +0.00 [+0.00, +0.00] (95 % paired bootstrap" in printed
    rows = {(r["model"], r["variant"]): r for r in pq.read_table(out).to_pylist()}
    assert [v for m, v in rows if m == "adapted"] == [
        "sequential", "shallow", "speed", "lanes", "speed_no_exits", "lanes_no_exits", "oracle"
    ]  # fmt: skip
    assert [v for m, v in rows if m == "plain"] == ["sequential", "shallow", "speed", "lanes", "oracle"]
    for key, r in rows.items():
        assert (r["metric"] is None) == (key[1] == "shallow"), key
        if key[1] != "shallow":
            assert r["metric"] == "bleu" and r["quality_low"] <= r["quality"] <= r["quality_high"] and r["identical"]
    assert rows["plain", "speed"]["quality"] == rows["adapted", "speed"]["quality"]  # the same weights and output
    other = _checkpoint(tmp_path / "news", tiny_tokenizer, "summarize")
    with pytest.raises(SystemExit) as exit_:  # the news records are read first (datasets may draw a progress bar)
        _job("bench_levers").main(["--checkpoint", f"a={plain}", "--checkpoint", f"b={other}"])
    assert exit_.value.code == 2
    last = capsys.readouterr().err.splitlines()[-1]
    assert last == "error: checkpoint 'b' reads other inputs (summarize) than the first (translate_en_de)"
    message = _error_line(capsys, "bench_levers", ["--checkpoint", plain, "--checkpoint", plain])
    assert message.startswith("error: several checkpoints are NAME=PATH with different names, got ")


def test_the_lever_benchmark_takes_a_looped_lm():
    """A looped LM's variants: its shallow decoder keeps the prelude and coda (1+2x1+1), every SPEED variant equals
    sequential decoding, and the oracle needs no more steps than plain SPEED."""
    from speed.benchmarks.levers import _lever_variants, parse_levers, run_lever_benchmark
    from speed.config import lm_preset
    from speed.models.looped_lm import LoopedLM

    torch.manual_seed(0)
    model = LoopedLM(lm_preset("tiny", pattern="1+2x3+1")).eval()
    levers = parse_levers("lanes=branches:3,branch_depth:3")
    shallow = next(v.decoder for v in _lever_variants("lm", model, levers) if v.name == "shallow")
    assert str(shallow.sharing) == "1+2x1+1"
    weights, same = shallow.state_dict(), model.state_dict()  # the same parameters, one loop of them
    assert weights.keys() == same.keys() and all(torch.equal(weights[k], same[k]) for k in weights)
    rows = {r["variant"]: r for r in run_lever_benchmark(model, [[5, 6, 7, 8], [9, 10]], levers, 6).table.to_pylist()}
    assert list(rows) == ["sequential", "shallow", "speed", "lanes", "oracle"]
    assert all(rows[v]["identical"] for v in ("speed", "lanes", "oracle"))
    assert rows["oracle"]["passes_per_token"] <= rows["speed"]["passes_per_token"] < 3


def test_the_lever_job_reads_a_hugging_face_directory_with_its_tokenizer(tmp_path, capsys):
    """``jobs/bench_levers.py --checkpoint <Ouro directory> --task ...``: the task's sentences as user turns of the
    directory's chat template, outputs ending at its stop ids (<|im_end|> too), every SPEED variant identical to
    sequential decoding; the quality scores the sequential outputs against an independent decode."""
    import pyarrow.parquet as pq
    from imported_helpers import write_chat_ouro
    from test_cli import _job

    from speed.benchmarks.heldout import held_out
    from speed.data import get_task, read_records
    from speed.hf_tokenizer import load_tokenizer
    from speed.models.family import family_of
    from speed.models.pretrained import from_pretrained

    directory = write_chat_ouro(tmp_path / "Ouro-tiny", end_of_turn_bias=0.36)
    out = tmp_path / "levers.parquet"
    argv = ["--checkpoint", str(directory), "--task", "translate_en_de", "--limit", "3", "--threads", "1"]
    argv += ["--levers", "lanes=branches:2,branch_depth:2", "--max-new-tokens", "6", "--out", str(out)]
    assert _job("bench_levers").main(argv) == 0
    assert "model 2x3, 3 translate_en_de test sentences" in capsys.readouterr().out
    rows = {r["variant"]: r for r in pq.read_table(out).to_pylist()}
    assert set(rows) == {"sequential", "shallow", "speed", "lanes", "oracle"}
    assert all(r["identical"] for v, r in rows.items() if v != "shallow") and rows["speed"]["metric"] == "bleu"
    model, tok = from_pretrained(directory), load_tokenizer(directory)
    work = held_out(str(directory), "test", 3, "translate_en_de")
    task = family_of(model).read_task(get_task("translate_en_de"))  # an LM's: the instruction opens the source
    sources = read_records(task, "test", None, 3).dataset["source"]
    stopped = []
    for source, ids in zip(sources, work.inputs):
        assert ids == tok.encode_chat([{"role": "user", "content": source}])  # the directory's template
        ref = generate(
            model,
            torch.tensor([ids]),
            options=DecodeOptions(method="sequential", max_new_tokens=6, stop_ids=tok.stop_ids),
        )
        stopped.append(ref.stopped[0])
    assert any(stopped) and rows["sequential"]["tokens"] < 3 * 6  # some end at a stop id before the limit


def test_the_lever_job_refuses_a_directory_it_cannot_read_in_one_line(tmp_path, capsys):
    import json

    from test_cli import _error_line

    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
    out = tmp_path / "levers.parquet"
    message = _error_line(capsys, "bench_levers", ["--checkpoint", str(bad), "--task", "summarize", "--out", str(out)])
    assert "model_type 'gpt2' is not one the platform loads" in message and not out.exists()
