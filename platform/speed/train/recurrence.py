"""Huginn's sampled recurrence: how many loops a training step runs, and through how many it backpropagates.

Huginn-0125 (Geiping et al., arXiv 2502.05171; ``randomized_iteration_sampler`` in ``raven_modeling_minimal.py``
of seal-rg/recurrent-pretraining) draws every step's loop count from a log-normal Poisson: a rate
``r ~ LogNormal(mu, sigma = 1/2)`` with ``mu = log(mean) - sigma^2 / 2`` (so E[r] = mean), then
``p = Poisson(r) + 1`` loops (E[p] = mean + 1), of which the first ``max(p - k, 0)`` run without gradients and the
last ``min(k, p)`` with them (k the backpropagation depth; Huginn: mean 32, k 8). Huginn seeds the draw by the
step; here it is a function of the run's seed and the step, the same on every worker (their loop counts must
agree: the collectives of a step are per loop) and the same when a run resumes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

SIGMA = 0.5  # the log-normal's sigma in Huginn's sampler
UNBOUNDED_CAP = 3  # without a backprop depth every loop's activations are kept: draws are capped at 3 x the mean


@dataclass(frozen=True)
class Recurrence:
    """One step's loops: ``loops`` in all, the last ``backprop`` of them with gradients."""

    loops: int
    backprop: int


def sample_recurrence(mean: int, backprop_depth: int | None, seed: int, step: int) -> Recurrence:
    """Huginn's draw for optimizer step ``step`` (1-based) of a run seeded ``seed``: ``p = Poisson(r) + 1`` loops,
    ``r ~ LogNormal(log(mean) - SIGMA^2 / 2, SIGMA)``, gradients through the last ``min(backprop_depth, p)``.

    Without a backprop depth every loop keeps its activations, so ``p`` is capped at ``UNBOUNDED_CAP * mean``
    (the memory plan's bound; Huginn's own sampler has no cap because it always truncates).
    """
    if mean < 1:
        raise ValueError(f"the mean recurrence must be positive, got {mean}")
    generator = torch.Generator().manual_seed(seed * 1_000_003 + step)
    mu = math.log(mean) - SIGMA**2 / 2
    rate = torch.empty(1, dtype=torch.float64).log_normal_(mu, SIGMA, generator=generator)
    loops = int(torch.poisson(rate, generator=generator).item()) + 1
    if backprop_depth is None:
        loops = min(loops, max_loops(mean, None))
        return Recurrence(loops, loops)
    return Recurrence(loops, min(backprop_depth, loops))


def max_loops(mean: int, backprop_depth: int | None) -> int:
    """The most loops whose activations a step keeps: the backprop depth, else the cap on the draw."""
    return backprop_depth if backprop_depth is not None else UNBOUNDED_CAP * mean
