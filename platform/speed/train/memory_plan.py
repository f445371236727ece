"""The memory plan of a training job: what one worker's device holds in a step, printed before any worker starts.

Parameters, gradients and optimizer state follow the strategy: DDP keeps all of them on every worker; FSDP
(``speed.train.sharding``) keeps 1/world of each, plus the unsharded copies of the units it computes (the root's,
and two blocks': the one running and the one prefetched) in the compute dtype. Activations are what autograd keeps
for the backward pass, counted per token from the block's own operations (``block_floats``): the inputs and
outputs its norms, projections, attention (a flash kernel's: queries, keys, values, output, log-sum-exp; no score
matrix) and feed-forward save; per loop the injection, the loop norm and the exit (final norm, head input, the
log-probabilities over the vocabulary). Activation checkpointing keeps a block's input alone (``block``) or a loop's
(``loop``), and adds one recomputed block or loop while the backward pass runs. A truncated recurrence keeps the
last K loops' (``speed.train.recurrence``).

The looped LM's counts are checked against the peak a step's allocations reach on the CPU, under DDP and under
FSDP on two workers (``speed.benchmarks.train_memory``, tests/test_train_memory.py); the T5's follow the same
reading of its layers and are not checked against a measurement.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from math import prod
from typing import TYPE_CHECKING

import torch

from speed.config import LMConfig, ModelConfig
from speed.models.family import build_model
from speed.train.recurrence import max_loops
from speed.train.sharding import shard_units

if TYPE_CHECKING:  # the plan reads a job's fields; the GPU check plans without the job's dependencies
    from speed.train.config import JobConfig

GIB = 2**30
FLOAT32 = 4
SLACK = 1.10  # the refusal's margin over the plan: the allocator's fragmentation and the framework's own buffers


class PlanRefused(ValueError):
    """A job whose worker's share of memory would not fit its device (one line, before any worker starts)."""


@dataclass(frozen=True)
class StepShape:
    """What a worker's step holds depends on: the model, the micro-batch, the strategy, checkpointing, truncation."""

    model: ModelConfig | LMConfig
    micro_batch: int  # sequences per forward pass on one worker
    source_len: int  # a T5's encoder tokens; a looped LM's: its row's tokens (``target_len`` 0)
    target_len: int
    world: int = 1
    strategy: str = "ddp"
    checkpointing: str = "none"
    optimizer: str = "adamw"
    gpu_bf16: bool = False  # bf16 compute on a GPU (autocast under DDP, FSDP's precision policy)
    recurrence_sampling: bool = False
    backprop_depth: int | None = None
    gate: bool = False  # Ouro's gate objective

    @property
    def seq_len(self) -> int:
        return self.source_len + self.target_len


def step_shape(job: JobConfig) -> StepShape:
    """A training job's ``StepShape``: its longest sequences (a looped LM's packed row, or prompt plus answer)."""
    d, t, packed = job.data, job.train, isinstance(job.model, LMConfig) and job.data.pack
    return StepShape(
        model=job.model,
        micro_batch=job.micro_batch,
        source_len=d.max_source_len,
        target_len=0 if packed else d.max_target_len,
        world=job.scale.num_workers,
        strategy=job.scale.strategy,
        checkpointing=t.checkpoint_activations,
        optimizer=job.optim.name,
        gpu_bf16=job.scale.use_gpu and t.bf16,
        recurrence_sampling=t.recurrence_sampling,
        backprop_depth=t.backprop_depth,
        gate=t.loss_weights == "gate",
    )


@dataclass(frozen=True)
class MemoryPlan:
    """Bytes one worker holds at the peak of a step (``total``), by kind."""

    strategy: str
    world: int
    checkpointing: str
    micro_batch: int  # sequences per forward pass
    seq_len: int  # tokens per sequence (the longest the data allows)
    loops: int  # loops whose activations are kept (M, the backprop depth, or the sampled draw's cap)
    parameter_count: int
    parameters: int  # the worker's (sharded) parameters, with FSDP's unsharded working copies
    gradients: int
    optimizer: int
    per_layer: int  # activations one layer pass keeps, for the micro-batch
    per_loop: int  # one loop's kept activations (its layers, injection, loop norm and exit)
    activations: int  # the step's kept activations, at the end of the forward pass
    logits: int  # one loop's logits and their gradient, at once when the backward pass starts
    recompute: int  # one block's or loop's activations recomputed in the backward pass (checkpointing)
    last_exit: int  # the last loop's exit, freed before the first recomputation
    buckets: int  # DDP's gradient buckets (a second copy of the gradients), 0 for one worker or FSDP

    @property
    def total(self) -> int:
        """The peak: the forward pass's end (everything kept, the first logits' gradient), a recomputation in the
        backward pass (everything kept but the last exit), or the step's end (every gradient, the optimizer)."""
        states = self.parameters + self.optimizer
        forward_end = states + self.activations + self.logits
        backward = states + self.activations - self.last_exit + self.recompute
        step_end = states + self.gradients + self.buckets
        return max(forward_end, backward, step_end)

    def lines(self) -> list[str]:
        """The plan as printed before a job starts."""
        head = (
            f"memory plan per worker ({self.strategy}, {self.world} worker(s), checkpointing {self.checkpointing}, "
            f"micro-batch {self.micro_batch} x {self.seq_len} tokens, {self.loops} loops kept, "
            f"{self.parameter_count / 1e6:.1f}M parameters):"
        )
        rows = [
            ("parameters", self.parameters),
            ("gradients", self.gradients),
            ("optimizer state", self.optimizer),
            ("activations per layer", self.per_layer),
            ("activations per loop", self.per_loop),
            ("activations", self.activations),
            ("logits and gradient", self.logits),
            ("recomputed", self.recompute),
            ("peak", self.total),
        ]
        return [head, *(f"  {name:<22} {gib(value):>10}" for name, value in rows)]


def gib(n: int) -> str:
    return f"{n / GIB:.3f} GiB"


def plan_memory(job: JobConfig) -> MemoryPlan:
    """The plan of a training job's step on one worker."""
    return plan_step(step_shape(job))


def plan_step(shape: StepShape, compute_bytes: int | None = None) -> MemoryPlan:
    """The plan of one worker's step of ``shape``; ``compute_bytes`` the activations' element size (default: 2 with
    bf16 on a GPU, else 4)."""
    act = compute_bytes or (2 if shape.gpu_bf16 else FLOAT32)
    world, fsdp = shape.world, shape.strategy == "fsdp"
    with torch.device("meta"):
        model = build_model(shape.model)
    sizes = [tuple(p.shape) for p in model.parameters()]  # tied weights once
    count = sum(prod(s) for s in sizes)
    optimizer = sum(_optimizer_floats(s, shape.optimizer) for s in sizes) * FLOAT32
    tokens = shape.micro_batch * shape.seq_len
    if isinstance(shape.model, LMConfig):
        per_layer, per_loop, kept, loops, recompute, last_exit = _lm_activations(shape, shape.model, tokens, act)
    else:
        per_layer, per_loop, kept, loops, recompute, last_exit = _t5_activations(shape, shape.model, act)
    parameters, gradients = count * FLOAT32, count * FLOAT32
    if fsdp:
        gathered = 2 if shape.gpu_bf16 else FLOAT32  # the compute dtype of gathered parameters
        blocks = shard_units(model)
        unit = max((sum(p.numel() for p in b.parameters()) for b in blocks), default=0) * gathered
        in_units = {id(p): p.numel() for b in blocks for p in b.parameters()}
        root = (count - sum(in_units.values())) * gathered
        parameters = _share(parameters, world) + root + 2 * unit
        gradients = _share(gradients, world) + root + unit
        optimizer = _share(optimizer, world)
    elif shape.gpu_bf16:
        parameters += count * 2  # autocast's bfloat16 copies of the weights, cached for the step
    return MemoryPlan(
        strategy=shape.strategy,
        world=world,
        checkpointing=shape.checkpointing,
        micro_batch=shape.micro_batch,
        seq_len=shape.seq_len,
        loops=loops,
        parameter_count=count,
        parameters=parameters,
        gradients=gradients,
        optimizer=optimizer,
        per_layer=per_layer,
        per_loop=per_loop,
        activations=kept,
        logits=2 * tokens * shape.model.vocab_size * FLOAT32,
        recompute=recompute,
        last_exit=last_exit,
        buckets=gradients if world > 1 and not fsdp else 0,
    )


def check_fits(plan: MemoryPlan, device_bytes: int | None) -> None:
    """Raise ``PlanRefused`` (one line) when the plan, with ``SLACK``, exceeds ``device_bytes``; None: unknown."""
    if device_bytes is not None and plan.total * SLACK > device_bytes:
        raise PlanRefused(
            f"a worker needs {gib(plan.total)} (the plan above, x{SLACK} margin) but its device holds "
            f"{gib(device_bytes)}: shard it (--strategy fsdp, more workers), --checkpoint-activations block, "
            "or a smaller --batch-size / --grad-accum split"
        )


def block_floats(c: LMConfig) -> int:
    """Values per token one looped-LM block keeps for its backward pass (see the module docstring).

    Each RMS norm keeps its input, its reciprocal RMS and its normalised input before the gain; attention keeps
    the rotated queries, the keys and values (copies repeated per query head under grouped queries, else the
    keys and the fused projection they are views of), the output and its log-sum-exp; the feed-forward its
    normed input, the fused gate and up projection, silu(gate) and the product. ``sandwich`` and ``residual``
    norms add one norm per sublayer.
    """
    d, H, K, D, F = c.d_model, c.n_heads, c.n_kv_heads, c.head_dim, c.d_ff
    norms = 2 + (2 if c.norm != "pre" else 0)
    norm_floats = norms * (2 * d + 1)
    inputs = 2 * d  # the normed inputs of the qkv and wi projections
    if H == K:
        attention = H * D + K * D + (H + 2 * K) * D + H * D + H
    else:
        attention = 4 * H * D + H
    return norm_floats + inputs + attention + 4 * F


def _lm_activations(shape: StepShape, c: LMConfig, tokens: int, act: int) -> tuple[int, int, int, int, int, int]:
    """(per layer, per loop, kept, loops kept, recomputed, last exit) bytes of a looped LM's step."""
    s, depth = c.sharing, shape.backprop_depth
    if shape.recurrence_sampling or depth is not None:
        loops = max_loops(s.n_loops, depth) if shape.recurrence_sampling else min(depth, s.n_loops)
        exits = 1  # only the last loop's exit
    else:
        loops, exits = s.n_loops, s.n_loops
    d, V = c.d_model, c.vocab_size
    layer = block_floats(c) * tokens * act
    exit_floats = (3 * d + 1) * tokens * act + tokens * V * FLOAT32  # final norm, head input; log-probabilities
    if shape.gate:
        exit_floats += tokens * V * FLOAT32  # the per-token losses keep a second log-softmax
    loop_extra = ((2 * d if c.injection else 0) + (2 * d + 1 if c.loop_norm else 0)) * tokens * act
    layers_per_loop = s.n_unique + s.coda
    per_loop = layers_per_loop * layer + loop_extra + exit_floats
    prelude = s.prelude * layer + d * tokens * act  # and the embedding's output
    if shape.checkpointing == "block":
        kept_loop = layers_per_loop * d * tokens * act + loop_extra + exit_floats
        prelude, recompute = s.prelude * d * tokens * act, layer
    elif shape.checkpointing == "loop":
        # the loop's input; its output is the loop norm's input and the exit's (both counted)
        kept_loop = d * tokens * act + (2 * d + 1 if c.loop_norm else 0) * tokens * act + exit_floats
        recompute = layers_per_loop * layer + loop_extra
    else:
        kept_loop, recompute = per_loop, 0
    kept_exits = exits * exit_floats
    kept = prelude + loops * (kept_loop - exit_floats) + kept_exits
    return layer, per_loop, kept, loops, recompute, exit_floats


def _t5_activations(shape: StepShape, c: ModelConfig, act: int) -> tuple[int, int, int, int, int, int]:
    """The same reading for a T5: its encoder once over the sources, its decoder's N layers M times over the targets,
    attention as T5 computes it (scores and probabilities kept, (H, L) per token)."""
    d, H, F = c.d_model, c.n_heads, c.d_ff
    inner = H * c.d_kv
    S, T, seqs = shape.source_len, shape.target_len, shape.micro_batch
    enc = (3 * (2 * d + 1) + 2 * d + 4 * inner + 2 * H * S + 4 * F) * seqs * S * act
    dec = (4 * (2 * d + 1) + 3 * d + 6 * inner + 2 * H * (T + S) + 4 * F) * seqs * T * act
    s = c.sharing
    exit_floats = ((3 * d + 1) * act + c.vocab_size * FLOAT32) * seqs * T
    per_loop = s.n_unique * dec + exit_floats
    kept = c.n_encoder_layers * enc + s.n_loops * per_loop
    return dec, per_loop, kept, s.n_loops, 0, exit_floats


def _optimizer_floats(shape: tuple[int, ...], name: str) -> int:
    """Optimizer state values of one parameter: AdamW's two moments; Adafactor's row and column factors of a
    matrix (a vector's full second moment)."""
    if name == "adamw":
        return 2 * prod(shape)
    if len(shape) >= 2:
        return prod(shape[:-1]) + prod(shape[:-2]) * shape[-1]
    return prod(shape)


def _share(n: int, world: int) -> int:
    return -(-n // world)


def device_memory(job: JobConfig) -> int | None:
    """One worker's device memory: ``scale.device_memory_gb``; else this machine's first GPU's (a GPU job) or, for a
    CPU job on a local Ray, its available memory shared by the workers; None where it cannot be known here (a
    cluster's workers run elsewhere: ``$RAY_ADDRESS``)."""
    if job.scale.device_memory_gb is not None:
        return int(job.scale.device_memory_gb * GIB)
    if job.scale.use_gpu:
        return torch.cuda.get_device_properties(0).total_memory if torch.cuda.is_available() else None
    if os.environ.get("RAY_ADDRESS"):
        return None
    import psutil

    return psutil.virtual_memory().available // job.scale.num_workers
