"""SPEED's levers on trained checkpoints of either family: batch 1, greedy, every lever setting side by side with
plain SPEED, sequential decoding and the shallow decoder (``jobs/bench_levers.py``).
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Collection
from dataclasses import dataclass
from typing import Any, get_type_hints

import pyarrow as pa
import torch

from speed.benchmarks.heldout import Quality
from speed.config import coerce
from speed.decode.generate import DecodeOptions, generate
from speed.engine import LEVERS, Method, Speculation
from speed.models.looped_lm import LoopedLM
from speed.models.t5 import SpeedT5

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
class LeverRun:
    """The lever benchmark's rows (``LEVER_BENCH_SCHEMA``) and each model's sequential output per input."""

    table: pa.Table
    outputs: dict[str, list[list[int]]]


@dataclass(frozen=True)
class _Variant:
    model: str
    name: str
    decoder: SpeedT5 | LoopedLM
    method: Method
    setting: LeverSetting
    exit_adapters: bool
    oracle: bool = False  # speculate the sequential output (run after the others: it needs that output)


def _lever_variants(name: str, model: SpeedT5 | LoopedLM, levers: dict[str, LeverSetting]) -> list[_Variant]:
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
    models: SpeedT5 | LoopedLM | dict[str, SpeedT5 | LoopedLM],
    inputs: list[list[int]],
    levers: dict[str, LeverSetting],
    max_new_tokens: int,
    quality: Callable[[list[list[int]]], Quality] | None = None,
    stop_ids: Collection[int] | None = None,
) -> LeverRun:
    """Batch 1, greedy: each input decoded by every model's variants (``_lever_variants``), which alternate per
    sentence in a rotating order, so that a loaded machine slows them alike. ``quality`` scores a model's
    sequential outputs (every exact variant's too); ``stop_ids``: where outputs end (None: the model's EOS). One row
    per (model, variant) (``LEVER_BENCH_SCHEMA``)."""
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
                options=DecodeOptions(
                    method=v.method,
                    max_new_tokens=max_new_tokens,
                    speculation=v.setting.speculation,
                    trace=False,
                    row_budget=v.setting.row_budget,
                    stop_ids=stop_ids,
                ),
                oracle=known,
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
