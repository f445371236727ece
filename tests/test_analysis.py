"""speed.analysis on real result files, and every notebook in analysis/ executed headless on tiny real runs."""

from __future__ import annotations

import importlib.util
import shutil
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime, timezone
from pathlib import Path

import nbformat
import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import pytest
import torch
from budget_helpers import make_run

from speed import DecodeOptions, SpeedT5, generate, preset
from speed.analysis import (
    benchmark_latency,
    discover,
    flip_rates_by_position,
    latency_plane,
    load_evaluation,
    load_families,
    load_payoff,
    load_summary,
    loop_table,
    model_identity,
    payoff_curves,
    payoff_traces,
    quality_difference,
    rows_per_step,
    tradeoff,
)
from speed.analysis.families import format_families
from speed.analysis.notebooks import notebook_paths
from speed.analysis.serving import in_flight_at, max_in_flight
from speed.analysis.tradeoff import model_label
from speed.benchmarks.decode import BenchConfig, run_benchmark
from speed.config import lm_preset, to_dict
from speed.engine.trace import TraceBuilder, flip_rates
from speed.eval.budget import BUDGET_FILE, budget_curve
from speed.eval.evaluate import EvalConfig, run_evaluation
from speed.eval.metrics import bleu
from speed.models.family import match_parameters, parameter_count
from speed.models.looped_lm import LoopedLM
from speed.paths import repo_root
from speed.serve.schemas import LOADGEN_SCHEMA, REQUEST_SCHEMA
from speed.tokenizer import Tokenizer
from speed.train.families import FAMILIES_FILE, FAMILIES_SCHEMA, family_row

NOTEBOOKS = notebook_paths()
# The figures each notebook writes, relative to the results folder of _results().
FIGURES = {
    "flips.ipynb": ["flip_rate_per_loop.png", "eval-2x3/flips.png"],  # a one-loop 2x1 has no flips to draw
    "tradeoff.ipynb": ["accuracy_vs_latency.png", "benchmark_latency.png"],
    "serving.ipynb": ["load/serving_load.png", "stats/requests/serving_rows_per_step.png"],
    "sweep.ipynb": [],  # no sweep here: tests/test_sweep.py runs it on a real sweep's folder
    "families.ipynb": [f"families/families_{name}.png" for name in ("flips", "costs", "plane")],
    "budget.ipynb": ["budget_costs.png", "budget_flips.png"],
    "payoff.ipynb": ["payoff_map.png"],
}


@pytest.fixture(scope="module")
def results(tmp_path_factory, tiny_tokenizer):
    """A results folder from tiny real runs: two evaluations, two decode benchmarks of 2x3 (one of the evaluated
    2x3's own config, one of a wider model) and served-shaped load rows."""
    root = tmp_path_factory.mktemp("results")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        tok = Tokenizer.load(tiny_tokenizer)
        for pattern in ("2x3", "2x1"):
            torch.manual_seed(0)
            model = SpeedT5(preset("tiny", vocab_size=tok.vocab_size, pattern=pattern)).eval()
            config = EvalConfig(
                "translate_en_de", "validation", limit=6, batch_size=3, max_new_tokens=10, max_source_len=64,
                check_sequential=True,
            )  # fmt: skip
            run_evaluation(model, tok, config, root / f"eval-{pattern}", progress=False)
        for name, d_model in (("bench_decode", 32), ("bench_wider", 48)):
            model_config = preset("tiny", vocab_size=tok.vocab_size, pattern="2x3", d_model=d_model)
            bench = run_benchmark(BenchConfig(model=model_config, new_tokens=6, reps=1, compare_hf=False))
            pq.write_table(bench, root / f"{name}.parquet")
        _load_runs(model_2x3(tok.vocab_size), root)
        _families(tok, root / "families")
        _budget(tiny_tokenizer, tmp_path_factory.mktemp("budget_run"), root / "budget")
        _payoff(root / "payoff.parquet")
    finally:
        torch.set_num_threads(threads)
    return root


def _families(tok: Tokenizer, folder: Path) -> None:
    """A family comparison's folder as speed.train.families.compare_families writes it, of untrained tiny models:
    a T5 2x3 and a looped LM 1+2x3+1 evaluated on the same examples, and families.parquet."""
    rows = []
    for family, model in (("t5", model_2x3(tok.vocab_size)), ("lm", _lm(tok.vocab_size))):
        config = EvalConfig("translate_en_de", "validation", limit=4, batch_size=1, max_new_tokens=8,
                            max_source_len=64, bootstrap_samples=100)  # fmt: skip
        name = f"{family}-{model.config.pattern}"
        summary = run_evaluation(model, tok, config, folder / name, progress=False)
        train = {"train_steps": 0, "train_examples": 0, "train_tokens": 0, "train_seconds": 0.0}
        rows.append(family_row(family, summary, name, parameter_count(model.config), train))
    pq.write_table(pa.Table.from_pylist(rows, schema=FAMILIES_SCHEMA), folder / FAMILIES_FILE)


def _payoff(path: Path) -> None:
    """A payoff map's rows at a tiny Ouro shape: two loop-1 agreements and a trace, batch 1 and 2, the cost model off
    and on, one round."""
    from test_bench_shapes import TINY_OURO

    from speed.benchmarks.payoff import PayoffConfig, TracePattern, run_payoff_map

    trace = TraceBuilder()
    for pos in range(4):
        trace.add_token(0, pos, [5, 7, 7] if pos % 2 else [7, 7, 7])
    config = PayoffConfig("tiny-ouro", TINY_OURO.resolve(), ("bfloat16",), (1, 2), (0.5, 0.9),
                          (TracePattern("demo", trace.table()),), rounds=1, new_tokens=6, prompt_len=5)  # fmt: skip
    pq.write_table(run_payoff_map(config, progress=lambda line: None), path)


def _budget(tokenizer: Path, scratch: Path, folder: Path) -> None:
    """A budget curve's budget.parquet (what the budget notebook loads) of a tiny T5 run's three checkpoints; the
    evaluations stay in ``scratch`` (tests/test_budget.py checks them)."""
    vocab = Tokenizer.load(tokenizer).vocab_size
    run = make_run(scratch / "run", lambda step: _seeded_2x3(vocab, step), tokenizer, "translate_en_de")
    config = EvalConfig(split="validation", limit=3, batch_size=1, max_new_tokens=6, bootstrap_samples=20,
                        check_sequential=False)  # fmt: skip
    budget_curve(str(run), config, str(scratch / "curve"), samples=20, log=lambda line: None)
    folder.mkdir()
    shutil.copyfile(scratch / "curve" / BUDGET_FILE, folder / BUDGET_FILE)


def _seeded_2x3(vocab_size: int, seed: int) -> SpeedT5:
    torch.manual_seed(seed)
    return SpeedT5(preset("tiny", vocab_size=vocab_size, pattern="2x3")).eval()


def _lm(vocab_size: int) -> LoopedLM:
    torch.manual_seed(0)
    return LoopedLM(lm_preset("tiny", vocab_size=vocab_size, pattern="1+2x3+1")).eval()


def model_2x3(vocab_size: int) -> SpeedT5:
    torch.manual_seed(0)
    return SpeedT5(preset("tiny", vocab_size=vocab_size, pattern="2x3")).eval()


def _load_runs(model: SpeedT5, root: Path) -> None:
    """Closed-loop load at concurrency 1 and 2 on real in-process SPEED decoding, written as the load generator's
    and the Serve replicas' Parquet rows, in their own schemas (the Serve application itself feeds the serving
    notebook in tests/test_serve_app.py)."""
    load_rows, request_rows = [], []
    ids = torch.randint(3, model.config.vocab_size, (8, 1, 6), generator=torch.Generator().manual_seed(1))
    for concurrency in (1, 2):
        start = time.perf_counter()

        def one(i: int, concurrency=concurrency, start=start) -> None:
            sent = time.perf_counter()
            result = generate(model, ids[i], options=DecodeOptions(method="speed", max_new_tokens=8, trace=False))
            done = time.perf_counter()
            request_id = f"c{concurrency}-{i}"
            arrived = datetime.fromtimestamp(time.time() - (done - sent), tz=timezone.utc)
            stats, ms = result.stats, 1000 * (done - sent)
            finish = "stop" if result.tokens[0][-1] == model.eos_id else "length"
            load_rows.append(
                {"run": f"c{concurrency}", "request": i, "prompt": i, "status": 200, "error": None,
                 "request_id": request_id, "scheduled_s": sent - start, "start_s": sent - start, "latency_ms": ms,
                 "ttft_ms": None, "prompt_tokens": 6, "completion_tokens": stats.tokens, "finish_reason": finish,
                 "replica": "replica-0", "flushes": stats.flushes, "text": ""}
            )  # fmt: skip
            request_rows.append(
                {"request_id": request_id, "choice": 0, "replica": "replica-0", "engine_id": i, "arrived": arrived,
                 "model": "tiny", "task": None, "method": "speed", "launch_loop": 1, "invalidation": "eager",
                 "route": "completions", "prompt": 0, "temperature": 0.0, "top_p": 1.0, "top_k": 0, "seed": 0,
                 "presence_penalty": 0.0, "frequency_penalty": 0.0, "stream": False, "max_tokens": 8,
                 "prompt_tokens": 6, "completion_tokens": stats.tokens,
                 "finish_reason": finish, "steps": stats.steps, "rows": stats.rows, "flushes": stats.flushes,
                 "wasted_rows": stats.wasted_rows, "flip_rate": [], "drafts": 0, "draft_tokens": 0,
                 "accepted_tokens": 0,
                 "accepted_per_pos": [], "draft_tokens_per_pos": [], "queued_ms": 0.0, "ttft_ms": None,
                 "latency_ms": ms, "total_ms": ms, "max_active": concurrency, "row_budget": None}
            )  # fmt: skip

        with ThreadPoolExecutor(concurrency) as pool:
            list(pool.map(one, range(len(ids))))
    (root / "load").mkdir()
    (root / "stats" / "requests").mkdir(parents=True)
    pq.write_table(pa.Table.from_pylist(load_rows, schema=LOADGEN_SCHEMA), root / "load" / "runs.parquet")
    pq.write_table(
        pa.Table.from_pylist(request_rows, schema=REQUEST_SCHEMA), root / "stats" / "requests" / "r-1.parquet"
    )


def test_discover_finds_every_kind_of_result(results):
    found = discover(results)
    assert [p.name for p in found.evaluations] == ["eval-2x1", "eval-2x3", "lm-1+2x3+1", "t5-2x3"]
    assert [p.name for p in found.bench] == ["bench_decode.parquet", "bench_wider.parquet"]
    assert [p.name for p in found.load] == ["runs.parquet"]
    assert [p.name for p in found.requests] == ["r-1.parquet"]
    assert found.sweeps == []  # sweeps: tests/test_sweep.py
    assert found.families == [results / "families"]
    assert found.budgets == [results / "budget"]
    assert found.payoff == [results / "payoff.parquet"]
    ev = load_evaluation(found.evaluations[1])
    assert ev.pattern == "2x3" and ev.loops == 3 and ev.predictions.num_rows == 6
    assert set(ev.trace.column("loop").to_pylist()) == {1, 2, 3}


def test_the_payoff_map_splits_into_curves_and_traces(results):
    """Loop-1 agreements as curves, in agreement order per (dtype, batch, cost model); the trace's cells apart."""
    table = load_payoff(discover(results).payoff)
    assert table.num_rows == 2 * 3 * 2
    curves, traces = payoff_curves(table).to_pylist(), payoff_traces(table).to_pylist()
    assert [(r["batch"], r["cost_model"], r["pattern"]) for r in curves] == [
        (b, c, p) for b in (1, 2) for c in (False, True) for p in ("agree=0.50", "agree=0.90")
    ]
    assert {r["pattern"] for r in traces} == {"demo"} and len(traces) == 4
    assert all(r["identical"] for r in curves + traces)
    assert load_payoff([]).num_rows == 0


def test_flip_rates_by_position_pools_buckets():
    trace = TraceBuilder()
    trace.add_token(0, 0, [5, 6, 6])
    trace.add_token(0, 1, [1, 1, 1])
    trace.add_token(1, 0, [7, 6, 6])
    trace.add_token(0, 2, [2, 3, 2])
    by_position = flip_rates_by_position(trace.table()).to_pylist()
    assert [(r["position"], r["loop"], r["tokens"]) for r in by_position[:3]] == [(0, 1, 2), (0, 2, 2), (0, 3, 2)]
    assert [r["flip_rate_final"] for r in by_position if r["loop"] == 1] == [1.0, 0.0, 0.0]
    assert [r["flip_rate_prev"] for r in by_position if r["position"] == 2] == [0.0, 1.0, 1.0]
    pooled = flip_rates_by_position(trace.table(), bucket=2).to_pylist()
    assert [(r["position"], r["tokens"]) for r in pooled if r["loop"] == 1] == [(0, 3), (2, 1)]
    assert pooled[0]["flip_rate_final"] == pytest.approx(2 / 3)
    # One bucket spanning every position is the per-loop rate.
    whole = flip_rates_by_position(trace.table(), bucket=100).column("flip_rate_final").to_pylist()
    assert whole == flip_rates(trace.table()).column("flip_rate_final").to_pylist()
    with pytest.raises(ValueError, match="bucket"):
        flip_rates_by_position(trace.table(), bucket=0)


def test_model_identity_is_the_resolved_config():
    tiny = preset("tiny", pattern="2x3")
    config = to_dict(tiny)
    assert model_identity(config) == model_identity({**config, "dropout": 0.3})  # training only
    assert model_identity({k: v for k, v in config.items() if k != "eos_id"}) == model_identity(config)  # default
    assert model_identity(to_dict(tiny.replace(d_model=48))) != model_identity(config)  # same pattern name
    assert model_identity(to_dict(tiny.replace(vocab_size=300))) != model_identity(config)
    lm = to_dict(lm_preset("tiny", pattern="2x3"))  # an LM's config: its family's fields, its own identity
    assert model_identity(lm) != model_identity(config) and model_identity(lm) == model_identity(dict(lm))
    assert model_label(lm).startswith("2x3 d32")


def test_tradeoff_joins_evaluations_and_benchmark_of_the_same_model(results):
    found = discover(results)
    evaluated = [p for p in found.evaluations if p.parent == results]  # not the family comparison's (test below)
    summaries = [(str(p), load_evaluation(p).summary) for p in evaluated]
    own, wider = (pq.read_table(path) for path in found.bench)
    rows = tradeoff(summaries, pa.concat_tables([own, wider])).to_pylist()
    by_key = {(r["pattern"], r["method"], r["timing"]): r for r in rows}
    shared = summaries[1][1]
    seconds, tokens = shared["decode"]["speed"]["seconds"], shared["decode"]["speed"]["tokens"]
    assert by_key[("2x3", "speed", "evaluation")]["ms_per_token"] == pytest.approx(1000 * seconds / tokens)
    assert by_key[("2x3", "speed", "evaluation")]["score"] == shared["metrics"]["bleu"]["score"]
    assert by_key[("2x3", "sequential", "evaluation")]["metric"] == "bleu"
    # The benchmark of the evaluated 2x3's own config joins, for the timings its random weights do not change;
    # the wider 2x3 shares the pattern name only and joins nothing.
    own_ms = {r["variant"]: r["ms_per_token"] for r in own.to_pylist()}
    benchmarked = [r for r in rows if r["timing"] == "benchmark"]
    assert sorted((r["pattern"], r["method"], r["ms_per_token"]) for r in benchmarked) == sorted(
        [("2x3", "sequential", own_ms["sequential"]), ("2x3", "speed_oracle", own_ms["speed_oracle"])]
        + [("2x1", "sequential", own_ms["shallow"])]
    )
    assert {r["model"] for r in rows if r["pattern"] == "2x3"} == {model_identity(shared["model"])}
    # One loop: a single timing, sequential; the 2x1 is the shallow baseline of the 2x3.
    assert {(r["method"], r["timing"]) for r in rows if r["pattern"] == "2x1"} == {
        ("sequential", "evaluation"),
        ("sequential", "benchmark"),
    }
    assert {r["role"] for r in rows if r["pattern"] == "2x1"} == {"shallow"}
    assert {r["role"] for r in rows if r["pattern"] == "2x3"} == {"shared"}
    assert tradeoff(summaries, wider).filter(pc.equal(pc.field("timing"), "benchmark")).num_rows == 0


def test_benchmark_latency_lists_every_benchmarked_model_apart(results):
    own, wider = (pq.read_table(path) for path in discover(results).bench)
    timed = benchmark_latency(pa.concat_tables([own, wider])).to_pylist()
    assert [(r["variant"], r["ms_per_token"]) for r in timed] == [
        (r["variant"], r["ms_per_token"]) for t in (own, wider) for r in t.to_pylist()
    ]
    labels = {r["label"] for r in timed if r["pattern"] == "2x3"}
    assert len(labels) == 2 and {label.split()[1] for label in labels} == {"d32", "d48"}  # two models, one name
    assert benchmark_latency(None).num_rows == 0


def test_in_flight_counts():
    starts, ends = np.array([0.0, 1.0, 2.0, 5.0]), np.array([3.0, 2.0, 4.0, 6.0])
    assert max_in_flight(starts, ends) == 2  # [1, 2) ends as [2, 4) starts
    assert in_flight_at(starts, ends).tolist() == [1, 2, 2, 1]
    assert max_in_flight(np.array([0.0, 0.0, 0.0]), np.array([1.0, 1.0, 1.0])) == 3


def test_load_summary_and_rows_per_step(results):
    found = discover(results)
    load = pq.read_table(found.load[0])
    runs = {r["run"]: r for r in load_summary(load).to_pylist()}
    assert set(runs) == {"c1", "c2"}
    assert runs["c1"]["concurrency"] == 1 and runs["c2"]["concurrency"] == 2  # read off the timings
    for run, summary in runs.items():
        part = [r for r in load.to_pylist() if r["run"] == run]
        latencies = [r["latency_ms"] for r in part]
        assert summary["requests"] == 8 and summary["errors"] == 0 and summary["replicas"] == 1
        assert summary["p50_ms"] == pytest.approx(float(np.median(latencies)))
        assert summary["p99_ms"] <= max(latencies) and summary["ttft_p50_ms"] is None
        tokens = sum(r["completion_tokens"] for r in part)
        assert summary["tokens_per_s"] == pytest.approx(tokens / summary["seconds"])
    requests = pq.read_table(found.requests[0])
    per_request = rows_per_step(requests).to_pylist()
    stats = {r["request_id"]: r for r in requests.to_pylist()}
    for r in per_request:
        assert r["rows_per_step"] == pytest.approx(stats[r["request_id"]]["rows"] / stats[r["request_id"]]["steps"])
        assert 1 <= r["in_flight"] <= 2
    assert max(r["rows_per_step"] for r in per_request) > 1  # a 2x3 pipelines more than one row per step


def test_the_families_side_by_side(results):
    """families.parquet's rows hold what each evaluation measured; the long tables and the paired difference
    are computed from them and from the predictions."""
    families = load_families(results / "families")
    rows = {r["family"]: r for r in families.table.to_pylist()}
    assert set(rows) == {"t5", "lm"} and families.table.schema.equals(FAMILIES_SCHEMA)
    for family, r in rows.items():
        summary = families.evaluations[family].summary
        speed, sequential = summary["decode"]["speed"], summary["decode"]["sequential"]
        assert r["speed_ms_per_token"] == pytest.approx(1000 * speed["seconds"] / speed["tokens"])
        assert r["sequential_ms_per_token"] == pytest.approx(1000 * sequential["seconds"] / sequential["tokens"])
        assert r["accuracy"] == summary["metrics"]["bleu"]["score"] and r["accuracy_metric"] == "bleu"
        assert r["accuracy_low"] <= r["accuracy"] <= r["accuracy_high"] and r["identical"]
        assert r["perplexity"] == summary["perplexity"]["perplexity"] and len(r["perplexity"]) == 3
        assert r["oracle_steps_per_token"] <= r["steps_per_token"]
    loops = loop_table(families.table).to_pylist()
    assert [(r["family"], r["loop"]) for r in loops] == [(f, i) for f in ("t5", "lm") for i in (1, 2, 3)]
    assert [r["flip_rate_final"] for r in loops if r["family"] == "lm"] == rows["lm"]["flip_rate_final"]
    assert loops[2]["fraction"] == 1.0 and loops[2]["flip_rate_final"] == 0.0  # the last loop is the token
    plane = latency_plane(families.table).to_pylist()
    assert len(plane) == 4 and {(r["family"], r["decoder"]) for r in plane} == {
        (f, d) for f in ("t5", "lm") for d in ("speed", "sequential")
    }
    for r in plane:
        assert r["accuracy"] == rows[r["family"]]["accuracy"]
        assert r["ms_per_token"] == rows[r["family"]][f"{r['decoder']}_ms_per_token"]
    difference = quality_difference(families, samples=50)
    refs = families.evaluations["t5"].predictions["reference"].to_pylist()
    hyps = {f: families.evaluations[f].predictions["hypothesis"].to_pylist() for f in ("t5", "lm")}
    scores = {f: bleu(hyps[f], refs)["score"] for f in hyps}
    assert difference["bleu"]["delta"] == pytest.approx(scores["lm"] - scores["t5"])
    assert "lm" in format_families(families.table) and "1+2x3+1" in format_families(families.table)


def test_the_lm_is_sized_to_the_t5s_parameter_count():
    t5 = preset("mini", pattern="2x3", d_model=128, n_heads=4, d_kv=32, d_ff=512, n_encoder_layers=2, vocab_size=4000)
    lm = lm_preset("mini", pattern="1+2x3+1", d_model=128, n_heads=4, n_kv_heads=4, head_dim=32, vocab_size=4000)
    target = parameter_count(t5)
    assert target == sum(p.numel() for p in SpeedT5(t5).parameters())  # counted on the meta device alike
    matched = match_parameters(lm, target)
    per_unit = parameter_count(matched.replace(d_ff=matched.d_ff + 1)) - parameter_count(matched)
    assert abs(parameter_count(matched) - target) <= per_unit / 2  # the closest width
    assert matched.replace(d_ff=lm.d_ff) == lm  # only the FFN width changed
    with pytest.raises(ValueError, match="no d_ff brings"):
        match_parameters(lm, 1000)


def test_notebooks_are_stored_without_outputs():
    assert [p.name for p in NOTEBOOKS] == sorted(FIGURES)
    for path in NOTEBOOKS:
        cells = nbformat.read(path, as_version=4).cells
        assert all(c.outputs == [] and c.execution_count is None for c in cells if c.cell_type == "code"), path


@pytest.mark.slow
def test_every_notebook_runs_headless_and_writes_its_figures(results, capsys):
    """`make analysis`'s job on the tiny results: every notebook executes and writes its figures."""
    assert _analysis_job().main(["--results", str(results)]) == 0
    for notebook, figures in FIGURES.items():
        for figure in figures:
            assert (results / figure).stat().st_size > 0, (notebook, figure)
        assert nbformat.read(results / "notebooks" / notebook, as_version=4).cells[1].outputs  # executed
    printed = capsys.readouterr().out
    assert "4 evaluation(s), 2 benchmark file(s), 1 load file(s), 1 request-statistics file(s), 0 sweep(s)" in printed
    assert "1 family comparison(s), 1 budget curve(s), 1 payoff map(s)" in printed
    assert f"figure: {results / 'accuracy_vs_latency.png'}" in printed
    assert f"figure: {results / 'benchmark_latency.png'}" in printed


def _analysis_job():
    spec = importlib.util.spec_from_file_location("analysis_job", repo_root() / "jobs" / "analysis.py")
    job = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(job)
    return job
