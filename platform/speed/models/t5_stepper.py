"""The engine's view of a ``SpeedT5`` (``SpeedT5.stepper()``): its decoding memory (``Memory``: each slot's
encoder keys and values, written once at admission and shared by every loop), its KV cache, and the decoder's
shared group once per pipeline step (``SpeedT5.step``, or ``SpeedT5.step_staged`` over the rows ``prepare``
staged).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import Tensor, nn

from speed.engine.cache import KVCache, Rows, pool_blocks
from speed.engine.cache_index import StagedIndex
from speed.engine.kernels import attention_triton, chunk_span
from speed.engine.memory import MemoryNeed
from speed.engine.types import Admitted
from speed.models.steppers import ModelStepper


def mask_value(dtype: torch.dtype) -> float:
    """What an additive attention bias adds to hide a key: ``dtype``'s lowest finite value."""
    return torch.finfo(dtype).min


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


class T5Stepper(ModelStepper):
    """The engine's view of a ``SpeedT5``: encoder memory per slot, the decoder's shared group once per pipeline
    step (the group pass, ``step``)."""

    model: nn.Module  # a SpeedT5 (speed.models.t5 imports this module: not the reverse)
    _staged: tuple[Rows, StagedIndex] | None = None  # the rows ``prepare`` staged last, and their cache index

    def cache(
        self, n_slots: int, max_prompt_len: int, max_len: int, side: bool = True, blocks: int | None = None
    ) -> KVCache:
        """An empty KV cache for ``n_slots`` requests of up to ``max_len`` decoder positions each (the prompt
        is the encoder's: it takes no decoder position); with the runner-up branches' side entries if ``side``;
        a pool of ``blocks`` blocks (None: every slot at ``max_len``)."""
        m, c = self.model, self.model.config
        shape = (m.n_loops, len(m.decoder_layers), n_slots, c.n_heads, max_len, c.d_kv)
        return KVCache(*shape, m.compute_dtype, m.device, None if side else 0, blocks)

    def memory_need(
        self, n_slots: int, max_prompt_len: int, max_len: int, side: bool = True, blocks: int | None = None
    ) -> MemoryNeed:
        """What ``cache`` and ``memory`` of this capacity allocate, and the weights, without allocating."""
        m, c = self.model, self.model.config
        dtype = m.compute_dtype
        item = torch.empty((), dtype=dtype).element_size()
        N = len(m.decoder_layers)
        shape = (m.n_loops, N, n_slots, c.n_heads, max_len, c.d_kv)
        cache, side_bytes = KVCache(*shape, dtype, "meta", None if side else 0, blocks).nbytes()
        S, L = chunk_span(max_prompt_len), chunk_span(max_len)
        cross = 2 * N * n_slots * c.n_heads * S * c.d_kv  # encoder keys/values per slot
        masks = n_slots * S + max_len * c.n_heads * L  # cross_bias, self_bias
        memory = (cross + masks) * item
        return MemoryNeed(self.weights_bytes(), cache, side_bytes, memory, pool_blocks(n_slots, max_len, blocks))

    def memory(self, capacity: int, max_prompt_len: int, max_len: int) -> Memory:
        """Empty decoding memory: ``capacity`` slots of up to ``max_prompt_len`` encoder tokens.

        The decoder position bias for ``max_len`` positions is built here, once.
        """
        m, c = self.model, self.model.config
        p = m.decoder_norm.weight  # of the compute dtype (``SpeedT5.compute_dtype``), on the model's device
        S, L = chunk_span(max_prompt_len), chunk_span(max_len)
        shape = (capacity, c.n_heads, S, c.d_kv)
        keys = [torch.zeros(shape, dtype=p.dtype, device=p.device) for _ in m.decoder_layers]
        values = [torch.zeros(shape, dtype=p.dtype, device=p.device) for _ in m.decoder_layers]
        cross_bias = torch.full((capacity, 1, 1, S), mask_value(p.dtype), dtype=p.dtype, device=p.device)
        causal = torch.full((max_len, L), mask_value(p.dtype), dtype=p.dtype, device=p.device).triu(1)
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
        memory.cross_bias[slot, ..., S:] = mask_value(memory.cross_bias.dtype)
        memory.prompt_lens[slot] = S
        return Admitted(self.model.start_id, None)

    def embed(self, tokens: Sequence[int] | Tensor) -> Tensor:
        """Decoder input embeddings (R, d) of token ids (R,)."""
        return self.model.shared(torch.as_tensor(tokens, dtype=torch.long, device=self.device))

    def step(
        self, memory: Memory, cache: KVCache, rows: Rows, *pass_args: Any, **pass_kwargs: Any
    ) -> tuple[Tensor, Tensor | None]:
        """``SpeedT5.step`` over R rows, the rest of its arguments (``hidden`` and which exits) as the engine passed
        them; over the rows ``prepare`` staged, ``SpeedT5.step_staged``."""
        staged = self._staged
        if staged is not None and staged[0] is rows:
            return self.model.step_staged(memory, cache, staged[1], rows, *pass_args, **pass_kwargs)
        return self.model.step(memory, cache, rows, *pass_args, **pass_kwargs)

    @property
    def capturable(self) -> bool:
        """Whether a CUDA graph can replay this stepper's pass (``speed.engine.graphs``): on the Triton kernels,
        whose pass ``prepare`` stages."""
        return attention_triton(self.device)

    def prepare(self, memory: Memory, cache: KVCache, rows: Rows) -> None:
        """The host's part of the next ``step`` over ``rows`` (a bucket's rows, ``speed.engine.graphs``), done
        before it: the cache's bookkeeping and index (``KVCache.stage``), where it attends on the Triton kernel
        (elsewhere ``step`` does its bookkeeping as it goes). The encoder memory needs none: the pass picks each
        row's slot of it on the device. ``step`` over these very rows then runs ``SpeedT5.step_staged``, as often
        as it is called (a graph's warm-up and capture run it twice)."""
        if cache.triton_attention:
            self._staged = (rows, cache.stage(rows))
