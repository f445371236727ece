"""What every model's engine ``Stepper`` shares: the model's loops, EOS, vocabulary, device and mode.

Each family's stepper has a module of its own beside its model's (``speed.models.t5_stepper.T5Stepper`` over
``SpeedT5.step``, ``speed.models.lm_stepper.LMStepper`` over ``LoopedLM.step``), and a model hands it out with
``model.stepper()``; so ``Engine(model)`` and ``generate(model)`` take a model as it is, and the engine imports
no model (``speed.engine.as_stepper``). What a stepper adds to its model's pure computation is the engine's
bookkeeping: a request's slot in the decoding memory, its admission, where its rows sit in the KV cache.

What a request's admission leaves in the cache and the first token's logits depend on its prompt alone, never
on the requests admitted with it: T5 encodes each prompt alone; the LM's batched prefill runs its prompts'
tokens as rows of the row-invariant kernels (``speed.engine.matmuls.rows_linear``) and attends within each
prompt, where a plain (B, T) GEMM would round with B and the padding.
"""

from __future__ import annotations

from typing import Any

import torch


class ModelStepper:
    """What every adapter forwards from its model: loops, EOS, vocabulary, device, training mode."""

    def __init__(self, model: Any) -> None:
        self.model = model
        self.n_loops, self.eos_id, self.vocab_size = model.n_loops, model.eos_id, model.vocab_size

    @property
    def training(self) -> bool:
        return self.model.training

    def eval(self) -> ModelStepper:
        """The model's inference mode (what ``generate`` sets around a decode of a model in training mode)."""
        self.model.eval()
        return self

    def train(self, mode: bool = True) -> ModelStepper:
        """The model's training mode back."""
        self.model.train(mode)
        return self

    @property
    def device(self) -> torch.device:
        return self.model.device

    def weights_bytes(self) -> int:
        """Bytes of the model's parameters and buffers (shared ones counted once)."""
        return sum(t.nbytes for t in (*self.model.parameters(), *self.model.buffers()))
