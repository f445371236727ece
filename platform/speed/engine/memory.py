"""What an engine's capacity needs in memory, computed before anything is allocated, and the refusal when it does
not fit.

A model's stepper says what a capacity needs (``Stepper.memory_need``: a ``MemoryNeed``, from the model's shapes
alone, equal to what its ``cache`` and ``memory`` then allocate). ``check_memory`` compares what the engine is
about to allocate with what the device has free (``available_bytes``: ``SPEED_MEMORY_LIMIT`` bytes when set, else
CUDA's free memory or the host's available memory) and raises ``MemoryBudgetError``, one line saying what was
asked, what it needs, what is available and what fits, before a single tensor is made.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass

import psutil
import torch

MEMORY_LIMIT_ENV = "SPEED_MEMORY_LIMIT"  # bytes the engine may allocate, instead of what the device has free


@dataclass(frozen=True)
class MemoryNeed:
    """Bytes a model needs to decode at one capacity (``Stepper.memory_need``)."""

    weights: int  # the model's parameters and buffers (already loaded when an engine is built)
    cache: int  # key/value positions of every virtual layer, the prompt's included (an LM's)
    side: int  # runner-up branches' side entries (0: an engine without branches)
    memory: int  # the rest the engine allocates per capacity (T5: cross-attention keys/values, masks, position bias)

    @property
    def allocated(self) -> int:
        """What building an engine allocates: everything but the weights."""
        return self.cache + self.side + self.memory

    @property
    def total(self) -> int:
        return self.weights + self.allocated

    def describe(self) -> str:
        """One line: the total and its parts."""
        return (
            f"{size(self.total)} (weights {size(self.weights)}, cache {size(self.cache)}, "
            f"side entries {size(self.side)}, memory {size(self.memory)})"
        )


class MemoryBudgetError(ValueError):
    """An engine capacity that needs more memory than the device has available."""


def size(n: int) -> str:
    """``n`` bytes as the messages print it: in GiB, MiB or KiB, two decimals."""
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n} B"


def available_bytes(device: torch.device) -> tuple[int, str]:
    """Bytes the engine may allocate on ``device``, and where that figure comes from."""
    limit = os.environ.get(MEMORY_LIMIT_ENV)
    if limit:
        try:
            return int(limit), MEMORY_LIMIT_ENV
        except ValueError:
            raise ValueError(f"{MEMORY_LIMIT_ENV} must be a number of bytes, got {limit!r}") from None
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0], f"free on {device}"
    return psutil.virtual_memory().available, "available host memory"


def _largest(low: int, high: int, ok: Callable[[int], bool]) -> int:
    """The largest n in low..high with ``ok(n)`` (``ok`` true up to some n, false after); low - 1 if none."""
    while low <= high:
        mid = (low + high) // 2
        if ok(mid):
            low = mid + 1
        else:
            high = mid - 1
    return high


def check_memory(
    need: Callable[[int, int, int], MemoryNeed],
    max_active: int,
    max_prompt_len: int,
    max_target_len: int,
    device: torch.device,
) -> MemoryNeed:
    """``need(max_active, max_prompt_len, max_target_len)`` if what it allocates fits on ``device``, else
    ``MemoryBudgetError``: what was asked, what it needs, what is available, and what fits (the most slots at
    this length, the longest output at these slots)."""
    asked = need(max_active, max_prompt_len, max_target_len)
    available, source = available_bytes(device)
    if asked.allocated <= available:
        return asked
    slots = _largest(1, max_active, lambda n: need(n, max_prompt_len, max_target_len).allocated <= available)
    length = _largest(1, max_target_len, lambda n: need(max_active, max_prompt_len, n).allocated <= available)
    fits = [
        f"max_active={slots} at this length" if slots else "",
        f"max_target_len={length} at max_active={max_active}" if length else "",
    ]
    fits_text = " or ".join(f for f in fits if f) or "nothing at this max_prompt_len"
    raise MemoryBudgetError(
        f"max_active={max_active}, max_prompt_len={max_prompt_len}, max_target_len={max_target_len} needs "
        f"{size(asked.allocated)} for its cache (cache {size(asked.cache)}, side entries {size(asked.side)}, "
        f"memory {size(asked.memory)}; weights {size(asked.weights)} already loaded), but {size(available)} is "
        f"available ({source}); fits: {fits_text}"
    )
