"""What an engine's capacity needs in memory, computed before anything is allocated, and the refusal when it does
not fit.

A model's stepper says what a capacity needs (``Stepper.memory_need``: a ``MemoryNeed``, from the model's shapes
alone, equal to what its ``cache`` and ``memory`` then allocate). ``check_memory`` compares what the engine is
about to allocate with what the device has free (``available_bytes``: ``SPEED_MEMORY_LIMIT`` bytes when set, else
CUDA's free memory or the host's available memory) and raises ``MemoryBudgetError``, one line saying what was
asked, what it needs, what is available and what fits, before a single tensor is made. The key/value cache is a pool
of blocks (``speed.engine.cache``): by default as many as ``max_active`` requests at their longest take, fewer where
those do not fit (an engine then admits fewer requests at once, never fails mid-decode), and ``EngineConfig.kv_blocks``
sets it outright.

A model is checked the same way before it is loaded (``check_choice``: the weights and an engine's capacity, in
the dtype asked and its alternatives, ``speed.models.pretrained.check_load``), so a load that cannot fit is
refused in one line naming what would, before its first tensor is allocated.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import psutil
import torch

from speed.engine.kernels import ATTN_CHUNK

MEMORY_LIMIT_ENV = "SPEED_MEMORY_LIMIT"  # bytes the engine may allocate, instead of what the device has free


@dataclass(frozen=True)
class MemoryNeed:
    """Bytes a model needs to decode at one capacity (``Stepper.memory_need``)."""

    weights: int  # the model's parameters and buffers (already loaded when an engine is built)
    cache: int  # the key/value pool: its blocks and the zero block (``speed.engine.cache``), prompts' positions too
    side: int  # runner-up branches' side entries (0: an engine without branches)
    memory: int  # the rest the engine allocates per capacity (T5: cross-attention keys/values, masks, position bias)
    blocks: int = 0  # blocks in the pool, each ATTN_CHUNK positions of one request at every virtual layer

    @property
    def per_block(self) -> int:
        """Bytes one block of the pool holds (``ATTN_CHUNK`` positions of every virtual layer)."""
        return self.cache // (self.blocks + 1)

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
            f"{size(self.total)} (weights {size(self.weights)}, cache {size(self.cache)}{self._pool()}, "
            f"side entries {size(self.side)}, memory {size(self.memory)})"
        )

    def _pool(self) -> str:
        """The cache in the pool's terms: its blocks, and what one holds (and one position of it)."""
        if not self.blocks:
            return ""
        per = self.per_block
        return f": {self.blocks} blocks of {size(per)}, {size(per // ATTN_CHUNK)} per token"


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


def check_memory(
    need: Callable[..., MemoryNeed],
    max_active: int,
    max_prompt_len: int,
    max_target_len: int,
    device: torch.device,
    blocks: int | None = None,
) -> MemoryNeed:
    """``need(max_active, max_prompt_len, max_target_len, blocks=blocks)``, the engine's allocation with a key/value
    pool of ``blocks`` blocks (None: enough for ``max_active`` requests at their longest, or, where that does not
    fit on ``device``, the most blocks that do), if it fits; else ``MemoryBudgetError``: what was asked, what it
    needs, what is available, and what fits (the most blocks; one request at its longest needs
    ``need(1, ...).blocks``)."""
    asked = need(max_active, max_prompt_len, max_target_len, blocks=blocks)
    available, source = available_bytes(device)
    if asked.allocated <= available:
        return asked
    longest = need(1, max_prompt_len, max_target_len).blocks  # one request of the longest prompt and output
    rest = need(max_active, max_prompt_len, max_target_len, blocks=0).allocated  # all but the pool's blocks
    fits = max(-1, (available - rest) // asked.per_block) if asked.per_block else -1
    if blocks is None and fits >= longest:  # the default pool, capped by what is available
        return need(max_active, max_prompt_len, max_target_len, blocks=fits)
    fits_text = (
        f"kv_blocks={fits} (a request of max_prompt_len + max_target_len positions takes {longest})"
        if fits >= 1
        else f"no block at max_active={max_active} (side entries and memory alone need {size(rest)})"
    )
    raise MemoryBudgetError(
        f"max_active={max_active}, max_prompt_len={max_prompt_len}, max_target_len={max_target_len} needs "
        f"{size(asked.allocated)} for its cache (a pool of {asked.blocks} blocks of {size(asked.per_block)}, "
        f"{ATTN_CHUNK} positions of every virtual layer each: {size(asked.cache)}; side entries "
        f"{size(asked.side)}, memory {size(asked.memory)}; weights {size(asked.weights)} already loaded), but "
        f"{size(available)} is available ({source}); fits: {fits_text}"
    )


def check_choice(what: str, needs: Mapping[str, MemoryNeed], asked: str, device: torch.device) -> MemoryNeed:
    """``needs[asked]`` (``needs``: one choice's name, a dtype, -> what it needs in all, weights included) if its
    total fits what ``device`` has available; else ``MemoryBudgetError``, one line: ``what`` as ``asked``, what it
    needs (its parts), what is available, and which other choices fit (or that none does)."""
    need = needs[asked]
    available, source = available_bytes(device)
    if need.total <= available:
        return need
    others = {name: other.total for name, other in needs.items() if name != asked}
    fitting = [f"{name} ({size(total)}) fits" for name, total in others.items() if total <= available]
    fits = ", ".join(fitting) or "nothing fits (" + ", ".join(f"{n} needs {size(t)}" for n, t in others.items()) + ")"
    needs_text = need.describe() if need.allocated else f"{size(need.total)} for its weights"
    raise MemoryBudgetError(f"{what} as {asked} needs {needs_text}, {size(available)} available ({source}): {fits}")
