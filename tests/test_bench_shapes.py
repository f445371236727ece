"""The real-shape decode benchmark (``speed.benchmarks.shapes``, ``jobs/bench_shapes.py``): the published
shapes, the weights read per token, the memory check, and a tiny shape end to end through the job."""

from __future__ import annotations

import importlib.util
import json

import pytest
import torch

from speed.benchmarks import shapes
from speed.benchmarks.decode_lm import LM_BENCH_SCHEMA
from speed.benchmarks.shapes import HUGINN_0125, OURO_1_4B, SHAPES, Shape, empty_model, random_weights, streamed_bytes
from speed.engine import native
from speed.models.convert_huginn import config_from_huginn
from speed.models.convert_ouro import config_from_ouro
from speed.models.family import parameter_count
from speed.paths import repo_root

TINY_OURO = Shape(
    OURO_1_4B
    | {"hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2, "num_attention_heads": 4,
       "num_key_value_heads": 4, "head_dim": 16, "vocab_size": 128},
    config_from_ouro,
)  # fmt: skip
TINY_HUGINN = Shape(
    HUGINN_0125
    | {"n_embd": 64, "n_heads": 4, "num_key_value_heads": 4, "intermediate_size": 96, "vocab_size": 128,
       "padded_vocab_size": 128, "eos_token_id": 120},
    config_from_huginn,
    recurrence=3,
)  # fmt: skip


def _job():
    spec = importlib.util.spec_from_file_location("bench_shapes_job", repo_root() / "jobs" / "bench_shapes.py")
    job = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(job)
    return job


def test_the_shapes_are_the_published_models():
    """Dimensions as the public config.json files state them, and parameter counts as the model cards do."""
    ouro, ouro26 = SHAPES["ouro-1.4b"].resolve(), SHAPES["ouro-2.6b"].resolve()
    assert (ouro.d_model, ouro.d_ff, ouro.n_heads, ouro.vocab_size, ouro.pattern) == (2048, 5632, 16, 49152, "24x4")
    assert not ouro.tie_embeddings and ouro26.pattern == "48x4"
    huginn = SHAPES["huginn-3.5b"].resolve()
    assert (huginn.d_model, huginn.n_heads, huginn.d_ff, huginn.vocab_size) == (5280, 55, 17920, 65536)
    assert huginn.pattern == "2+4x4+2" and huginn.tie_embeddings
    assert SHAPES["huginn-3.5b"].resolve(32).pattern == "2+4x32+2"  # the published mean_recurrence
    t5 = SHAPES["t5-large"].resolve()
    assert (t5.d_model, t5.d_ff, t5.n_heads, t5.d_kv, t5.vocab_size, t5.pattern) == (1024, 2816, 16, 64, 32128, "24x1")
    billions = {name: parameter_count(SHAPES[name].resolve()) / 1e9 for name in SHAPES}
    assert 1.3 < billions["ouro-1.4b"] < 1.5 and 2.5 < billions["ouro-2.6b"] < 2.8
    assert 3.4 < billions["huginn-3.5b"] < 3.7 and 0.7 < billions["t5-large"] < 0.8


def test_the_weights_read_per_token_count_each_loop_pass():
    """Ouro: its layers once per loop, the final norm, the exit gate and the head once, not the embedding;
    Huginn: the core block and the adapter per recurrence, prelude, coda, norm and the tied head once (Ouro in
    bf16 weights: its linear weights in 2 bytes, its norms and the gate's bias in 4)."""
    ouro = empty_model(TINY_OURO.resolve(), torch.bfloat16)
    d, ff, layers, vocab = 64, 96, 2, 128
    linear, norms = 4 * d * d + 3 * d * ff, 4 * d  # q, k, v, o; gate, up, down; four norms
    assert streamed_bytes(ouro) == 2 * (4 * layers * linear + d + vocab * d) + 4 * (4 * layers * norms + d + 1)
    huginn = empty_model(TINY_HUGINN.resolve(), torch.float32)
    block = 4 * d * d + 3 * d * ff + 4 * d + 2 * d  # Wqkv, proj; fc, proj; four norms; q and k biases
    loops = 3 * (4 * block + 2 * d * d)  # the core's 4 blocks and the adapter, per recurrence
    assert streamed_bytes(huginn) == 4 * (loops + 4 * block + d + vocab * d)


def test_a_tiny_shape_runs_end_to_end(tmp_path, capsys, monkeypatch):
    """Through the job: rows of sequential, oracle SPEED and SPEED at batch 1 and 4 (each checked exact against
    sequential decoding in bfloat16 by the benchmark), the bandwidth and limit columns, the JSON summary."""
    monkeypatch.setitem(SHAPES, "tiny-ouro", TINY_OURO)
    out = tmp_path / "rows.parquet"
    flags = ["--shape", "tiny-ouro", "--reps", "1", "--new-tokens", "4", "--prompt-len", "8", "--bandwidth-mib", "16"]
    assert _job().main([*flags, "--out", str(out), "--json"]) == 0
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    rows = report["rows"]
    assert [(r["batch"], r["variant"]) for r in rows] == [
        (b, v) for b in (1, 4) for v in ("sequential", "speed_oracle", "speed")
    ]
    import pyarrow.parquet as pq

    assert pq.read_table(out).schema.equals(LM_BENCH_SCHEMA)
    for r in rows:
        assert r["shape"] == "tiny-ouro" and r["dtype"] == "bfloat16" and r["read_gb_per_s"] > 0
        assert r["layout"] == "packed"
        assert r["ratio_vs_limit"] == pytest.approx(r["ms_per_token"] / r["limit_ms_per_token"])
        assert r["gb_per_s"] == pytest.approx(r["weight_bytes_per_token"] / r["ms_per_token"] / 1e6)
        assert r["peak_rss_bytes"] > 0 and r["ttft_ms"] > 0 and r["ms_per_token"] > 0 and r["speedup"] > 0
    summary = report["summary"]
    n_linears = 2 * 4 + 1  # per layer: q/k/v, output, gate/up, down; the head (the embedding's own weights apart)
    assert summary["packed_weights"] == {"bfloat16/packed": n_linears if native.library() else 0}
    first = {r["variant"]: r for r in rows if r["batch"] == 1}
    assert summary["oracle_speedup"] == pytest.approx(
        first["sequential"]["ms_per_token"] / first["speed_oracle"]["ms_per_token"]
    )
    assert summary["sequential_vs_limit"] == pytest.approx(first["sequential"]["ratio_vs_limit"])
    paired = summary["paired"]  # one round: its ratios are the medians' (the limit at that round's own read)
    assert paired["rounds"] == 1 and paired["oracle_speedup"] == pytest.approx(summary["oracle_speedup"])
    assert paired["sequential_vs_limit"] == pytest.approx(
        summary["sequential_vs_limit"] * paired["read_gb_per_s"] / summary["read_gb_per_s"]
    )


def test_a_time_per_token_is_its_own_runs_split(monkeypatch):
    """The time after every sequence's first token, over the tokens after the first, of the same run: never the
    difference of two runs (one token against all of them), which went negative at batch 4 where the decode is short
    beside the prefill. Here each run reports a split unrelated to its wall time, and the rows take it as it is."""
    import dataclasses

    from speed.decode.generate import Decoder

    real = Decoder.__call__  # what every timed run calls (its engine kept: ``speed.benchmarks.decode.decoding``)

    def split(self, *args, **kw):
        result = real(self, *args, **kw)
        return dataclasses.replace(result, first_token_s=0.5, decode_s=0.012 * self.options.max_new_tokens)

    monkeypatch.setattr(Decoder, "__call__", split)
    cfg = shapes.ShapeBenchConfig("tiny-ouro", TINY_OURO.resolve(), batches=(1, 4), prompt_len=8, new_tokens=4,
                                  reps=2, bandwidth_bytes=2**20)  # fmt: skip
    table, summary = shapes.run_shape_benchmark(cfg)
    for r in table.to_pylist():
        assert r["ttft_ms"] == pytest.approx(500.0)
        assert r["ms_per_token"] == pytest.approx(12.0 * 4 / (r["batch"] * 3))
    assert summary["paired"]["oracle_speedup"] == pytest.approx(1.0)


def test_generate_splits_its_own_time():
    """``GenerateResult``'s split: both parts within the call's wall time, the first token's part first."""
    import time

    from speed.decode.generate import DecodeOptions, generate

    model = empty_model(TINY_OURO.resolve(), torch.float32)
    model = random_weights(model, 0, "cpu", model.eos_id)
    ids = torch.randint(3, 128, (4, 8))
    for n in (1, 5):
        start = time.perf_counter()
        result = generate(model, ids, options=DecodeOptions(max_new_tokens=n, trace=False))
        wall = time.perf_counter() - start
        assert 0 < result.first_token_s and 0 <= result.decode_s and result.first_token_s + result.decode_s <= wall
        assert n > 1 or result.decode_s < result.first_token_s


def test_two_dtypes_are_timed_in_the_same_rounds(capsys, monkeypatch, tmp_path):
    """``--dtype float32,bfloat16``: a model of each, every variant of both in the table (each checked exact
    against its own sequential decoding), the limit per dtype's bytes, and the summary's ``dtype_speedup`` the
    first dtype's time per token over the other's; the headline figures are the first dtype's."""
    monkeypatch.setitem(SHAPES, "tiny-ouro", TINY_OURO)
    flags = ["--shape", "tiny-ouro", "--reps", "1", "--new-tokens", "4", "--prompt-len", "8", "--bandwidth-mib", "16"]
    flags += ["--batches", "1", "--dtype", "float32,bfloat16", "--out", str(tmp_path / "rows.parquet"), "--json"]
    assert _job().main(flags) == 0
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    rows = {(r["dtype"], r["variant"]): r for r in report["rows"]}
    kinds = ("sequential", "speed_oracle", "speed")
    assert list(rows) == [(d, v) for d in ("float32", "bfloat16") for v in kinds]
    full, half = rows["float32", "sequential"], rows["bfloat16", "sequential"]
    assert half["weight_bytes_per_token"] < full["weight_bytes_per_token"]  # bf16's linear weights in 2 bytes
    assert full["limit_ms_per_token"] / half["limit_ms_per_token"] == pytest.approx(
        full["weight_bytes_per_token"] / half["weight_bytes_per_token"]
    )
    summary = report["summary"]
    assert summary["dtype"] == "float32"
    assert summary["oracle_speedup"] == pytest.approx(
        full["ms_per_token"] / rows["float32", "speed_oracle"]["ms_per_token"]
    )
    assert summary["dtype_speedup"]["bfloat16"] == pytest.approx(
        {v: rows["float32", v]["ms_per_token"] / rows["bfloat16", v]["ms_per_token"] for v in kinds}
    )


def test_paired_ratios_are_taken_round_by_round(capsys, monkeypatch, tmp_path):
    """``summary.paired``: each round's ratios (sequential over oracle SPEED, over the limit at that round's read,
    float32 over bf16), then their median; three rounds, each round's figures kept (``per_round``)."""
    monkeypatch.setitem(SHAPES, "tiny-ouro", TINY_OURO)
    flags = ["--shape", "tiny-ouro", "--reps", "3", "--new-tokens", "3", "--prompt-len", "4", "--bandwidth-mib", "8"]
    flags += ["--batches", "1", "--dtype", "float32,bfloat16", "--out", str(tmp_path / "rows.parquet"), "--json"]
    assert _job().main(flags) == 0
    out = capsys.readouterr().out.strip().splitlines()
    summary = json.loads(out[-1])["summary"]
    paired, each = summary["paired"], summary["paired"]["per_round"]
    assert paired["rounds"] == 3 and all(len(v) == 3 for k, v in each.items() if k != "dtype_speedup")
    assert max(each["read_gb_per_s"]) <= summary["read_gb_per_s"] * (1 + 1e-9)  # the run's best: also untimed reads
    for key in ("oracle_speedup", "sequential_vs_limit", "read_gb_per_s"):
        assert paired[key] == pytest.approx(sorted(each[key])[1])
    assert paired["dtype_speedup"]["bfloat16"] == pytest.approx(sorted(each["dtype_speedup"]["bfloat16"])[1])
    assert all(x > 0 for key in ("oracle_speedup", "sequential_vs_limit") for x in each[key])  # runs' own splits


def test_packed_and_plain_weights_are_timed_in_the_same_rounds(capsys, monkeypatch, tmp_path):
    """``--layout packed,plain``: the same weights packed for the native kernel and as loaded, every variant of
    both (each exact against its own sequential decoding), the same bytes per token, and ``layout_speedup`` the
    packed model's time per token over the plain one's."""
    if native.library() is None:
        pytest.skip(f"no native kernel here: {native.unavailable_reason()}")
    monkeypatch.setitem(SHAPES, "tiny-ouro", TINY_OURO)
    flags = ["--shape", "tiny-ouro", "--reps", "1", "--new-tokens", "4", "--prompt-len", "8", "--bandwidth-mib", "16"]
    flags += ["--batches", "1", "--layout", "packed,plain", "--out", str(tmp_path / "rows.parquet"), "--json"]
    assert _job().main(flags) == 0
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    rows = {(r["layout"], r["variant"]): r for r in report["rows"]}
    kinds = ("sequential", "speed_oracle", "speed")
    assert list(rows) == [(layout, v) for layout in ("packed", "plain") for v in kinds]
    packed, plain = rows["packed", "sequential"], rows["plain", "sequential"]
    assert packed["weight_bytes_per_token"] == plain["weight_bytes_per_token"]  # Ouro's widths fill whole panels
    summary = report["summary"]
    assert summary["layout"] == "packed" and summary["packed_weights"]["bfloat16/plain"] == 0
    assert summary["packed_weights"]["bfloat16/packed"] > 0
    assert summary["layout_speedup"]["plain"] == pytest.approx(
        {v: rows["packed", v]["ms_per_token"] / rows["plain", v]["ms_per_token"] for v in kinds}
    )


def test_an_unknown_layout_is_refused_in_one_line(capsys):
    with pytest.raises(SystemExit) as exit_:
        _job().main(["--shape", "ouro-1.4b", "--layout", "packed,tiled"])
    assert exit_.value.code == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line.startswith("error: --layout 'tiled': choose from packed, plain")


def test_an_unknown_dtype_is_refused_in_one_line(capsys):
    with pytest.raises(SystemExit) as exit_:
        _job().main(["--shape", "ouro-1.4b", "--dtype", "float32,float16"])
    assert exit_.value.code == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line.startswith("error: --dtype 'float16': choose from float32, bfloat16")


def test_a_shape_that_does_not_fit_is_refused_in_one_line_before_allocating(capsys, monkeypatch):
    monkeypatch.setattr(shapes, "available_bytes", lambda device: (2**30, "available host memory"))

    def allocate(*args, **kwargs):
        raise AssertionError("allocated before the memory check")

    monkeypatch.setattr(shapes, "random_weights", allocate)
    with pytest.raises(SystemExit) as exit_:
        _job().main(["--shape", "ouro-1.4b"])
    assert exit_.value.code == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line.startswith("error: ouro-1.4b at batch 4 needs ") and "1.00 GiB is available" in line
    assert "weights 2.86 GiB" in line  # bf16 weights: 1.33e9 linear parameters in bf16, the 0.1e9 embedding in fp32


def test_random_weights_are_made_in_place_and_seeded():
    config = TINY_HUGINN.resolve()
    a = random_weights(empty_model(config, torch.bfloat16), 0, "cpu", config.eos_id)
    b = random_weights(empty_model(config, torch.bfloat16), 0, "cpu", config.eos_id)
    linear = {id(m.weight) for m in a.modules() if isinstance(m, torch.nn.Linear)}  # bf16 weights: these bf16
    assert all(p.dtype == (torch.bfloat16 if id(p) in linear else torch.float32) for p in a.parameters())
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))
    assert a.lm_head.weight is a.embed_tokens.weight  # still tied
    assert not a.lm_head.weight[config.eos_id].any()
