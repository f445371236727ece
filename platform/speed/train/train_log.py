"""The per-step training log (an Arrow schema) and the progress line a person follows."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import pyarrow as pa

from speed.progress import format_duration

# One row per optimizer step; saved as train_log.parquet in every training checkpoint.
TRAIN_LOG_SCHEMA = pa.schema(
    [
        pa.field("step", pa.int64(), nullable=False),  # optimizer steps completed
        pa.field("loss", pa.float32(), nullable=False),  # L_w = sum_i w_i L_i, mean over workers
        pa.field("loop_losses", pa.list_(pa.float32()), nullable=False),  # L_1..L_M, mean over workers
        pa.field("lr", pa.float64(), nullable=False),
        pa.field("grad_norm", pa.float32(), nullable=False),  # before clipping
        pa.field("tokens", pa.int64(), nullable=False),  # non-pad source + target tokens, all workers
        pa.field("step_time_s", pa.float64(), nullable=False),
        pa.field("tokens_per_s", pa.float64(), nullable=False),
        pa.field("elapsed_s", pa.float64(), nullable=False),  # wall clock of this launch so far
        pa.field("restarts", pa.int32(), nullable=False),  # resumes (failures, --resume) before this step
    ]
)


@dataclass(frozen=True)
class StepRecord:
    """One optimizer step's measurements (a TRAIN_LOG_SCHEMA row)."""

    step: int
    loss: float
    loop_losses: list[float]
    lr: float
    grad_norm: float
    tokens: int
    step_time_s: float
    tokens_per_s: float
    elapsed_s: float
    restarts: int


def records_to_table(records: list[StepRecord]) -> pa.Table:
    """Step records as a TRAIN_LOG_SCHEMA table."""
    columns = {name: [getattr(r, name) for r in records] for name in TRAIN_LOG_SCHEMA.names}
    return pa.table(columns, schema=TRAIN_LOG_SCHEMA)


def eta_seconds(steps_left: int, seconds_per_step: float, budget_left_s: float | None) -> float:
    """Time to the end of the run: remaining steps at the recent pace, capped by a wall-clock budget."""
    eta = steps_left * seconds_per_step
    return min(eta, budget_left_s) if budget_left_s is not None else eta


def window_mean(records: list[StepRecord]) -> StepRecord:
    """The last record with its losses averaged over ``records`` and tokens/s over their total time.

    Progress lines show this for the steps since the previous line: one step's
    loss on one batch is too noisy to follow a run by.
    """
    n = len(records)
    loops = [sum(r.loop_losses[i] for r in records) / n for i in range(len(records[-1].loop_losses))]
    seconds = sum(r.step_time_s for r in records)
    return dataclasses.replace(
        records[-1],
        loss=sum(r.loss for r in records) / n,
        loop_losses=loops,
        tokens_per_s=sum(r.tokens for r in records) / seconds if seconds > 0 else records[-1].tokens_per_s,
        step_time_s=seconds / n,
    )


def progress_line(record: StepRecord, max_steps: int, eta_s: float) -> str:
    """``step 40/200 | loss 5.123 | L_i 6.01 5.80 ... | lr 8.0e-04 | 1234 tok/s | 2.10 s/step | ETA 5m36s``."""
    loops = " ".join(f"{x:.3f}" for x in record.loop_losses)
    return (
        f"step {record.step}/{max_steps} | loss {record.loss:.4f} | L_i {loops} | lr {record.lr:.2e} | "
        f"gnorm {record.grad_norm:.2f} | {record.tokens_per_s:.0f} tok/s | {record.step_time_s:.2f} s/step | "
        f"ETA {format_duration(eta_s)}"
    )
