"""Loss-weight schemes for the shared early-exit loss ``L_w = sum_i w_i L_i``.

Every scheme is a pure function ``(n_loops) -> weights`` of shape (M,) that
sums to 1; loop i is 1-based in the formulas below. Parametric families take
their parameter after a colon, so that a sweep can sample it: ``power:P``
(w_i proportional to i^P) and ``ratio:R`` (w_i proportional to R^i).
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


def power(n_loops: int, p: float) -> Tensor:
    """w_i proportional to i^p: p = 0 is uniform, 0.5 sqrt, 1 linear; larger p favours later loops."""
    return _normalise(torch.arange(1, n_loops + 1, dtype=torch.float64) ** p).float()


def ratio(n_loops: int, r: float) -> Tensor:
    """w_i proportional to r^i: r = 1 is uniform, 2 geometric; r < 1 favours earlier loops."""
    # r^(i - M) keeps the largest term at 1 whatever r and M (no overflow for large r).
    return _normalise(r ** torch.arange(1 - n_loops, 1, dtype=torch.float64)).float()


PARAMETRIC: dict[str, Callable[[int, float], Tensor]] = {"power": power, "ratio": ratio}
_PARAMETER_RANGE = {"power": (-8.0, 8.0), "ratio": (0.05, 20.0)}  # beyond these one loop takes all the weight


def parametric(family: str, value: float) -> str:
    """The scheme name of a parametric family at ``value``, e.g. ``parametric("power", 1.5) == "power:1.5"``."""
    name = f"{family}:{value:.4g}"
    check_scheme(name)
    return name


def check_scheme(scheme: str) -> None:
    """Raise ValueError unless ``scheme`` is a named scheme or ``family:value`` of a parametric family in range."""
    family, sep, value = scheme.partition(":")
    if not sep:
        if scheme not in SCHEMES:
            raise ValueError(
                f"unknown loss-weight scheme {scheme!r}; choose one of {sorted(SCHEMES)} "
                f"or a parametric {'|'.join(f'{f}:VALUE' for f in PARAMETRIC)}"
            )
        return
    if family not in PARAMETRIC:
        raise ValueError(f"unknown loss-weight scheme {scheme!r}; parametric families are {sorted(PARAMETRIC)}")
    try:
        x = float(value)
    except ValueError:
        raise ValueError(f"loss-weight scheme {scheme!r}: {value!r} is not a number") from None
    lo, hi = _PARAMETER_RANGE[family]
    if not lo <= x <= hi:
        raise ValueError(f"loss-weight scheme {scheme!r}: the {family} parameter must lie in [{lo}, {hi}]")


def loss_weights(scheme: str, n_loops: int) -> Tensor:
    """The (n_loops,) weights of a scheme (named or ``family:value``); unknown names and n_loops < 1 are errors."""
    check_scheme(scheme)
    if n_loops < 1:
        raise ValueError(f"n_loops must be at least 1, got {n_loops}")
    family, sep, value = scheme.partition(":")
    return PARAMETRIC[family](n_loops, float(value)) if sep else SCHEMES[scheme](n_loops)
