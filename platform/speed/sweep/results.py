"""The sweep's result files: one row per trial, the Pareto frontier, the frontier's measured latency.

``RESULTS_SCHEMA`` (``results.parquet``): every trial with its full resolved job
config and all its metrics; failed and early-stopped trials are rows too.
``FRONTIER_SCHEMA`` (``frontier.parquet``): the finished trials that no other
finished trial beats on both accuracy and SPEED cost. ``LATENCY_SCHEMA``
(``latency.parquet``): the frontier's checkpoints timed side by side.

SPEED cost is hardware independent: *layer steps per token*, the pipeline steps
a sequence needs per committed token times the N unique layers each step runs
(one step reads the group's weights once, for every token in flight). A
sequential NxM decoder costs N*M; a perfectly speculating one N. A looped LM's
``P+NxM+C`` (``layer_steps``) runs its coda in every loop's exit and its prelude
once per token: P + steps * (N + C), sequentially P + M(N + C). The best
launch loop, invalidation policy and lever setting (runner-up branches, confidence
gate) of each trial set its cost; the rows it computes per token are recorded
beside it (branches trade rows for steps).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import pyarrow as pa

from speed.config import SharingPattern
from speed.tables import Column, table_head, table_line, text_table

RESULTS_FILE = "results.parquet"
FRONTIER_FILE = "frontier.parquet"
LATENCY_FILE = "latency.parquet"

# measured; stopped early by the scheduler; raised an error; not done when the sweep was interrupted
STATUSES = ("finished", "stopped", "failed", "unfinished")

# SPEED's cost at one decoding setting, measured on the validation split at batch 1.
COST_TYPE = pa.struct(
    [
        pa.field("launch_loop", pa.int32()),  # 1..M
        pa.field("invalidation", pa.string()),  # eager | final
        # SPEED's levers (speed.engine.Request); null in a measurement from before they were swept (plain)
        pa.field("branches", pa.int32()),  # runner-up branches in flight (0: none)
        pa.field("branch_depth", pa.int32()),
        pa.field("min_confidence", pa.float64()),  # confidence gate of a launch (0: none)
        pa.field("steps_per_token", pa.float64()),  # pipeline steps per committed token
        pa.field("layer_steps_per_token", pa.float64()),  # layer_steps(pattern, steps_per_token): T5 steps * N
        pa.field("rows_per_token", pa.float64()),  # token-loops computed per committed token (branches add rows)
        pa.field("flushes_per_token", pa.float64()),
        pa.field("wasted_rows_per_token", pa.float64()),  # token-loops computed for flushed tokens
    ]
)

RESULTS_SCHEMA = pa.schema(
    [
        pa.field("sweep", pa.string(), nullable=False),
        pa.field("trial", pa.string(), nullable=False),  # deterministic: <index>-<pattern>-<loss weights>
        pa.field("status", pa.string(), nullable=False),  # one of STATUSES
        pa.field("error", pa.string()),  # the failure's last line (failed trials)
        pa.field("task", pa.string(), nullable=False),
        pa.field("family", pa.string()),  # t5 | lm (speed.models.family); null in sweeps written before the LM's
        pa.field("pattern", pa.string(), nullable=False),
        pa.field("n_unique", pa.int32(), nullable=False),  # N: unique layers of the looped core (the parameter count)
        pa.field("n_loops", pa.int32(), nullable=False),  # M
        # the sequential cost in layer steps per token: N*M (an LM's P+NxM+C: P + M(N + C), layer_steps)
        pa.field("depth", pa.int32(), nullable=False),
        pa.field("loss_weights", pa.string(), nullable=False),  # speed.losses scheme
        pa.field("settle", pa.string()),  # speed.losses.SettleConfig label: none, to_last:1, consecutive:3:fc, ...
        pa.field("job", pa.string(), nullable=False),  # the trial's resolved JobConfig as JSON
        pa.field("steps", pa.int64()),  # optimizer steps trained
        pa.field("train_loss", pa.float64()),  # weighted loss L_w at the last report
        pa.field("val_loss_last", pa.float64()),  # the last loop's validation loss (what the scheduler ranks)
        pa.field("val_loss_loops", pa.list_(pa.float64())),  # validation loss of every loop
        # teacher-forced on the validation split (speed.eval.validation): per loop, argmax changed from the
        # previous loop's; and the flip cost sum_k flip_prev(k) * (k - 1) (speed.losses.flip_cost)
        pa.field("val_flip_rate_prev", pa.list_(pa.float64())),
        pa.field("val_flip_cost", pa.float64()),
        pa.field("accuracy_metric", pa.string()),  # bleu (translation) | rougeL (summarization)
        pa.field("accuracy", pa.float64()),  # that metric, 0-100, on the validation split
        pa.field("bleu", pa.float64()),
        pa.field("chrf", pa.float64()),
        pa.field("rouge1", pa.float64()),
        pa.field("rouge2", pa.float64()),
        pa.field("rougeL", pa.float64()),
        pa.field("flip_rate_prev", pa.list_(pa.float64())),  # per loop: prediction changed from the previous loop
        pa.field("flip_rate_final", pa.list_(pa.float64())),  # per loop: prediction differs from the final token
        pa.field("flip_rate_loop1", pa.float64()),  # flip_rate_final of loop 1
        pa.field("flip_cost", pa.float64()),  # flip cost of the decoded tokens' flip_rate_prev
        pa.field("costs", pa.list_(COST_TYPE)),  # every launch loop 1..M x both invalidation policies
        pa.field("speed_cost", pa.float64()),  # best layer_steps_per_token over costs
        pa.field("speed_steps_per_token", pa.float64()),  # steps_per_token at that setting
        pa.field("best_launch_loop", pa.int32()),
        pa.field("best_invalidation", pa.string()),
        pa.field("best_branches", pa.int32()),  # the levers at that setting
        pa.field("best_branch_depth", pa.int32()),
        pa.field("best_min_confidence", pa.float64()),
        pa.field("speed_rows_per_token", pa.float64()),  # rows_per_token at that setting
        pa.field("examples", pa.int32()),  # validation examples decoded for the metrics
        pa.field("checkpoint", pa.string()),  # the trial's final training checkpoint
        # times its training resumed from a checkpoint (a retry after a lost node, a resumed sweep), from that
        # checkpoint's train log; null without one
        pa.field("restarts", pa.int32()),
    ]
)

# RESULTS_SCHEMA's columns of a frontier row; a finished trial has them all, but for these, null where unset
_FRONTIER_NULLABLE = ("settle", "best_branches", "best_branch_depth", "best_min_confidence", "flip_rate_loop1")
_FRONTIER_COLUMNS = ("trial", "pattern", "loss_weights", "settle", "accuracy_metric", "accuracy", "speed_cost")
_FRONTIER_COLUMNS += ("speed_steps_per_token", "depth", "best_launch_loop", "best_invalidation", "best_branches")
_FRONTIER_COLUMNS += ("best_branch_depth", "best_min_confidence", "flip_rate_loop1", "checkpoint")
FRONTIER_SCHEMA = pa.schema(
    [RESULTS_SCHEMA.field(name).with_nullable(name in _FRONTIER_NULLABLE) for name in _FRONTIER_COLUMNS]
)

LATENCY_SCHEMA = pa.schema(
    [
        pa.field("trial", pa.string(), nullable=False),
        pa.field("pattern", pa.string(), nullable=False),
        pa.field("variant", pa.string(), nullable=False),  # speed | sequential | shallow (a trained Nx1 trial)
        pa.field("launch_loop", pa.int32()),  # SPEED only
        pa.field("invalidation", pa.string()),  # SPEED only
        pa.field("branches", pa.int32()),  # SPEED only
        pa.field("branch_depth", pa.int32()),  # SPEED only
        pa.field("min_confidence", pa.float64()),  # SPEED only
        pa.field("ms_per_token", pa.float64(), nullable=False),  # median over the interleaved rounds
        pa.field("ms_per_token_min", pa.float64(), nullable=False),
        pa.field("speedup_vs_sequential", pa.float64()),  # the same checkpoint's sequential ms / this ms
        pa.field("ratio_vs_shallow", pa.float64()),  # this ms / the shallow decoder's (when one was trained)
        pa.field("tokens", pa.int64(), nullable=False),  # committed tokens per round
        pa.field("steps", pa.int64(), nullable=False),  # pipeline steps per round (batch 1, summed over inputs)
        pa.field("rows", pa.int64(), nullable=False),  # rows (token-loops) per round
        pa.field("reps", pa.int32(), nullable=False),
        pa.field("threads", pa.int32(), nullable=False),
    ]
)


def layer_steps(pattern: SharingPattern | str, steps_per_token: float) -> float:
    """Layer steps per token of ``steps_per_token`` pipeline steps: each step runs the N core layers and the C coda
    layers of an exit (a looped LM's coda is part of every exit), the P prelude layers run once per token. T5's
    ``NxM``: steps * N; sequential decoding (M steps per token): the pattern's sequential cost."""
    p = SharingPattern.parse(pattern) if isinstance(pattern, str) else pattern
    return p.prelude + steps_per_token * (p.n_unique + p.coda)


def sequential_layers(pattern: SharingPattern | str) -> int:
    """The sequential cost of a pattern in layer steps per token: N*M, or P + M(N + C)."""
    p = SharingPattern.parse(pattern) if isinstance(pattern, str) else pattern
    return int(layer_steps(p, p.n_loops))


def pareto_front(points: Sequence[tuple[float, float]]) -> list[int]:
    """Indices of the points (accuracy, cost) no other point dominates, by increasing cost.

    A point dominates another when its accuracy is at least as high and its cost
    at most as high, one of them strictly. Of exact duplicates the first is kept.
    """
    order = sorted(range(len(points)), key=lambda i: (points[i][1], -points[i][0], i))
    front: list[int] = []
    best = -float("inf")
    for i in order:
        if points[i][0] > best:
            front.append(i)
            best = points[i][0]
    return front


def frontier(results: pa.Table) -> pa.Table:
    """The Pareto frontier (accuracy against speed_cost) of the finished trials in a ``RESULTS_SCHEMA`` table."""
    rows = [r for r in results.to_pylist() if r["status"] == "finished" and r["accuracy"] is not None]
    keep = pareto_front([(r["accuracy"], r["speed_cost"]) for r in rows])
    names = FRONTIER_SCHEMA.names
    return pa.Table.from_pylist([{k: rows[i][k] for k in names} for i in keep], schema=FRONTIER_SCHEMA)


def _maybe(key: str, spec: str) -> Callable[[dict[str, Any]], str]:
    """A cell of ``key`` in ``spec``, "-" where the row has none."""
    return lambda r: _num(r[key], spec)


RESULTS_COLUMNS = (
    Column("trial", 36, "trial", left=True),
    Column("status", 9, "status"),
    Column("steps", 6, _maybe("steps", "d")),
    Column("val L_M", 9, _maybe("val_loss_last", ".3f")),
    Column("metric", 8, lambda r: r["accuracy_metric"] or ""),
    Column("score", 7, _maybe("accuracy", ".2f")),
    Column("flip@1", 8, _maybe("flip_rate_loop1", ".3f")),
    Column("flipcost", 9, _maybe("val_flip_cost", ".3f")),
    Column("steps/tok", 10, _maybe("speed_steps_per_token", ".2f")),
    Column("cost", 7, _maybe("speed_cost", ".2f")),
    Column("depth", 6, "depth"),
    Column("best setting", 0, lambda r: _setting(r) if r["best_launch_loop"] else "", gap="  "),
)
FRONTIER_COLUMNS = (
    Column("trial", 36, "trial", left=True),
    Column("metric", 8, "accuracy_metric"),
    Column("score", 7, "accuracy", ".2f"),
    Column("cost", 7, "speed_cost", ".2f"),
    Column("steps/tok", 10, "speed_steps_per_token", ".2f"),
    Column("depth", 6, "depth"),
    Column("flip@1", 8, _maybe("flip_rate_loop1", ".3f")),
    Column("setting", 0, lambda r: _setting(r), gap="  "),
)
LATENCY_COLUMNS = (
    Column("trial", 36, "trial", left=True),
    Column("variant", 11, "variant"),
    Column("setting", 12, lambda r: _latency_setting(r)),
    Column("ms/token", 10, "ms_per_token", ".2f"),
    Column("vs seq", 8, lambda r: _ratio(r["speedup_vs_sequential"])),
    Column("vs shallow", 11, lambda r: _ratio(r["ratio_vs_shallow"])),
    Column("steps", 7, "steps"),
)


def format_results(results: pa.Table) -> str:
    """A fixed-width text table of every trial: status, losses, accuracy, flip rate at loop 1, SPEED cost."""
    lines = table_head(RESULTS_COLUMNS)
    for r in sorted(results.to_pylist(), key=lambda r: r["trial"]):
        lines.append(table_line(RESULTS_COLUMNS, r))
        if r["error"]:
            lines.append(f"{'':<36}error: {r['error']}")
    return "\n".join(lines)


def format_frontier(table: pa.Table) -> str:
    """The frontier as a fixed-width text table, cheapest first."""
    return text_table(FRONTIER_COLUMNS, table.to_pylist())


def format_latency(table: pa.Table) -> str:
    """The latency stage's rows as a fixed-width text table."""
    return text_table(LATENCY_COLUMNS, table.to_pylist())


def _latency_setting(r: dict[str, Any]) -> str:
    """A latency row's levers, compactly: launch loop and invalidation, branches, confidence."""
    setting = f"{r['launch_loop']},{r['invalidation']}" if r["launch_loop"] else ""
    setting += f",b{r['branches']}x{r['branch_depth']}" if r["branches"] else ""
    setting += f",c{r['min_confidence']:g}" if r["min_confidence"] else ""
    return setting


def _setting(row: dict[str, Any]) -> str:
    """A results or frontier row's best setting in words (the levers only when set)."""
    text = f"launch {row['best_launch_loop']}, {row['best_invalidation']}"
    if row.get("best_branches"):
        text += f", {row['best_branches']} branches x {row['best_branch_depth']}"
    if row.get("best_min_confidence"):
        text += f", confidence >= {row['best_min_confidence']:g}"
    return text


def _num(value: Any, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def _ratio(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}x"
