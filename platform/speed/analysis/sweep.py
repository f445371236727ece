"""A sweep's trade-off: accuracy against SPEED cost, flip rates per loop, cost per launch loop, latency.

``jobs/sweep.py`` writes ``results.parquet`` (``RESULTS_SCHEMA``, one row per
trial), ``frontier.parquet`` and, after its latency stage, ``latency.parquet``
into the sweep's folder. These functions turn them into the long tables the
sweep notebook draws: one row per finished trial, per (trial, loop) and per
(trial, launch loop, invalidation policy). A trial's *recipe* is its loss-weight
scheme plus its settle term (``speed.losses.SettleConfig``), the levers the
figures colour by.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from speed.sweep.results import FRONTIER_FILE, LATENCY_FILE, RESULTS_FILE, RESULTS_SCHEMA, pareto_front

TRIALS_SCHEMA = pa.schema(
    [
        pa.field("trial", pa.string()),
        pa.field("pattern", pa.string()),
        pa.field("loss_weights", pa.string()),
        pa.field("settle", pa.string()),  # SettleConfig label (none for sweeps written before it)
        pa.field("recipe", pa.string()),  # loss_weights, plus " + settle <label>" when there is a settle term
        pa.field("n_unique", pa.int32()),
        pa.field("n_loops", pa.int32()),
        pa.field("depth", pa.int32()),  # sequential cost, layer steps per token
        pa.field("accuracy_metric", pa.string()),
        pa.field("accuracy", pa.float64()),
        pa.field("val_loss_last", pa.float64()),
        pa.field("flip_rate_loop1", pa.float64()),
        pa.field("val_flip_cost", pa.float64()),  # teacher-forced flip cost on the validation split
        pa.field("flip_cost", pa.float64()),  # flip cost of the decoded tokens
        pa.field("launch1_steps_per_token", pa.float64()),  # SPEED's steps per token at launch loop 1, eager
        pa.field("speed_steps_per_token", pa.float64()),  # at the best setting
        pa.field("speed_cost", pa.float64()),  # SPEED's layer steps per token at the best setting
        pa.field("saving", pa.float64()),  # depth / speed_cost: SPEED's reduction of layer steps
        pa.field("best_launch_loop", pa.int32()),
        pa.field("best_invalidation", pa.string()),
        pa.field("best_branches", pa.int32()),  # runner-up branches at the best setting (null: not measured)
        pa.field("best_min_confidence", pa.float64()),
        pa.field("speed_rows_per_token", pa.float64()),  # rows per token at the best setting
        pa.field("on_frontier", pa.bool_()),
    ]
)


@dataclass(frozen=True)
class Sweep:
    """One sweep's folder and its tables (frontier and latency None when not written)."""

    path: Path
    results: pa.Table  # RESULTS_SCHEMA
    frontier: pa.Table | None
    latency: pa.Table | None

    @property
    def name(self) -> str:
        return self.path.name


def load_sweep(path: str | Path) -> Sweep:
    """Read the files ``jobs/sweep.py`` wrote into the sweep folder ``path``."""
    path = Path(path)
    if not (path / RESULTS_FILE).is_file():
        raise FileNotFoundError(f"{path} holds no {RESULTS_FILE}: not a sweep folder")
    extra = {
        name: pq.read_table(path / name) if (path / name).is_file() else None for name in (FRONTIER_FILE, LATENCY_FILE)
    }
    return Sweep(path, pq.read_table(path / RESULTS_FILE), extra[FRONTIER_FILE], extra[LATENCY_FILE])


def _finished(results: pa.Table) -> list[dict]:
    rows = results.filter(pc.equal(results["status"], "finished")).to_pylist()
    return [r for r in rows if r["accuracy"] is not None]


def trials(results: pa.Table) -> pa.Table:
    """One row per finished trial (``TRIALS_SCHEMA``), cheapest SPEED cost first; ``on_frontier`` marks the
    trials no other finished trial beats on both accuracy and SPEED cost."""
    rows = _finished(results)
    front = set(pareto_front([(r["accuracy"], r["speed_cost"]) for r in rows]))
    out = [
        {name: r.get(name) for name in TRIALS_SCHEMA.names}
        | {"settle": r.get("settle") or "none", "recipe": recipe(r["loss_weights"], r.get("settle"))}
        | {"launch1_steps_per_token": _launch1(r["costs"])}
        | {"saving": r["depth"] / r["speed_cost"] if r["speed_cost"] else None, "on_frontier": i in front}
        for i, r in enumerate(rows)
    ]
    out.sort(key=lambda r: (r["speed_cost"], -r["accuracy"], r["trial"]))
    return pa.Table.from_pylist(out, schema=TRIALS_SCHEMA)


def recipe(loss_weights: str, settle: str | None) -> str:
    """``linear`` or ``linear + settle consecutive:3:fc``: what a trial trained with, besides its pattern."""
    return loss_weights if settle in (None, "none") else f"{loss_weights} + settle {settle}"


def _launch1(costs: list[dict]) -> float | None:
    launch1 = (c for c in _plain(costs) if (c["launch_loop"], c["invalidation"]) == (1, "eager"))
    return next((c["steps_per_token"] for c in launch1), None)


def _plain(costs: list[dict]) -> list[dict]:
    """The costs of plain SPEED: no runner-up branches, no confidence gate (null: measured before the levers)."""
    return [c for c in costs if not c.get("branches") and not c.get("min_confidence")]


def loop_flips(results: pa.Table) -> pa.Table:
    """One row per (finished trial, loop 1..M): the flip rate from the previous loop and against the final token."""
    rows = []
    for r in _finished(results):
        for loop, (prev, final) in enumerate(zip(r["flip_rate_prev"], r["flip_rate_final"]), start=1):
            rows.append(
                {"trial": r["trial"], "pattern": r["pattern"], "loss_weights": r["loss_weights"], "loop": loop,
                 "flip_rate_prev": prev, "flip_rate_final": final}
            )  # fmt: skip
    schema = pa.schema(
        [("trial", pa.string()), ("pattern", pa.string()), ("loss_weights", pa.string()), ("loop", pa.int32()),
         ("flip_rate_prev", pa.float64()), ("flip_rate_final", pa.float64())]
    )  # fmt: skip
    return pa.Table.from_pylist(rows, schema=schema)


def launch_costs(results: pa.Table) -> pa.Table:
    """One row per (finished trial, launch loop, invalidation policy): plain SPEED's steps and flushes per token
    (the settings with branches or a confidence gate are in ``results``' ``costs``)."""
    rows = []
    for r in _finished(results):
        for c in _plain(r["costs"]):
            rows.append({"trial": r["trial"], "pattern": r["pattern"], "loss_weights": r["loss_weights"], **c})
    fields = [pa.field(n, pa.string()) for n in ("trial", "pattern", "loss_weights")]
    schema = pa.schema(fields + list(RESULTS_SCHEMA.field("costs").type.value_type))
    return pa.Table.from_pylist(rows, schema=schema).sort_by(
        [("trial", "ascending"), ("invalidation", "ascending"), ("launch_loop", "ascending")]
    )
