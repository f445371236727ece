"""Training checkpoints: the model part (``speed.models.checkpoint``) plus the state that resumes a run exactly.

A training checkpoint directory holds
    model.pt, config.json, spm.model   speed.models.checkpoint.save_model (config.json: {"model", "job", "step"};
                                       an imported model's tokenizer/ in place of spm.model)
    train_state.pt                     step, optimizer, scheduler, every rank's RNG states, world size
    sharded/                           FSDP's runs (speed.train.sharding): model and optimizer state in shards, in
                                       place of model.pt and train_state.pt's optimizer (None there)
    train_log.parquet                  speed.train.train_log.TRAIN_LOG_SCHEMA, one row per step so far
    complete                           the step, written last (``mark_complete``): the checkpoint is whole
so ``speed.models.checkpoint.load_model(dir)`` (evaluation, serving) reads any of them.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.parquet as pq
import torch

from speed.hf_tokenizer import pack_tokenizer
from speed.models.checkpoint import CHECKPOINT_PREFIX, COMPLETE_FILE, checkpoint_tokenizer, save_model
from speed.models.looped_lm import LoopedLM
from speed.models.t5 import SpeedT5
from speed.paths import TRAIN_LOG_FILE
from speed.storage import locate
from speed.train.train_log import TRAIN_LOG_SCHEMA

TRAIN_STATE_FILE = "train_state.pt"


class IncompatibleCheckpointError(ValueError):
    """A checkpoint whose model, task, tokenizer or optimizer cannot continue the requested run."""


@dataclass
class TrainingState:
    """Everything besides the weights that continues a run exactly where a checkpoint left it."""

    step: int  # optimizer steps completed
    optimizer: dict[str, Any] | None  # None in a sharded checkpoint: its optimizer state is in sharded/
    scheduler: dict[str, Any]
    rng: list[dict[str, Any]]  # per rank: torch, CUDA and Python generator states
    log: pa.Table  # TRAIN_LOG_SCHEMA rows of steps 1..step


def checkpoint_name(step: int) -> str:
    """Directory name of the checkpoint after ``step`` optimizer steps (sorts by step)."""
    return f"{CHECKPOINT_PREFIX}{step:08d}"


def rng_state() -> dict[str, Any]:
    """This process's global random generator states (torch, CUDA, Python); data order needs none."""
    return {
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None,
        "python": random.getstate(),
    }


def set_rng_state(state: dict[str, Any]) -> None:
    """Restore states captured by ``rng_state``."""
    torch.set_rng_state(state["torch"])
    if state["cuda"] is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
    random.setstate(state["python"])


def save_training_checkpoint(
    directory: str | Path,
    model: SpeedT5 | LoopedLM,
    tokenizer_path: str | Path | None,
    job: dict[str, Any],
    state: TrainingState,
) -> Path:
    """Write a resumable checkpoint (model part via ``speed.models.checkpoint.save_model``) into ``directory``.

    ``job`` is the resolved job (``speed.train.config.job_to_dict``); without ``tokenizer_path`` the
    checkpoint holds no tokenizer (the GPU check's throwaway one, ``speed.benchmarks.gpu``). A state without an
    optimizer is a sharded checkpoint's: its weights and optimizer are written apart (``speed.train.sharding``).
    """
    directory = save_job_model(directory, model, tokenizer_path, job, state.step, weights=state.optimizer is not None)
    torch.save(
        {"step": state.step, "optimizer": state.optimizer, "scheduler": state.scheduler, "rng": state.rng},
        directory / TRAIN_STATE_FILE,
    )
    pq.write_table(state.log.cast(TRAIN_LOG_SCHEMA), directory / TRAIN_LOG_FILE)
    return directory


def save_job_model(
    directory: str | Path,
    model: SpeedT5 | LoopedLM,
    tokenizer_path: str | Path | None,
    job: dict[str, Any],
    step: int,
    weights: bool = True,
) -> Path:
    """The model part of a job's checkpoint (``speed.models.checkpoint.save_model``): weights, the tokenizer (an
    imported model's directory: its files in tokenizer/) and config.json ``{"model", "job", "step"}``, ``job`` the
    resolved job (``speed.train.config.job_to_dict``) whose split ``speed.train.exits`` trains adapters on."""
    job_dict = {key: value for key, value in job.items() if key != "model"}  # the model: config.json's "model"
    return save_model(Path(directory), model, tokenizer_path, {"job": job_dict, "step": step}, weights=weights)


def load_training_state(directory: str | Path) -> TrainingState:
    """The ``TrainingState`` of a local checkpoint directory; a missing file is named in the error."""
    directory = Path(directory)
    path = directory / TRAIN_STATE_FILE
    if not path.is_file():
        raise FileNotFoundError(
            f"{directory} has no {TRAIN_STATE_FILE}: it is a model checkpoint, not a training checkpoint "
            "(use --init-from to start a new run from its weights)"
        )
    raw = torch.load(path, map_location="cpu", weights_only=False)  # our own file: Python RNG tuples
    log_path = directory / TRAIN_LOG_FILE
    log = pq.read_table(log_path).cast(TRAIN_LOG_SCHEMA) if log_path.is_file() else TRAIN_LOG_SCHEMA.empty_table()
    return TrainingState(raw["step"], raw["optimizer"], raw["scheduler"], raw["rng"], log)


def check_compatible(saved: dict[str, Any], job: dict[str, Any], tokenizer_bytes: bytes, where: str) -> None:
    """Refuse a checkpoint (config.json dict) whose model, task, optimizer or tokenizer differs from ``job``'s.

    ``job`` is the resolved job of this run (``speed.train.config.job_to_dict``); ``tokenizer_bytes`` its
    tokenizer (``speed.hf_tokenizer.pack_tokenizer``).
    """
    problems = []
    ours = {key: value for key, value in job["model"].items() if key != "family"}
    theirs_family, our_family = saved.get("family", "t5"), job["model"].get("family", "t5")
    if theirs_family != our_family:
        problems.append(f"the model family is {theirs_family!r} there, {our_family!r} here")
    for key in sorted(set(ours) | set(saved.get("model", {}))):
        if saved.get("model", {}).get(key) != ours.get(key):
            problems.append(f"model.{key} is {saved.get('model', {}).get(key)!r} there, {ours.get(key)!r} here")
    saved_job = saved.get("job", {})
    for section, key in (("data", "task"), ("optim", "name")):
        theirs, mine = saved_job.get(section, {}).get(key), job[section][key]
        if theirs != mine:
            problems.append(f"{section}.{key} is {theirs!r} there, {mine!r} here")
    tokenizer = checkpoint_tokenizer(where, saved)
    if tokenizer is not None and pack_tokenizer(tokenizer) != tokenizer_bytes:
        problems.append(f"its tokenizer ({Path(tokenizer).name}) differs from this run's")
    if problems:
        raise IncompatibleCheckpointError(
            f"checkpoint {where} cannot continue this run: {'; '.join(problems)} (pass the settings it ran with, "
            "or start a new run from its weights: --init-from)"
        )


# ----- marking checkpoints complete (``speed.models.checkpoint`` finds them) ------------------------------


def checkpoint_uri(checkpoint: Any) -> str:
    """A ``ray.train.Checkpoint``'s location: a local path, or a URI on remote storage."""
    fs = checkpoint.filesystem
    if fs is None or isinstance(fs, pafs.LocalFileSystem):
        return checkpoint.path
    return f"{fs.type_name}://{checkpoint.path}"


def mark_complete(checkpoint: str, step: int) -> None:
    """Write the marker that says every file of ``checkpoint`` (a path or URI) is on storage: call it last."""
    (locate(checkpoint) / COMPLETE_FILE).write_text(f"{step}\n")
