"""Training checkpoints: the model part (``speed.checkpoint``) plus the state that resumes a run exactly.

A training checkpoint directory holds
    model.pt, config.json, spm.model   speed.checkpoint.save_model (config.json: {"model", "job", "step"})
    train_state.pt                     step, optimizer, scheduler, every rank's RNG states, world size
    train_log.parquet                  speed.train.progress.TRAIN_LOG_SCHEMA, one row per step so far
    complete                           the step, written last (``mark_complete``): the checkpoint is whole
so ``speed.checkpoint.load_model(dir)`` (evaluation, serving) reads any of them.
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.parquet as pq
import torch
from pyarrow.fs import FileType

from speed.checkpoint import CONFIG_FILE, TOKENIZER_FILE, save_model
from speed.model import SpeedT5
from speed.train.progress import TRAIN_LOG_SCHEMA

TRAIN_STATE_FILE = "train_state.pt"
TRAIN_LOG_FILE = "train_log.parquet"
CHECKPOINT_PREFIX = "checkpoint_"
COMPLETE_FILE = "complete"  # written after every other file of a checkpoint is on storage (holds the step)


class IncompatibleCheckpointError(ValueError):
    """A checkpoint whose model, task, tokenizer or optimizer cannot continue the requested run."""


@dataclass
class TrainingState:
    """Everything besides the weights that continues a run exactly where a checkpoint left it."""

    step: int  # optimizer steps completed
    optimizer: dict[str, Any]
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
    model: SpeedT5,
    tokenizer_path: str | Path,
    job: dict[str, Any],
    state: TrainingState,
) -> Path:
    """Write a resumable checkpoint (model part via ``speed.checkpoint.save_model``) into ``directory``.

    ``job`` is the resolved job (``speed.train.config.job_to_dict``).
    """
    directory = Path(directory)
    job_dict = {key: value for key, value in job.items() if key != "model"}  # the model: config.json's "model"
    save_model(directory, model, tokenizer_path, {"job": job_dict, "step": state.step})
    torch.save(
        {"step": state.step, "optimizer": state.optimizer, "scheduler": state.scheduler, "rng": state.rng},
        directory / TRAIN_STATE_FILE,
    )
    pq.write_table(state.log.cast(TRAIN_LOG_SCHEMA), directory / TRAIN_LOG_FILE)
    return directory


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


def read_checkpoint_config(directory: str | Path) -> dict[str, Any]:
    """A checkpoint's config.json (sections ``model``, ``job``, ``step``), from a local path or a URI."""
    fs, root = _filesystem(str(directory))
    path = f"{root}/{CONFIG_FILE}"
    if fs.get_file_info(path).type != FileType.File:
        raise FileNotFoundError(f"{directory} is not a checkpoint: it has no {CONFIG_FILE}")
    with fs.open_input_stream(path) as f:
        return json.loads(f.read().decode())


def check_compatible(saved: dict[str, Any], job: dict[str, Any], tokenizer_bytes: bytes, where: str) -> None:
    """Refuse a checkpoint (config.json dict) whose model, task, optimizer or tokenizer differs from ``job``'s.

    ``job`` is the resolved job of this run (``speed.train.config.job_to_dict``).
    """
    problems = []
    ours = job["model"]
    for key in sorted(set(ours) | set(saved.get("model", {}))):
        if saved.get("model", {}).get(key) != ours.get(key):
            problems.append(f"model.{key} is {saved.get('model', {}).get(key)!r} there, {ours.get(key)!r} here")
    saved_job = saved.get("job", {})
    for section, key in (("data", "task"), ("optim", "name")):
        theirs, mine = saved_job.get(section, {}).get(key), job[section][key]
        if theirs != mine:
            problems.append(f"{section}.{key} is {theirs!r} there, {mine!r} here")
    tokenizer = Path(where) / TOKENIZER_FILE
    if tokenizer.is_file() and tokenizer.read_bytes() != tokenizer_bytes:
        problems.append("its tokenizer (spm.model) differs from this run's")
    if problems:
        raise IncompatibleCheckpointError(f"checkpoint {where} cannot continue this run: " + "; ".join(problems))


# ----- locating checkpoints (local folders and URIs alike) ------------------------------------------


def _filesystem(uri: str) -> tuple[pafs.FileSystem, str]:
    if "://" not in uri:
        uri = str(Path(uri).expanduser().resolve())
    return pafs.FileSystem.from_uri(uri)


def checkpoint_uri(checkpoint: Any) -> str:
    """A ``ray.train.Checkpoint``'s location: a local path, or a URI on remote storage."""
    fs = checkpoint.filesystem
    if fs is None or isinstance(fs, pafs.LocalFileSystem):
        return checkpoint.path
    return f"{fs.type_name}://{checkpoint.path}"


def mark_complete(checkpoint: str, step: int) -> None:
    """Write the marker that says every file of ``checkpoint`` (a path or URI) is on storage: call it last."""
    fs, root = _filesystem(checkpoint)
    with fs.open_output_stream(f"{root}/{COMPLETE_FILE}") as f:
        f.write(f"{step}\n".encode())


def newest_complete_checkpoint(run_dir: str) -> str | None:
    """The newest ``checkpoint_*`` of a run directory that holds the completion marker; None when there is none.

    Checkpoints on storage, not Ray's ``checkpoint_manager_snapshot.json``, which
    lags them: a run stopped hard resumes at most one checkpoint interval back.
    """
    fs, root = _filesystem(run_dir)
    if fs.get_file_info(root).type != FileType.Directory:
        return None
    children = fs.get_file_info(pafs.FileSelector(root))
    names = [c.base_name for c in children if c.type == FileType.Directory]
    names = [name for name in names if name.startswith(CHECKPOINT_PREFIX)]
    for name in sorted(names, reverse=True):
        if fs.get_file_info(f"{root}/{name}/{COMPLETE_FILE}").type == FileType.File:
            return f"{run_dir.rstrip('/')}/{name}"
    return None


def latest_checkpoint(path: str) -> str:
    """``path`` itself when it is a checkpoint, else the newest complete ``checkpoint_*`` inside a run directory."""
    fs, root = _filesystem(path)
    info = fs.get_file_info(root)
    if info.type != FileType.Directory:
        raise FileNotFoundError(f"no checkpoint or run directory at {path}")
    if fs.get_file_info(f"{root}/{CONFIG_FILE}").type == FileType.File:
        return path
    newest = newest_complete_checkpoint(path)
    if newest is None:
        raise FileNotFoundError(f"{path} holds no {CONFIG_FILE} and no complete {CHECKPOINT_PREFIX}* directory")
    return newest


@contextmanager
def local_checkpoint(path: str) -> Iterator[Path]:
    """A checkpoint (or the newest one of a run) as a local directory, downloaded first when ``path`` is a URI."""
    from ray.train import Checkpoint

    uri = latest_checkpoint(path)
    if "://" not in uri:
        yield Path(uri).expanduser().resolve()
        return
    with Checkpoint(uri).as_directory() as local:
        yield Path(local)
