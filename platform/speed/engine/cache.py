"""The decoder's key/value cache, keyed by virtual layer (loop, layer), paged in blocks of ``ATTN_CHUNK`` positions.

A looped decoder runs each unique layer M times, once per loop, so one
physical layer owns M separate caches: keys written by loop 1 of layer 2 are
never read by loop 3 of layer 2. Rows are written at explicit positions (as in
gpt-fast), and invalidating speculative tokens only lowers per-virtual-layer
valid lengths: it copies nothing, and the next write at that position
overwrites the stale entry.

Paging (vLLM's PagedAttention habit): keys and values live in a pool of
blocks, each ``ATTN_CHUNK`` positions of one slot at every virtual layer, taken
from the pool when a position in them is first written and given back when the
slot is reset or invalidated past them. A slot's block table maps its
positions' chunks onto pool blocks. One table per slot rather than per virtual
layer: a token is written at every virtual layer within a few steps of its
first, so the virtual layers of a slot fill their chunks together; per-layer
tables would multiply the bookkeeping and the gather's index by loops x layers
and save nothing. Since a block is exactly one of the attention's fixed chunks
(``speed.engine.kernels.attend``), a read gathers whole chunks in position
order into the same (R, H, span, D) tensor an unpaged cache would hand out, so
a row's logits do not depend on which blocks it got nor on what the pool holds
(entries past a row's position are masked, and attention gives them weight
exactly zero; unallocated chunks read block 0, kept zero).

The cache holds ``n_slots`` requests at once, one per engine slot; a slot
keeps up to ``max_len`` key positions per virtual layer, and the pool
``n_blocks`` blocks over all slots (default: every slot at ``max_len``, what an
unpaged cache holds). The engine reserves a request's worst case in blocks at
admission (``blocks_needed``), so a running request always finds its blocks.

Runner-up branches (tree speculation): a branch is a second token at the same
position p as a speculative chain token, so it cannot share the chain's
position; it may grow its own chain (a lane) at p+1, p+2, ... Each slot has
side entries per virtual layer, one key/value each (not paged: a few per
slot): a branch row writes its key/value there, and a read gathers the row's
prefix up to the fork from its slot's blocks and the lane's positions from
their side entries, in position order, so attention sums exactly the keys a
chain token with the same prefix would see. Promoting a lane copies each
token's entries (one per loop it ran) into its positions of the slot. A cache
built for an engine without branches has no side entries (``n_side=0``).

Over 500 lines because it is one class whose methods share its bookkeeping (the block table, the valid lengths,
the side entries, the cached gather indices) and ``StagedView``, the class as a staged pass sees it; the device
indices a pass reads it through are ``speed.engine.cache_index``.

``KVCache.nbytes`` of a cache built on the ``meta`` device is what a cache of its size allocates, so an engine can
say before allocating whether it fits.
"""

from __future__ import annotations

import heapq

import numpy as np
import torch
from torch import Tensor

from speed.engine import native
from speed.engine.cache_index import PagedIndex, StagedIndex
from speed.engine.kernels import ATTN_CHUNK, attend, attention_native, attention_triton, chunk_span, triton_ops
from speed.engine.rows import Rows, to_device

__all__ = ["CacheError", "KVCache", "Rows", "StagedView", "pool_blocks"]

ZERO_BLOCK = 0  # the pool's block that unallocated table entries point to: never written, always zero


class CacheError(RuntimeError):
    """A write that would leave a gap in, or overwrite, a valid cache prefix, or find the pool empty."""


def pool_blocks(n_slots: int, max_len: int, n_blocks: int | None = None) -> int:
    """Blocks in a pool: ``n_blocks``, or by default enough for every slot at ``max_len`` positions."""
    return n_slots * (chunk_span(max_len) // ATTN_CHUNK) if n_blocks is None else n_blocks


class KVCache:
    """Self-attention keys/values for every virtual layer (loop, layer), in blocks of ``ATTN_CHUNK`` positions.

    Storage per physical layer j: ``keys[j]`` and ``values[j]`` of shape
    (n_loops, n_heads, n_blocks + 1, ATTN_CHUNK, d_kv), block 0 the zero block
    (``ZERO_BLOCK``); allocated empty, so the host's memory is touched only
    by the blocks taken (each is zeroed when taken). ``table[slot, c]`` is the
    pool block holding chunk c (positions c*ATTN_CHUNK ...) of ``slot``, 0
    while none. ``lengths[loop, layer, slot]`` is the valid prefix length at
    that virtual layer for that slot. Branch rows keep their key/value in
    ``side_keys[j]``/``side_values[j]`` (n_loops, n_slots * n_side, n_heads,
    d_kv): side entry b of slot s is index ``s * n_side + b`` (``n_side``:
    n_loops**2 by default; 0: no side tensors at all, for an engine without branches).
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
        n_blocks: int | None = None,
    ) -> None:
        self.n_positions = chunk_span(max_len)
        self.n_blocks = pool_blocks(n_slots, max_len, n_blocks)
        if self.n_blocks < 0:
            raise ValueError(f"n_blocks must be >= 0, got {self.n_blocks}")
        shape = (n_loops, n_heads, self.n_blocks + 1, ATTN_CHUNK, d_kv)
        self.keys = [torch.empty(shape, dtype=dtype, device=device) for _ in range(n_layers)]
        self.values = [torch.empty(shape, dtype=dtype, device=device) for _ in range(n_layers)]
        for t in (*self.keys, *self.values):
            t[:, :, ZERO_BLOCK].zero_()
        self.table = np.zeros((n_slots, self.n_positions // ATTN_CHUNK), dtype=np.int64)
        self._free = list(range(1, self.n_blocks + 1))  # a heap: the lowest free block is taken first
        self._version = 0  # bumped whenever the table changes (the read's gather index is kept until then)
        self._index: tuple | None = None  # (rows, span, version, index) of the last read
        self._written: tuple | None = None  # (rows, version, (blocks, places)) of the last write
        self._offsets: tuple | None = None  # (rows, version, (offsets, lengths)) of the last native attention
        self._paged: tuple | None = None  # (rows, version, PagedIndex) of the last Triton attention
        self._bias: tuple | None = None  # (rows, dtype, bias) of the last torch attention
        self._staged: dict[int, StagedIndex] = {}  # a staged pass's static index, by row count (``stage``)
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
        self.n_heads = n_heads
        self.device = torch.device(device)
        # which attention ``attend`` runs: a property of the cache (its dtype and device), never of the rows
        self.triton_attention = attention_triton(self.device)
        self.native_attention = not self.triton_attention and attention_native(dtype, self.device)
        self.scratch: int | None = None  # the padding rows' slot (``set_scratch``); None: no padding rows

    def set_scratch(self, slot: int) -> None:
        """Make ``slot`` the padding rows' (``speed.engine.graphs``, a row-count bucket filled up): it gets one
        block for good (chunk 0), and a chain row of that slot at a position in chunk 0 writes there without the
        valid-prefix check nor a length, so padding rows never write a request's place nor count as written. The
        engine gives the slot to no request (it takes it out of its free slots)."""
        self.reset(slot)
        self.scratch = slot
        self._take(np.array([slot]), np.array([0]))

    @property
    def tensors(self) -> list[Tensor]:
        """Every tensor this cache allocated (what ``kv_bytes`` counts)."""
        return [*self.keys, *self.values, *self.side_keys, *self.side_values]

    @property
    def pool_head_stride(self) -> int:
        """Elements between two kv heads' entries of one position in a layer's pool (the native attention's)."""
        return (self.n_blocks + 1) * ATTN_CHUNK * self.keys[0].shape[-1] if self.keys else 0

    @property
    def blocks_used(self) -> int:
        """Pool blocks taken now (by every slot but the padding rows' scratch slot)."""
        return self.n_blocks - len(self._free) - (self.scratch is not None)

    def blocks_needed(self, prompt_len: int, max_new_tokens: int) -> int:
        """Blocks a request reserves: one per chunk of its ``max_new_tokens`` output positions (its prompt takes
        none here: a T5 prompt is the encoder's)."""
        return chunk_span(max_new_tokens) // ATTN_CHUNK

    def nbytes(self) -> tuple[int, int]:
        """Bytes its tensors hold: (its pool's keys/values, the zero block's included; its side entries'). A cache
        built on the ``meta`` device allocates nothing: what one of its arguments would allocate."""
        pool = sum(t.nbytes for t in (*self.keys, *self.values))
        return pool, sum(t.nbytes for t in (*self.side_keys, *self.side_values))

    def _take(self, slot: np.ndarray, chunk: np.ndarray) -> None:
        """Give each (slot, chunk) pair without a block one from the pool (zeroed)."""
        missing = self.table[slot, chunk] == ZERO_BLOCK
        if not missing.any():
            return
        pairs = np.unique(np.stack([slot[missing], chunk[missing]]), axis=1)
        if pairs.shape[1] > len(self._free):
            raise CacheError(
                f"the pool's {self.n_blocks} blocks are all taken ({pairs.shape[1]} more wanted): the engine reserves "
                "a request's blocks at admission, so this is a scheduling bug"
            )
        blocks = [heapq.heappop(self._free) for _ in range(pairs.shape[1])]
        self.table[pairs[0], pairs[1]] = blocks
        b = to_device(blocks, self.device)
        for t in (*self.keys, *self.values):
            t.index_fill_(2, b, 0.0)  # finite: a masked entry must still give exactly zero weight times it
        self._version += 1

    def _give_back(self, slot: int, from_chunk: int) -> None:
        """Return the blocks of ``slot``'s chunks from ``from_chunk`` on to the pool."""
        held = self.table[slot, from_chunk:]
        taken = held[held != ZERO_BLOCK]
        if len(taken):
            for b in taken.tolist():
                heapq.heappush(self._free, b)
            held[:] = ZERO_BLOCK
            self._version += 1

    def write(self, layer: int, rows: Rows, k: Tensor, v: Tensor) -> None:
        """Append each row's key/value (R, H, D) at its virtual layer (its loop, ``layer``).

        Each chain row must land exactly at the end of the valid prefix of its
        virtual layer (a gap or an overwrite of a valid entry is a scheduling bug and
        raises ``CacheError``); a branch row goes to its side entry and needs
        its prefix (positions before its own) valid at its virtual layer.
        """
        if rows.side is not None:
            branch = rows.side >= 0
            b = to_device(np.flatnonzero(branch), k.device)
            self._write_side(layer, rows, k.index_select(0, b), v.index_select(0, b), branch)
            if not branch.all():
                chain = np.flatnonzero(~branch)
                c = to_device(chain, k.device)
                self.write(layer, rows.take(chain), k.index_select(0, c), v.index_select(0, c))
            return
        chunk = self._claim(layer, rows)
        _, loop_t, _ = rows.tensors(self.device)
        block, within = self._places(rows, chunk)
        self.keys[layer][loop_t, :, block, within] = k
        self.values[layer][loop_t, :, block, within] = v

    def _claim(self, layer: int, rows: Rows) -> np.ndarray:
        """A chain write's bookkeeping: check that each row lands at the end of its virtual layer's valid prefix,
        give its chunk a block, count its position valid. Returns the rows' chunks."""
        chunk = rows.pos // ATTN_CHUNK
        if self.scratch is not None and (rows.slot == self.scratch).any():  # padding rows: their block is kept
            rows = rows.take(np.flatnonzero(rows.slot != self.scratch))
            if not len(rows):
                return chunk
        have = self.lengths[rows.loop, layer, rows.slot]
        if not np.array_equal(have, rows.pos):
            bad = int(np.flatnonzero(have != rows.pos)[0])
            raise CacheError(
                f"write at virtual layer (loop {rows.loop[bad]}, layer {layer}), slot {rows.slot[bad]}, "
                f"position {rows.pos[bad]}, but its valid length is {have[bad]}"
            )
        if int(rows.pos.max()) >= self.max_len:
            raise CacheError(f"position {int(rows.pos.max())} beyond the cache's max_len {self.max_len}")
        self._take(rows.slot, rows.pos // ATTN_CHUNK)
        self.lengths[rows.loop, layer, rows.slot] = rows.pos + 1
        return chunk

    def claim(self, layer: int, rows: Rows) -> tuple[Tensor, Tensor]:
        """For a caller that writes the chain rows' keys/values itself (``speed.engine.native.lm_block``): the
        checks and bookkeeping of ``write`` (no branch rows), then the native attention's index
        (``_attend_offsets``), in which row r's own place is ``offsets[r, lengths[r] - 1]``."""
        if rows.side is not None or not self.native_attention:
            raise CacheError("claim is for chain rows on the native attention (write, then attend, otherwise)")
        self._claim(layer, rows)
        return self._attend_offsets(rows)

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
        chunks = np.arange(start // ATTN_CHUNK, -(-(start + T) // ATTN_CHUNK))
        self._take(np.full(len(chunks), slot), chunks)
        for c in chunks.tolist():  # the span's piece in each of its blocks
            lo, hi = max(start, c * ATTN_CHUNK), min(start + T, (c + 1) * ATTN_CHUNK)
            at, b = slice(lo - c * ATTN_CHUNK, hi - c * ATTN_CHUNK), int(self.table[slot, c])
            self.keys[layer][loop, :, b, at] = k[:, lo - start : hi - start]
            self.values[layer][loop, :, b, at] = v[:, lo - start : hi - start]
        self.lengths[loop, layer, slot] = start + T

    def _write_side(self, layer: int, rows: Rows, k: Tensor, v: Tensor, branch: np.ndarray) -> None:
        """Store the branch rows' (``branch`` mask) keys/values (B, H, D) in their side entries."""
        self._check_side(layer, rows, branch)
        slot, loop, side = rows.slot[branch], rows.loop[branch], rows.side[branch]
        loop_t, flat_t = (to_device(a, self.device) for a in (loop, slot * self.n_side + side))
        self.side_keys[layer][loop_t, flat_t] = k
        self.side_values[layer][loop_t, flat_t] = v

    def _check_side(self, layer: int, rows: Rows, branch: np.ndarray) -> None:
        """A branch write's check: each branch row (``branch`` mask) finds its prefix, the positions before its
        lane's fork, valid at its virtual layer, and its position within the cache."""
        slot, loop, pos = rows.slot[branch], rows.loop[branch], rows.pos[branch]
        have, fork = self.lengths[loop, layer, slot], rows.forks()
        if (have < fork).any():
            bad = int(np.flatnonzero(have < fork)[0])
            raise CacheError(
                f"branch write at virtual layer (loop {loop[bad]}, layer {layer}), slot {slot[bad]}, position "
                f"{pos[bad]}, but its prefix's valid length is {have[bad]} (its lane forks at {fork[bad]})"
            )
        if int(pos.max()) >= self.max_len:
            raise CacheError(f"position {int(pos.max())} beyond the cache's max_len {self.max_len}")

    def _places(self, rows: Rows, chunk: np.ndarray) -> tuple[Tensor, Tensor]:
        """(R,) each chain row's block and place in it, as tensors; kept for the tile's next layers, as the read's
        index."""
        memo = self._written
        if memo is not None and memo[0] is rows and memo[1] == self._version:
            return memo[2]
        block, within = self.table[rows.slot, chunk], rows.pos % ATTN_CHUNK
        places = to_device(block, self.device), to_device(within, self.device)
        self._written = (rows, self._version, places)
        return places

    def _gather_index(self, rows: Rows, span: int) -> Tensor:
        """(R * H * span / ATTN_CHUNK,) each row's blocks per head in the flattened pool (loop, head, block), in
        position order; the same for every layer until the table changes (kept for the tile's next layers)."""
        memo = self._index
        if memo is not None and memo[0] is rows and memo[1] == span and memo[2] == self._version:
            return memo[3]
        n_chunks, H = span // ATTN_CHUNK, self.n_heads
        blocks = self.table[rows.slot, :n_chunks]  # (R, n_chunks)
        base = (rows.loop[:, None] * H + np.arange(H)[None, :]) * (self.n_blocks + 1)  # (R, H)
        index = to_device((base[:, :, None] + blocks[:, None, :]).reshape(-1), self.device)
        self._index = (rows, span, self._version, index)
        return index

    def read(self, layer: int, rows: Rows, span: int) -> tuple[Tensor, Tensor]:
        """Keys and values (R, H, span, D) each row attends to: the first ``span`` positions of its virtual layer.

        ``span`` is a whole number of attention chunks covering every row's
        position (``chunk_span``); positions past a row's own are stale or
        empty and must be masked. One ``index_select`` per tensor over the
        flattened pool's blocks (the rows' block tables, per head), copying only the span.
        """
        if span % ATTN_CHUNK or not 0 < span <= self.n_positions:
            raise ValueError(f"span must be a multiple of {ATTN_CHUNK} in 1..{self.n_positions}, got {span}")
        index, R = self._gather_index(rows, span), len(rows)
        keys, values = (t[layer].flatten(0, 2).index_select(0, index) for t in (self.keys, self.values))
        D = keys.shape[-1]
        keys, values = keys.view(R, self.n_heads, span, D), values.view(R, self.n_heads, span, D)  # copies
        if rows.side is not None:  # a branch row sees its lane's keys/values from the fork on, the chain's before
            r, pos, side = rows.lane_entries()
            r_t, pos_t, lo_t, flat_t = (
                to_device(a, self.device)
                for a in (r, pos, rows.loop[r], rows.slot[r] * self.n_side + side)
            )
            keys[r_t, :, pos_t] = self.side_keys[layer][lo_t, flat_t]
            values[r_t, :, pos_t] = self.side_values[layer][lo_t, flat_t]
        return keys, values

    def attend(self, layer: int, rows: Rows, q: Tensor, bias: Tensor | None = None) -> Tensor:
        """Each row's self-attention (R, H_q, D) at its virtual layer (its loop, ``layer``): its query q (R, H_q,
        D), already scaled, against the keys and values of its positions 0..pos (its own written first), the
        query heads sharing each of the cache's H heads in groups of H_q / H; with ``bias`` (R, H_q,
        ``n_positions``) added to each head's scores (T5's relative positions: on the Triton attention only).

        On the native kernel (``native_attention``) the entries are read in place through the block table (a
        branch row's lane from its side entries), each row over its own positions only; else ``read`` gathers
        the fewest whole chunks covering the rows and ``speed.engine.kernels.attend`` masks the positions past
        each row's. Either way a row's result depends on nothing but its own query and entries.
        """
        if self.triton_attention:
            index = self.paged_index(rows)
            sides = (self.side_keys[layer], self.side_values[layer]) if index.lane_pos is not None else (None, None)
            pool = (self.keys[layer], self.values[layer])
            return triton_ops().paged_attend(q, *pool, *index.chain, *sides, *index.lanes, bias)
        if bias is not None:
            raise CacheError("attention with a score bias runs on the Triton attention only")
        if self.native_attention:
            offsets, lengths = self._attend_offsets(rows)
            D, stride = q.shape[-1], self.pool_head_stride
            sides = (self.side_keys[layer], self.side_values[layer]) if self.n_side else (None, None)
            return native.attend(q, self.keys[layer], self.values[layer], *sides, offsets, lengths, stride, D)
        bias = self._attend_bias(rows, q.dtype)  # (R, 1, 1, span)
        keys, values = self.read(layer, rows, bias.shape[-1])  # 2 x (R, H, span, D)
        group = q.shape[1] // self.n_heads
        if group > 1:
            keys, values = keys.repeat_interleave(group, dim=1), values.repeat_interleave(group, dim=1)
        return attend(q, keys, values, bias)

    def _attend_bias(self, rows: Rows, dtype: torch.dtype) -> Tensor:
        """Torch's attention's mask (R, 1, 1, span) over the fewest whole chunks covering the rows: 0 at each row's
        positions 0..pos, the dtype's least value past them. It depends on the rows alone: kept for the tile's
        next layers (made once per pass, not once per layer)."""
        memo = self._bias
        if memo is not None and memo[0] is rows and memo[1] == dtype:
            return memo[2]
        span = chunk_span(int(rows.pos.max()) + 1)
        _, _, pos_t = rows.tensors(self.device)
        visible = torch.arange(span, device=self.device)[None, :] <= pos_t[:, None]  # (R, span)
        bias = torch.zeros(visible.shape, dtype=dtype, device=self.device)
        bias = bias.masked_fill(~visible, torch.finfo(dtype).min)[:, None, None]
        self._bias = (rows, dtype, bias)
        return bias

    def stage(self, rows: Rows, live: np.ndarray | None = None) -> StagedIndex:
        """The host's part of a pass over ``rows`` at every layer, done before the pass (a captured CUDA graph's
        ``prepare``): the checks and bookkeeping of ``write`` at each layer (blocks taken, lengths counted), and
        the rows' whole index (where each writes, what each attends: ``StagedIndex``) copied in one pinned,
        non-blocking copy into this row count's static buffers, whose addresses never change. The pass then reads
        those buffers alone (``write_staged``, ``attend_staged``): nothing of the rows on the host.

        Rows not ``live`` (mask; None: all) run as padding rows (``set_scratch``: the scratch slot's block,
        loop 0, position 0): they write only there and count nowhere (a looped LM's rows past loop 0 in its
        prelude). Chain rows write the pool, branch rows their side entries (``n_side``); each also writes the
        other kind's scratch place, so that every row writes both with one index each (what lands there is
        never read by a real row). Needs the triton attention and a scratch slot."""
        if self.scratch is None or not self.triton_attention:
            raise CacheError("a staged pass needs a scratch slot (set_scratch) and the Triton attention")
        R, scratch = len(rows), self.scratch
        if live is not None and not live.all():
            rows = _as_padding(rows, ~live, scratch)
        branch = np.zeros(R, dtype=bool) if rows.side is None else rows.side >= 0
        if branch.any():  # as write does at every layer: the branches' checks first, then the chain's claims
            for layer in range(len(self.keys)):
                self._check_side(layer, rows, branch)
        chain = rows if not branch.any() else rows.take(np.flatnonzero(~branch))
        if len(chain):
            for layer in range(len(self.keys)):
                self._claim(layer, chain)
        index = self._staged.get(R)
        if index is None:
            index = self._staged[R] = StagedIndex.allocate(R, self.table.shape[1], self.n_side, self.device)
        chunk = np.where(branch, 0, rows.pos // ATTN_CHUNK)
        block = np.where(branch, self.table[scratch, 0], self.table[rows.slot, chunk])
        within = np.where(branch, 0, rows.pos % ATTN_CHUNK)
        side = np.zeros(R, dtype=np.int64) if rows.side is None else np.maximum(rows.side, 0)
        entry = np.where(branch, rows.slot * self.n_side + side, scratch * self.n_side)
        lane_pos, lane_entry = self._lanes(rows if branch.any() else None, R, self.n_side)
        columns = (rows.loop, rows.pos, rows.pos + 1, block, within, entry)
        host = StagedIndex.pack(columns, self.table[rows.slot], lane_pos, lane_entry)
        index.packed.copy_(to_device(host, self.device))
        return index

    def write_staged(self, layer: int, index: StagedIndex, k: Tensor, v: Tensor) -> None:
        """``write`` of a staged pass's rows (``stage``), their keys/values (R, H, D): device indices only."""
        self.keys[layer][index.loop, :, index.block, index.within] = k
        self.values[layer][index.loop, :, index.block, index.within] = v
        if self.n_side:
            self.side_keys[layer][index.loop, index.entry] = k
            self.side_values[layer][index.loop, index.entry] = v

    def attend_staged(self, layer: int, index: StagedIndex, q: Tensor, bias: Tensor | None = None) -> Tensor:
        """``attend`` of a staged pass's rows (``stage``) on the Triton attention: device indices only."""
        sides = (self.side_keys[layer], self.side_values[layer]) if self.n_side else (None, None)
        lanes = (index.lane_pos, index.lane_entry) if self.n_side else (None, None)
        pool = (self.keys[layer], self.values[layer])
        return triton_ops().paged_attend(q, *pool, index.loop, index.length, index.table, *sides, *lanes, bias)

    def paged_index(self, rows: Rows) -> PagedIndex:
        """The Triton attention's index of ``rows`` (``PagedIndex``), on the cache's device; the same for every
        layer until the table changes (kept for the tile's next layers)."""
        memo = self._paged
        if memo is not None and memo[0] is rows and memo[1] == self._version:
            return memo[2]
        lane_pos = lane_entry = None
        if rows.side is not None:
            lane_pos, lane_entry = self._lanes(rows, len(rows), int(np.bincount(rows.lane_entries()[0]).max()))
        arrays = (rows.loop, rows.pos + 1, self.table[rows.slot], lane_pos, lane_entry)
        index = PagedIndex(*(None if a is None else to_device(a, self.device) for a in arrays))
        self._paged = (rows, self._version, index)
        return index

    def _lanes(self, rows: Rows | None, R: int, width: int) -> tuple[np.ndarray, np.ndarray]:
        """(R, width) each branch row's lane positions (-1 pads; a chain row's all -1) and their side entries
        (slot * n_side + side), as the Triton attention reads them; all padding for ``rows`` None."""
        lane_pos, lane_entry = np.full((R, width), -1, dtype=np.int64), np.zeros((R, width), dtype=np.int64)
        if rows is not None:
            r, pos, side = rows.lane_entries()
            place = np.arange(len(r)) - np.searchsorted(r, r)  # each entry's place in its row's lane (r ascends)
            lane_pos[r, place], lane_entry[r, place] = pos, rows.slot[r] * self.n_side + side
        return lane_pos, lane_entry

    def _attend_offsets(self, rows: Rows) -> tuple[Tensor, Tensor]:
        """The native attention's index: (R, L) each row's positions' element offsets in the pool of a layer (kv
        head 0), a branch row's lane positions as ``-(1 + offset)`` in the side entries; (R,) its positions to
        attend (pos + 1). The same for every layer until the table changes (kept for the tile's next layers)."""
        memo = self._offsets
        if memo is not None and memo[0] is rows and memo[1] == self._version:
            return memo[2]
        H, D = self.n_heads, self.keys[0].shape[-1]
        p = np.arange(int(rows.pos.max()) + 1)
        blocks = self.table[rows.slot][:, p // ATTN_CHUNK]  # (R, L)
        offsets = ((rows.loop[:, None] * H) * (self.n_blocks + 1) + blocks) * (ATTN_CHUNK * D) + (p % ATTN_CHUNK) * D
        if rows.side is not None:
            r, pos, side = rows.lane_entries()
            entry = rows.loop[r] * (self.n_slots * self.n_side) + rows.slot[r] * self.n_side + side
            offsets[r, pos] = -(1 + entry * H * D)
        index = torch.from_numpy(np.ascontiguousarray(offsets)), torch.from_numpy(rows.pos + 1)
        self._offsets = (rows, self._version, index)
        return index

    def slot_entries(self, layer: int, slot: int, length: int) -> tuple[Tensor, Tensor]:
        """Keys and values (n_loops, H, length, D) of ``slot``'s first ``length`` positions at physical layer
        ``layer``, chunk by chunk through its block table (copies; for checks, not the decode path)."""
        chunks = self.table[slot, : chunk_span(length) // ATTN_CHUNK].tolist()
        keys, values = (torch.cat([t[layer][:, :, b] for b in chunks], dim=2) for t in (self.keys, self.values))
        return keys[:, :, :length], values[:, :, :length]

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
        chunk = pos // ATTN_CHUNK
        self._take(np.array([slot]), np.array([chunk]))
        b, at, entry = int(self.table[slot, chunk]), pos % ATTN_CHUNK, slot * self.n_side + side
        for j in range(len(self.keys)):
            self.keys[j][:loops_done, :, b, at] = self.side_keys[j][:loops_done, entry]
            self.values[j][:loops_done, :, b, at] = self.side_values[j][:loops_done, entry]
        self.lengths[:loops_done, :, slot] = pos + 1

    def invalidate(self, slot: int, from_pos: int) -> None:
        """Drop positions >= ``from_pos`` of ``slot`` at every virtual layer (no copy); the blocks wholly past them
        go back to the pool."""
        np.minimum(self.lengths[:, :, slot], from_pos, out=self.lengths[:, :, slot])
        self._give_back(slot, -(-from_pos // ATTN_CHUNK))

    def reset(self, slot: int) -> None:
        """Empty ``slot`` and return its blocks, e.g. when its request leaves or a new one takes it over."""
        self.lengths[:, :, slot] = 0
        self._give_back(slot, 0)


class StagedView:
    """A ``KVCache`` as a staged pass's layers see it (``KVCache.stage``): ``write`` and ``attend`` as the cache's,
    but through the staged index, whatever rows they are handed (they read nothing of them)."""

    native_attention = False  # a staged pass attends on the Triton kernel
    triton_attention = True

    def __init__(self, cache: KVCache, index: StagedIndex) -> None:
        self.cache, self.index = cache, index

    def write(self, layer: int, rows: Rows, k: Tensor, v: Tensor) -> None:
        self.cache.write_staged(layer, self.index, k, v)

    def attend(self, layer: int, rows: Rows, q: Tensor, bias: Tensor | None = None) -> Tensor:
        return self.cache.attend_staged(layer, self.index, q, bias)


def _as_padding(rows: Rows, dead: np.ndarray, scratch: int) -> Rows:
    """``rows`` with the ``dead`` ones (mask) made padding rows: chain rows of the ``scratch`` slot at loop 0,
    position 0 (copies: ``rows`` stays as it was)."""
    slot, loop, pos = (np.where(dead, fill, a) for a, fill in ((rows.slot, scratch), (rows.loop, 0), (rows.pos, 0)))
    if rows.side is None or (rows.side[~dead] < 0).all():
        return Rows(slot, loop, pos)
    up = tuple(() if d else u for d, u in zip(dead.tolist(), rows.up))
    return Rows(slot, loop, pos, np.where(dead, -1, rows.side), up)
