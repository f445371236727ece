"""Side-by-side decode latency: sequential vs SPEED vs a shallow decoder, in one process: what both families'
runs share, and the encoder-decoder's run (the looped LM's: ``speed.benchmarks.decode_lm``).

Every variant decodes the same input; repetitions are interleaved (the order
rotates each round) and medians reported, so that a noisy machine shifts all
variants alike. Ratios are computed from these medians, never typed in.
"""

from __future__ import annotations

import inspect
import json
import platform as _platform
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pyarrow as pa
import torch

from speed.config import LMConfig, ModelConfig, to_dict
from speed.decode.generate import DecodeOptions, Decoder, GenerateResult, generate
from speed.models.exits import attach, exits_for
from speed.models.family import build_model
from speed.models.looped_lm import LoopedLM
from speed.models.t5 import SpeedT5
from speed.tables import Column, text_table

BENCH_SCHEMA = pa.schema(
    [
        pa.field(
            "variant", pa.string()
        ),  # sequential | speed | speed_oracle | speed_exits | shallow | ours_deep | hf_generate
        pa.field("pattern", pa.string()),
        pa.field("model", pa.string()),  # the timed model's resolved ModelConfig as JSON (its weights are random)
        pa.field("ms_per_token", pa.float64()),  # median over repetitions
        pa.field("ms_per_token_min", pa.float64()),
        pa.field("baseline", pa.string()),  # the variant this row's speed-up is measured against
        pa.field("speedup", pa.float64()),  # baseline ms / this ms
        pa.field("ratio_vs_shallow", pa.float64()),  # this ms / shallow Nx1 ms
        pa.field("tokens", pa.int64()),
        pa.field("steps", pa.int64()),
        pa.field("rows", pa.int64()),
        pa.field("flushes", pa.int64()),
        pa.field("wasted_rows", pa.int64()),
        pa.field("reps", pa.int32()),
        pa.field("d_model", pa.int32()),
        pa.field("vocab_size", pa.int32()),
        pa.field("batch", pa.int32()),
        pa.field("threads", pa.int32()),
        pa.field("torch", pa.string()),
        pa.field("machine", pa.string()),  # the CPU architecture, or on CUDA the GPU's name
    ]
)


@dataclass(frozen=True)
class DecodeBenchConfig:
    """What every decode benchmark measures: the model (dims and pattern; its weights are random), the batch, the
    output length, repetitions, the seed and the device."""

    model: ModelConfig | LMConfig
    batch: int = 1
    new_tokens: int = 64
    reps: int = 5
    seed: int = 0
    compare_hf: bool = True  # also time our sequential Dx1 (D = N*M) against transformers' generate
    device: str = "cpu"  # where every variant runs (its inputs start on the CPU, as a request's do)


@dataclass(frozen=True)
class BenchConfig(DecodeBenchConfig):
    """The encoder-decoder's: a ``ModelConfig``, its source length, and exit adapters."""

    model: ModelConfig
    source_len: int = 32
    exit_rank: int | None = 64  # also time SPEED with exit adapters of this rank (speed.models.exits); None: not


def random_model(config: ModelConfig | LMConfig, seed: int) -> SpeedT5 | LoopedLM:
    """A random model of the config's family (a T5 without dropout) whose EOS row is zeroed, so that every run
    decodes the full length."""
    torch.manual_seed(seed)
    model = build_model(config.replace(dropout=0.0) if isinstance(config, ModelConfig) else config).eval()
    with torch.no_grad():
        model.lm_head.weight[config.eos_id].zero_()
    return model


@dataclass(frozen=True)
class BenchModels:
    """What every variant of a decode benchmark shares: the timed model and its shallow Nx1 twin (one loop of N
    layers, the same seed), the random inputs and the model's sequential greedy decoding of them."""

    model: SpeedT5 | LoopedLM
    shallow: SpeedT5 | LoopedLM
    ids: torch.Tensor  # (batch, input length), on the CPU, as a request's are
    reference: GenerateResult  # sequential greedy decoding: what every exact variant must reproduce

    def configs(self) -> dict[str, ModelConfig | LMConfig]:
        """The timed model's config of each variant that runs ``model`` or ``shallow``."""
        deep = self.model.config
        return {"sequential": deep, "speed": deep, "speed_oracle": deep, "shallow": self.shallow.config}


def bench_models(cfg: DecodeBenchConfig, input_len: int, first_id: int) -> BenchModels:
    """``cfg``'s random model and its shallow Nx1 on ``cfg.device``, ``cfg.batch`` random inputs of ``input_len``
    tokens (ids from ``first_id`` up: no special token) and the sequential reference of ``cfg.new_tokens``."""
    model = random_model(cfg.model, cfg.seed).to(cfg.device)
    shallow = random_model(cfg.model.replace(pattern=str(cfg.model.sharing.one_loop())), cfg.seed).to(cfg.device)
    torch.manual_seed(cfg.seed + 1)
    ids = torch.randint(first_id, cfg.model.vocab_size, (cfg.batch, input_len))
    reference = generate(
        model, ids, options=DecodeOptions(method="sequential", max_new_tokens=cfg.new_tokens, trace=False)
    )
    return BenchModels(model, shallow, ids, reference)


def decoding(model: torch.nn.Module, ids: torch.Tensor, new_tokens: int, **kw: Any) -> Callable[[], GenerateResult]:
    """A run that decodes ``ids`` for ``new_tokens`` tokens (``kw``: ``DecodeOptions``' fields, and ``generate``'s
    ``oracle``) through one ``Decoder``
    built at its first call (``interleave``'s untimed one): every later call only decodes, never builds an engine
    nor captures a CUDA graph, so a timed round times decoding alone."""
    oracle = kw.pop("oracle", None)
    decoder: Decoder | None = None

    def go() -> GenerateResult:
        nonlocal decoder
        if decoder is None:
            decoder = Decoder(model, *ids.shape, DecodeOptions(max_new_tokens=new_tokens, **kw))
        return decoder(ids, oracle=oracle)

    return go


def interleave(
    variants: dict[str, Callable[[], int]], reps: int, device: str = "cpu", unit: str = "ms/token"
) -> dict[str, list[float]]:
    """Run each variant once untimed, then ``reps`` timed rounds in rotating order; ms per token.

    Each variant returns the number of tokens it decoded (a variant that returns 1 makes the figures ms a run:
    its progress lines then say so through ``unit``); on a CUDA ``device`` the clock is read only after the
    device has finished the variant's work.
    """
    sync = torch.cuda.synchronize if torch.device(device).type == "cuda" else lambda: None
    for fn in variants.values():
        fn()
    sync()
    times: dict[str, list[float]] = {name: [] for name in variants}
    names = list(variants)
    for r in range(reps):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            t0 = time.perf_counter()
            tokens = variants[name]()
            sync()
            times[name].append((time.perf_counter() - t0) * 1000 / tokens)
        print(
            f"  round {r + 1}/{reps}: " + ", ".join(f"{n} {times[n][-1]:.1f}" for n in names) + f" {unit}", flush=True
        )
    return times


def machine_name(device: str) -> str:
    """The CPU architecture, or on CUDA the GPU's name: the rows' ``machine``."""
    if torch.device(device).type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"{_platform.machine()} {_platform.processor() or ''}".strip()


def variant_columns(
    name: str,
    config: ModelConfig | LMConfig,
    result: GenerateResult | None,
    ms_per_token: dict[str, float],
    tokens: int,
) -> dict[str, Any]:
    """A variant's row: its name, the timed model's pattern and resolved config (JSON), its decode time per token
    (of ``ms_per_token``, every variant's) and speed-up over its baseline (transformers' generate for our deep
    decoder and itself, else sequential) and the shallow Nx1 (None where none ran), and its decoding's tokens,
    steps and flushes (``result``, None for transformers': then ``tokens``, and no steps)."""
    baseline = "hf_generate" if name in ("ours_deep", "hf_generate") else "sequential"
    stats = result.stats if result is not None else None
    return {
        "variant": name,
        "pattern": config.pattern,
        "model": json.dumps(to_dict(config), sort_keys=True),
        "ms_per_token": ms_per_token[name],
        "baseline": baseline,
        "speedup": ms_per_token[baseline] / ms_per_token[name],
        "ratio_vs_shallow": ms_per_token[name] / ms_per_token["shallow"] if "shallow" in ms_per_token else None,
        "tokens": stats.tokens if stats else tokens,
        "steps": stats.steps if stats else None,
        "flushes": stats.flushes if stats else None,
    }


def run_columns(cfg: DecodeBenchConfig) -> dict[str, Any]:
    """What every row of one benchmark run shares: its sizes and repetitions, the threads, torch and the machine."""
    return {
        "reps": cfg.reps,
        "d_model": cfg.model.d_model,
        "vocab_size": cfg.model.vocab_size,
        "batch": cfg.batch,
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "machine": machine_name(cfg.device),
    }


def check_exact(results: dict[str, GenerateResult], reference: GenerateResult, names: tuple[str, ...]) -> None:
    """Each named variant that ran decoded exactly ``reference``'s tokens (sequential greedy decoding's)."""
    for name in names:
        if name in results and results[name].tokens != reference.tokens:
            raise AssertionError(f"{name} output differs from sequential greedy decoding")


def transformers_installed() -> bool:
    """Whether ``transformers`` (a test/bench extra) imports; where not, a line says the comparison is skipped."""
    try:
        import transformers  # noqa: F401
    except ImportError as err:
        print(f"skipping the transformers comparison: {err}")
        return False
    return True


def warn_unless_hf_agrees(ours: torch.nn.Module, ids: torch.Tensor, new_tokens: int, hf_tokens: torch.Tensor) -> None:
    """Print a warning where our sequential greedy tokens differ from transformers' on the same weights."""
    check = generate(
        ours, ids, options=DecodeOptions(method="sequential", max_new_tokens=new_tokens, trace=False)
    ).tokens
    if check != hf_tokens.tolist():
        print("warning: our Dx1 greedy tokens differ from transformers' (numerical near-ties on random weights?)")


def run_benchmark(cfg: BenchConfig) -> pa.Table:
    """Measure all variants side by side and return one row per variant (``BENCH_SCHEMA``)."""
    bench = bench_models(cfg, cfg.source_len, first_id=3)
    model, shallow, ids, reference = bench.model, bench.shallow, bench.ids, bench.reference
    n = cfg.new_tokens
    tokens = sum(map(len, reference.tokens))
    results: dict[str, GenerateResult] = {}
    configs = bench.configs()

    def run(name: str, m: SpeedT5, **kw) -> Callable[[], int]:
        decode = decoding(m, ids, n, trace=False, **kw)  # one engine per variant, its graphs captured once

        def go() -> int:
            results[name] = decode()
            return tokens

        return go

    variants = {
        "sequential": run("sequential", model, method="sequential"),
        "speed": run("speed", model, method="speed"),
        "speed_oracle": run("speed_oracle", model, method="speed", oracle=reference.tokens),
        "shallow": run("shallow", shallow, method="sequential"),
    }
    if cfg.exit_rank is not None:  # fresh adapters: SPEED's schedule is plain SPEED's, so the difference is their cost
        adapted = random_model(cfg.model, cfg.seed)  # the same weights as ``model``
        attach(adapted, exits_for(adapted, cfg.exit_rank)).to(cfg.device)
        variants["speed_exits"] = run("speed_exits", adapted, method="speed")
        configs["speed_exits"] = adapted.config
    hf_pair = _hf_pair(cfg, ids) if cfg.compare_hf else None
    if hf_pair is not None:
        ours, hf_go = hf_pair
        variants["ours_deep"] = run("ours_deep", ours, method="sequential")
        configs["ours_deep"] = configs["hf_generate"] = ours.config  # transformers' T5 has the same weights
        variants["hf_generate"] = lambda: hf_go().numel()  # batch x n tokens (EOS disabled)
    print(
        f"benchmark: {cfg.model.pattern} d_model={cfg.model.d_model} vocab={cfg.model.vocab_size} "
        f"batch={cfg.batch} tokens={n} reps={cfg.reps} threads={torch.get_num_threads()} device={cfg.device}",
        flush=True,
    )
    times = interleave(variants, cfg.reps, cfg.device)
    check_exact(results, reference, ("speed", "speed_oracle", "speed_exits"))
    med = {name: statistics.median(ts) for name, ts in times.items()}
    shared = run_columns(cfg)
    rows = []
    for name, ts in times.items():
        stats = results[name].stats if name in results else None
        row = variant_columns(name, configs[name], results.get(name), med, tokens) | shared
        row |= {
            "ms_per_token_min": min(ts),
            "rows": stats.rows if stats else None,
            "wasted_rows": stats.wasted_rows if stats else None,
        }
        rows.append(row)
    return pa.Table.from_pylist(rows, schema=BENCH_SCHEMA)


def _hf_pair(cfg: BenchConfig, ids: torch.Tensor):
    """Our sequential Dx1 and transformers' T5 ``generate`` on the same random weights."""
    if not transformers_installed():
        return None
    from transformers import T5ForConditionalGeneration
    from transformers.cache_utils import DynamicCache, EncoderDecoderCache

    from speed.models.convert_t5 import from_hf_model, hf_config_from

    depth = cfg.model.sharing.depth
    torch.manual_seed(cfg.seed)
    hf = T5ForConditionalGeneration(hf_config_from(cfg.model.replace(dropout=0.0), n_decoder_layers=depth)).eval()
    with torch.no_grad():
        hf.lm_head.weight[cfg.model.eos_id].zero_()
    ours = from_hf_model(hf, pattern=f"{depth}x1").eval().to(cfg.device)
    hf, hf_ids = hf.to(cfg.device), ids.to(cfg.device)
    n = cfg.new_tokens

    # An explicit cache: transformers 5.x sizes T5's default one by the encoder depth. Its keyword is `cache` from
    # 5.2x on and `past_key_values` before (5.17, the GPU machine's, refuses `cache`).
    cache_kwarg = "cache" if "cache" in inspect.signature(hf.forward).parameters else "past_key_values"

    def hf_generate() -> torch.Tensor:
        cache = {cache_kwarg: EncoderDecoderCache(DynamicCache(), DynamicCache())}
        with torch.inference_mode():
            out = hf.generate(hf_ids, max_new_tokens=n, min_new_tokens=n, do_sample=False, num_beams=1, **cache)
        assert out.shape[1] == n + 1  # decoder start + n tokens
        return out[:, 1:]

    warn_unless_hf_agrees(ours, ids, n, hf_generate())
    return ours, hf_generate


def _blank_none(key: str) -> Callable[[dict[str, Any]], Any]:
    return lambda r: "" if r[key] is None else r[key]


DECODE_COLUMNS = (
    Column("variant", 14, "variant", left=True),
    Column("pattern", 8, "pattern"),
    Column("TTFT ms", 10, "ttft_ms", ".1f"),  # the LM's rows only
    Column("ms/token", 10, "ms_per_token", ".2f"),
    Column("speed-up", 9, "speedup", ".2f", "x"),
    Column("over", 13, "baseline"),
    Column("vs shallow", 12, "ratio_vs_shallow", ".2f", "x"),
    Column("steps", 7, _blank_none("steps")),
    Column("flushes", 9, _blank_none("flushes")),
)


def format_table(table: pa.Table) -> str:
    """A fixed-width text table of the decode benchmark's rows, T5's or the LM's (with its time to first token)."""
    ttft = "ttft_ms" in table.column_names
    return text_table([c for c in DECODE_COLUMNS if ttft or c.value != "ttft_ms"], table.to_pylist())
