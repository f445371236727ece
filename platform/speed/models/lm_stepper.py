"""The engine's view of a ``LoopedLM`` (``LoopedLM.stepper()``): its prompt prefilled into the cache at
admission, no other memory, and the rows' output positions mapped to cache positions after the prompt
(``PromptCache``).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
from torch import Tensor

from speed.engine.cache import Rows, pool_blocks
from speed.engine.kernels import ATTN_CHUNK, attention_triton, chunk_span
from speed.engine.memory import MemoryNeed
from speed.engine.types import Admitted
from speed.models.lm_decode import LMCache, LMDecoding, StagedPass
from speed.models.steppers import ModelStepper


class PromptCache:
    """An ``LMCache`` seen in output positions: output position p of a slot is its cache position
    ``offset[slot] + p``, after the slot's prompt (``offset``: the prompt's length minus 1)."""

    def __init__(self, inner: LMCache) -> None:
        self.inner = inner
        self.offset = np.zeros(inner.loops.n_slots, dtype=np.int64)  # (C,)

    @property
    def device(self) -> torch.device:
        return self.inner.device

    @property
    def n_blocks(self) -> int:
        """Blocks in the pool (``LMCache.n_blocks``)."""
        return self.inner.n_blocks

    @property
    def blocks_used(self) -> int:
        """Blocks taken now (``LMCache.blocks_used``)."""
        return self.inner.blocks_used

    def blocks_needed(self, prompt_len: int, max_new_tokens: int) -> int:
        """Blocks a request reserves: one per chunk of its cache positions, its prompt's but the last (that one
        is output position 0's row) and its ``max_new_tokens`` output positions."""
        return chunk_span(prompt_len - 1 + max_new_tokens) // ATTN_CHUNK

    def reset(self, slot: int) -> None:
        self.inner.reset(slot)
        self.offset[slot] = 0

    def invalidate(self, slot: int, from_pos: int) -> None:
        self.inner.invalidate(slot, int(self.offset[slot]) + from_pos)

    def promote(self, slot: int, side: int, pos: int, loops_done: int) -> None:
        self.inner.promote(slot, side, int(self.offset[slot]) + pos, loops_done)

    def rows(self, rows: Rows) -> Rows:
        """``rows`` at their cache positions."""
        offset = self.offset[rows.slot]
        if rows.side is None:
            return Rows(rows.slot, rows.loop, rows.pos + offset)
        up = tuple(tuple((p + int(o), b) for p, b in lane) for lane, o in zip(rows.up, offset))
        return Rows(rows.slot, rows.loop, rows.pos + offset, rows.side, up)


class LMStepper(ModelStepper):
    """The engine's view of a ``LoopedLM``: the prompt prefilled into the cache at admission, no memory."""

    model: LMDecoding  # a LoopedLM, through its cached path
    _staged: tuple[Rows, StagedPass] | None = None  # the rows ``prepare`` staged last, and what it staged

    @property
    def gated(self) -> bool:
        """Whether the model has an exit gate (``step_gated``; ``exit_gate`` requests need one)."""
        return self.model.exit_gate is not None

    def cache(
        self, n_slots: int, max_prompt_len: int, max_len: int, side: bool = True, blocks: int | None = None
    ) -> PromptCache:
        """An empty cache for ``n_slots`` requests of a prompt of up to ``max_prompt_len`` tokens and
        ``max_len`` output positions each (output position 0's row is the prompt's last); with the runner-up
        branches' side entries if ``side``; a pool of ``blocks`` blocks (None: every slot at its longest)."""
        return PromptCache(self.model.cache(n_slots, max_prompt_len + max_len - 1, side, blocks))

    def memory_need(
        self, n_slots: int, max_prompt_len: int, max_len: int, side: bool = True, blocks: int | None = None
    ) -> MemoryNeed:
        """What ``cache`` of this capacity allocates (the prompt's positions included), and the weights."""
        positions = max_prompt_len + max_len - 1
        cache, side_bytes = self.model.cache_bytes(n_slots, positions, side, blocks)
        return MemoryNeed(self.weights_bytes(), cache, side_bytes, 0, pool_blocks(n_slots, positions, blocks))

    def memory(self, capacity: int, max_prompt_len: int, max_len: int) -> None:
        """None: everything a request keeps is in the cache."""
        return None

    def admit(
        self, memory: None, cache: PromptCache, slots: Sequence[int], prompts: Sequence[Tensor]
    ) -> list[Admitted]:
        """Prefill the requests' prompts (each (P,)) together into their empty slots (``LoopedLM.prefill_batch``:
        row-invariant, so each prompt's result is its own alone); each last position's exits (M, V) are its
        output position 0's."""
        exits, gates = self.model.prefill_gated(cache.inner, slots, prompts, gates=self.gated)
        for slot, prompt in zip(slots, prompts):
            cache.offset[slot] = prompt.shape[0] - 1
        gates = [None] * len(prompts) if gates is None else gates
        return [Admitted(int(prompt[-1]), x, g) for prompt, x, g in zip(prompts, exits, gates)]

    def embed(self, tokens: Sequence[int] | Tensor) -> Tensor:
        """Each token's carry into its first loop (R, W) (``LoopedLM.embed``)."""
        return self.model.embed(tokens)

    @property
    def capturable(self) -> bool:
        """Whether a CUDA graph can replay this stepper's pass (``speed.engine.graphs``): on the Triton kernels,
        whose pass ``prepare`` stages."""
        return attention_triton(self.device)

    def prepare(self, memory: None, cache: PromptCache, rows: Rows) -> None:
        """The host's part of the next ``step`` over ``rows`` (a bucket's rows, ``speed.engine.graphs``), done
        before it: ``LoopedLM.stage`` at their cache positions, where the cache attends on the Triton kernel
        (elsewhere ``step`` does its bookkeeping as it goes). ``step`` over these very rows then runs
        ``LoopedLM.step_staged``, as often as it is called (a graph's warm-up and capture run it twice)."""
        if cache.inner.loops.triton_attention:
            self._staged = (rows, self.model.stage(cache.inner, cache.rows(rows)))

    def step(
        self,
        memory: None,
        cache: PromptCache,
        rows: Rows,
        hidden: Tensor,
        with_logits: bool = True,
        logit_rows: Sequence[int] | None = None,
    ) -> tuple[Tensor, Tensor | None]:
        """One group pass over R rows at their output positions (``LoopedLM.step`` at cache positions), exit
        logits for the rows ``logit_rows`` names; over the rows ``prepare`` staged, ``LoopedLM.step_staged``."""
        staged = self._staged
        if staged is not None and staged[0] is rows:
            return self.model.step_staged(cache.inner, staged[1], rows, hidden, with_logits, logit_rows)
        return self.model.step(cache.inner, cache.rows(rows), hidden, with_logits, logit_rows)

    def step_gated(
        self, memory: None, cache: PromptCache, rows: Rows, hidden: Tensor, logit_rows: Sequence[int] | None = None
    ) -> tuple[Tensor, Tensor, Tensor]:
        """``step`` with each row's exit-gate lambda (R,) beside the picked rows' logits (``LoopedLM.step_gated``)."""
        return self.model.step_gated(cache.inner, cache.rows(rows), hidden, logit_rows)
