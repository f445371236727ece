"""What one training worker holds (``WorkerContext``, built once by ``speed.train.loop``) and its checkpoints:
finding the run's newest on storage (``own_checkpoint``), restoring from one (``restore``: weights, optimizer,
scheduler, this rank's RNG), and writing one (``save_checkpoint``: every rank reports, rank 0 writes, or every
worker its FSDP shards), its completion marker written once it is all on storage (``upload_with_marker``).
"""

from __future__ import annotations

import random
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pyarrow as pa
import ray.train
import torch
import torch.distributed as dist
from torch import nn

from speed.data.corpus import TokenizedCorpus
from speed.eval.validation import validation_metrics
from speed.models.checkpoint import MODEL_FILE, SHARDED_DIR, newest_complete_checkpoint, read_checkpoint_config
from speed.models.looped_lm import LoopedLM
from speed.models.t5 import SpeedT5
from speed.train import tracking
from speed.train.batches import BatchPlan
from speed.train.config import JobConfig, job_to_dict
from speed.train.optim import lr_factor
from speed.train.sharding import is_sharded, load_sharded, local_bytes, optimizer_tensors, save_sharded
from speed.train.state import (
    IncompatibleCheckpointError,
    TrainingState,
    check_compatible,
    checkpoint_name,
    checkpoint_uri,
    load_training_state,
    mark_complete,
    rng_state,
    save_training_checkpoint,
    set_rng_state,
)
from speed.train.train_log import StepRecord, records_to_table


@dataclass(frozen=True)
class WorkerContext:
    """What one worker's steps, checkpoints and restore read; built once by ``speed.train.loop``."""

    job: JobConfig
    rank: int
    world: int
    device: torch.device
    model: nn.Module  # Ray's prepare_model of it (on ``device``; DDP when world > 1) once restored, or FSDP's
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    plan: BatchPlan  # this rank's share of every global batch
    corpus: TokenizedCorpus  # the prepared training split
    validation: TokenizedCorpus | None  # rank 0 only, when the job has a prepared validation split (sweeps)
    tokenizer_path: Path  # this worker's copy of the run's tokenizer (spm.model or a folder), in every checkpoint
    tokenizer: bytes  # its contents: a checkpoint with another tokenizer cannot continue the run
    deadline: float | None  # Unix time of the wall-clock budget; None: no budget


def unwrap(model: nn.Module) -> SpeedT5 | LoopedLM:
    return model.module if isinstance(model, nn.parallel.DistributedDataParallel) else model


def seed_worker(seed: int, rank: int) -> None:
    """Distinct, reproducible dropout and sampling streams per rank (after the shared model init)."""
    torch.manual_seed(seed * 10_007 + rank + 1)
    random.seed(seed * 10_007 + rank + 1)


def own_checkpoint(run_dir: str, world: int) -> str | None:
    """This run's newest complete checkpoint on storage (path or URI), as rank 0 sees it; None when it has none yet.

    Not Ray's registered checkpoint, which lags the markers (``upload_with_marker``).
    """
    chosen = [None]
    if ray.train.get_context().get_world_rank() == 0:
        chosen = [newest_complete_checkpoint(run_dir)]
    if world > 1:
        dist.broadcast_object_list(chosen, src=0)  # every rank resumes from the same step
    return chosen[0]


def restore(ctx: WorkerContext, directory: Path) -> tuple[int, pa.Table]:
    """Load weights, optimizer, scheduler and this rank's RNG from a training checkpoint; returns (step, log)."""
    job = ctx.job
    check_compatible(read_checkpoint_config(directory), job_to_dict(job), ctx.tokenizer, str(directory))
    state = load_training_state(directory)
    sharded = (directory / SHARDED_DIR).is_dir()
    if sharded != is_sharded(ctx.model):  # a run continues with the strategy it ran with
        ran, other = ("fsdp", "ddp") if sharded else ("ddp", "fsdp")
        raise IncompatibleCheckpointError(
            f"{directory} is a {ran} checkpoint: resume it with --strategy {ran} (or start a {other} run from its "
            "weights: --init-from)"
        )
    if sharded:  # each worker reads what its shards need
        load_sharded(directory, ctx.model, ctx.optimizer)
    else:
        unwrap(ctx.model).load_state_dict(torch.load(directory / MODEL_FILE, map_location="cpu", weights_only=True))
        ctx.optimizer.load_state_dict(state.optimizer)
    ctx.scheduler.load_state_dict(state.scheduler)
    # The schedule follows this run's config (its lr and max_steps), not the one saved.
    ctx.scheduler.base_lrs = [job.optim.lr] * len(ctx.optimizer.param_groups)
    for group in ctx.optimizer.param_groups:
        group["initial_lr"] = job.optim.lr
        group["lr"] = job.optim.lr * lr_factor(state.step, job.optim, job.train.max_steps)
    if len(state.rng) == ctx.world:
        set_rng_state(state.rng[ctx.rank])
    else:  # another worker count: the data order still resumes exactly, dropout streams restart
        seed_worker(job.train.seed + state.step, ctx.rank)
    return state.step, state.log


def save_checkpoint(
    ctx: WorkerContext,
    step: int,
    history: pa.Table,
    records: list[StepRecord],
    settle_term: float | None = None,
) -> None:
    """Every rank reports (a barrier); rank 0 alone writes the checkpoint, with every rank's RNG state.

    ``history`` and ``records``: the log before this launch and this launch's steps. The report holds the
    last step's losses (with ``train.settle``: ``settle_loss``, the term S, and ``settle_weight``, lambda at
    that step) and, with a validation split, ``speed.eval.validation``'s metrics.
    """
    job = ctx.job
    rngs = [rng_state()]
    if ctx.world > 1:
        rngs = [None] * ctx.world
        dist.all_gather_object(rngs, rng_state())
    last = records[-1] if records else None
    metrics: dict[str, Any] = {"step": step}
    if last is not None:
        metrics |= {"loss": last.loss, "tokens_per_s": last.tokens_per_s, "lr": last.lr}
        metrics |= {f"loss_loop{i + 1}": x for i, x in enumerate(last.loop_losses)}
        if job.train.settle.active and settle_term is not None:
            metrics |= {"settle_loss": settle_term, "settle_weight": job.train.settle.weight_at(step)}
    if ctx.validation is not None:
        metrics |= validation_metrics(unwrap(ctx.model), job.family, ctx.validation, job.micro_batch)
    metrics |= held_bytes(ctx)
    tracking.log_report(step, metrics)  # rank 0: the validation metrics and the settle term, when tracked
    if is_sharded(ctx.model):
        save_sharded_checkpoint(ctx, step, history, records, rngs, metrics)
        return
    with tempfile.TemporaryDirectory() as tmp:
        checkpoint = None
        if ctx.rank == 0:
            log = pa.concat_tables([history, records_to_table(records)])
            state = TrainingState(step, ctx.optimizer.state_dict(), ctx.scheduler.state_dict(), rngs, log)
            save_training_checkpoint(tmp, unwrap(ctx.model), ctx.tokenizer_path, job_to_dict(job), state)
            checkpoint = ray.train.Checkpoint.from_directory(tmp)
        name = checkpoint_name(step)
        upload = upload_with_marker(step)
        ray.train.report(metrics, checkpoint=checkpoint, checkpoint_dir_name=name, checkpoint_upload_fn=upload)


def held_bytes(ctx: WorkerContext) -> dict[str, int]:
    """The most parameter and optimizer-state bytes any worker holds now (measured on each: a shard's own), so a
    run's reports say what sharding saved."""
    held = torch.tensor(
        [local_bytes(list(ctx.model.parameters())), local_bytes(optimizer_tensors(ctx.optimizer))],
        dtype=torch.float64,
    )
    if ctx.world > 1:
        held = held.to(ctx.device)
        dist.all_reduce(held, op=dist.ReduceOp.MAX)
    return {"worker_parameter_bytes": int(held[0]), "worker_optimizer_bytes": int(held[1])}


def save_sharded_checkpoint(
    ctx: WorkerContext,
    step: int,
    history: pa.Table,
    records: list[StepRecord],
    rngs: list[dict[str, Any]],
    metrics: dict[str, Any],
) -> None:
    """FSDP's checkpoint: every worker uploads its shards (``speed.train.sharding.save_sharded``) and rank 0 the
    rest (config, scheduler, RNG states, log) into the same folder; once all are on storage, rank 0 marks it
    complete and reports it."""
    name = checkpoint_name(step)
    storage = ray.train.get_context().get_storage()
    with tempfile.TemporaryDirectory() as tmp:
        save_sharded(tmp, ctx.model, ctx.optimizer)
        if ctx.rank == 0:
            log = pa.concat_tables([history, records_to_table(records)])
            state = TrainingState(step, None, ctx.scheduler.state_dict(), rngs, log)
            save_training_checkpoint(tmp, ctx.model, ctx.tokenizer_path, job_to_dict(ctx.job), state)
        persisted = storage.persist_current_checkpoint(ray.train.Checkpoint.from_directory(tmp), name)
    dist.barrier()  # every worker's shards are on storage
    checkpoint = persisted if ctx.rank == 0 else None

    def mark(uploaded: ray.train.Checkpoint, dir_name: str) -> ray.train.Checkpoint:
        mark_complete(checkpoint_uri(uploaded), step)
        return uploaded

    ray.train.report(metrics, checkpoint=checkpoint, checkpoint_dir_name=name, checkpoint_upload_fn=mark)


def upload_with_marker(step: int) -> Callable[[ray.train.Checkpoint, str], ray.train.Checkpoint]:
    """Ray's upload of a checkpoint, then its completion marker.

    The marker is written as soon as every file is on storage, before the report
    reaches Ray's controller (which a killed driver never lets happen), so a run
    stopped hard loses at most the interval since its last upload.
    """
    storage = ray.train.get_context().get_storage()

    def upload(checkpoint: ray.train.Checkpoint, dir_name: str) -> ray.train.Checkpoint:
        persisted = storage.persist_current_checkpoint(checkpoint, dir_name)
        mark_complete(checkpoint_uri(persisted), step)
        return persisted

    return upload
