"""Optimizers (AdamW, torch's Adafactor), their config, and the warm-up plus decay learning-rate schedule.

Imports torch alone (no Ray, no data libraries): ``speed.benchmarks.gpu`` trains with it where neither is installed.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch
from torch import nn

OPTIMIZERS = ("adamw", "adafactor")
SCHEDULES = ("cosine", "linear", "constant", "rsqrt")


@dataclass(frozen=True)
class OptimConfig:
    """Optimiser and learning-rate schedule (linear warm-up, then ``schedule`` decay to ``min_lr_ratio``)."""

    name: str = "adamw"  # adamw | adafactor (torch.optim.Adafactor)
    lr: float = 1e-3
    weight_decay: float = 0.01
    betas: tuple[float, float] = (0.9, 0.98)  # AdamW only
    warmup_steps: int = 50
    schedule: str = "cosine"  # cosine | linear | constant | rsqrt
    min_lr_ratio: float = 0.1  # floor of the decay, as a fraction of lr
    grad_clip: float = 1.0  # max global gradient norm; 0 disables clipping

    def __post_init__(self) -> None:
        object.__setattr__(self, "betas", tuple(self.betas))
        if self.name not in OPTIMIZERS:
            raise ValueError(f"unknown optimizer {self.name!r}; choose one of {list(OPTIMIZERS)}")
        if self.schedule not in SCHEDULES:
            raise ValueError(f"unknown schedule {self.schedule!r}; choose one of {list(SCHEDULES)}")
        if self.lr <= 0:
            raise ValueError(f"OptimConfig.lr must be positive, got {self.lr}")
        if self.warmup_steps < 0 or self.grad_clip < 0 or self.weight_decay < 0:
            raise ValueError("OptimConfig.warmup_steps, grad_clip and weight_decay must be >= 0")
        if not 0.0 <= self.min_lr_ratio <= 1.0:
            raise ValueError(f"OptimConfig.min_lr_ratio must be in [0, 1], got {self.min_lr_ratio}")
        if len(self.betas) != 2:
            raise ValueError(f"OptimConfig.betas must be two numbers, got {self.betas}")


def lr_factor(step: int, config: OptimConfig, max_steps: int) -> float:
    """Multiplier of the peak lr after ``step`` scheduler steps: linear warm-up, then the configured decay.

    Warm-up reaches 1.0 at ``warmup_steps``; the decay ends at ``min_lr_ratio`` on ``max_steps``
    (``rsqrt``: T5's inverse square root, floored at ``min_lr_ratio``).
    """
    warmup = config.warmup_steps
    if step < warmup:
        return (step + 1) / warmup
    floor = config.min_lr_ratio
    if config.schedule == "constant":
        return 1.0
    if config.schedule == "rsqrt":
        return max(floor, math.sqrt(max(warmup, 1) / (step + 1)))
    progress = min(1.0, (step - warmup) / max(1, max_steps - warmup))
    if config.schedule == "linear":
        return floor + (1.0 - floor) * (1.0 - progress)
    return floor + (1.0 - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))  # cosine


def build_optimizer(model: nn.Module, config: OptimConfig) -> torch.optim.Optimizer:
    """AdamW or Adafactor over ``model``; weight decay only on matrices (not on norm scales)."""
    matrices = [p for p in model.parameters() if p.requires_grad and p.dim() >= 2]
    vectors = [p for p in model.parameters() if p.requires_grad and p.dim() < 2]
    groups = [{"params": matrices, "weight_decay": config.weight_decay}, {"params": vectors, "weight_decay": 0.0}]
    if config.name == "adamw":
        return torch.optim.AdamW(groups, lr=config.lr, betas=config.betas)
    return torch.optim.Adafactor(groups, lr=config.lr)


def build_scheduler(
    optimizer: torch.optim.Optimizer, config: OptimConfig, max_steps: int
) -> torch.optim.lr_scheduler.LambdaLR:
    """The warm-up plus decay schedule as a ``LambdaLR`` stepped once per optimizer step."""
    return torch.optim.lr_scheduler.LambdaLR(
        optimizer, functools.partial(lr_factor, config=config, max_steps=max_steps)
    )


def follow_parameters(optimizer: torch.optim.Optimizer) -> None:
    """Move the optimizer's state to its parameters' devices and dtypes, after the parameters moved.

    A run resumes on the CPU (the checkpoint's state loads beside CPU parameters) and then moves the model to
    its device; the state must follow, or the next step mixes devices.
    """
    # load_state_dict casts each state tensor to its parameter's device and floating dtype (AdamW's step count
    # stays on the CPU unless the optimizer is fused or capturable, as torch keeps it)
    optimizer.load_state_dict(optimizer.state_dict())
