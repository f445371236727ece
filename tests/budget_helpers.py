"""A tiny training run's directory made in-process (no Ray): kept ``checkpoint_<step>`` training checkpoints."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pyarrow as pa

from speed.models.looped_lm import LoopedLM
from speed.models.t5 import SpeedT5
from speed.train.state import TrainingState, checkpoint_name, mark_complete, save_training_checkpoint
from speed.train.train_log import TRAIN_LOG_SCHEMA

STEPS = (2, 4, 6)
TOKENS_PER_STEP = 10


def make_run(
    folder: Path,
    model_at: Callable[[int], SpeedT5 | LoopedLM],
    tokenizer: Path,
    task: str,
    steps: tuple[int, ...] = STEPS,
    every: int = 2,
    keep: int = 3,
) -> Path:
    """A run directory as a finetuning job leaves it: ``checkpoint_<step>`` training checkpoints (the model
    ``model_at(step)`` at each) with the job's task and checkpoint settings, the train log (``TOKENS_PER_STEP``
    tokens a step) and the completion marker."""
    for step in steps:
        log = pa.Table.from_pylist(
            [{"step": s, "loss": 1.0, "loop_losses": [1.0], "lr": 1e-3, "grad_norm": 1.0, "tokens": TOKENS_PER_STEP,
              "step_time_s": 0.1, "tokens_per_s": 100.0, "elapsed_s": 0.1 * s, "restarts": 0}
             for s in range(1, step + 1)],
            schema=TRAIN_LOG_SCHEMA,
        )  # fmt: skip
        job = {
            "data": {"task": task, "max_source_len": 64},
            "train": {"checkpoint_every": every, "keep_checkpoints": keep},
        }
        checkpoint = folder / checkpoint_name(step)
        save_training_checkpoint(checkpoint, model_at(step), tokenizer, job, TrainingState(step, {}, {}, [], log))
        mark_complete(str(checkpoint), step)
    return folder
