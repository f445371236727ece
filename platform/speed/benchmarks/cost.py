"""The engine's cost model on a trained checkpoint's held-out text (``jobs/bench_cost.py``): sequential decoding,
SPEED on every in-flight row and SPEED under the cost model, side by side at several batch sizes.
"""

from __future__ import annotations

import time
from collections.abc import Collection
from dataclasses import dataclass

import pyarrow as pa
import torch

from speed.data import pad_inputs
from speed.decode.generate import DecodeOptions, generate
from speed.engine import Speculation
from speed.engine.sampling import Sampling
from speed.tables import Column, text_table

COST_BENCH_SCHEMA = pa.schema(
    [
        pa.field("case", pa.string()),  # e.g. "b8 greedy", "b4 sampled branches"
        pa.field("batch", pa.int64()),
        pa.field("variant", pa.string()),  # sequential | speed | speed_cost
        pa.field("tokens", pa.int64()),
        pa.field("passes_per_token", pa.float64()),  # group passes (steps) per token, the batch's together
        pa.field("rows_per_token", pa.float64()),
        pa.field("closed_steps", pa.int64()),  # steps the cost model ran as sequential decoding
        pa.field("ms_per_token", pa.float64()),  # wall time over every token of the case
        pa.field("vs_sequential", pa.float64()),  # sequential's ms per token / this variant's: > 1 is faster
        pa.field("cpu_ms_per_token", pa.float64()),  # the process's CPU time over every token (others' load aside)
        pa.field("cpu_vs_sequential", pa.float64()),  # the same ratio on CPU time
        pa.field("identical", pa.bool_()),  # every output equals sequential decoding's
    ]
)
VARIANTS = ("sequential", "speed", "speed_cost")


@dataclass(frozen=True)
class CostCase:
    """One workload: a batch size, a sampling and SPEED's settings."""

    name: str
    batch: int
    sampling: Sampling = Sampling()
    speculation: Speculation = Speculation()


def run_cost_benchmark(
    model: torch.nn.Module,
    inputs: list[list[int]],
    cases: list[CostCase],
    max_new_tokens: int,
    pad_id: int,
    stop_ids: Collection[int] | None = None,
) -> pa.Table:
    """Each case's inputs in batches of its size, each batch decoded by every variant in a rotating order (so a
    loaded machine slows them alike); one row per (case, variant) (``COST_BENCH_SCHEMA``). ``trace`` is off, as in
    a server's or a benchmark's decoding."""
    rows = []
    for case in cases:
        seconds = dict.fromkeys(VARIANTS, 0.0)
        cpu = dict.fromkeys(VARIANTS, 0.0)
        counts = {v: [0, 0, 0, 0] for v in VARIANTS}  # tokens, passes, rows, closed steps
        identical = dict.fromkeys(VARIANTS, True)
        for k, start in enumerate(range(0, len(inputs), case.batch)):
            ids, mask = pad_inputs(inputs[start : start + case.batch], pad_id)
            out = {}
            for v in [VARIANTS[(k + j) % len(VARIANTS)] for j in range(len(VARIANTS))]:
                t0, c0 = time.perf_counter(), time.process_time()
                result = generate(
                    model,
                    ids,
                    mask,
                    DecodeOptions(
                        method="sequential" if v == "sequential" else "speed",
                        max_new_tokens=max_new_tokens,
                        speculation=case.speculation,
                        sampling=case.sampling,
                        trace=False,
                        cost_model=v == "speed_cost",
                        stop_ids=stop_ids,
                    ),
                )
                seconds[v] += time.perf_counter() - t0
                cpu[v] += time.process_time() - c0
                st = result.stats
                for i, n in enumerate((st.tokens, st.group_passes, st.rows, st.closed_steps)):
                    counts[v][i] += n
                out[v] = result.tokens
            for v in VARIANTS:
                identical[v] &= out[v] == out["sequential"]
        per_token = {v: seconds[v] / counts[v][0] * 1e3 for v in VARIANTS}
        cpu_per_token = {v: cpu[v] / counts[v][0] * 1e3 for v in VARIANTS}
        shown = ", ".join(f"{v} {per_token[v]:.2f}" for v in VARIANTS)
        print(f"  {case.name}: ms per token {shown}", flush=True)
        for v in VARIANTS:
            tokens, passes, n_rows, closed = counts[v]
            rows.append(
                {
                    "case": case.name,
                    "batch": case.batch,
                    "variant": v,
                    "tokens": tokens,
                    "passes_per_token": passes / tokens,
                    "rows_per_token": n_rows / tokens,
                    "closed_steps": closed,
                    "ms_per_token": per_token[v],
                    "vs_sequential": per_token["sequential"] / per_token[v],
                    "cpu_ms_per_token": cpu_per_token[v],
                    "cpu_vs_sequential": cpu_per_token["sequential"] / cpu_per_token[v],
                    "identical": identical[v],
                }
            )
    return pa.Table.from_pylist(rows, schema=COST_BENCH_SCHEMA)


COST_COLUMNS = (
    Column("case", 22, "case", left=True),
    Column("variant", 12, "variant", left=True),
    Column("tokens", 7, "tokens"),
    Column("passes/tok", 11, "passes_per_token", ".3f"),
    Column("rows/tok", 9, "rows_per_token", ".2f"),
    Column("closed", 8, "closed_steps"),
    Column("ms/token", 10, "ms_per_token", ".3f"),
    Column("vs seq", 8, "vs_sequential", ".2f", "x"),
    Column("cpu vs seq", 11, "cpu_vs_sequential", ".2f", "x"),
    Column("identical", 0, "identical", gap="  "),
)


def format_cost_table(table: pa.Table) -> str:
    """A fixed-width text table of the cost benchmark's rows."""
    return text_table(COST_COLUMNS, table.to_pylist())
