"""``train_loop_per_worker``: what every Ray Train worker runs.

DDP through ``ray.train.torch.prepare_model``, or FSDP2 (``--strategy fsdp``: ``speed.train.sharding``, sharded
checkpoints); each worker memory-maps the
corpus the driver prepared (``speed.data.shards``) and trains on its own
shard of every global batch (``speed.train.batches``); AdamW or Adafactor with
warm-up plus decay; gradient clipping and accumulation; bf16 autocast on GPU;
the shared early-exit loss ``L_w = sum_i w_i L_i``, plus ``lambda_t * S`` when
``train.settle`` asks for the agreement term (``speed.losses.SettleConfig``), or Ouro's gate objective
(``--loss-weights gate``); for the looped LM activation checkpointing and Huginn's sampled, truncated recurrence
(``speed.models.looped_lm.TrainRun``, ``speed.train.recurrence``). Rank 0 logs every loop's
loss and tokens/s (also to MLflow: ``speed.train.tracking``), and writes checkpoints reported through
``ray.train.report``.
A worker (re)started by Ray, or a rerun of the same command, resumes from the
run's newest complete checkpoint on storage; a ``--resume`` run from the
checkpoint it names.
"""

from __future__ import annotations

import math
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import pyarrow as pa
import ray.train
import ray.train.torch
import torch
import torch.distributed as dist
from torch import nn

from speed.config import LMConfig
from speed.data.corpus import open_corpus
from speed.hf_tokenizer import unpack_tokenizer
from speed.losses import GATE, loss_weights, settled_loss
from speed.models.checkpoint import (
    TOKENIZER_FILE,
    local_checkpoint,
)
from speed.models.family import build_model
from speed.models.form import get_form
from speed.models.looped_lm import LoopedLM, TrainRun
from speed.models.pretrained import load_pretrained
from speed.models.t5 import SpeedT5
from speed.train import tracking
from speed.train.batches import BatchPlan
from speed.train.config import JobConfig, TrainConfig, job_from_dict
from speed.train.optim import build_optimizer, build_scheduler, follow_parameters
from speed.train.origin import hub_origin
from speed.train.recurrence import sample_recurrence
from speed.train.sharding import (
    grad_norm_value,
    is_sharded,
    shard_model,
)
from speed.train.train_log import (
    TRAIN_LOG_SCHEMA,
    StepRecord,
    eta_seconds,
    progress_line,
    window_mean,
)
from speed.train.worker_checkpoint import (
    WorkerContext,
    own_checkpoint,
    restore,
    save_checkpoint,
    seed_worker,
    unwrap,
)

_PACE_WINDOW = 20  # steps averaged for the ETA
HANG_LIMIT_S = 900.0  # train.hang_at_step: a hang nobody ended fails the run after this long


class InjectedFailure(RuntimeError):
    """The failure ``train.fail_at_step`` asks for (fault-tolerance tests and drills), or a ``train.hang_at_step``
    hang that nobody ended."""


def _hang(rank: int, step: int) -> None:
    """``train.hang_at_step``: stop before step ``step + 1``, as a worker on a lost or frozen node would, so a
    drill can end the node while the run is at a known checkpoint; fails after ``HANG_LIMIT_S``."""
    if rank == 0:
        print(f"hanging before step {step + 1} (train.hang_at_step) until this worker is ended", flush=True)
    time.sleep(HANG_LIMIT_S)
    raise InjectedFailure(f"rank {rank} hung before step {step + 1} (train.hang_at_step), and nothing ended it")


def initial_model(job: JobConfig, load_init: bool = True) -> SpeedT5 | LoopedLM:
    """A fresh model of the job's family (seeded), or the weights of ``init_from`` (a speed checkpoint, an imported
    LM's directory read by ``load_pretrained``, or a T5 v1.1: ``hf:`` or a Hugging Face directory,
    ``speed.train.origin.hub_origin``)."""
    torch.manual_seed(job.train.seed)
    if job.init_from is None or not load_init:
        return build_model(job.model)
    hub = hub_origin(job.init_from)
    if hub is not None:  # the job's pattern, not the directory's: the form re-loops the layers
        model = get_form(hub.form).hub_model(hub.name, job.model.pattern)
    else:
        with local_checkpoint(job.init_from) as directory:
            model = load_pretrained(directory, exits=False).model  # its backbone: exit adapters are trained apart
    if model.config != job.model:
        raise ValueError(f"--init-from {job.init_from} holds model {model.config}, but the job resolved {job.model}")
    return model.train()


def train_loop_per_worker(config: dict[str, Any]) -> None:
    """Train this worker's share of the job (in a scratch folder removed at the end, also on failure).

    ``config``: ``job`` (a resolved JobConfig dict), ``tokenizer`` (``speed.hf_tokenizer.pack_tokenizer``'s bytes),
    ``corpus`` (the prepared training split: a path or URI), ``deadline`` (Unix time or None) and
    ``run_dir`` (this run's directory on storage: its newest checkpoint there resumes it).
    """
    with tempfile.TemporaryDirectory(prefix="speed-worker-") as workdir, tracking.session(config["job"]):
        _work(config, Path(workdir))


def _work(config: dict[str, Any], workdir: Path) -> None:
    job = job_from_dict(config["job"])
    ray_ctx = ray.train.get_context()
    rank, world = ray_ctx.get_world_rank(), ray_ctx.get_world_size()
    torch.set_num_threads(job.train.num_threads or max(1, int(job.scale.cpus_per_worker)))
    tokenizer_path = unpack_tokenizer(config["tokenizer"], workdir / "tokenizer", TOKENIZER_FILE)

    corpus = open_corpus(config["corpus"])
    plan = BatchPlan(
        corpus.lengths,
        job.train.batch_size,
        world,
        rank,
        job.train.grad_accum,
        job.train.seed,
        job.train.group_by_length,
    )
    own = own_checkpoint(config["run_dir"], world)  # this run's newest, if any
    resuming = own is not None or job.resume is not None
    model = initial_model(job, load_init=not resuming)  # resumed weights come from the checkpoint
    device = ray.train.torch.get_device()
    fsdp = job.scale.strategy == "fsdp"
    if fsdp:  # the same seeded (or loaded) weights on every worker, each keeping its shard
        model = shard_model(model, world, device, job.train.bf16)
    optimizer = build_optimizer(model, job.optim)
    scheduler = build_scheduler(optimizer, job.optim, job.train.max_steps)
    seed_worker(job.train.seed, rank)
    ctx = WorkerContext(
        job=job,
        rank=rank,
        world=world,
        device=device,
        model=model,
        optimizer=optimizer,
        scheduler=scheduler,
        plan=plan,
        corpus=corpus,
        # A prepared validation split (sweeps): rank 0 adds every loop's validation loss to each report (not
        # under FSDP, whose forward is every worker's at once).
        validation=open_corpus(config["validation"]) if rank == 0 and config.get("validation") and not fsdp else None,
        tokenizer_path=tokenizer_path,
        tokenizer=config["tokenizer"],
        deadline=config.get("deadline"),
    )

    history = TRAIN_LOG_SCHEMA.empty_table()
    step = 0
    if resuming:
        origin = own if own is not None else job.resume
        with local_checkpoint(origin) as directory:
            step, history = restore(ctx, Path(directory))
        if rank == 0:
            print(f"resumed at step {step} from {origin}", flush=True)
    if rank == 0:
        print(
            f"{len(corpus)} training examples, {plan.steps_per_epoch} steps/epoch, {world} worker(s) x "
            f"{job.train.grad_accum} micro-batches of {job.micro_batch}; {ctx.device}",
            flush=True,
        )
    if not fsdp:  # on a GPU prepare_model moves the parameters there
        unused = {"find_unused_parameters": True} if _may_skip_parameters(job) else None
        ctx = replace(ctx, model=ray.train.torch.prepare_model(model, parallel_strategy_kwargs=unused))
        if step:  # the restored optimizer state went to the parameters' device at load (the CPU)
            follow_parameters(ctx.optimizer)
    _train(ctx, step, history, resumed_own=own is not None)


def _may_skip_parameters(job: JobConfig) -> bool:
    """Whether a step may leave parameters without a gradient, which DDP must then look for: an exit gate that a
    weight scheme never reads, or a truncated recurrence (without injection its prelude feeds only the loops run
    without gradients)."""
    t, model = job.train, job.model
    if not isinstance(model, LMConfig):
        return False
    gate_unread = model.exit_gate and t.loss_weights != GATE
    return gate_unread or t.recurrence_sampling or t.backprop_depth is not None


@dataclass(frozen=True)
class StepSums:
    """What the workers add up after each optimizer step, in one all-reduce: each loop's loss (summed over this
    worker's micro-batches / their count), the tokens trained, rank 0's out-of-time flag, the settle term's sum."""

    loop_losses: torch.Tensor  # (M,) on the training device
    tokens: float
    out_of_time: float  # 1.0 on rank 0 once its time budget is spent, else 0.0
    settle: torch.Tensor  # () on the training device
    objective: torch.Tensor  # () the trained loss (over micro-batches, like loop_losses): the gate objective's log

    def summed(self, world: int) -> StepSums:
        """These sums over every worker (the same values when ``world`` is 1)."""
        if world == 1:
            return self
        n = self.loop_losses.numel()
        extra = [torch.tensor(self.tokens), torch.tensor(self.out_of_time), self.settle.cpu(), self.objective.cpu()]
        packed = torch.cat([self.loop_losses, torch.stack(extra).to(self.loop_losses.device)])
        dist.all_reduce(packed)
        return StepSums(packed[:n], float(packed[n]), float(packed[n + 1]), packed[n + 2], packed[n + 3])


def _train(ctx: WorkerContext, step: int, history: pa.Table, resumed_own: bool) -> None:
    """The step loop, from ``step`` to ``max_steps`` (or a clean early stop), checkpointing on the way.

    ``history``: the log of the steps before ``step``; ``resumed_own``: this run's checkpoint of ``step``
    (not another run's) was restored, so it is on storage already.
    """
    job, model, optimizer, scheduler = ctx.job, ctx.model, ctx.optimizer, ctx.scheduler
    plan, corpus, rank, world, device, deadline = ctx.plan, ctx.corpus, ctx.rank, ctx.world, ctx.device, ctx.deadline
    t, family = job.train, job.family
    sharded = is_sharded(model)
    lm = isinstance(unwrap(model), LoopedLM)
    shape = job.run_shape if lm else TrainRun()
    n_loops = unwrap(model).n_loops
    n_exits = 1 if t.recurrence_sampling or shape.last_only else n_loops  # Huginn's: the last loop's loss alone
    weights = None  # the gate objective's weights are each token's exit distribution
    if t.loss_weights != GATE:
        weights = (torch.ones(1) if n_exits == 1 else loss_weights(t.loss_weights, n_loops)).to(device)
    bf16 = device.type == "cuda" and t.bf16 and not sharded  # FSDP's precision policy casts its own
    autocast = torch.autocast("cuda", dtype=torch.bfloat16) if bf16 else nullcontext()
    clip = job.optim.grad_clip if job.optim.grad_clip > 0 else math.inf
    last_step = min(t.max_steps, t.stop_at_step or t.max_steps)
    launched = time.perf_counter()
    records: list[StepRecord] = []
    saved_at = step if resumed_own else None  # this run's checkpoint of ``step`` is on storage already
    restarts = history.column("restarts")[-1].as_py() + 1 if history.num_rows else 0

    while step < last_step:
        if t.fail_at_step == step + 1 and not resumed_own and rank == world - 1:
            raise InjectedFailure(f"injected failure on rank {rank} before step {step + 1} (train.fail_at_step)")
        if t.hang_at_step == step + 1 and not resumed_own:
            _hang(rank, step)
        started = time.perf_counter()
        model.train()
        micro = plan.micro_batches(step)
        epoch = plan.epoch_at(step)  # span-corruption noise is drawn anew each epoch
        loop_sum = torch.zeros(n_exits, device=device)
        settle_sum = torch.zeros((), device=device)
        objective_sum = torch.zeros((), device=device)
        tokens = 0
        run = {"run": _step_run(shape, t, n_loops, step + 1)} if lm else {}
        for i, indices in enumerate(micro):
            batch = {k: v.to(device) for k, v in family.collate(corpus.examples(indices, epoch, t.seed)).items()}
            sync = world == 1 or i == len(micro) - 1  # all-reduce gradients once per optimizer step
            with _accumulating(model, sync):
                with autocast:  # the forward only; backward runs in the dtypes autocast chose
                    # the family's collate gives the forward's keyword arguments, labels among them
                    out = model(**batch, weights=weights, return_logits=t.settle.active, **run)
                    loss, settle = settled_loss(out.loss, out.loop_logits, batch["labels"], t.settle, step + 1)
                (loss / len(micro)).backward()
            loop_sum += out.loop_losses.detach().float()
            settle_sum += settle.detach().float() if settle is not None else 0.0
            objective_sum += out.loss.detach().float()
            tokens += family.tokens(batch)
        grad_norm = grad_norm_value(torch.nn.utils.clip_grad_norm_(model.parameters(), clip))
        lr = optimizer.param_groups[0]["lr"]
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        step += 1

        out_of_time = rank == 0 and deadline is not None and _past_deadline(deadline, records, started)
        objective = objective_sum / len(micro)
        total = StepSums(loop_sum / len(micro), float(tokens), float(out_of_time), settle_sum, objective).summed(world)
        loop_losses = (total.loop_losses / world).tolist()
        settle_term = float(total.settle) / (world * len(micro))
        elapsed = time.perf_counter() - started
        if weights is None:  # the gate objective: the loss trained, not a weighted sum of the loops'
            trained = float(total.objective) / world
        else:
            trained = float(sum(w * x for w, x in zip(weights.tolist(), loop_losses)))
        record = StepRecord(
            step=step,
            loss=trained,
            loop_losses=loop_losses,
            lr=lr,
            grad_norm=grad_norm,
            tokens=int(total.tokens),
            step_time_s=elapsed,
            tokens_per_s=float(total.tokens) / elapsed,
            elapsed_s=time.perf_counter() - launched,
            restarts=restarts,
        )
        records.append(record)
        stop = total.out_of_time > 0 or step >= last_step
        if rank == 0 and (step % t.log_every == 0 or stop):
            pace = sum(r.step_time_s for r in records[-_PACE_WINDOW:]) / len(records[-_PACE_WINDOW:])
            budget_left = deadline - time.time() if deadline is not None else None
            window = window_mean(records[-t.log_every :])  # the steps since the previous line
            print(progress_line(window, t.max_steps, eta_seconds(last_step - step, pace, budget_left)), flush=True)
            tracking.log_step(window)  # rank 0's MLflow run, when tracked
        if step % t.checkpoint_every == 0 or stop:
            save_checkpoint(ctx, step, history, records, settle_term)
            saved_at = step
        if stop:
            if rank == 0 and step < last_step:
                print(f"time budget of {t.time_budget_min} min reached: stopped at step {step}", flush=True)
            break
    if saved_at != step:  # nothing left to train (a finished run resumed): still leave a checkpoint here
        save_checkpoint(ctx, step, history, records)


def _step_run(shape: TrainRun, t: TrainConfig, n_loops: int, step: int) -> TrainRun:
    """The looped LM's forward for optimizer step ``step``: ``shape``, with Huginn's loop count drawn for the step
    (``train.recurrence_sampling``: the same draw on every worker and when resumed)."""
    if not t.recurrence_sampling:
        return shape
    drawn = sample_recurrence(n_loops, t.backprop_depth, t.seed, step)
    return replace(shape, loops=drawn.loops, backprop=drawn.backprop)


@contextmanager
def _accumulating(model: nn.Module, sync: bool) -> Iterator[None]:
    """A micro-batch's backward pass, its gradients reduced across workers only when ``sync`` (the last of a step):
    DDP's ``no_sync``, FSDP's ``set_requires_gradient_sync``."""
    if isinstance(model, nn.parallel.DistributedDataParallel) and not sync:
        with model.no_sync():
            yield
        return
    if is_sharded(model):
        model.set_requires_gradient_sync(sync)
    yield


def _past_deadline(deadline: float, records: list[StepRecord], started: float) -> bool:
    """Whether another step (at the recent pace) would overrun the wall-clock budget."""
    pace = records[-1].step_time_s if records else time.perf_counter() - started
    return time.time() + pace > deadline
