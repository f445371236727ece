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

from speed.kernels import ATTN_CHUNK, chunk_span


class CacheError(RuntimeError):
    """A write that would leave a gap in, or overwrite, a valid cache prefix."""


@dataclass(frozen=True)
class Rows:
    """The tokens processed by one pass of the shared layer group, one row each.

    Row r is the token at decoder position ``pos[r]`` of cache row ``seq[r]``,
    running loop ``loop[r]`` (0-based).
    """

    seq: np.ndarray  # (R,) int64
    loop: np.ndarray  # (R,) int64
    pos: np.ndarray  # (R,) int64
    _tensors: dict = field(default_factory=dict, repr=False, compare=False)  # device -> (seq, loop, pos)

    @classmethod
    def build(cls, seq: list[int], loop: list[int], pos: list[int]) -> Rows:
        """Rows from three equally long lists of ints."""
        s, lo, p = (np.asarray(x, dtype=np.int64) for x in (seq, loop, pos))
        if not len(s) == len(lo) == len(p):
            raise ValueError(f"seq, loop and pos differ in length: {len(s)}, {len(lo)}, {len(p)}")
        return cls(s, lo, p)

    def __len__(self) -> int:
        return len(self.seq)

    def take(self, index: np.ndarray) -> Rows:
        """The rows at ``index`` (an index may repeat, e.g. to pad a tile)."""
        return Rows(self.seq[index], self.loop[index], self.pos[index])

    def tensors(self, device: torch.device | str) -> tuple[Tensor, Tensor, Tensor]:
        """(seq, loop, pos) as long tensors on ``device``, made once per device."""
        key = str(device)
        if key not in self._tensors:
            self._tensors[key] = tuple(torch.as_tensor(a, device=device) for a in (self.seq, self.loop, self.pos))
        return self._tensors[key]


class KVCache:
    """Preallocated self-attention keys/values for every (loop, layer) depth.

    Storage per physical layer j: ``keys[j]`` and ``values[j]`` of shape
    (n_loops, batch, n_heads, slots, d_kv), where ``slots`` is ``max_len``
    rounded up to whole attention chunks (the tail is never written and
    always masked). ``lengths[loop, layer, seq]`` is the valid prefix length
    at that depth for that sequence.
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
        self.slots = chunk_span(max_len)
        shape = (n_loops, batch, n_heads, self.slots, d_kv)
        self.keys = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(n_layers)]
        self.values = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(n_layers)]
        self.lengths = np.zeros((n_loops, n_layers, batch), dtype=np.int64)
        self.max_len = max_len
        self.batch = batch
        self.device = torch.device(device)

    def write(self, layer: int, rows: Rows, k: Tensor, v: Tensor) -> None:
        """Append each row's key/value (R, H, D) at its depth.

        Each row must land exactly at the end of the valid prefix of its depth
        (a gap or an overwrite of a valid entry is a scheduling bug and raises
        ``CacheError``).
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
        seq_t, loop_t, pos_t = rows.tensors(self.device)
        self.keys[layer][loop_t, seq_t, :, pos_t] = k
        self.values[layer][loop_t, seq_t, :, pos_t] = v

    def read(self, layer: int, rows: Rows, span: int) -> tuple[Tensor, Tensor]:
        """Keys and values (R, H, span, D) each row attends to: the first ``span`` slots of its depth.

        ``span`` is a whole number of attention chunks covering every row's
        position (``chunk_span``); slots past a row's own position are stale
        or empty and must be masked. One ``index_select`` per tensor over the
        flattened (loop, sequence) rows, copying only the span.
        """
        if span % ATTN_CHUNK or not 0 < span <= self.slots:
            raise ValueError(f"span must be a multiple of {ATTN_CHUNK} in 1..{self.slots}, got {span}")
        seq_t, loop_t, _ = rows.tensors(self.device)
        flat = loop_t * self.batch + seq_t
        keys, values = (t[layer].flatten(0, 1)[:, :, :span] for t in (self.keys, self.values))
        return keys.index_select(0, flat), values.index_select(0, flat)

    def invalidate(self, seq: int, from_pos: int) -> None:
        """Drop positions >= ``from_pos`` of sequence ``seq`` at every depth (no copy)."""
        np.minimum(self.lengths[:, :, seq], from_pos, out=self.lengths[:, :, seq])

    def reset(self, seq: int) -> None:
        """Empty sequence ``seq``'s row, e.g. when a new request takes it over."""
        self.lengths[:, :, seq] = 0
