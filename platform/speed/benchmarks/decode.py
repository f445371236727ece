"""Side-by-side decode latency: sequential vs SPEED vs a shallow decoder, in one process; and SPEED
under seeded sampling against sequential sampling (``run_sampling_benchmark``).

Every variant decodes the same input; repetitions are interleaved (the order
rotates each round) and medians reported, so that a noisy machine shifts all
variants alike. Ratios are computed from these medians, never typed in.
"""

from __future__ import annotations

import json
import platform as _platform
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, get_type_hints

import pyarrow as pa
import torch

from speed.config import LMConfig, ModelConfig, coerce, to_dict
from speed.decode.generate import GenerateResult, generate
from speed.engine import LEVERS, Method, Speculation
from speed.engine.sampling import Sampling
from speed.models.exits import attach, exits_for
from speed.models.family import build_model
from speed.models.looped_lm import LoopedLM
from speed.models.t5 import SpeedT5

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
    reference = generate(model, ids, method="sequential", max_new_tokens=cfg.new_tokens, trace=False)
    return BenchModels(model, shallow, ids, reference)


def interleave(variants: dict[str, Callable[[], int]], reps: int, device: str = "cpu") -> dict[str, list[float]]:
    """Run each variant once untimed, then ``reps`` timed rounds in rotating order; ms per token.

    Each variant returns the number of tokens it decoded; on a CUDA ``device`` the clock is read only
    after the device has finished the variant's work.
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
            f"  round {r + 1}/{reps}: " + ", ".join(f"{n} {times[n][-1]:.1f}" for n in names) + " ms/token", flush=True
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
    decoder and itself, else sequential) and the shallow Nx1, and its decoding's tokens, steps and flushes
    (``result``, None for transformers': then ``tokens``, and no steps)."""
    baseline = "hf_generate" if name in ("ours_deep", "hf_generate") else "sequential"
    stats = result.stats if result is not None else None
    return {
        "variant": name,
        "pattern": config.pattern,
        "model": json.dumps(to_dict(config), sort_keys=True),
        "ms_per_token": ms_per_token[name],
        "baseline": baseline,
        "speedup": ms_per_token[baseline] / ms_per_token[name],
        "ratio_vs_shallow": ms_per_token[name] / ms_per_token["shallow"],
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
    check = generate(ours, ids, method="sequential", max_new_tokens=new_tokens, trace=False).tokens
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
        def go() -> int:
            results[name] = generate(m, ids, max_new_tokens=n, trace=False, **kw)
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

    def hf_generate() -> torch.Tensor:
        # An explicit cache: transformers 5.x sizes T5's default one by the encoder depth.
        cache = EncoderDecoderCache(DynamicCache(), DynamicCache())
        with torch.inference_mode():
            out = hf.generate(hf_ids, max_new_tokens=n, min_new_tokens=n, do_sample=False, num_beams=1, cache=cache)
        assert out.shape[1] == n + 1  # decoder start + n tokens
        return out[:, 1:]

    warn_unless_hf_agrees(ours, ids, n, hf_generate())
    return ours, hf_generate


def format_table(table: pa.Table) -> str:
    """A fixed-width text table of the decode benchmark's rows, T5's or the LM's (with its time to first token)."""
    ttft = "ttft_ms" in table.column_names
    head = f"{'variant':<14}{'pattern':>8}" + (f"{'TTFT ms':>10}" if ttft else "")
    head += f"{'ms/token':>10}{'speed-up':>9}{'over':>13}{'vs shallow':>12}{'steps':>7}{'flushes':>9}"
    lines = [head, "-" * len(head)]
    for r in table.to_pylist():
        steps = "" if r["steps"] is None else r["steps"]
        flushes = "" if r["flushes"] is None else r["flushes"]
        lines.append(
            f"{r['variant']:<14}{r['pattern']:>8}"
            + (f"{r['ttft_ms']:>10.1f}" if ttft else "")
            + f"{r['ms_per_token']:>10.2f}{r['speedup']:>8.2f}x{r['baseline']:>13}"
            f"{r['ratio_vs_shallow']:>11.2f}x{steps:>7}{flushes:>9}"
        )
    return "\n".join(lines)


# ----- sampling: SPEED against sequential sampling, coupled and argmax guesses --------------------------

SAMPLING_BENCH_SCHEMA = pa.schema(
    [
        pa.field("temperature", pa.float64()),
        pa.field("method", pa.string()),  # sequential | speed
        pa.field("guess", pa.string()),  # what SPEED speculates from: greedy (T = 0) | coupled | argmax; "" sequential
        pa.field("sentences", pa.int64()),
        pa.field("tokens", pa.int64()),
        pa.field("passes_per_token", pa.float64()),  # group passes (weight reads) per token; sequential: M
        pa.field("flushes", pa.int64()),
        pa.field("seconds", pa.float64()),  # wall time decoding, summed over the sentences
        pa.field("ms_per_token", pa.float64()),
        pa.field("speedup", pa.float64()),  # the sequential seconds at this temperature / this variant's
        pa.field("identical", pa.bool_()),  # every sentence's tokens equal sequential sampling's
    ]
)


def run_sampling_benchmark(
    model: SpeedT5, inputs: list[list[int]], temperatures: tuple[float, ...], max_new_tokens: int
) -> pa.Table:
    """Batch 1: each input decoded sequentially and with SPEED at each temperature (sentence i samples with
    seed i), with coupled and argmax guesses when sampling; the variants alternate per sentence in a rotating
    order, so that a loaded machine slows them alike. One row per variant (``SAMPLING_BENCH_SCHEMA``)."""
    variants = [("sequential", t, "") for t in temperatures]
    variants += [("speed", t, g) for t in temperatures for g in (("greedy",) if t == 0 else ("coupled", "argmax"))]
    seconds = {v: 0.0 for v in variants}
    tokens = {v: 0 for v in variants}
    passes = {v: 0 for v in variants}
    flushes = {v: 0 for v in variants}
    identical = {v: True for v in variants}
    for i, ids in enumerate(inputs):
        x = torch.tensor([ids])
        out: dict[tuple[str, float, str], list[list[int]]] = {}
        for k in range(len(variants)):
            v = variants[(i + k) % len(variants)]
            method, t, guess = v
            sampling = Sampling(temperature=t, seed=i, coupled=guess != "argmax")
            t0 = time.perf_counter()
            result = generate(model, x, method=method, max_new_tokens=max_new_tokens, trace=False, sampling=sampling)
            seconds[v] += time.perf_counter() - t0
            out[v] = result.tokens
            tokens[v] += result.stats.tokens
            passes[v] += result.stats.group_passes
            flushes[v] += result.stats.flushes
        for v in variants:
            identical[v] &= out[v] == out[("sequential", v[1], "")]
        if (i + 1) % 10 == 0 or i + 1 == len(inputs):
            shown = ", ".join(
                f"T={t} {m}{'/' + g if g else ''} {passes[(m, t, g)] / tokens[(m, t, g)]:.2f}" for m, t, g in variants
            )
            print(f"  {i + 1}/{len(inputs)} sentences; passes per token: {shown}", flush=True)
    rows = [
        {
            "temperature": t,
            "method": method,
            "guess": guess,
            "sentences": len(inputs),
            "tokens": tokens[v],
            "passes_per_token": passes[v] / tokens[v],
            "flushes": flushes[v],
            "seconds": seconds[v],
            "ms_per_token": seconds[v] * 1000 / tokens[v],
            "speedup": seconds[("sequential", t, "")] / seconds[v],
            "identical": identical[v],
        }
        for v in variants
        for method, t, guess in [v]
    ]
    return pa.Table.from_pylist(rows, schema=SAMPLING_BENCH_SCHEMA)


def format_sampling_table(table: pa.Table) -> str:
    """A fixed-width text table of the sampling benchmark rows."""
    head = f"{'T':>5} {'method':<11}{'guess':<9}{'tokens':>8}{'passes/token':>14}{'ms/token':>10}{'speed-up':>10}"
    lines = [head + "  identical", "-" * (len(head) + 11)]
    for r in table.to_pylist():
        lines.append(
            f"{r['temperature']:>5.2f} {r['method']:<11}{r['guess']:<9}{r['tokens']:>8}{r['passes_per_token']:>14.2f}"
            f"{r['ms_per_token']:>10.2f}{r['speedup']:>9.2f}x  {r['identical']}"
        )
    return "\n".join(lines)


# ----- SPEED's levers on a trained checkpoint ---------------------------------------------------------------

LEVER_BENCH_SCHEMA = pa.schema(
    [
        pa.field("model", pa.string()),  # which checkpoint (the job's --checkpoint NAME=...; one checkpoint: "model")
        pa.field("variant", pa.string()),  # sequential | shallow | speed | a lever setting; "..._no_exits": no
        # adapters; oracle: SPEED speculating the sequential output (timed after the others, not in rotation)
        pa.field("settings", pa.string()),  # JSON of LeverSetting.given (branches, branch_depth, row_budget, ...)
        pa.field("exit_adapters", pa.bool_()),  # SPEED drafted from the checkpoint's exit adapters (speed.models.exits)
        pa.field("sentences", pa.int64()),
        pa.field("tokens", pa.int64()),
        pa.field("passes_per_token", pa.float64()),  # group passes (weight reads) per token; SPEED at batch 1: steps
        pa.field("rows_per_token", pa.float64()),  # rows the steps ran per token (a row: one token through one loop)
        pa.field("seconds", pa.float64()),  # wall time decoding, summed over the sentences
        pa.field("ms_per_token", pa.float64()),
        pa.field("cpu_ms_per_token", pa.float64()),  # the process's CPU time (all threads) per token
        pa.field("vs_speed", pa.float64()),  # this variant's seconds per token / the same model's plain SPEED's
        pa.field("identical", pa.bool_()),  # every sentence equals the model's sequential decoding (shallow: no need)
        pa.field("metric", pa.string()),  # bleu | rougeL: the task's metric (null when the run had no references)
        pa.field("quality", pa.float64()),  # the model's sequential output scored against the references, the same
        pa.field("quality_low", pa.float64()),  # for every exact variant; its 95 % bootstrap interval (null for the
        pa.field("quality_high", pa.float64()),  # shallow decoder, a different model)
    ]
)


@dataclass(frozen=True)
class LeverSetting:
    """One variant of the lever benchmark: SPEED's settings and the engine's row budget, as ``generate`` takes them."""

    speculation: Speculation = Speculation()
    row_budget: int | None = None  # rows per step; None: every in-flight row

    def given(self) -> dict[str, Any]:
        """What differs from plain SPEED, by name (the rows' ``settings``)."""
        plain = Speculation()
        out = {n: getattr(self.speculation, n) for n in LEVERS if getattr(self.speculation, n) != getattr(plain, n)}
        return out if self.row_budget is None else out | {"row_budget": self.row_budget}


def parse_levers(text: str) -> dict[str, LeverSetting]:
    """``"b6=branches:6,row_budget:8;lanes=branches:6,branch_depth:6"`` -> ``{"b6": ..., "lanes": ...}``: each key
    a ``Speculation`` field (``speed.engine.LEVERS``) or ``row_budget``, its value coerced by the field's type."""
    known = {name: get_type_hints(Speculation)[name] for name in LEVERS} | {"row_budget": int}
    out: dict[str, LeverSetting] = {}
    for part in filter(None, (p.strip() for p in text.split(";"))):
        name, sep, body = part.partition("=")
        if not sep or not name or name in ("sequential", "shallow", "speed") or name in out or name.endswith(NO_EXITS):
            raise ValueError(f"a lever setting is NAME=key:value,... with a new name, got {part!r}")
        setting = {}
        for item in filter(None, body.split(",")):
            key, sep, value = item.partition(":")
            if key not in known or not sep:
                raise ValueError(f"{part!r}: {item!r} is not one of {sorted(known)} as key:value")
            setting[key] = coerce(value, known[key], f"{name}.{key}")
        budget = setting.pop("row_budget", None)
        try:
            out[name] = LeverSetting(Speculation(**setting), budget)
        except ValueError as err:
            raise ValueError(f"{part!r}: {err}") from None
    return out


NO_EXITS = "_no_exits"  # a variant's name suffix: the same SPEED settings without the checkpoint's exit adapters


@dataclass(frozen=True)
class Quality:
    """A model's output scored against the references, with a 95 % bootstrap interval."""

    metric: str  # bleu | rougeL
    score: float
    low: float
    high: float


@dataclass(frozen=True)
class LeverRun:
    """The lever benchmark's rows (``LEVER_BENCH_SCHEMA``) and each model's sequential output per input."""

    table: pa.Table
    outputs: dict[str, list[list[int]]]


@dataclass(frozen=True)
class _Variant:
    model: str
    name: str
    decoder: SpeedT5
    method: Method
    setting: LeverSetting
    exit_adapters: bool
    oracle: bool = False  # speculate the sequential output (run after the others: it needs that output)


def _lever_variants(name: str, model: SpeedT5, levers: dict[str, LeverSetting]) -> list[_Variant]:
    """One model's variants: sequential, the shallow Nx1 (the same weights, one loop), plain SPEED and each lever
    setting; a model with exit adapters also runs every SPEED variant without them (``<name>_no_exits``); last,
    ``oracle``: plain SPEED speculating the known sequential output (the steps it needs if every exit agreed)."""
    from speed.models.checkpoint import backbone_state

    shallow = type(model)(model.config.replace(pattern=str(model.sharing.one_loop()))).eval()
    shallow.load_state_dict(backbone_state(model))  # the same parameters: a shared decoder's first loop alone
    adapted = model.exit_adapters is not None
    speeds = {"speed": LeverSetting()} | levers
    out = [
        _Variant(name, "sequential", model, "sequential", LeverSetting(), False),
        _Variant(name, "shallow", shallow.to(model.device), "sequential", LeverSetting(), False),
    ]
    out += [_Variant(name, v, model, "speed", setting, adapted) for v, setting in speeds.items()]
    if adapted:
        without = type(model)(model.config).eval()
        without.load_state_dict(backbone_state(model))
        without.to(model.device)
        out += [_Variant(name, v + NO_EXITS, without, "speed", setting, False) for v, setting in speeds.items()]
    return [*out, _Variant(name, "oracle", model, "speed", LeverSetting(), adapted, oracle=True)]


def run_lever_benchmark(
    models: SpeedT5 | dict[str, SpeedT5],
    inputs: list[list[int]],
    levers: dict[str, LeverSetting],
    max_new_tokens: int,
    quality: Callable[[list[list[int]]], Quality] | None = None,
) -> LeverRun:
    """Batch 1, greedy: each input decoded by every model's variants (``_lever_variants``), which alternate per
    sentence in a rotating order, so that a loaded machine slows them alike. ``quality`` scores a model's
    sequential outputs (every exact variant's too). One row per (model, variant) (``LEVER_BENCH_SCHEMA``)."""
    models = {"model": models} if isinstance(models, torch.nn.Module) else dict(models)
    variants = [v for name, model in models.items() for v in _lever_variants(name, model, levers)]
    keys = [(v.model, v.name) for v in variants]
    seconds, cpu, tokens, passes, rows = ({k: 0.0 for k in keys} for _ in range(5))
    identical = {k: True for k in keys}
    outputs: dict[str, list[list[int]]] = {name: [] for name in models}
    timed = [v for v in variants if not v.oracle]
    for i, ids in enumerate(inputs):
        x = torch.tensor([ids])
        out = {}
        # the timed variants in a rotating order; each model's oracle after them, given its sequential output
        order = [timed[(i + k) % len(timed)] for k in range(len(timed))] + [v for v in variants if v.oracle]
        for v in order:
            known = [out[v.model, "sequential"][0]] if v.oracle else None
            t0, c0 = time.perf_counter(), time.process_time()
            result = generate(
                v.decoder,
                x,
                method=v.method,
                max_new_tokens=max_new_tokens,
                speculation=v.setting.speculation,
                trace=False,
                oracle=known,
                row_budget=v.setting.row_budget,
            )
            seconds[v.model, v.name] += time.perf_counter() - t0
            cpu[v.model, v.name] += time.process_time() - c0
            out[v.model, v.name] = result.tokens
            tokens[v.model, v.name] += result.stats.tokens
            passes[v.model, v.name] += result.stats.group_passes
            rows[v.model, v.name] += result.stats.rows
        for model, name in keys:
            identical[model, name] &= out[model, name] == out[model, "sequential"]
        for name in models:
            outputs[name].append(out[name, "sequential"][0])
        if (i + 1) % 10 == 0 or i + 1 == len(inputs):
            shown = ", ".join(f"{'/'.join(k) if len(models) > 1 else k[1]} {passes[k] / tokens[k]:.2f}" for k in keys)
            print(f"  {i + 1}/{len(inputs)} sentences; passes per token: {shown}", flush=True)
    scores = {name: quality(outputs[name]) for name in models} if quality is not None else {}
    table = pa.Table.from_pylist(
        [
            {
                "model": v.model,
                "variant": v.name,
                "settings": json.dumps(v.setting.given(), sort_keys=True),
                "exit_adapters": v.exit_adapters,
                "sentences": len(inputs),
                "tokens": int(tokens[k]),
                "passes_per_token": passes[k] / tokens[k],
                "rows_per_token": rows[k] / tokens[k],
                "seconds": seconds[k],
                "ms_per_token": seconds[k] / tokens[k] * 1000,
                "cpu_ms_per_token": cpu[k] / tokens[k] * 1000,
                "vs_speed": (seconds[k] / tokens[k]) / (seconds[v.model, "speed"] / tokens[v.model, "speed"]),
                "identical": identical[k],
                **_quality_columns(scores.get(v.model) if v.name != "shallow" else None),
            }
            for v, k in zip(variants, keys)
        ],
        schema=LEVER_BENCH_SCHEMA,
    )
    return LeverRun(table, outputs)


def _quality_columns(quality: Quality | None) -> dict[str, Any]:
    names = ("metric", "quality", "quality_low", "quality_high")
    values = (None,) * 4 if quality is None else (quality.metric, quality.score, quality.low, quality.high)
    return dict(zip(names, values))


def _scoring(held: HeldOut) -> tuple[Any, str]:
    """The tokenizer that detokenizes ``held``'s outputs, and its task's metric (BLEU for translation, else ROUGE-L)."""
    from speed.data import get_task
    from speed.tokenizer import Tokenizer

    return Tokenizer.load(held.tokenizer_path), "bleu" if "bleu" in get_task(held.task).metrics else "rougeL"


def score_outputs(held: HeldOut, samples: int = 1000) -> Callable[[list[list[int]]], Quality]:
    """A ``quality`` for ``run_lever_benchmark``: a model's outputs detokenized and scored against ``held``'s
    references with the task's metric (BLEU for translation, else ROUGE-L) and its bootstrap interval."""
    from speed.eval import metrics

    tok, metric = _scoring(held)

    def quality(outputs: list[list[int]]) -> Quality:
        scored = metrics.bootstrap(tok.decode_batch(outputs), held.references[: len(outputs)], samples)[metric]
        return Quality(metric, scored["score"], scored["low"], scored["high"])

    return quality


def paired_quality(held: HeldOut, outputs: dict[str, list[list[int]]], samples: int = 1000) -> list[str]:
    """Each checkpoint's output against the first's on the same references: the task's metric's difference with
    its 95 % paired-bootstrap interval (``speed.eval.metrics.paired_bootstrap``), one line per checkpoint."""
    from speed.eval import metrics

    tok, metric = _scoring(held)
    (first, baseline), *others = outputs.items()
    refs, lines = held.references[: len(baseline)], []
    for name, output in others:
        d = metrics.paired_bootstrap(tok.decode_batch(baseline), tok.decode_batch(output), refs, samples)[metric]
        lines.append(
            f"{name} vs {first}: {metric} {d['system']:.2f} vs {d['baseline']:.2f}, difference {d['delta']:+.2f} "
            f"[{d['low']:+.2f}, {d['high']:+.2f}] (95 % paired bootstrap, {samples} resamples)"
        )
    return lines


def format_lever_table(table: pa.Table) -> str:
    """A fixed-width text table of the lever benchmark rows (the model column only when there are several)."""
    rows = table.to_pylist()
    several = len({r["model"] for r in rows}) > 1
    width = max([len(r["variant"]) for r in rows] + [7]) + 2
    head = (f"{'model':<10}" if several else "") + f"{'variant':<{width}}{'tokens':>7}{'passes/token':>13}"
    head += f"{'rows/token':>11}{'ms/token':>9}{'CPU ms/tok':>11}{'vs SPEED':>9}{'quality [95 %]':>22}"
    lines = [head + "  identical  settings", "-" * (len(head) + 21)]
    for r in rows:
        low, high = r["quality_low"], r["quality_high"]
        scored = "-" if r["quality"] is None else f"{r['quality']:.2f} [{low:.2f}, {high:.2f}]"
        lines.append(
            (f"{r['model']:<10}" if several else "")
            + f"{r['variant']:<{width}}{r['tokens']:>7}{r['passes_per_token']:>13.3f}{r['rows_per_token']:>11.2f}"
            f"{r['ms_per_token']:>9.2f}{r['cpu_ms_per_token']:>11.2f}{r['vs_speed']:>8.2f}x{scored:>22}"
            f"  {str(r['identical']):<9}  {r['settings']}"
        )
    return "\n".join(lines)


@dataclass(frozen=True)
class HeldOut:
    """A trained checkpoint and the encoder inputs of its task's held-out sentences (the benchmarks' workload)."""

    model: SpeedT5
    task: str
    inputs: list[list[int]]
    references: list[str]  # the records' targets
    tokenizer_path: str


def held_out(checkpoint: str, split: str, limit: int | None) -> HeldOut:
    """Load ``checkpoint`` and encode the first ``limit`` records of its training task's ``split`` as its family
    reads them (T5's encoder inputs, an LM's chat prompts), truncated as in training; a checkpoint without
    tokenizer or task is a clear error."""
    from speed.data import get_task, read_records
    from speed.models.checkpoint import load_model
    from speed.models.family import family_of
    from speed.tokenizer import Tokenizer

    loaded = load_model(checkpoint)
    if loaded.tokenizer_path is None:
        raise FileNotFoundError(f"checkpoint {checkpoint} holds no spm.model")
    data = loaded.config.get("job", {}).get("data", {})
    if not data.get("task"):
        raise ValueError(f"checkpoint {checkpoint} records no training task")
    family = family_of(loaded.model)
    records = read_records(family.read_task(get_task(data["task"])), split, data.get("source"), limit)
    columns = records.dataset.to_dict()
    tok = Tokenizer.load(loaded.tokenizer_path)
    inputs = family.encode_sources(columns["source"], tok, data.get("max_source_len") or 512)
    return HeldOut(loaded.model, data["task"], inputs, columns["target"], loaded.tokenizer_path)
