"""SPEED under seeded sampling against sequential sampling, batch 1, side by side: coupled and argmax guesses
(``jobs/bench_sampling.py``); either family.
"""

from __future__ import annotations

import time

import pyarrow as pa
import torch

from speed.decode.generate import DecodeOptions, DecodeStats, generate
from speed.engine.sampling import Sampling
from speed.models.looped_lm import LoopedLM
from speed.models.t5 import SpeedT5

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
    model: SpeedT5 | LoopedLM, inputs: list[list[int]], temperatures: tuple[float, ...], max_new_tokens: int
) -> pa.Table:
    """Batch 1: each input decoded sequentially and with SPEED at each temperature (sentence i samples with
    seed i), with coupled and argmax guesses when sampling; the variants alternate per sentence in a rotating
    order, so that a loaded machine slows them alike. One row per variant (``SAMPLING_BENCH_SCHEMA``)."""
    variants = [("sequential", t, "") for t in temperatures]
    variants += [("speed", t, g) for t in temperatures for g in (("greedy",) if t == 0 else ("coupled", "argmax"))]
    seconds = {v: 0.0 for v in variants}
    stats = {v: DecodeStats() for v in variants}  # each variant's counters over the sentences
    identical = {v: True for v in variants}
    for i, ids in enumerate(inputs):
        x = torch.tensor([ids])
        out: dict[tuple[str, float, str], list[list[int]]] = {}
        for k in range(len(variants)):
            v = variants[(i + k) % len(variants)]
            method, t, guess = v
            sampling = Sampling(temperature=t, seed=i, coupled=guess != "argmax")
            t0 = time.perf_counter()
            result = generate(
                model,
                x,
                options=DecodeOptions(method=method, max_new_tokens=max_new_tokens, trace=False, sampling=sampling),
            )
            seconds[v] += time.perf_counter() - t0
            out[v] = result.tokens
            stats[v] += result.stats
        for v in variants:
            identical[v] &= out[v] == out[("sequential", v[1], "")]
        if (i + 1) % 10 == 0 or i + 1 == len(inputs):
            shown = ", ".join(
                f"T={t} {m}{'/' + g if g else ''} {stats[m, t, g].group_passes / stats[m, t, g].tokens:.2f}"
                for m, t, g in variants
            )
            print(f"  {i + 1}/{len(inputs)} sentences; passes per token: {shown}", flush=True)
    rows = [
        {
            "temperature": t,
            "method": method,
            "guess": guess,
            "sentences": len(inputs),
            "tokens": stats[v].tokens,
            "passes_per_token": stats[v].group_passes / stats[v].tokens,
            "flushes": stats[v].flushes,
            "seconds": seconds[v],
            "ms_per_token": seconds[v] * 1000 / stats[v].tokens,
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
