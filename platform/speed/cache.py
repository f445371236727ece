"""The decoder's key/value cache, keyed by virtual depth (loop, layer).

A looped decoder runs each unique layer M times, once per loop, so one
physical layer owns M separate caches: keys written by loop 1 of layer 2 are
never read by loop 3 of layer 2. The cache is preallocated; rows are written
at explicit positions (as in gpt-fast), and invalidating speculative tokens
only lowers per-depth valid lengths: it copies nothing, and the next write at
that position overwrites the stale entry.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch
from torch import Tensor


class CacheError(RuntimeError):
    """A write that would leave a gap in, or overwrite, a valid cache prefix."""


@dataclass(frozen=True)
class Rows:
    """The tokens processed by one pass of the shared layer group, one row each.

    Row r is the token at decoder position ``pos[r]`` of sequence ``seq[r]`` (its
    row in the cache), running loop ``loop[r]`` (0-based).
    """

    seq: np.ndarray  # (R,) int64
    loop: np.ndarray  # (R,) int64
    pos: np.ndarray  # (R,) int64
    seq_t: Tensor = field(repr=False)  # (R,) long, the same values as tensors
    loop_t: Tensor = field(repr=False)
    pos_t: Tensor = field(repr=False)

    @classmethod
    def build(cls, seq: list[int], loop: list[int], pos: list[int]) -> Rows:
        """Rows from three equally long lists of ints."""
        s, lo, p = (np.asarray(x, dtype=np.int64) for x in (seq, loop, pos))
        return cls(s, lo, p, torch.from_numpy(s), torch.from_numpy(lo), torch.from_numpy(p))

    def __len__(self) -> int:
        return len(self.seq)

    @property
    def span(self) -> int:
        """Key positions any row may attend to: max position + 1."""
        return int(self.pos.max()) + 1


class KVCache:
    """Preallocated self-attention keys/values for every (loop, layer) depth.

    Storage per physical layer j: ``keys[j]`` and ``values[j]`` of shape
    (n_loops, batch, n_heads, max_len, d_kv). ``lengths[loop, layer, seq]`` is
    the valid prefix length at that depth for that sequence.
    """

    def __init__(
        self,
        n_loops: int,
        n_layers: int,
        batch: int,
        n_heads: int,
        max_len: int,
        d_kv: int,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ) -> None:
        shape = (n_loops, batch, n_heads, max_len, d_kv)
        self.keys = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(n_layers)]
        self.values = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(n_layers)]
        self.lengths = np.zeros((n_loops, n_layers, batch), dtype=np.int64)
        self.max_len = max_len

    def write(self, layer: int, rows: Rows, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        """Append each row's key/value (R, H, D) at its depth; return the keys/values it attends to.

        Each row must land exactly at the end of the valid prefix of its depth
        (a gap or an overwrite of a valid entry is a scheduling bug and raises
        ``CacheError``). Returns (R, H, span, D) keys and values; entries past a
        row's own position are stale or other rows' and must be masked.
        """
        have = self.lengths[rows.loop, layer, rows.seq]
        if not np.array_equal(have, rows.pos):
            bad = int(np.flatnonzero(have != rows.pos)[0])
            raise CacheError(
                f"write at depth (loop {rows.loop[bad]}, layer {layer}), sequence {rows.seq[bad]}, "
                f"position {rows.pos[bad]}, but its valid length is {have[bad]}"
            )
        if int(rows.pos.max()) >= self.max_len:
            raise CacheError(f"position {int(rows.pos.max())} beyond the cache's max_len {self.max_len}")
        self.lengths[rows.loop, layer, rows.seq] = rows.pos + 1
        keys, values = self.keys[layer], self.values[layer]
        keys[rows.loop_t, rows.seq_t, :, rows.pos_t] = k
        values[rows.loop_t, rows.seq_t, :, rows.pos_t] = v
        span = rows.span
        return keys[rows.loop_t, rows.seq_t, :, :span], values[rows.loop_t, rows.seq_t, :, :span]

    @property
    def device(self) -> torch.device:
        return self.keys[0].device

    def invalidate(self, seq: int, from_pos: int) -> None:
        """Drop positions >= ``from_pos`` of sequence ``seq`` at every depth (no copy)."""
        np.minimum(self.lengths[:, :, seq], from_pos, out=self.lengths[:, :, seq])

    def reset(self, seq: int) -> None:
        """Empty sequence ``seq``'s row, e.g. when a new request takes it over."""
        self.lengths[:, :, seq] = 0
