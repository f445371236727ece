"""The decoder's key/value cache, keyed by virtual layer (loop, layer).

A looped decoder runs each unique layer M times, once per loop, so one
physical layer owns M separate caches: keys written by loop 1 of layer 2 are
never read by loop 3 of layer 2. The cache is preallocated; rows are written
at explicit positions (as in gpt-fast), and invalidating speculative tokens
only lowers per-virtual-layer valid lengths: it copies nothing, and the next
write at that position overwrites the stale entry.

The cache holds ``n_slots`` requests at once, one per engine slot; a slot
keeps up to ``max_len`` key positions per virtual layer.

Runner-up branches (tree speculation): a branch is a second token at the same
position p as a speculative chain token, so it cannot share the chain's
position; it may grow its own chain (a lane) at p+1, p+2, ... Each slot has
side entries per virtual layer, one key/value each: a branch row writes its
key/value there, and a read gathers the row's prefix up to the fork from its
slot's positions and the lane's positions from their side entries, in
position order, so attention sums exactly the keys a chain token with the
same prefix would see. Promoting a lane copies each token's entries (one per loop it ran) into
its positions of the slot. A cache built for an engine without branches has no side entries (``n_side=0``).

``kv_bytes`` is what a cache of a given size allocates, so an engine can say before allocating whether it fits.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import Tensor

from speed.engine.kernels import ATTN_CHUNK, chunk_span
from speed.engine.rows import Rows

__all__ = ["CacheError", "KVCache", "Rows", "kv_bytes"]


class CacheError(RuntimeError):
    """A write that would leave a gap in, or overwrite, a valid cache prefix."""


class KVCache:
    """Preallocated self-attention keys/values for every virtual layer (loop, layer).

    Storage per physical layer j: ``keys[j]`` and ``values[j]`` of shape
    (n_loops, n_slots, n_heads, n_positions, d_kv), where ``n_positions`` is
    ``max_len`` rounded up to whole attention chunks (the tail is never
    written and always masked). ``lengths[loop, layer, slot]`` is the valid
    prefix length at that virtual layer for that slot. Branch rows keep their
    key/value in ``side_keys[j]``/``side_values[j]`` (n_loops, n_slots *
    n_side, n_heads, d_kv): side entry b of slot s is index ``s * n_side + b``
    (``n_side``: n_loops**2 by default; 0: no side tensors at all, for an engine without branches).
    """

    def __init__(
        self,
        n_loops: int,
        n_layers: int,
        n_slots: int,
        n_heads: int,
        max_len: int,
        d_kv: int,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
        n_side: int | None = None,
    ) -> None:
        self.n_positions = chunk_span(max_len)
        shape = (n_loops, n_slots, n_heads, self.n_positions, d_kv)
        self.keys = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(n_layers)]
        self.values = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(n_layers)]
        self.lengths = np.zeros((n_loops, n_layers, n_slots), dtype=np.int64)
        # side entries per slot: a lane of < M tokens per in-flight token, M = n_loops unless the layers run
        # in fewer loops than the model has (a looped LM's prelude: one loop, the model's M lanes)
        self.n_side = n_loops * n_loops if n_side is None else n_side
        side_shape = (n_loops, n_slots * self.n_side, n_heads, d_kv)
        n_sided = n_layers if self.n_side else 0
        self.side_keys = [torch.zeros(side_shape, dtype=dtype, device=device) for _ in range(n_sided)]
        self.side_values = [torch.zeros(side_shape, dtype=dtype, device=device) for _ in range(n_sided)]
        self.max_len = max_len
        self.n_slots = n_slots
        self.device = torch.device(device)

    @property
    def tensors(self) -> list[Tensor]:
        """Every tensor this cache allocated (what ``kv_bytes`` counts)."""
        return [*self.keys, *self.values, *self.side_keys, *self.side_values]

    def write(self, layer: int, rows: Rows, k: Tensor, v: Tensor) -> None:
        """Append each row's key/value (R, H, D) at its virtual layer (its loop, ``layer``).

        Each chain row must land exactly at the end of the valid prefix of its
        virtual layer (a gap or an overwrite of a valid entry is a scheduling bug and
        raises ``CacheError``); a branch row goes to its side entry and needs
        its prefix (positions before its own) valid at its virtual layer.
        """
        if rows.side is not None:
            branch = rows.side >= 0
            b = torch.as_tensor(np.flatnonzero(branch), device=k.device)
            self._write_side(layer, rows, k.index_select(0, b), v.index_select(0, b), branch)
            if not branch.all():
                chain = np.flatnonzero(~branch)
                c = torch.as_tensor(chain, device=k.device)
                self.write(layer, rows.take(chain), k.index_select(0, c), v.index_select(0, c))
            return
        have = self.lengths[rows.loop, layer, rows.slot]
        if not np.array_equal(have, rows.pos):
            bad = int(np.flatnonzero(have != rows.pos)[0])
            raise CacheError(
                f"write at virtual layer (loop {rows.loop[bad]}, layer {layer}), slot {rows.slot[bad]}, "
                f"position {rows.pos[bad]}, but its valid length is {have[bad]}"
            )
        if int(rows.pos.max()) >= self.max_len:
            raise CacheError(f"position {int(rows.pos.max())} beyond the cache's max_len {self.max_len}")
        self.lengths[rows.loop, layer, rows.slot] = rows.pos + 1
        slot_t, loop_t, pos_t = rows.tensors(self.device)
        self.keys[layer][loop_t, slot_t, :, pos_t] = k
        self.values[layer][loop_t, slot_t, :, pos_t] = v

    def write_span(self, layer: int, loop: int, slot: int, start: int, k: Tensor, v: Tensor) -> None:
        """Write positions start..start+T-1 of one slot at virtual layer (``loop``, ``layer``): k, v (H, T, D).

        A prompt's prefill: ``start`` must be the valid length there (else ``CacheError``, as for ``write``).
        """
        have, T = int(self.lengths[loop, layer, slot]), k.shape[1]
        if have != start:
            raise CacheError(
                f"span write at virtual layer (loop {loop}, layer {layer}), slot {slot}, from position {start}, "
                f"but its valid length is {have}"
            )
        if start + T > self.max_len:
            raise CacheError(f"positions up to {start + T - 1} beyond the cache's max_len {self.max_len}")
        self.keys[layer][loop, slot, :, start : start + T] = k
        self.values[layer][loop, slot, :, start : start + T] = v
        self.lengths[loop, layer, slot] = start + T

    def _write_side(self, layer: int, rows: Rows, k: Tensor, v: Tensor, branch: np.ndarray) -> None:
        """Store the branch rows' (``branch`` mask) keys/values (B, H, D) in their side entries."""
        slot, loop, pos, side = rows.slot[branch], rows.loop[branch], rows.pos[branch], rows.side[branch]
        have, fork = self.lengths[loop, layer, slot], rows.forks()
        if (have < fork).any():
            bad = int(np.flatnonzero(have < fork)[0])
            raise CacheError(
                f"branch write at virtual layer (loop {loop[bad]}, layer {layer}), slot {slot[bad]}, position "
                f"{pos[bad]}, but its prefix's valid length is {have[bad]} (its lane forks at {fork[bad]})"
            )
        if int(pos.max()) >= self.max_len:
            raise CacheError(f"position {int(pos.max())} beyond the cache's max_len {self.max_len}")
        loop_t, flat_t = (torch.as_tensor(a, device=self.device) for a in (loop, slot * self.n_side + side))
        self.side_keys[layer][loop_t, flat_t] = k
        self.side_values[layer][loop_t, flat_t] = v

    def read(self, layer: int, rows: Rows, span: int) -> tuple[Tensor, Tensor]:
        """Keys and values (R, H, span, D) each row attends to: the first ``span`` positions of its virtual layer.

        ``span`` is a whole number of attention chunks covering every row's
        position (``chunk_span``); positions past a row's own are stale or
        empty and must be masked. One ``index_select`` per tensor over the
        flattened (loop, slot) pairs, copying only the span.
        """
        if span % ATTN_CHUNK or not 0 < span <= self.n_positions:
            raise ValueError(f"span must be a multiple of {ATTN_CHUNK} in 1..{self.n_positions}, got {span}")
        slot_t, loop_t, _ = rows.tensors(self.device)
        flat = loop_t * self.n_slots + slot_t
        keys, values = (t[layer].flatten(0, 1)[:, :, :span] for t in (self.keys, self.values))
        keys, values = keys.index_select(0, flat), values.index_select(0, flat)  # (R, H, span, D), copies
        if rows.side is not None:  # a branch row sees its lane's keys/values from the fork on, the chain's before
            r, pos, side = rows.lane_entries()
            r_t, pos_t, lo_t, flat_t = (
                torch.as_tensor(a, device=self.device)
                for a in (r, pos, rows.loop[r], rows.slot[r] * self.n_side + side)
            )
            keys[r_t, :, pos_t] = self.side_keys[layer][lo_t, flat_t]
            values[r_t, :, pos_t] = self.side_values[layer][lo_t, flat_t]
        return keys, values

    def promote(self, slot: int, side: int, pos: int, loops_done: int) -> None:
        """Make the branch in side entry ``side`` of ``slot`` the token at ``pos``: copy its first ``loops_done`` loops.

        Position ``pos`` must be free (invalidated) at those loops and its
        prefix valid, as for a chain write.
        """
        if loops_done == 0:
            return
        have = self.lengths[:loops_done, :, slot]
        if (have != pos).any():
            raise CacheError(f"promotion to position {pos} of slot {slot}, but its valid lengths are {have.tolist()}")
        for j in range(len(self.keys)):
            self.keys[j][:loops_done, slot, :, pos] = self.side_keys[j][:loops_done, slot * self.n_side + side]
            self.values[j][:loops_done, slot, :, pos] = self.side_values[j][:loops_done, slot * self.n_side + side]
        self.lengths[:loops_done, :, slot] = pos + 1

    def invalidate(self, slot: int, from_pos: int) -> None:
        """Drop positions >= ``from_pos`` of ``slot`` at every virtual layer (no copy)."""
        np.minimum(self.lengths[:, :, slot], from_pos, out=self.lengths[:, :, slot])

    def reset(self, slot: int) -> None:
        """Empty ``slot``, e.g. when a new request takes it over."""
        self.lengths[:, :, slot] = 0


def kv_bytes(
    n_loops: int,
    n_layers: int,
    n_slots: int,
    n_heads: int,
    max_len: int,
    d_kv: int,
    dtype: torch.dtype = torch.float32,
    n_side: int | None = None,
) -> tuple[int, int]:
    """Bytes a ``KVCache`` of these arguments allocates: (its positions' keys/values, its side entries')."""
    n_side = n_loops * n_loops if n_side is None else n_side
    item = torch.empty((), dtype=dtype).element_size()
    entry = 2 * n_layers * n_loops * n_slots * n_heads * d_kv * item  # a key and a value per (loop, layer, slot)
    return entry * chunk_span(max_len), entry * n_side
