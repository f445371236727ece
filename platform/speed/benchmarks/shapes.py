"""Decode latency at the published models' real shapes, random weights (no download): sequential, SPEED with oracle
speculation (the engine's ceiling) and SPEED's own, at batch 1 and 4, against the machine's own read bandwidth.

Each shape is a published config.json (``SHAPES``, checked against the public configs) turned into our config by
the importer that loads the real checkpoint (``config_from_ouro``, ``config_from_huginn``, T5's
``config_from_hf``), so the engine runs exactly what an imported checkpoint runs. Before anything is allocated,
the weights, the KV cache of the largest batch and the bandwidth buffer are checked against the available memory
(``check_fits``: one line when they do not fit).

Every variant decodes the same prompts once per round, and the run splits its own time at the moment every
sequence had its first token (``GenerateResult.first_token_s``, TTFT: the engine, the prefill and the first
token; ``decode_s``, the rest): the time per token is the rest over the tokens after the first. Two runs'
difference (one token against all of them) went negative where the decode is short beside the prefill and the
two runs' noise (batch 4 at tiny sizes); one run's split cannot. A read of a buffer larger than the caches
(``torch.sum``, best of several) runs interleaved with them: the machine's read bandwidth in the same run, and
so the limit. A decoding step must read the weights of every loop pass at least once (``streamed_bytes``), so
sequential decoding's time per token is at least that over the bandwidth; ``ratio_vs_limit`` is how far each
variant is from it (SPEED, which reads the
shared weights once for several tokens' loops, may go below 1).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pyarrow as pa
import torch

from speed.benchmarks.decode import check_exact, interleave, run_columns, variant_columns
from speed.benchmarks.decode_lm import LM_BENCH_SCHEMA, decode_runs, split_medians
from speed.benchmarks.loading import peak_rss
from speed.config import LMConfig, ModelConfig
from speed.decode.generate import DecodeOptions, GenerateResult, generate
from speed.engine.memory import MemoryBudgetError, MemoryNeed, available_bytes, size
from speed.models.convert_huginn import config_from_huginn
from speed.models.convert_ouro import config_from_ouro
from speed.models.family import build_model
from speed.models.precision import with_dtype
from speed.tables import Column, text_table

# The published config.json fields the importers read (ByteDance/Ouro-1.4B and -2.6B, tomg-group-umd/huginn-0125,
# google/t5-v1_1-large); nothing else of them matters to the shapes.
OURO_1_4B = {
    "model_type": "ouro", "hidden_size": 2048, "intermediate_size": 5632, "num_hidden_layers": 24,
    "num_attention_heads": 16, "num_key_value_heads": 16, "head_dim": 128, "vocab_size": 49152,
    "total_ut_steps": 4, "rope_theta": 1000000.0, "rms_norm_eps": 1e-6, "tie_word_embeddings": False,
    "hidden_act": "silu", "eos_token_id": 0,
}  # fmt: skip
HUGINN_0125 = {
    "model_type": "huginn_raven", "n_embd": 5280, "n_heads": 55, "num_key_value_heads": 55,
    "intermediate_size": 17920, "n_layers_in_prelude": 2, "n_layers_in_recurrent_block": 4, "n_layers_in_coda": 2,
    "mean_recurrence": 32, "vocab_size": 65536, "padded_vocab_size": 65536, "rope_base": 50000.0,
    "norm_eps": 1e-6, "qk_bias": True, "bias": False, "tie_embeddings": True, "block_size": 4096,
    "injection_type": "linear", "eos_token_id": 65505,
}  # fmt: skip
T5_V1_1_LARGE = {
    "model_type": "t5", "d_model": 1024, "d_ff": 2816, "d_kv": 64, "num_heads": 16, "num_layers": 24,
    "num_decoder_layers": 24, "vocab_size": 32128, "feed_forward_proj": "gated-gelu", "layer_norm_epsilon": 1e-6,
    "relative_attention_num_buckets": 32, "tie_word_embeddings": False, "eos_token_id": 1, "pad_token_id": 0,
    "decoder_start_token_id": 0, "dropout_rate": 0.0,
}  # fmt: skip


def _t5(hf: dict, loops: int | None) -> ModelConfig:
    from transformers import T5Config

    from speed.models.convert_t5 import config_from_hf

    layers = hf["num_decoder_layers"]
    return config_from_hf(T5Config.from_dict(hf), None if loops is None else f"{layers}x{loops}")


@dataclass(frozen=True)
class Shape:
    """A published model's shape: its config.json (``hf``) and the importer's function from it and a recurrence
    count (None: the checkpoint's own) to our config."""

    hf: dict
    config: Callable[[dict, int | None], ModelConfig | LMConfig]
    recurrence: int | None = None  # the count the benchmark runs by default (None: the published one)

    def resolve(self, recurrence: int | None = None) -> ModelConfig | LMConfig:
        """Our config at ``recurrence`` loops (default: the shape's)."""
        return self.config(self.hf, recurrence if recurrence is not None else self.recurrence)


SHAPES: dict[str, Shape] = {
    "ouro-1.4b": Shape(OURO_1_4B, config_from_ouro),
    "ouro-2.6b": Shape(OURO_1_4B | {"num_hidden_layers": 48}, config_from_ouro),
    # published mean_recurrence 32; 4 keeps a CPU run short (--recurrence 32 for the published count)
    "huginn-3.5b": Shape(HUGINN_0125, config_from_huginn, recurrence=4),
    "t5-large": Shape(T5_V1_1_LARGE, _t5),
}


@dataclass(frozen=True)
class ShapeBenchConfig:
    """One real-shape run: the shape's name and resolved config, the batches, prompt and output lengths,
    repetitions, the weights' dtypes (each a model of its own, all timed in the same rounds; the first is the
    summary's), the bandwidth buffer and where it all runs."""

    shape: str
    model: ModelConfig | LMConfig
    batches: tuple[int, ...] = (1, 4)
    prompt_len: int = 32  # the LM's prompt, T5's encoder input
    new_tokens: int = 8
    reps: int = 3
    seed: int = 0
    dtypes: tuple[str, ...] = ("bfloat16",)  # bfloat16: the published checkpoints' own
    # each dtype's model with its weights packed for the native kernel (``pack_for_decoding``) and/or plain
    layouts: tuple[str, ...] = ("packed",)
    bandwidth_bytes: int = 2**30  # the read-bandwidth buffer: well above any cache
    device: str = "cpu"


def empty_model(config: ModelConfig | LMConfig, dtype: torch.dtype) -> torch.nn.Module:
    """A model of ``config`` on the meta device as ``dtype`` (``torch.bfloat16``: bf16 weights, the linear weights
    bfloat16 and the rest float32, ``speed.models.precision``): its shapes, no memory."""
    with torch.device("meta"):
        return with_dtype(build_model(config), dtype)


def random_weights(model: torch.nn.Module, seed: int, device: str, eos_id: int) -> torch.nn.Module:
    """``model`` (on the meta device) allocated once on ``device`` and filled in place: matrices N(0, 0.02), biases
    0, norm gains 1 (no float32 copy of a bfloat16 model is ever made); its EOS row of the head zeroed, so every
    run decodes the full length."""
    shared = _shared_parameters(model)
    model = model.to_empty(device=device)
    for owner, leaf, first in shared:  # to_empty gives each name its own tensor: tie them again
        setattr(model.get_submodule(owner), leaf, model.get_parameter(first))
    generator = torch.Generator(device=device).manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() >= 2:
                p.normal_(0.0, 0.02, generator=generator)
            else:
                p.fill_(0.0 if name.endswith("bias") else 1.0)
        model.lm_head.weight[eos_id].zero_()
    return model.eval()


def _shared_parameters(model: torch.nn.Module) -> list[tuple[str, str, str]]:
    """Each parameter name that holds the same parameter as an earlier name (a tied head): (its module, its leaf
    name, the earlier name)."""
    first: dict[int, str] = {}
    shared = []
    for name, p in model.named_parameters(remove_duplicate=False):
        if id(p) in first:
            owner, _, leaf = name.rpartition(".")
            shared.append((owner, leaf, first[id(p)]))
        else:
            first[id(p)] = name
    return shared


def streamed_bytes(model: torch.nn.Module) -> int:
    """The weight bytes one token's decoding reads at least once: the looped block's (and the injection adapter's)
    once per loop pass, the rest of the decoder (prelude, coda, norms, head) once; not the embedding (one row a
    token) nor the encoder (once per request). A tensor named twice (a tied head) counts as its most-read name."""
    looped, unread = ("core.", "adapter", "decoder_layers."), ("embed_tokens.", "shared.", "encoder_")
    reads: dict[int, tuple[int, int]] = {}  # storage -> (bytes, passes)
    for name, p in model.named_parameters(remove_duplicate=False):
        passes = model.n_loops if name.startswith(looped) else 0 if name.startswith(unread) else 1
        key = id(p)
        reads[key] = (p.numel() * p.element_size(), max(passes, reads.get(key, (0, 0))[1]))
    return sum(nbytes * passes for nbytes, passes in reads.values())


def check_fits(cfg: ShapeBenchConfig, models: list[torch.nn.Module]) -> MemoryNeed:
    """What the run needs (``models``, one per dtype, on the meta device): their weights and the KV caches of the
    largest batch (each stepper's ``memory_need``), one per variant (each keeps its engine through the rounds:
    ``speed.benchmarks.decode.decoding``), and the bandwidth buffer; a ``MemoryBudgetError`` (one line) unless it
    fits in the device's available memory."""
    needs = [m.stepper().memory_need(max(cfg.batches), cfg.prompt_len, cfg.new_tokens + 1) for m in models]
    engines = len(VARIANTS)
    need = MemoryNeed(
        sum(n.weights for n in needs), engines * sum(n.cache for n in needs), engines * sum(n.side for n in needs),
        engines * sum(n.memory for n in needs) + cfg.bandwidth_bytes,
    )  # fmt: skip
    available, source = available_bytes(torch.device(cfg.device))
    if need.total > available:
        raise MemoryBudgetError(
            f"{cfg.shape} at batch {max(cfg.batches)} needs {need.describe()}, the memory including the "
            f"{size(cfg.bandwidth_bytes)} bandwidth buffer, but {size(available)} is available ({source}): "
            "choose a smaller shape, batch or fewer or smaller --dtype"
        )
    return need


def read_bandwidth(buffer: torch.Tensor, times: list[float]) -> Callable[[], int]:
    """A run for ``interleave``: ``torch.sum`` over ``buffer`` three times, each one's seconds kept in ``times``
    (the best of them, buffer bytes over seconds, is the read bandwidth)."""
    sync = torch.cuda.synchronize if buffer.is_cuda else lambda: None

    def go() -> int:
        for _ in range(3):
            start = time.perf_counter()
            buffer.sum()
            sync()
            times.append(time.perf_counter() - start)
        return 1

    return go


VARIANTS = ("sequential", "speed_oracle", "speed")  # each batch's timed variants, in each dtype
LAYOUTS = ("packed", "plain")  # a model's weights packed for decoding (``pack_for_decoding``), or as loaded


def run_shape_benchmark(cfg: ShapeBenchConfig) -> tuple[pa.Table, dict[str, Any]]:
    """Every batch's variants of every dtype and layout side by side (``LM_BENCH_SCHEMA`` rows, the real-shape
    columns filled) and the summary: the first dtype's and layout's batch-1 ``oracle_speedup`` (sequential's time
    per token / oracle SPEED's) and ``sequential_vs_limit`` (sequential's time per token / the time the measured
    bandwidth needs to read the weights once per loop pass), the bandwidth and the random models' build time; with
    several dtypes also ``dtype_speedup``: each variant's batch-1 time per token in the first dtype over its time
    in each other, and with several layouts ``layout_speedup``, the same in the first layout over each other
    (measured in the same rounds)."""
    if not cfg.dtypes or len(set(cfg.dtypes)) != len(cfg.dtypes):
        raise ValueError(f"dtypes {cfg.dtypes}: name each dtype once")
    if not cfg.layouts or len(set(cfg.layouts)) != len(cfg.layouts) or not set(cfg.layouts) <= set(LAYOUTS):
        raise ValueError(f"layouts {cfg.layouts}: name each of {', '.join(LAYOUTS)} at most once")
    shells = {(d, layout): empty_model(cfg.model, getattr(torch, d)) for d in cfg.dtypes for layout in cfg.layouts}
    need = check_fits(cfg, list(shells.values()))
    start = time.perf_counter()
    models: dict[tuple[str, str], torch.nn.Module] = {}
    packed: dict[str, int] = {}  # weights packed per model: none where the kernel would not take them (small
    # float32 ones) or the family cannot (T5's encoder runs its layers' forward)
    for (dtype, layout), shell in shells.items():
        models[dtype, layout] = random_weights(shell, cfg.seed, cfg.device, cfg.model.eos_id)
        packed[f"{dtype}/{layout}"] = models[dtype, layout].pack_for_decoding() if layout == "packed" else 0
    build_s = time.perf_counter() - start
    streamed = {kind: streamed_bytes(model) for kind, model in models.items()}
    buffer = torch.ones(cfg.bandwidth_bytes // 4, dtype=torch.float32, device=cfg.device)
    print(
        f"shape benchmark: {cfg.shape} {cfg.model.pattern} d_model={cfg.model.d_model} "
        + ", ".join(f"{dtype} {layout} ({size(streamed[dtype, layout])} read per token)" for dtype, layout in models)
        + f", weights {size(need.weights)} (built in {build_s:.1f} s), batches {list(cfg.batches)}, "
        f"prompt={cfg.prompt_len} tokens={cfg.new_tokens} reps={cfg.reps} threads={torch.get_num_threads()} "
        f"device={cfg.device}",
        flush=True,
    )
    rows, bandwidth_times, rounds = [], [], {}
    for batch in cfg.batches:
        batch_rows, per_round = _batch_rows(cfg, models, batch, buffer, bandwidth_times)
        rows += batch_rows
        rounds.setdefault(batch, per_round)
    read_gbps = cfg.bandwidth_bytes / min(bandwidth_times) / 1e9
    for row in rows:  # the bandwidth of the whole run: the best read of all rounds
        per_token = streamed[row["dtype"], row["layout"]] / row["batch"]
        limit_ms = per_token / (read_gbps * 1e9) * 1000
        row |= {
            "read_gb_per_s": read_gbps,
            "limit_ms_per_token": limit_ms,
            "ratio_vs_limit": row["ms_per_token"] / limit_ms,
            "weight_bytes_per_token": per_token,
            "gb_per_s": per_token / (row["ms_per_token"] / 1000) / 1e9,
        }
    first = {(r["dtype"], r["layout"], r["variant"]): r for r in rows if r["batch"] == cfg.batches[0]}
    main, layout = cfg.dtypes[0], cfg.layouts[0]
    summary: dict[str, Any] = {
        "shape": cfg.shape,
        "dtype": main,
        "layout": layout,
        "batch": cfg.batches[0],
        "oracle_speedup": first[main, layout, "sequential"]["ms_per_token"]
        / first[main, layout, "speed_oracle"]["ms_per_token"],
        "sequential_vs_limit": first[main, layout, "sequential"]["ratio_vs_limit"],
        "read_gb_per_s": read_gbps,
        "weights_bytes": need.weights,
        "packed_weights": packed,
        "build_s": build_s,
    }

    def ratios(other: tuple[str, str]) -> dict[str, float]:
        return {
            kind: first[main, layout, kind]["ms_per_token"] / first[(*other, kind)]["ms_per_token"] for kind in VARIANTS
        }

    if len(cfg.dtypes) > 1:
        summary["dtype_speedup"] = {other: ratios((other, layout)) for other in cfg.dtypes[1:]}
    if len(cfg.layouts) > 1:
        summary["layout_speedup"] = {other: ratios((main, other)) for other in cfg.layouts[1:]}
    summary["paired"] = _paired(rounds[cfg.batches[0]], streamed, cfg)
    return pa.Table.from_pylist(rows, schema=LM_BENCH_SCHEMA), summary


def _paired(per_round: dict, streamed: dict, cfg: ShapeBenchConfig) -> dict[str, Any]:
    """The headline ratios taken within each round, then their median over the rounds (``paired``): where the
    machine's bandwidth moves between rounds, a ratio of two medians may set one mode's time against another's,
    while a round's two runs are seconds apart. Also each round's figures (``per_round``)."""
    main, layout = cfg.dtypes[0], cfg.layouts[0]
    seq, oracle = per_round[main, layout, "sequential"], per_round[main, layout, "speed_oracle"]
    batch = cfg.batches[0]
    limit = [streamed[main, layout] / batch / (gbps * 1e9) * 1000 for gbps in per_round["read_gb_per_s"]]
    each: dict[str, Any] = {
        "oracle_speedup": [a / b for a, b in zip(seq, oracle)],
        "sequential_vs_limit": [a / b for a, b in zip(seq, limit)],
        "read_gb_per_s": per_round["read_gb_per_s"],
    }
    others = list(cfg.dtypes[1:])
    if others:
        each["dtype_speedup"] = {d: [a / b for a, b in zip(seq, per_round[d, layout, "sequential"])] for d in others}
    paired: dict[str, Any] = {
        key: statistics.median(each[key]) for key in ("oracle_speedup", "sequential_vs_limit", "read_gb_per_s")
    }
    if others:
        paired["dtype_speedup"] = {d: statistics.median(v) for d, v in each["dtype_speedup"].items()}
    return paired | {"rounds": len(seq), "per_round": each}


def _batch_rows(
    cfg: ShapeBenchConfig,
    models: dict[tuple[str, str], torch.nn.Module],
    batch: int,
    buffer: torch.Tensor,
    bandwidth_times: list[float],
) -> tuple[list[dict], dict]:
    """One batch's rows: sequential, oracle SPEED and SPEED's own in each (dtype, layout)'s model, all timed
    interleaved in the same rounds with the bandwidth read (a run named ``dtype/layout/variant``); and each round's
    time per token of every (dtype, layout, variant) and read bandwidth (``_paired``)."""
    torch.manual_seed(cfg.seed + batch)
    ids = torch.randint(3, cfg.model.vocab_size, (batch, cfg.prompt_len))  # no special token below 3
    n = cfg.new_tokens
    variants: dict[str, Callable[[], int]] = {}
    checks: dict[tuple[str, str], tuple[dict[str, GenerateResult], GenerateResult]] = {}
    # per model and variant, each run's (seconds to the first tokens, seconds after them)
    splits: dict[tuple[str, str], dict[str, list[tuple[float, float]]]] = {}
    for (dtype, layout), model in models.items():
        name = f"{dtype}/{layout}"
        reference = generate(model, ids, options=DecodeOptions(method="sequential", max_new_tokens=n, trace=False))
        results: dict[str, GenerateResult] = {}
        run = decode_runs(results, ids, n, splits.setdefault((dtype, layout), {}))
        kinds = {
            "sequential": {"method": "sequential"},
            "speed_oracle": {"method": "speed", "oracle": reference.tokens},
            "speed": {"method": "speed"},
        }
        variants |= {f"{name}/{kind}": run(kind, model, n, **kw) for kind, kw in kinds.items()}
        checks[dtype, layout] = (results, reference)
    variants["bandwidth"] = read_bandwidth(buffer, bandwidth_times)
    print(f" batch {batch}:", flush=True)
    start = len(bandwidth_times) + 3  # interleave's untimed first call reads three times too
    interleave(variants, cfg.reps, cfg.device, unit="ms a run")  # each run's split lands in splits
    reads = bandwidth_times[start:]  # three a round, in round order
    size_b = buffer.numel() * buffer.element_size()
    per_round: dict = {"read_gb_per_s": [size_b / min(reads[i : i + 3]) / 1e9 for i in range(0, len(reads), 3)]}
    run_cfg = _RunColumns(cfg.model, batch, cfg.reps, cfg.device)
    peak = peak_rss()
    rows = []
    for (dtype, layout), (results, reference) in checks.items():
        name = f"{dtype}/{layout}"
        check_exact(results, reference, ("speed", "speed_oracle"))
        timed = {kind: splits[dtype, layout][kind][1:] for kind in VARIANTS}  # interleave's first run is untimed
        first, per_token = split_medians(timed, batch * (n - 1))
        for kind in VARIANTS:
            per_round[dtype, layout, kind] = [d * 1000 / (batch * (n - 1)) for _, d in timed[kind]]
        shared = run_columns(run_cfg) | {"prompt_len": cfg.prompt_len, "shape": cfg.shape, "dtype": dtype}
        shared["layout"] = layout
        rows += [
            variant_columns(kind, cfg.model, results[kind], per_token, batch * n)
            | shared
            | {"ttft_ms": first[kind], "peak_rss_bytes": peak}
            for kind in VARIANTS
        ]
    return rows, per_round


@dataclass(frozen=True)
class _RunColumns:
    """What ``run_columns`` reads of a run: its model, batch, repetitions and device."""

    model: ModelConfig | LMConfig
    batch: int
    reps: int
    device: str


SHAPE_COLUMNS = (
    Column("shape", 12, "shape", left=True),
    Column("dtype", 9, "dtype", left=True),
    Column("layout", 7, lambda r: r["layout"] or "", left=True),
    Column("batch", 6, "batch"),
    Column("variant", 13, "variant", left=True, gap=" "),
    Column("TTFT ms", 9, "ttft_ms", ".1f"),
    Column("ms/token", 10, "ms_per_token", ".2f"),
    Column("speed-up", 9, "speedup", ".2f", "x"),
    Column("GB/token", 9, lambda r: r["weight_bytes_per_token"] / 1e9, ".2f"),
    Column("GB/s", 7, "gb_per_s", ".1f"),
    Column("read GB/s", 10, "read_gb_per_s", ".1f"),
    Column("vs limit", 10, "ratio_vs_limit", ".2f", "x"),
    Column("peak RSS", 12, lambda r: size(r["peak_rss_bytes"])),
)


def format_shape_table(table: pa.Table) -> str:
    """A fixed-width text table of the real-shape rows: times, ratios, bandwidths and peak memory."""
    return text_table(SHAPE_COLUMNS, table.to_pylist())
