"""The GPU check's sharded-training stage: a few FSDP steps (one worker) of Ouro-1.4B's shape with random weights,
bfloat16 compute and activation checkpointing per block, as ``--strategy fsdp --checkpoint-activations block``
trains (``speed.train.sharding``); no Ray, so it runs where ``jobs/gpu_check.py`` does.

It reports the device's peak memory beside the memory plan's (``speed.train.memory_plan``), tokens per second
over the steps after the first, and every step's loss: the same random batch each step, so the loss must fall.
On an H100 it is meant to take well under a minute (not yet run on one); ``TINY`` runs it at a tiny shape on the
CPU (gloo), to check its logic.
"""

from __future__ import annotations

import math
import tempfile
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from speed.benchmarks.shapes import OURO_1_4B
from speed.config import LMConfig
from speed.models.convert_ouro import config_from_ouro
from speed.models.looped_lm import LoopedLM, TrainRun, next_token_labels
from speed.train.memory_plan import StepShape, plan_step
from speed.train.optim import OptimConfig, build_optimizer
from speed.train.sharding import grad_norm_value, shard_model


@dataclass(frozen=True)
class TrainCheckSize:
    """The stage's shape: ``FULL_TRAIN`` Ouro-1.4B's, ``TINY_TRAIN`` a CPU dry run's."""

    model: LMConfig
    batch: int
    seq_len: int
    steps: int
    lr: float = 3e-4


FULL_TRAIN = TrainCheckSize(config_from_ouro(OURO_1_4B), batch=4, seq_len=512, steps=6)
_TINY = {"hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2, "num_attention_heads": 4,
         "num_key_value_heads": 4, "head_dim": 16, "vocab_size": 128}  # fmt: skip
TINY_TRAIN = TrainCheckSize(config_from_ouro(OURO_1_4B | _TINY), batch=2, seq_len=16, steps=4, lr=3e-3)


@dataclass(frozen=True)
class ShardedTrainingRun:
    """What the stage measured."""

    parameters: int
    steps: int
    tokens_per_step: int
    losses: list[float]
    grad_norms: list[float]
    tokens_per_s: float  # over the steps after the first
    peak_memory_mb: float | None  # the device's peak allocation (CUDA), None on the CPU
    planned_mb: float  # the memory plan's peak for the same step

    @property
    def ok(self) -> bool:
        """Every loss finite and the last below the first."""
        return all(map(math.isfinite, self.losses)) and self.losses[-1] < self.losses[0]


def sharded_training_stage(size: TrainCheckSize, device: str) -> ShardedTrainingRun:
    """``size.steps`` AdamW steps of FSDP (world 1) with block checkpointing on ``device``, one fixed batch."""
    dev = torch.device(device)
    with tempfile.TemporaryDirectory(prefix="speed-gpu-train-") as scratch:
        dist.init_process_group(
            "nccl" if dev.type == "cuda" else "gloo", init_method=f"file://{scratch}/store", rank=0, world_size=1
        )
        try:
            return _train(size, dev)
        finally:
            dist.destroy_process_group()


def _train(size: TrainCheckSize, dev: torch.device) -> ShardedTrainingRun:
    torch.manual_seed(0)
    with torch.device(dev):
        model = LoopedLM(size.model).train()  # random weights, float32 masters; bf16 compute by the policy
    gpu = dev.type == "cuda"
    model = shard_model(model, 1, dev, bf16=gpu)
    optimizer = build_optimizer(model, OptimConfig(lr=size.lr))
    shape = StepShape(size.model, size.batch, size.seq_len, 0, strategy="fsdp", checkpointing="block", gpu_bf16=gpu)
    plan = plan_step(shape)
    generator = torch.Generator().manual_seed(1)
    ids = torch.randint(2, size.model.vocab_size, (size.batch, size.seq_len), generator=generator).to(dev)
    labels = next_token_labels(ids)
    run = TrainRun(checkpoint="block")
    if gpu:
        torch.cuda.reset_peak_memory_stats(dev)
    losses, norms, times = [], [], []
    for _ in range(size.steps):
        started = time.perf_counter()
        out = model(ids, labels, run=run)
        out.loss.backward()
        norms.append(grad_norm_value(torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)))
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(float(out.loss.detach()))  # a sync: the step is done
        times.append(time.perf_counter() - started)
    tokens = size.batch * size.seq_len
    timed = times[1:] or times
    return ShardedTrainingRun(
        parameters=sum(p.numel() for p in model.parameters()),
        steps=size.steps,
        tokens_per_step=tokens,
        losses=losses,
        grad_norms=norms,
        tokens_per_s=tokens * len(timed) / sum(timed),
        peak_memory_mb=torch.cuda.max_memory_allocated(dev) / 2**20 if gpu else None,
        planned_mb=plan.total / 2**20,
    )


def training_check(tiny: bool, device: str) -> ShardedTrainingRun:
    """The GPU check's stage: ``FULL_TRAIN`` on the device, ``TINY_TRAIN`` for a dry run."""
    return sharded_training_stage(TINY_TRAIN if tiny else FULL_TRAIN, device)


def describe(run: ShardedTrainingRun) -> str:
    """One line for the GPU check's table."""
    peak = f"peak {run.peak_memory_mb:.0f} MiB vs plan {run.planned_mb:.0f} MiB" if run.peak_memory_mb else (
        f"plan {run.planned_mb:.0f} MiB (no device peak on the CPU)"
    )
    return (
        f"FSDP x1, {run.parameters / 1e9:.2f}B parameters, {run.steps} steps of {run.tokens_per_step} tokens: loss "
        f"{run.losses[0]:.3f} -> {run.losses[-1]:.3f}, {run.tokens_per_s:.0f} tokens/s, {peak}"
    )
