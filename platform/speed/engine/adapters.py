"""The engine's view of each model family: a ``Stepper`` over a plain ``nn.Module``.

The models (``speed.model.SpeedT5``, ``speed.lm.LoopedLM``) only compute:
forward passes, exits, and the layers' one-row-per-token decode kernels. What
the engine needs beyond that (a request's slot in the decoding memory, its
admission, where its rows sit in the KV cache) lives here, one adapter per
family; ``stepper_for`` picks it, so ``Engine(model)`` and ``generate(model)``
take a model as it is. Anything else (a stub, a ``LogitRecorder``) is taken to
be a ``Stepper`` already.

- ``T5Stepper``: admission encodes the prompt alone into the slot's
  cross-attention memory; output position 0's row is the start token's.
- ``LMStepper``: admission prefills the step's prompts together (every loop,
  every position, causal) into their slots' entries of every virtual layer, each
  last position's exits output position 0's (``LoopedLM.prefill_batch``). The slot's output positions
  sit after its prompt: output position p is cache position P - 1 + p (P the
  prompt's length), a translation that ``PromptCache`` and ``step`` make, so
  the engine sees output positions only.

What a request's admission leaves in the cache and the first token's logits
depend on its prompt alone, never on the requests admitted with it: T5 encodes
each prompt alone; the LM's batched prefill runs its prompts' tokens as rows of
the row-invariant kernels (``speed.kernels.rows_linear``) and attends within
each prompt, where a plain (B, T) GEMM would round with B and the padding.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import Tensor

from speed.cache import KVCache, Rows
from speed.engine.types import Admitted
from speed.kernels import chunk_span, in_tiles, tile_linear
from speed.lm import LMCache, LoopedLM
from speed.model import SpeedT5


def _mask_value(dtype: torch.dtype) -> float:
    return torch.finfo(dtype).min


# ----- T5 --------------------------------------------------------------------------------------------------


@dataclass
class Memory:
    """Slot-addressed decoding inputs of T5: one slot per request decoded at once, shared by every loop.

    ``keys[j]``/``values[j]``: cross-attention keys/values (C, H, S, D) of
    physical layer j for C slots of up to S encoder tokens (S: the longest
    prompt rounded up to whole attention chunks), written once when a
    request is admitted to its slot. ``cross_bias``: (C, 1, 1, S) mask of
    each slot's real tokens (0) and unused tail (a large negative);
    ``prompt_lens`` (C,): each slot's number of real tokens. ``self_bias``:
    (max_len, H, L) decoder position bias plus causal mask for L key positions
    (``max_len`` rounded up to whole chunks), indexed by query position; it
    does not depend on the request.
    """

    keys: list[Tensor]
    values: list[Tensor]
    cross_bias: Tensor
    self_bias: Tensor
    prompt_lens: np.ndarray


class _Adapter:
    """What every adapter forwards from its model: loops, EOS, vocabulary, device, training mode."""

    def __init__(self, model: SpeedT5 | LoopedLM) -> None:
        self.model = model
        self.n_loops, self.eos_id, self.vocab_size = model.n_loops, model.eos_id, model.vocab_size

    @property
    def training(self) -> bool:
        return self.model.training

    def eval(self) -> _Adapter:
        """The model's inference mode (what ``generate`` sets around a decode of a model in training mode)."""
        self.model.eval()
        return self

    def train(self, mode: bool = True) -> _Adapter:
        """The model's training mode back."""
        self.model.train(mode)
        return self

    @property
    def device(self) -> torch.device:
        return self.model.device


class T5Stepper(_Adapter):
    """The engine's view of a ``SpeedT5``: encoder memory per slot, the decoder's shared group once per pipeline
    step (the group pass, ``step``)."""

    model: SpeedT5

    def cache(self, n_slots: int, max_prompt_len: int, max_len: int) -> KVCache:
        """An empty KV cache for ``n_slots`` requests of up to ``max_len`` decoder positions each (the prompt
        is the encoder's: it takes no decoder position)."""
        m, c = self.model, self.model.config
        p = m.lm_head.weight
        return KVCache(m.n_loops, len(m.decoder_layers), n_slots, c.n_heads, max_len, c.d_kv, p.dtype, p.device)

    def memory(self, capacity: int, max_prompt_len: int, max_len: int) -> Memory:
        """Empty decoding memory: ``capacity`` slots of up to ``max_prompt_len`` encoder tokens.

        The decoder position bias for ``max_len`` positions is built here, once.
        """
        m, c = self.model, self.model.config
        p = m.lm_head.weight
        S, L = chunk_span(max_prompt_len), chunk_span(max_len)
        shape = (capacity, c.n_heads, S, c.d_kv)
        keys = [torch.zeros(shape, dtype=p.dtype, device=p.device) for _ in m.decoder_layers]
        values = [torch.zeros(shape, dtype=p.dtype, device=p.device) for _ in m.decoder_layers]
        cross_bias = torch.full((capacity, 1, 1, S), _mask_value(p.dtype), dtype=p.dtype, device=p.device)
        causal = torch.full((max_len, L), _mask_value(p.dtype), dtype=p.dtype, device=p.device).triu(1)
        self_bias = (m.decoder_bias(max_len, L) + causal).transpose(0, 1).contiguous()  # (q, H, k)
        return Memory(keys, values, cross_bias, self_bias, np.zeros(capacity, dtype=np.int64))

    def admit(self, memory: Memory, cache: KVCache, slots: Sequence[int], prompts: Sequence[Tensor]) -> list[Admitted]:
        """Encode each request's ids (S,) into its slot: its cross-attention keys/values and mask.

        Each request is encoded alone, so its keys do not depend on which
        requests arrive with it; the slot's stale tail past S is masked. The
        decoder starts from the start token (T5's pad).
        """
        return [self._encode(memory, slot, prompt) for slot, prompt in zip(slots, prompts)]

    @torch.no_grad()
    def _encode(self, memory: Memory, slot: int, prompt: Tensor) -> Admitted:
        S = prompt.shape[0]
        encoded = self.model.encode(prompt[None])  # (1, S, d)
        for j, layer in enumerate(self.model.decoder_layers):
            k, v = layer.cross_attn.keys_values(encoded)  # 2 x (1, H, S, D)
            memory.keys[j][slot, :, :S] = k[0]
            memory.values[j][slot, :, :S] = v[0]
        memory.cross_bias[slot, ..., :S] = 0.0
        memory.cross_bias[slot, ..., S:] = _mask_value(memory.cross_bias.dtype)
        memory.prompt_lens[slot] = S
        return Admitted(self.model.start_id, None)

    def embed(self, tokens: Sequence[int] | Tensor) -> Tensor:
        """Decoder input embeddings (R, d) of token ids (R,)."""
        return self.model.shared(torch.as_tensor(tokens, dtype=torch.long, device=self.device))

    def step(
        self, memory: Memory, cache: KVCache, rows: Rows, hidden: Tensor, with_logits: bool = True
    ) -> tuple[Tensor, Tensor | None]:
        """One group pass (the model's call in a pipeline step): the shared N-layer group over R rows, each at
        its own loop.

        ``hidden`` (R, d) is each row's input to this loop; returns its output
        (R, d) and, if asked, the early-exit logits (R, V). Each row's results
        are bit-identical whatever other rows share the pass: the rows run in
        tiles of up to ``TILE_ROWS`` on row-invariant kernels (see ``speed.kernels``).
        """
        return in_tiles(lambda part, x: self._pass_tile(memory, cache, part, x, with_logits), rows, hidden)

    def _pass_tile(
        self, memory: Memory, cache: KVCache, rows: Rows, x: Tensor, with_logits: bool
    ) -> tuple[Tensor, Tensor | None]:
        """The group pass for one tile of n <= ``TILE_ROWS`` rows, ``x`` (n, d)."""
        m = self.model
        # Attention runs over the fewest whole chunks that cover the tile's rows: the kernels' results do not
        # depend on how many masked chunks follow (see ``attend``), so the span changes no row's logits.
        n, slot_t, _, pos_t = len(rows), *rows.tensors(x.device)
        L, S = chunk_span(int(rows.pos.max()) + 1), chunk_span(int(memory.prompt_lens[rows.slot].max()))
        self_bias = memory.self_bias[..., :L].index_select(0, pos_t).unsqueeze(2)  # (n, H, 1, L)
        first = int(rows.slot[0])
        one_slot = bool((rows.slot == first).all())  # e.g. one request's pipeline: share its keys, copy none

        def source(t: Tensor) -> Tensor:  # each row's slot of a per-slot tensor (C, ...) -> (n, ...)
            return t.narrow(0, first, 1).expand(n, *t.shape[1:]) if one_slot else t.index_select(0, slot_t)

        cross_bias = source(memory.cross_bias[..., :S])  # (n, 1, 1, S)
        # CYCLE order: loop l's pass runs virtual layers l*N .. l*N+N-1, which are the N unique layers in order
        for j, layer in enumerate(m.decoder_layers):
            keys, values = source(memory.keys[j][:, :, :S]), source(memory.values[j][:, :, :S])  # (n, H, S, D)
            x = layer.decode(x, rows, cache, j, self_bias, keys, values, cross_bias)  # (n, d)
        if not with_logits:
            return x, None
        # The exit adapters (speed.exits) change the early exits' inputs only: x, the carry, stays as it is
        y = x if m.exit_adapters is None else m.exit_adapters.adapt_rows(x, rows.loop)
        return x, tile_linear(m.lm_head, m.decoder_norm(y))


# ----- the decoder-only looped LM --------------------------------------------------------------------------


class PromptCache:
    """An ``LMCache`` seen in output positions: output position p of a slot is its cache position
    ``offset[slot] + p``, after the slot's prompt (``offset``: the prompt's length minus 1)."""

    def __init__(self, inner: LMCache) -> None:
        self.inner = inner
        self.offset = np.zeros(inner.loops.n_slots, dtype=np.int64)  # (C,)

    @property
    def device(self) -> torch.device:
        return self.inner.device

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


class LMStepper(_Adapter):
    """The engine's view of a ``LoopedLM``: the prompt prefilled into the cache at admission, no memory."""

    model: LoopedLM

    def cache(self, n_slots: int, max_prompt_len: int, max_len: int) -> PromptCache:
        """An empty cache for ``n_slots`` requests of a prompt of up to ``max_prompt_len`` tokens and
        ``max_len`` output positions each (output position 0's row is the prompt's last)."""
        return PromptCache(self.model.cache(n_slots, max_prompt_len + max_len - 1))

    def memory(self, capacity: int, max_prompt_len: int, max_len: int) -> None:
        """None: everything a request keeps is in the cache."""
        return None

    def admit(
        self, memory: None, cache: PromptCache, slots: Sequence[int], prompts: Sequence[Tensor]
    ) -> list[Admitted]:
        """Prefill the requests' prompts (each (P,)) together into their empty slots (``LoopedLM.prefill_batch``:
        row-invariant, so each prompt's result is its own alone); each last position's exits (M, V) are its
        output position 0's."""
        exits = self.model.prefill_batch(cache.inner, slots, prompts)
        for slot, prompt in zip(slots, prompts):
            cache.offset[slot] = prompt.shape[0] - 1
        return [Admitted(int(prompt[-1]), x) for prompt, x in zip(prompts, exits)]

    def embed(self, tokens: Sequence[int] | Tensor) -> Tensor:
        """Each token's carry into its first loop (R, W) (``LoopedLM.embed``)."""
        return self.model.embed(tokens)

    def step(
        self, memory: None, cache: PromptCache, rows: Rows, hidden: Tensor, with_logits: bool = True
    ) -> tuple[Tensor, Tensor | None]:
        """One group pass over R rows at their output positions (``LoopedLM.step`` at cache positions)."""
        return self.model.step(cache.inner, cache.rows(rows), hidden, with_logits)


def stepper_for(model: Any) -> Any:
    """The engine's ``Stepper`` for ``model``: its family's adapter, or ``model`` itself if it is none of them
    (a stub, a ``LogitRecorder``, an adapter)."""
    if isinstance(model, SpeedT5):
        return T5Stepper(model)
    if isinstance(model, LoopedLM):
        return LMStepper(model)
    return model
