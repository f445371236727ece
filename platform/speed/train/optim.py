"""Optimizers (AdamW, torch's Adafactor) and the warm-up plus decay learning-rate schedule."""

from __future__ import annotations

import functools
import math

import torch
from torch import nn

from speed.train.config import OptimConfig


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
