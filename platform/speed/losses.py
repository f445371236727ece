"""Loss-weight schemes for the shared early-exit loss ``L_w = sum_i w_i L_i``.

Every scheme is a pure function ``(n_loops) -> weights`` of shape (M,) that
sums to 1; loop i is 1-based in the formulas below.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor


def _normalise(raw: Tensor) -> Tensor:
    return raw / raw.sum()


def linear(n_loops: int) -> Tensor:
    """The paper's default: w_i = i / sum_j j (later loops weigh more)."""
    return _normalise(torch.arange(1, n_loops + 1, dtype=torch.float64)).float()


def uniform(n_loops: int) -> Tensor:
    """w_i = 1 / M."""
    return torch.full((n_loops,), 1.0 / n_loops)


def last(n_loops: int) -> Tensor:
    """Only the final loop: plain (non-early-exit) training."""
    w = torch.zeros(n_loops)
    w[-1] = 1.0
    return w


def geometric(n_loops: int) -> Tensor:
    """w_i proportional to 2^i: each loop weighs twice the one before."""
    return _normalise(2.0 ** torch.arange(1, n_loops + 1, dtype=torch.float64)).float()


def sqrt(n_loops: int) -> Tensor:
    """w_i proportional to sqrt(i): between uniform and linear."""
    return _normalise(torch.arange(1, n_loops + 1, dtype=torch.float64).sqrt()).float()


SCHEMES: dict[str, Callable[[int], Tensor]] = {
    "linear": linear,
    "uniform": uniform,
    "last": last,
    "geometric": geometric,
    "sqrt": sqrt,
}


def loss_weights(scheme: str, n_loops: int) -> Tensor:
    """The (n_loops,) weights of a named scheme; unknown names and n_loops < 1 are errors."""
    if scheme not in SCHEMES:
        raise ValueError(f"unknown loss-weight scheme {scheme!r}; choose one of {sorted(SCHEMES)}")
    if n_loops < 1:
        raise ValueError(f"n_loops must be at least 1, got {n_loops}")
    return SCHEMES[scheme](n_loops)
