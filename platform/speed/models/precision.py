"""bf16 weights: the linear layers' weights stored in bfloat16, everything else in float32.

Decoding at real shapes reads every weight once per loop pass, so halving the weights' bytes halves what a token
costs; the rest (activations, norms, biases, attention, the KV cache, the logits) stays float32, and every sum
accumulates in float32. ``with_dtype(model, torch.bfloat16)`` is this mode, which is what ``bfloat16`` means
wherever a dtype is chosen (``speed.from_pretrained``, ``jobs/evaluate.py --dtype``, ``jobs/bench_shapes.py
--dtype``); ``model.to(torch.bfloat16)`` still makes the whole model bfloat16.

The decode tiles' kernel (``speed.engine.native``) reads a bfloat16 weight as it is stored and widens it in
registers, row-invariant as for float32, so SPEED equals sequential decoding bit for bit in this mode too.
Where it is unavailable (``native.library() is None``: no compiler, or neither AVX-512 nor AVX2), the row
kernels widen the weight per call (``speed.engine.kernels``): exact as well, and slower than float32. The
whole-sequence forward (training, teacher-forced perplexity) runs each layer as ``WidenedLinear``: the weight
widened to the input's dtype.

Embeddings stay float32 (a lookup reads one row a token: there is no bandwidth to save), except an embedding tied
to the head (Huginn's), which shares the head's bfloat16 weight and is widened as it is looked up. Each model's
``compute_dtype`` (its norms') is what its activations, cache and logits take.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

WEIGHTS_DTYPE = torch.bfloat16  # the linear weights' dtype in this mode
COMPUTE_DTYPE = torch.float32  # everything else's
DTYPES = ("float32", "bfloat16")  # what a job's or Serve's ``dtype`` may name: float32, or bf16 weights


class WidenedLinear(nn.Linear):
    """A linear layer whose weight may be stored narrower than its input: widened to the input's dtype per call."""

    def forward(self, x: Tensor) -> Tensor:
        bias = None if self.bias is None else self.bias.to(x.dtype)
        return F.linear(x, self.weight.to(x.dtype), bias)


def bf16_weights(model: nn.Module) -> nn.Module:
    """``model`` in place (on any device, the meta device included) with every ``nn.Linear``'s weight in bfloat16
    (as ``WidenedLinear``) and every other parameter and buffer in float32; returned for chaining. Parameters
    shared by two modules (a tied head) stay one parameter."""
    linear_weights = set()
    for module in model.modules():
        if isinstance(module, nn.Linear):
            if type(module) is nn.Linear:
                module.__class__ = WidenedLinear
            linear_weights.add(id(module.weight))
    with torch.no_grad():
        for p in model.parameters():  # each shared parameter once
            p.data = p.data.to(WEIGHTS_DTYPE if id(p) in linear_weights else COMPUTE_DTYPE)
        for b in model.buffers():
            if b.is_floating_point():
                b.data = b.data.to(COMPUTE_DTYPE)
    return model


def with_dtype(model: nn.Module, dtype: torch.dtype) -> nn.Module:
    """``model`` in the mode ``dtype`` names: ``torch.bfloat16`` is bf16 weights (``bf16_weights``), any other
    dtype the whole model in it (``model.to(dtype)``)."""
    return bf16_weights(model) if dtype == WEIGHTS_DTYPE else model.to(dtype)


def dtype_named(name: str) -> torch.dtype:
    """The dtype a ``dtype`` option names (one of ``DTYPES``), for ``with_dtype``; another name is a ``ValueError``."""
    if name not in DTYPES:
        raise ValueError(f"dtype {name!r} is not one of {DTYPES}")
    return getattr(torch, name)
