"""``LoopedLM``'s cached incremental path: its KV cache (``LMCache``), the prompts' ``prefill`` and the group pass
``step``, one pass of the loop over rows each at its own loop and position (the model's call in one of the
engine's pipeline steps), on the batch-invariant kernels of ``speed.engine.kernels`` as T5's
(``speed.models.t5.SpeedT5.step``) is; and the staged pass a CUDA graph captures (``stage``, ``StagedPass``,
``step_staged``). ``LMDecoding`` holds these methods and ``speed.models.looped_lm.LoopedLM`` inherits them: one
model, its whole-sequence path there and its cached path here, which compute the same logits.

Shapes: B batch, T length, R decode rows (n in one tile), d d_model, W the carry's width (d, or 2d with
injection), K key/value heads, D head_dim, L key positions, V vocabulary, M loops, N core, P prelude and C coda
layers.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch
from torch import Tensor, nn

from speed.engine.cache import KVCache, Rows, StagedView
from speed.engine.cache_index import StagedIndex
from speed.engine.kernels import TILE_ROWS, in_tiles, rows_norm, tile_rms_norm
from speed.engine.matmuls import BiasFree, pack_linears, rows_linear, tile_linear
from speed.engine.rows import to_device
from speed.models.exits import exit_logits
from speed.models.lm_blocks import Store, rotary


@dataclass
class LMCache:
    """Keys/values of every virtual layer for ``n_slots`` sequences, in pools of blocks (see ``KVCache``).

    ``loops``: one entry per (loop, layer) of the looped layers, layer j < N
    the core's layer j and layer N + c the coda's layer c (the coda runs in
    every loop's exit). ``prelude``: the prelude's P layers, which run once per
    token (its only loop is 0), with as many side entries per slot as
    ``loops`` (a runner-up branch runs the prelude at its loop 0); None
    without a prelude.
    """

    loops: KVCache
    prelude: KVCache | None
    draws: dict[int, Tensor] = field(default_factory=dict)  # a staged pass's initial states by row count (static)

    @property
    def device(self) -> torch.device:
        return self.loops.device

    @property
    def n_blocks(self) -> int:
        """Blocks in each part's pool (the parts take the same blocks per slot, so they run out together)."""
        return self.loops.n_blocks

    @property
    def blocks_used(self) -> int:
        """Blocks taken now in the looped layers' pool (the prelude's takes the same)."""
        return self.loops.blocks_used

    def _parts(self) -> list[KVCache]:
        return [self.loops] if self.prelude is None else [self.prelude, self.loops]

    def invalidate(self, slot: int, from_pos: int) -> None:
        """Drop positions >= ``from_pos`` of ``slot`` at every virtual layer (no copy)."""
        for part in self._parts():
            part.invalidate(slot, from_pos)

    def reset(self, slot: int) -> None:
        """Empty ``slot``, e.g. for a new sequence."""
        for part in self._parts():
            part.reset(slot)

    def promote(self, slot: int, side: int, pos: int, loops_done: int) -> None:
        """Make the branch in side entry ``side`` of ``slot`` the token at ``pos`` (``KVCache.promote``); the
        prelude's entry is its loop 0's."""
        for part in self._parts():
            part.promote(slot, side, pos, loops_done)



@dataclass(frozen=True)
class StagedPass:
    """A group pass staged on the host (``LoopedLM.stage``): what ``LoopedLM.step_staged`` reads, all on the
    device in static buffers of its row count."""

    loops: StagedIndex  # the looped layers' cache index (positions and loops of the rows among it)
    prelude: StagedIndex | None  # the prelude's (rows past loop 0 as padding rows); None without a prelude
    draws: Tensor | None  # (R, d) the rows at loop 0's initial states (zero elsewhere); None without them


class LMDecoding:
    """The cached path of a ``LoopedLM`` (which inherits it): a cache, the prefill of prompts into it, the group
    pass over rows and its staged form. It reads the model's layers and options (``config``, ``sharing``,
    ``n_loops``, ``prelude``, ``core``, ``coda``, ``adapter``, ``norm``, ``lm_head``, ``exit_gate``,
    ``exit_adapters``, ``initial_state``, ``device``, ``compute_dtype``) and the steps both paths share
    (``_embed``, ``_inject``, ``_first_state``), all defined by ``LoopedLM``."""

    def cache(self, n_slots: int, max_len: int, side: bool = True, blocks: int | None = None) -> LMCache:
        """An empty cache for ``n_slots`` sequences of up to ``max_len`` positions (prompt included) each; with
        the runner-up branches' side entries if ``side`` (else none: a sequence decoded without branches); a pool
        of ``blocks`` blocks of ``ATTN_CHUNK`` positions (None: every slot at ``max_len``; see ``KVCache``)."""
        c, dtype = self.config, self.compute_dtype

        def kv(n_loops: int, n_layers: int, n_side: int) -> KVCache | None:
            if n_layers == 0:
                return None
            shape = (n_loops, n_layers, n_slots, c.n_kv_heads, max_len, c.head_dim)
            return KVCache(*shape, dtype, self.device, n_side, blocks)

        return LMCache(*(kv(*part) for part in self._cache_parts(side)))

    def cache_bytes(self, n_slots: int, max_len: int, side: bool = True, blocks: int | None = None) -> tuple[int, int]:
        """Bytes ``cache`` of these arguments allocates: (its pools', its side entries'), without allocating."""
        c, dtype = self.config, self.compute_dtype
        parts = [
            KVCache(
                n_loops, n_layers, n_slots, c.n_kv_heads, max_len, c.head_dim, dtype, "meta", n_side, blocks
            ).nbytes()
            for n_loops, n_layers, n_side in self._cache_parts(side)
            if n_layers
        ]
        return sum(kv for kv, _ in parts), sum(s for _, s in parts)

    def _cache_parts(self, side: bool) -> list[tuple[int, int, int]]:
        """(loops, layers, side entries per slot) of ``LMCache.loops`` and ``LMCache.prelude`` (0 layers: none)."""
        s = self.sharing
        n_side = s.n_loops**2 if side else 0  # the looped layers' side entries, in the prelude too
        return [(s.n_loops, s.n_unique + s.coda, n_side), (1, s.prelude, n_side)]

    def prefill(self, cache: LMCache, slot: int, input_ids: Tensor) -> Tensor:
        """``prefill_batch`` of one prompt (T,) into ``slot``: each loop's logits (M, V) at its last position."""
        return self.prefill_batch(cache, [slot], [input_ids])[0]

    def prefill_batch(self, cache: LMCache, slots: Sequence[int], prompts: Sequence[Tensor]) -> list[Tensor]:
        """``prefill_gated``'s logits alone."""
        return self.prefill_gated(cache, slots, prompts, gates=False)[0]

    @torch.no_grad()
    def prefill_gated(
        self, cache: LMCache, slots: Sequence[int], prompts: Sequence[Tensor], gates: bool = True
    ) -> tuple[list[Tensor], list[Tensor] | None]:
        """Run prompts (each (T_b,)) through every loop into their empty slots, together: their keys/values at
        positions 0..T_b-1 of every virtual layer; returns each prompt's loops' logits (M, V) at its last
        position (its first new token's), and with ``gates`` their loops' exit-gate lambdas (M,) there too (else
        None; the model must have a gate).

        The prompts' tokens are the rows of one pass: every matmul runs on tiles of ``PREFILL_ROWS`` rows of
        them on the row-invariant kernels (``speed.engine.matmuls.rows_linear``), attention runs on each prompt
        alone, and the exits' head on tiles of its last rows, so what a prompt leaves in the cache and its
        logits do not depend on the prompts prefilled with it, nor on their order.
        """
        if len(slots) != len(prompts) or not prompts:
            raise ValueError(f"prefill_batch needs one slot per prompt, got {len(slots)} slots, {len(prompts)} prompts")
        if any(p.numel() == 0 for p in prompts):
            raise ValueError("prefill needs at least one prompt token")
        c, N = self.config, self.sharing.n_unique
        ids = torch.cat([p.reshape(-1) for p in prompts]).to(self.device)  # (R,)
        lengths = [p.numel() for p in prompts]
        starts = np.cumsum([0, *lengths[:-1]]).tolist()
        segments = list(zip(starts, lengths))
        positions = torch.cat([torch.arange(T, device=self.device) for T in lengths])
        cos, sin = rotary(positions, c.head_dim, c.rope_theta, c.rope_layout)  # 2 x (R, D)

        def stores(part: str, loop: int, layer: int) -> list[Store]:
            kv = getattr(cache, part)
            return [lambda k, v, s=slot: kv.write_span(layer, loop, s, 0, k[0], v[0]) for slot in slots]

        e = self._embed(ids)  # (R, d)
        for p, block in enumerate(self.prelude):
            e = block.prefill(e, cos, sin, segments, stores("prelude", 0, p))
        state = self._first_state(e, positions) if self.adapter is not None else e
        last = torch.tensor([s + T - 1 for s, T in segments], device=self.device)
        logits, lambdas = [], []
        for i in range(self.n_loops):
            h = self._inject(state, e, rows_linear) if self.adapter is not None else state  # (R, d)
            for j, block in enumerate(self.core):
                h = block.prefill(h, cos, sin, segments, stores("loops", i, j))
            y = tile_rms_norm(self.norm, h) if c.coda_norm else h
            for k, block in enumerate(self.coda):
                y = block.prefill(y, cos, sin, segments, stores("loops", i, N + k))
            y = y.index_select(0, last)  # (B, d)
            if gates:
                lambdas.append(self._gate(rows_norm(self.norm, y), rows_linear))  # (B,)
            if self.exit_adapters is not None:
                y = self.exit_adapters.adapt_rows(y, [i] * len(prompts))
            logits.append(rows_linear(self.lm_head, rows_norm(self.norm, y), TILE_ROWS))  # (B, V)
            state = rows_norm(self.norm, h) if c.loop_norm else h
        return list(torch.stack(logits, dim=1)), (list(torch.stack(lambdas, dim=1)) if gates else None)  # B x (M, V)

    def _gate(self, state: Tensor, linear: Callable[[nn.Linear, Tensor], Tensor]) -> Tensor:
        """Each row's exit-gate lambda (R,) from its normed exit state (R, d): sigmoid(exit_gate(state)), the gate
        applied by ``linear`` (a row kernel, which takes bias-free layers: its bias is added after)."""
        if self.exit_gate is None:
            raise ValueError("this LoopedLM has no exit gate (LMConfig.exit_gate)")
        return torch.sigmoid(linear(BiasFree(self.exit_gate.weight), state)[:, 0] + self.exit_gate.bias)

    def pack_for_decoding(self) -> int:
        """Pack the weights that decode on the native kernel for it (``speed.engine.matmuls.pack_linears``: 4-8
        rows a pass at about one row's cost); returns how many. The cached decoding and the prefill run on the
        packed layers; ``forward`` and training do not (``unpack_linears`` restores the layers)."""
        return pack_linears(self)

    def embed(self, tokens: Sequence[int] | Tensor) -> Tensor:
        """Each token's carry into its first loop (R, W): its embedding, after a zero state with injection (the
        step draws ``initial_state``'s at the token's position: embed knows no position)."""
        x = self._embed(torch.as_tensor(tokens, dtype=torch.long, device=self.device))  # (R, d)
        return torch.cat([torch.zeros_like(x), x], dim=-1) if self.adapter is not None else x

    def step(
        self,
        cache: LMCache,
        rows: Rows,
        hidden: Tensor,
        with_logits: bool = True,
        logit_rows: Sequence[int] | None = None,
    ) -> tuple[Tensor, Tensor | None]:
        """One group pass of the loop over R rows, each at its own loop and position (the model's call in a
        pipeline step of ``speed.engine``).

        ``hidden`` (R, W) is each row's carry into this loop: ``embed``'s at
        loop 0, else what the previous ``step`` returned for it. Without
        injection the carry is the loop's input; with it, [state, e]. A row at
        loop 0 first runs the prelude (e = prelude(embedding)); every row then
        runs the core and its exit (the coda, the final norm and, if asked,
        the LM head) for the rows ``logit_rows`` names (ascending; None: all).
        Returns the carries into the next loop (R, W) and those rows' exit
        logits (K, V). Each row's results are bit-identical whatever
        other rows share the pass (tiles of ``TILE_ROWS`` rows on the
        row-invariant kernels of ``speed.engine.kernels``; the exits in tiles
        of their own, ``speed.models.exits.exit_logits``).
        """
        carry, y = in_tiles(lambda part, c: self._pass_tile(cache, part, c, with_logits), rows, hidden)
        return carry, (self._exit_logits(y, rows, logit_rows) if with_logits else None)

    def step_gated(
        self, cache: LMCache, rows: Rows, hidden: Tensor, logit_rows: Sequence[int] | None = None
    ) -> tuple[Tensor, Tensor, Tensor]:
        """``step`` with the exit logits (K, V) of the rows ``logit_rows`` names and every row's exit-gate lambda
        (R,) beside them (``exit_lambdas``' in the cached path: sigmoid(exit_gate(norm(y))), row-invariant as the
        logits)."""
        d = self.config.d_model
        carry, both = in_tiles(lambda part, c: self._pass_tile(cache, part, c, True, gates=True), rows, hidden)
        return carry, self._exit_logits(both[:, :d], rows, logit_rows), both[:, d]

    def stage(self, cache: LMCache, rows: Rows) -> StagedPass:
        """The host's part of ``step`` over ``rows`` (R), done before it (``LMStepper.prepare``, before a captured
        CUDA graph's replay): each cache part's bookkeeping and index (``KVCache.stage``; the prelude's with the
        rows past loop 0 as padding rows), and with an ``initial_state`` the draws of the rows at loop 0, each
        into static buffers of this row count. ``step_staged`` then reads those alone."""
        first = rows.loop == 0
        prelude = cache.prelude.stage(rows, first) if self.prelude else None
        draws = None
        if self.adapter is not None and self.initial_state is not None:
            R, d = len(rows), self.config.d_model
            draws = cache.draws.get(R)
            if draws is None:
                draws = cache.draws[R] = torch.zeros(R, d, dtype=self.compute_dtype, device=cache.device)
            host = torch.zeros(R, d, dtype=draws.dtype)
            if first.any():
                host[torch.from_numpy(np.flatnonzero(first))] = self.initial_state.draw(rows.pos[first], host)
            draws.copy_(to_device(host, cache.device))
        return StagedPass(cache.loops.stage(rows), prelude, draws)

    def step_staged(
        self,
        cache: LMCache,
        staged: StagedPass,
        rows: Rows,
        hidden: Tensor,
        with_logits: bool = True,
        logit_rows: Sequence[int] | None = None,
    ) -> tuple[Tensor, Tensor | None]:
        """``step`` over the rows ``stage`` staged, reading only device tensors (the staged buffers, ``hidden``
        and the weights), never ``rows``' host arrays nor anything back from the device: the pass a CUDA graph
        captures. On the Triton kernels, all rows at once; the same bits as ``step``'s.

        The prelude runs on every row (those past loop 0 as padding rows, their results dropped by a select on
        the device) and the exit adapters on every exit (unadapted rows keep their inputs' bits), so that no
        host decision depends on the rows."""
        c, d = self.config, self.config.d_model
        cos, sin = rotary(staged.loops.pos, c.head_dim, c.rope_theta, c.rope_layout)  # 2 x (R, D)
        x = hidden[:, -d:]
        first = (staged.loops.loop == 0)[:, None]  # (R, 1) on the device
        if self.prelude:
            e, view = x, StagedView(cache.prelude, staged.prelude)
            for p, block in enumerate(self.prelude):
                e = block.decode(e, cos, sin, rows, view, p)
            x = torch.where(first, e, x)
        h = x
        if self.adapter is not None:
            state = hidden[:, :d]
            if staged.draws is not None:
                state = torch.where(first, staged.draws, state)
            h = self._inject(state, x, tile_linear)
        carry, y = self._loop_tile(StagedView(cache.loops, staged.loops), rows, h, x, cos, sin, with_logits)
        if not with_logits:
            return carry, None
        return carry, exit_logits(y, staged.loops.loop, logit_rows, self.exit_adapters, self.norm, self.lm_head)

    def _exit_logits(self, y: Tensor, rows: Rows, logit_rows: Sequence[int] | None) -> Tensor:
        """The exit logits (K, V) of the picked rows of the coda's outputs ``y`` (R, d) (adapted, normed, the head)."""
        return exit_logits(y, rows.loop, logit_rows, self.exit_adapters, self.norm, self.lm_head)

    def _pass_tile(
        self, cache: LMCache, rows: Rows, carry: Tensor, with_exits: bool, gates: bool = False
    ) -> tuple[Tensor, Tensor | None]:
        """The group pass (``step``) for one tile of n <= ``TILE_ROWS`` rows, ``carry`` (n, W): the carries into
        the next loop and, ``with_exits``, the exits' inputs (the coda's outputs, (n, d)); with ``gates`` each
        row's gate lambda as one more column of them (n, d + 1), so that ``in_tiles`` joins both."""
        c, d = self.config, self.config.d_model
        _, _, pos_t = rows.tensors(carry.device)
        cos, sin = rotary(pos_t, c.head_dim, c.rope_theta, c.rope_layout)  # 2 x (n, D)
        x = carry[:, -d:]  # (n, d): the embedding at loop 0; then e with injection, else the loop's input
        first = np.flatnonzero(rows.loop == 0)
        if self.prelude and len(first):
            at = torch.as_tensor(first, device=carry.device)
            e, part = x.index_select(0, at), rows.take(first)  # the rows at loop 0
            for p, block in enumerate(self.prelude):
                e = block.decode(e, cos[at], sin[at], part, cache.prelude, p)
            x = x.index_copy(0, at, e)
        if self.adapter is not None:
            state = carry[:, :d]  # (n, d)
            if self.initial_state is not None and len(first):  # the rows at loop 0: their positions' draws
                at = torch.as_tensor(first, device=carry.device)
                state = state.index_copy(0, at, self.initial_state.draw(rows.pos[first], state))
            h = self._inject(state, x, tile_linear)  # (n, d)
        else:
            h = x
        return self._loop_tile(cache.loops, rows, h, x, cos, sin, with_exits, gates)

    def _loop_tile(
        self,
        loops: KVCache | StagedView,
        rows: Rows,
        h: Tensor,
        x: Tensor,
        cos: Tensor,
        sin: Tensor,
        with_exits: bool,
        gates: bool = False,
    ) -> tuple[Tensor, Tensor | None]:
        """The rest of ``_pass_tile`` from the loop's input h (n, d) on (``x``: the carry's e with injection): the
        core and the coda writing and reading ``loops``, the exits' inputs, the carries."""
        c, N = self.config, self.sharing.n_unique
        for j, block in enumerate(self.core):
            h = block.decode(h, cos, sin, rows, loops, j)
        y = tile_rms_norm(self.norm, h) if c.coda_norm else h
        for k, block in enumerate(self.coda):
            y = block.decode(y, cos, sin, rows, loops, N + k)
        exits = None
        if with_exits:  # the exit adapters (speed.models.exits) change the exits' inputs only, never the carry
            lam = self._gate(rows_norm(self.norm, y), tile_linear)[:, None] if gates else None  # (n, 1)
            exits = y if lam is None else torch.cat([y, lam.to(y.dtype)], dim=-1)
        state = tile_rms_norm(self.norm, h) if c.loop_norm else h  # (n, d)
        return (torch.cat([state, x], dim=-1) if self.adapter is not None else state), exits
