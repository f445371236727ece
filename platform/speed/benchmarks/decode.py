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

from speed.config import ModelConfig, coerce, to_dict
from speed.decoding import GenerateResult, generate
from speed.engine import LEVERS, Method, Speculation
from speed.exits import attach, exits_for
from speed.model import SpeedT5
from speed.sampling import Sampling

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
class BenchConfig:
    """What to measure: model dims, pattern, input and output lengths, repetitions."""

    model: ModelConfig
    batch: int = 1
    source_len: int = 32
    new_tokens: int = 64
    reps: int = 5
    seed: int = 0
    compare_hf: bool = True  # also time our sequential Dx1 (D = N*M) against transformers' generate
    device: str = "cpu"  # where every variant runs (its inputs start on the CPU, as a request's do)
    exit_rank: int | None = 64  # also time SPEED with exit adapters of this rank (speed.exits); None: not


def random_model(config: ModelConfig, seed: int) -> SpeedT5:
    """A random model whose EOS row is zeroed, so that every run decodes the full length."""
    torch.manual_seed(seed)
    model = SpeedT5(config.replace(dropout=0.0)).eval()
    with torch.no_grad():
        model.lm_head.weight[config.eos_id].zero_()
    return model


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


def run_benchmark(cfg: BenchConfig) -> pa.Table:
    """Measure all variants side by side and return one row per variant (``BENCH_SCHEMA``)."""
    sharing = cfg.model.sharing
    model = random_model(cfg.model, cfg.seed).to(cfg.device)
    shallow = random_model(cfg.model.replace(pattern=f"{sharing.n_unique}x1"), cfg.seed).to(cfg.device)
    torch.manual_seed(cfg.seed + 1)
    ids = torch.randint(3, cfg.model.vocab_size, (cfg.batch, cfg.source_len))
    n = cfg.new_tokens
    reference = generate(model, ids, method="sequential", max_new_tokens=n, trace=False)
    tokens = sum(map(len, reference.tokens))
    results: dict[str, GenerateResult] = {}
    configs = {"sequential": model.config, "speed": model.config, "speed_oracle": model.config}
    configs["shallow"] = shallow.config

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
    for name in ("speed", "speed_oracle", "speed_exits"):
        if name in results and results[name].tokens != reference.tokens:
            raise AssertionError(f"{name} output differs from sequential greedy decoding")
    med = {name: statistics.median(ts) for name, ts in times.items()}
    machine = machine_name(cfg.device)
    rows = []
    for name, ts in times.items():
        stats = results[name].stats if name in results else None
        baseline = "hf_generate" if name in ("ours_deep", "hf_generate") else "sequential"
        rows.append(
            {
                "variant": name,
                "pattern": configs[name].pattern,
                "model": json.dumps(to_dict(configs[name]), sort_keys=True),
                "ms_per_token": med[name],
                "ms_per_token_min": min(ts),
                "baseline": baseline,
                "speedup": med[baseline] / med[name],
                "ratio_vs_shallow": med[name] / med["shallow"],
                "tokens": stats.tokens if stats else tokens,
                "steps": stats.steps if stats else None,
                "rows": stats.rows if stats else None,
                "flushes": stats.flushes if stats else None,
                "wasted_rows": stats.wasted_rows if stats else None,
                "reps": cfg.reps,
                "d_model": cfg.model.d_model,
                "vocab_size": cfg.model.vocab_size,
                "batch": cfg.batch,
                "threads": torch.get_num_threads(),
                "torch": torch.__version__,
                "machine": machine,
            }
        )
    return pa.Table.from_pylist(rows, schema=BENCH_SCHEMA)


def _hf_pair(cfg: BenchConfig, ids: torch.Tensor):
    """Our sequential Dx1 and transformers' T5 ``generate`` on the same random weights."""
    try:
        from transformers import T5ForConditionalGeneration

        from speed.convert import from_hf_model, hf_config_from
    except ImportError as err:  # transformers is a test/bench extra
        print(f"skipping the transformers comparison: {err}")
        return None
    from transformers.cache_utils import DynamicCache, EncoderDecoderCache

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

    check = generate(ours, ids, method="sequential", max_new_tokens=n, trace=False).tokens
    if check != hf_generate().tolist():
        print("warning: our Dx1 greedy tokens differ from transformers' (numerical near-ties on random weights?)")
    return ours, hf_generate


def format_table(table: pa.Table) -> str:
    """A fixed-width text table of the benchmark rows."""
    head = f"{'variant':<14}{'pattern':>8}{'ms/token':>10}{'speed-up':>9}{'over':>13}{'vs shallow':>12}"
    head += f"{'steps':>7}{'flushes':>9}"
    lines = [head, "-" * len(head)]
    for r in table.to_pylist():
        steps = "" if r["steps"] is None else r["steps"]
        flushes = "" if r["flushes"] is None else r["flushes"]
        lines.append(
            f"{r['variant']:<14}{r['pattern']:>8}{r['ms_per_token']:>10.2f}{r['speedup']:>8.2f}x{r['baseline']:>13}"
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
        pa.field("variant", pa.string()),  # sequential | shallow | speed | speed_no_exits | a lever setting's name
        pa.field("settings", pa.string()),  # JSON of LeverSetting.given (branches, branch_depth, row_budget, ...)
        pa.field("sentences", pa.int64()),
        pa.field("tokens", pa.int64()),
        pa.field("passes_per_token", pa.float64()),  # group passes (weight reads) per token; SPEED at batch 1: steps
        pa.field("rows_per_token", pa.float64()),  # rows the steps ran per token (a row: one token through one loop)
        pa.field("seconds", pa.float64()),  # wall time decoding, summed over the sentences
        pa.field("ms_per_token", pa.float64()),
        pa.field("vs_speed", pa.float64()),  # this variant's seconds per token / plain SPEED's
        pa.field("identical", pa.bool_()),  # every sentence equals sequential decoding (shallow: a different model)
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
        if not sep or not name or name in ("sequential", "shallow", "speed") or name in out:
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


def run_lever_benchmark(
    model: SpeedT5, inputs: list[list[int]], levers: dict[str, LeverSetting], max_new_tokens: int
) -> pa.Table:
    """Batch 1, greedy: each input decoded sequentially, by the shallow Nx1 (the same weights, one loop), by plain
    SPEED and by SPEED with each lever setting; the variants alternate per sentence in a rotating order, so that
    a loaded machine slows them alike. A model with exit adapters (``speed.exits``) decodes with them, and the
    variant ``speed_no_exits`` without them. One row per variant (``LEVER_BENCH_SCHEMA``)."""
    from speed.checkpoint import backbone_state

    shallow = SpeedT5(model.config.replace(pattern=f"{model.sharing.n_unique}x1")).eval()
    shallow.load_state_dict(backbone_state(model))  # the same parameters: a shared decoder's first loop alone
    plain = LeverSetting()
    variants: dict[str, tuple[SpeedT5, Method, LeverSetting]] = {
        "sequential": (model, "sequential", plain),
        "shallow": (shallow, "sequential", plain),
        "speed": (model, "speed", plain),
    } | {name: (model, "speed", setting) for name, setting in levers.items()}
    if model.exit_adapters is not None:  # the checkpoint's exit adapters are a lever too: SPEED without them
        without = SpeedT5(model.config).eval()
        without.load_state_dict(backbone_state(model))
        variants["speed_no_exits"] = (without.to(model.device), "speed", plain)
    names = list(variants)
    seconds, tokens, passes, rows = ({n: 0.0 for n in names} for _ in range(4))
    identical = {n: True for n in names}
    for i, ids in enumerate(inputs):
        x = torch.tensor([ids])
        out = {}
        for k in range(len(names)):
            name = names[(i + k) % len(names)]
            m, method, setting = variants[name]
            t0 = time.perf_counter()
            result = generate(
                m,
                x,
                method=method,
                max_new_tokens=max_new_tokens,
                speculation=setting.speculation,
                trace=False,
                row_budget=setting.row_budget,
            )
            seconds[name] += time.perf_counter() - t0
            out[name] = result.tokens
            tokens[name] += result.stats.tokens
            passes[name] += result.stats.group_passes
            rows[name] += result.stats.rows
        for name in names:
            identical[name] &= out[name] == out["sequential"]
        if (i + 1) % 10 == 0 or i + 1 == len(inputs):
            shown = ", ".join(f"{n} {passes[n] / tokens[n]:.2f}" for n in names)
            print(f"  {i + 1}/{len(inputs)} sentences; passes per token: {shown}", flush=True)
    per_token = {n: seconds[n] / tokens[n] for n in names}
    return pa.Table.from_pylist(
        [
            {
                "variant": n,
                "settings": json.dumps(variants[n][2].given(), sort_keys=True),
                "sentences": len(inputs),
                "tokens": int(tokens[n]),
                "passes_per_token": passes[n] / tokens[n],
                "rows_per_token": rows[n] / tokens[n],
                "seconds": seconds[n],
                "ms_per_token": per_token[n] * 1000,
                "vs_speed": per_token[n] / per_token["speed"],
                "identical": identical[n],
            }
            for n in names
        ],
        schema=LEVER_BENCH_SCHEMA,
    )


def format_lever_table(table: pa.Table) -> str:
    """A fixed-width text table of the lever benchmark rows."""
    head = f"{'variant':<14}{'tokens':>8}{'passes/token':>14}{'rows/token':>12}{'ms/token':>10}{'vs SPEED':>10}"
    lines = [head + "  identical  settings", "-" * (len(head) + 21)]
    for r in table.to_pylist():
        lines.append(
            f"{r['variant']:<14}{r['tokens']:>8}{r['passes_per_token']:>14.3f}{r['rows_per_token']:>12.2f}"
            f"{r['ms_per_token']:>10.2f}{r['vs_speed']:>9.2f}x  {str(r['identical']):<9}  {r['settings']}"
        )
    return "\n".join(lines)


@dataclass(frozen=True)
class HeldOut:
    """A trained checkpoint and the encoder inputs of its task's held-out sentences (the benchmarks' workload)."""

    model: SpeedT5
    task: str
    inputs: list[list[int]]


def held_out(checkpoint: str, split: str, limit: int | None) -> HeldOut:
    """Load ``checkpoint`` and tokenize the first ``limit`` records of its training task's ``split``, truncated as
    in training; a checkpoint without tokenizer or task is a clear error."""
    from speed.checkpoint import load_model
    from speed.data import read_records, truncate
    from speed.tokenizer import Tokenizer

    loaded = load_model(checkpoint)
    if loaded.tokenizer_path is None:
        raise FileNotFoundError(f"checkpoint {checkpoint} holds no spm.model")
    data = loaded.config.get("job", {}).get("data", {})
    if not data.get("task"):
        raise ValueError(f"checkpoint {checkpoint} records no training task")
    records = read_records(data["task"], split, data.get("source"), limit)
    tok = Tokenizer.load(loaded.tokenizer_path)
    max_source_len = data.get("max_source_len") or 512
    sources = tok.encode_batch(records.dataset.to_dict()["source"])
    return HeldOut(loaded.model, data["task"], [truncate(ids, max_source_len) for ids in sources])
