"""The latency stage: the frontier's checkpoints timed side by side in one process.

Trials share nodes, so their wall-clock would measure their neighbours; this
stage runs after them, alone, and times every variant on the same validation
inputs (each decoded at batch 1) in interleaved rounds (``speed.benchmarks.decode.interleave``):
SPEED at each frontier trial's best setting (levers included), the same checkpoint decoded
sequentially (its full depth), and every trained ``Nx1`` of the sweep (the
shallow decoders, and the unshared full-depth ``Dx1`` when one was trained; a looped LM's
``P+Nx1+C``, the shallow decoder of every ``P+NxM+C``).
"""

from __future__ import annotations

import statistics
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import pyarrow as pa
import torch

from speed.benchmarks.decode import interleave
from speed.config import SharingPattern
from speed.data import get_task, pad_inputs, read_records
from speed.decode.generate import DecodeOptions, DecodeStats, generate
from speed.engine import Speculation
from speed.hf_tokenizer import chat_renderer, load_tokenizer
from speed.models.checkpoint import load_model
from speed.models.family import family_of
from speed.models.looped_lm import LoopedLM
from speed.models.t5 import SpeedT5
from speed.sweep.measure import PLAIN
from speed.sweep.results import LATENCY_SCHEMA
from speed.sweep.space import SWEPT_LEVERS


def time_frontier(
    frontier: pa.Table,
    results: pa.Table,
    task: str,
    source: str | None,
    limit: int,
    max_source_len: int,
    max_new_tokens: int,
    reps: int,
    device: str = "cpu",
) -> pa.Table:
    """One ``LATENCY_SCHEMA`` row per timed variant; ratios from medians measured in this one run."""
    finished = {r["trial"]: r for r in results.to_pylist() if r["status"] == "finished"}
    timed = [r["trial"] for r in frontier.to_pylist()]
    timed += [t for t, r in sorted(finished.items()) if r["n_loops"] == 1 and t not in timed]
    models: dict[str, SpeedT5 | LoopedLM] = {}
    tokenizer = None
    for trial in timed:
        loaded = load_model(finished[trial]["checkpoint"], map_location=device)
        tokenizer = tokenizer or load_tokenizer(loaded.tokenizer_path)
        models[trial] = loaded.model.to(device).eval()
    family = family_of(next(iter(models.values())))  # a sweep trains one family
    records = read_records(family.read_task(get_task(task)), "validation", source, limit).dataset.to_dict()
    inputs = family.encode_sources(records["source"], tokenizer, max_source_len, chat_renderer(tokenizer))

    stats: dict[str, DecodeStats] = {}
    variants: dict[str, Callable[[], int]] = {}
    for trial in timed:
        row = finished[trial]
        name = f"{trial}/sequential"
        variants[name] = _decoder(models[trial], inputs, max_new_tokens, stats, name)
        if trial in frontier.column("trial").to_pylist() and row["n_loops"] > 1:
            name = f"{trial}/speed"
            variants[name] = _decoder(models[trial], inputs, max_new_tokens, stats, name, _best(row))
    print(f"latency: {len(variants)} variants x {len(inputs)} inputs at batch 1, {reps} interleaved rounds", flush=True)
    times = interleave(variants, reps)
    median = {name: statistics.median(ts) for name, ts in times.items()}
    one_loop = [t for t in timed if finished[t]["n_loops"] == 1]
    shallow = {_shallow(finished[t]["pattern"]): median[f"{t}/sequential"] for t in one_loop}
    rows = []
    for name, ts in times.items():
        trial, variant = name.rsplit("/", 1)
        row = finished[trial]
        speed = variant == "speed"
        base = shallow.get(_shallow(row["pattern"]))
        best = _best(row) if speed else None
        rows.append(
            {
                "trial": trial,
                "pattern": row["pattern"],
                "variant": variant,
                **{name: None if best is None else getattr(best, name) for name in _COLUMNS},
                "ms_per_token": median[name],
                "ms_per_token_min": min(ts),
                "speedup_vs_sequential": median[f"{trial}/sequential"] / median[name],
                "ratio_vs_shallow": median[name] / base if base is not None else None,
                "tokens": stats[name].tokens,
                "steps": stats[name].steps,
                "rows": stats[name].rows,
                "reps": reps,
                "threads": torch.get_num_threads(),
            }
        )
    return pa.Table.from_pylist(rows, schema=LATENCY_SCHEMA)


_COLUMNS = ("launch_loop", "invalidation", *SWEPT_LEVERS)  # a LATENCY_SCHEMA row's SPEED settings (null: sequential)


def _shallow(pattern: str) -> str:
    """The one-loop pattern of the same layers: ``2x6`` -> ``2x1``, ``1+2x6+1`` -> ``1+2x1+1``."""
    return str(SharingPattern.parse(pattern).one_loop())


def _best(row: dict[str, Any]) -> Speculation:
    """A results row's best SPEED setting (its levers plain where the row predates them)."""
    best = {name: row.get(f"best_{name}") for name in _COLUMNS}
    return replace(PLAIN, **{name: value for name, value in best.items() if value is not None})


def _decoder(
    model: SpeedT5 | LoopedLM,
    inputs: list[list[int]],
    max_new_tokens: int,
    stats: dict[str, DecodeStats],
    name: str,
    speculation: Speculation | None = None,
) -> Callable[[], int]:
    """A variant for ``interleave``: decode every input alone (SPEED as ``speculation`` says, or without one
    sequentially); records its counters; returns the tokens."""
    method = "sequential" if speculation is None else "speed"

    def run() -> int:
        total = DecodeStats()
        for ids in inputs:
            input_ids, mask = pad_inputs([ids])  # (1, S), (1, S)
            device = next(model.parameters()).device
            result = generate(
                model,
                input_ids.to(device),
                mask.to(device),
                DecodeOptions(method=method, max_new_tokens=max_new_tokens, speculation=speculation, trace=False),
            )
            total += result.stats
        stats[name] = total
        return total.tokens

    return run
