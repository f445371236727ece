"""Batch-invariant decode kernels: a row's result never depends on the other rows of its group pass.

A pipeline step's group pass (the model's call, ``Stepper.step``) computes 1 to M rows per sequence (many more
across a batch or a server's requests), and the rows that share a pass change all the time. A
CPU or GPU kernel may pick its algorithm, blocking or reduction split by the
shape it is given (MKL's GEMM rounds a 3-row product differently from an
8-row one and takes a GEMV for one row; a reduction with one output splits
across threads; attention's softmax is blocked by its key length). So:

- Matmuls run on tiles of at most ``TILE_ROWS`` rows on kernels chosen per weight (``speed.engine.matmuls``).
- Attention is written as elementwise products and reductions that are per
  row and sum the key positions in fixed chunks of ``ATTN_CHUNK`` (see
  ``attend``), so its result does not depend on the number of masked positions
  after a row's real ones: a group pass attends over the fewest whole chunks that
  cover its rows, and a request decodes to the same logits whatever the
  capacity of the engine or server that runs it. Cross-attention always
  runs one query per row against its request's keys (shared, not copied,
  when every row of the tile belongs to one request).

``tests/test_kernels.py`` checks that a row's result depends neither on its
company nor on its position nor on the number of rows, nor attention's on the
number of masked positions or chunks. The sequential
reference and the SPEED engine call the same kernels, so their logits are
equal bit for bit (on the same device, dtype and thread count).
"""

from __future__ import annotations

import os
from collections.abc import Callable

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from speed.engine import native
from speed.engine.rows import Rows

TILE_ROWS = 8  # most rows per kernel call (oneDNN packs weights for it): at least M for one sequence
PREFILL_ROWS = 64  # rows per kernel call of a decoder-only prefill, whose prompts' tokens are its rows
ATTN_CHUNK = 32  # attention sums its key positions in chunks of this many (see ``attend``)


# The decode's other row ops (the attention over the KV cache, RMS norms, SwiGLU's gate): "auto" (the native
# kernels on CPU float32 rows and caches where they build, a looped LM's block on packed weights in one native
# call, ``native.lm_block``; else torch's), "ops" (the same native kernels, one call each: the same bits as
# "auto"), "torch" (always torch's: ``attend`` on the cache's gathered copy, ``nn.RMSNorm``, ``silu(gate) *
# up``) or "triton" (``speed.engine.triton_kernels`` for the linears too, on any device: under Triton's
# interpreter on the CPU, for tests). CUDA rows take the Triton kernels under "auto" and "ops" as well: the
# GPU's decode path. Chosen by dtype and device, never per pass.
DECODE_OPS_CHOICES = ("auto", "ops", "torch", "triton")
DECODE_OPS = os.environ.get("SPEED_DECODE_OPS", "auto")
if DECODE_OPS not in DECODE_OPS_CHOICES:
    raise ValueError(f"SPEED_DECODE_OPS={DECODE_OPS!r}: choose one of {DECODE_OPS_CHOICES}")


_TRITON: list = []  # speed.engine.triton_kernels once imported, or the ImportError that stopped it


def triton_ops():
    """``speed.engine.triton_kernels``, imported on first use (None where the ``triton`` package is missing)."""
    if not _TRITON:
        try:
            from speed.engine import triton_kernels

            _TRITON.append(triton_kernels)
        except ImportError as err:
            _TRITON.append(err)
    found = _TRITON[0]
    if isinstance(found, ImportError):
        if DECODE_OPS == "triton":
            raise RuntimeError(f"SPEED_DECODE_OPS=triton, but Triton does not import: {found}") from found
        return None
    return found


def on_triton(x: Tensor, weight: Tensor | None = None) -> bool:
    """Whether decode rows x run on the Triton kernels (``DECODE_OPS``): CUDA rows unless "torch", any rows under
    "triton"; never where a gradient is wanted (they have no backward) or Triton is missing."""
    if DECODE_OPS == "torch" or (DECODE_OPS != "triton" and not x.is_cuda):
        return False
    return without_grad(x if weight is None else weight, x) and triton_ops() is not None


def without_grad(weight: Tensor, x: Tensor) -> bool:
    """Nothing asks for a gradient through this call (the native kernel has no backward)."""
    return not torch.is_grad_enabled() or not (weight.requires_grad or x.requires_grad)


def _native_ops() -> bool:
    """Whether ``DECODE_OPS`` lets the CPU's native row kernels run (where they build)."""
    return DECODE_OPS in ("auto", "ops")


def fused_block_on(x: Tensor, rows: Rows, cache_native: bool) -> bool:
    """Whether a looped-LM block may run decode rows x in one native call (``native.lm_block``; ``DECODE_OPS``
    "auto"; "ops" runs the same kernels one call each): float32 rows on the CPU without gradients, no branch rows,
    a cache on the native attention. The block checks its own weights (packed, one dtype)."""
    return (
        DECODE_OPS == "auto"
        and cache_native
        and rows.side is None
        and 1 <= x.shape[0] <= native.MAX_ROWS
        and native.supports_rows(x)
        and without_grad(x, x)
    )


def attention_native(dtype: torch.dtype, device: torch.device) -> bool:
    """Whether a KV cache of this dtype on this device attends on the native kernel (``DECODE_OPS``)."""
    return _native_ops() and native.supports_attention(dtype, device)


def attention_triton(device: torch.device) -> bool:
    """Whether a KV cache on this device attends on the Triton kernel (``DECODE_OPS``; CUDA, or any under
    "triton")."""
    if DECODE_OPS == "torch" or (DECODE_OPS != "triton" and device.type != "cuda"):
        return False
    return triton_ops() is not None


def tile_rms_norm(norm: nn.Module, x: Tensor) -> Tensor:
    """``norm(x)`` for decode rows (n, d): an ``nn.RMSNorm`` on the native kernel (``DECODE_OPS``; each row alone,
    one fixed order), else the module itself (``nn.Identity`` too)."""
    if isinstance(norm, nn.RMSNorm) and norm.weight is not None:
        eps = norm.eps if norm.eps is not None else torch.finfo(x.dtype).eps
        if on_triton(x, norm.weight):
            return triton_ops().rms_norm(x, norm.weight, eps)
        if _native_ops() and native.supports_rows(x) and without_grad(norm.weight, x):
            return native.rms_norm(x, norm.weight, eps)
    return norm(x)


def rows_norm(norm: nn.Module, x: Tensor) -> Tensor:
    """``norm(x)`` for rows whose bits must not depend on their company (the exits' norm): on the Triton kernels
    ``tile_rms_norm``, else the module's own call (what the CPU's exits run: torch's RMS norm is per row there)."""
    return tile_rms_norm(norm, x) if on_triton(x) else norm(x)


def _eps(norm: nn.Module, dtype: torch.dtype) -> float:
    """An ``nn.RMSNorm``'s epsilon as torch applies it (its dtype's where None); 0 for the identity."""
    if not isinstance(norm, nn.RMSNorm):
        return 0.0
    return norm.eps if norm.eps is not None else torch.finfo(dtype).eps


def tile_residual(
    x: Tensor, y: Tensor, out_norm: nn.Module, norm_sum: bool, next_norm: nn.Module | None
) -> tuple[Tensor, Tensor | None]:
    """A block's residual step on decode rows (n, d): the stream x + out_norm(y) (``norm_sum``: out_norm(x + y);
    ``out_norm`` an ``nn.RMSNorm`` or ``nn.Identity``) and ``next_norm`` of it (None: None), one Triton launch on
    its path, else ``tile_rms_norm`` and the sum one by one (the bits the CPU always had)."""
    gains = [n.weight if isinstance(n, nn.RMSNorm) else None for n in (out_norm, next_norm)]
    plain = [isinstance(n, nn.Identity) or g is not None for n, g in zip((out_norm, next_norm), gains)]
    if on_triton(x) and plain[0] and (next_norm is None or gains[1] is not None):
        eps = [_eps(n, x.dtype) for n in (out_norm, next_norm)]
        return triton_ops().residual(x, y, gains[0], eps[0], norm_sum, gains[1], eps[1])
    x = tile_rms_norm(out_norm, x + y) if norm_sum else x + tile_rms_norm(out_norm, y)
    return x, (tile_rms_norm(next_norm, x) if next_norm is not None else None)


Turn = Callable[[Tensor, Tensor, Tensor], Tensor]  # a model's rotary rotation: (x, cos, sin) -> x turned


def tile_rope(x: Tensor, cos: Tensor, sin: Tensor, pairs: bool, turn: Turn) -> Tensor:
    """Decode rows' heads x (n, heads, D) rotated by cos/sin (n, D): the native kernel (``DECODE_OPS``; float32
    rows, each row's heads contiguous), bit for bit the model's own ``turn(x, cos, sin)`` (its ``rotate``, in the
    ``pairs`` layout or not, on cos/sin (n, 1, D)), which runs otherwise: one call instead of about ten small ops
    a head group."""
    contiguous_heads = x.dim() == 3 and x.stride(-1) == 1 and x.stride(1) == x.shape[-1]
    if _native_ops() and contiguous_heads and native.supports_rows(x) and without_grad(x, x):
        if cos.dtype == torch.float32:
            return native.rope(x, cos, sin, pairs)
    return turn(x, cos.unsqueeze(-2), sin.unsqueeze(-2))


def tile_swiglu(gate_up: Tensor) -> Tensor:
    """``silu(gate) * up`` of decode rows (n, 2F) holding [gate; up]: native (``DECODE_OPS``) or torch's."""
    if _native_ops() and native.supports_rows(gate_up) and without_grad(gate_up, gate_up):
        return native.swiglu(gate_up)
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


Split = Callable[[Tensor, Tensor, Tensor], tuple[Tensor, Tensor, Tensor]]  # a model's qkv split: (qkv, cos, sin)


def tile_rope_qkv(
    qkv: Tensor, cos: Tensor, sin: Tensor, heads: tuple[int, int], biases: tuple[Tensor | None, Tensor | None],
    pairs: bool, scale: float, split: Split,
) -> tuple[Tensor, Tensor, Tensor]:  # fmt: skip
    """Queries (n, H, D) times ``scale``, keys (n, K, D) and values (n, K, D) of decode rows' fused projection
    (n, (H + 2K) D), queries and keys biased (``biases``) and rotated by cos/sin (n, D) in the ``pairs`` layout or
    the halves: one Triton launch on its path, else the model's own ``split`` and the scale (its bits as they
    were). ``heads``: (H, K)."""
    if on_triton(qkv):
        return triton_ops().rope_qkv(qkv, cos, sin, *heads, *biases, pairs, scale)
    q, k, v = split(qkv, cos, sin)
    return q * scale, k, v


def chunk_span(length: int, chunk: int = ATTN_CHUNK) -> int:
    """``length`` key positions rounded up to a whole number of attention chunks (at least one)."""
    if length < 0:
        raise ValueError(f"length must be >= 0, got {length}")
    return max(1, -(-length // chunk)) * chunk


def attend(
    q: Tensor, keys: Tensor, values: Tensor, bias: Tensor, chunk: int = ATTN_CHUNK, source: Tensor | None = None
) -> Tensor:
    """One query per row: q (T, H, D) against keys/values (T, H, L, D) with additive bias (T, H or 1, 1, L); with
    ``source`` (T,) long on the device, row t against ``source[t]`` of keys/values (C, H, L, D) and bias (C, ...).

    Written as elementwise products, a sum over D, a max, and sums over L
    that treat every (row, head) alike: the CPU's fused attention kernel does
    not (with 2 threads the rows of the second thread round differently,
    measured). A plain ``sum`` or ``softmax`` over L groups its additions by
    vector lanes and by L, so its result would change with the number of
    (masked) positions, that is with the cache's or the encoder memory's
    capacity. So the positions are summed in fixed chunks of ``chunk`` (one
    reduction shape, whatever L), and the chunk sums one after the other
    (``cumsum``): masked positions get weight exactly zero, so more masked
    chunks after the real ones add exact zeros, and a row's result depends
    neither on what the masked positions hold nor on how many there are. L that
    is not a whole number of chunks is padded with masked positions (callers
    that care about the copy pass whole chunks). T5 applies no 1/sqrt(D)
    scaling. On the Triton kernels' path (``on_triton``) their ``attend``: the same chunks, an online softmax.
    """
    if on_triton(q):
        return triton_ops().attend(q, keys, values, bias, source)
    if source is not None:
        keys, values, bias = (t.index_select(0, source) for t in (keys, values, bias))
    T, H, L, D = keys.shape
    if L % chunk:
        pad = chunk_span(L, chunk) - L
        keys, values = F.pad(keys, (0, 0, 0, pad)), F.pad(values, (0, 0, 0, pad))
        bias = F.pad(bias, (0, pad), value=torch.finfo(bias.dtype).min)
        L += pad
    C = L // chunk
    scores = ((q.unsqueeze(2) * keys).sum(-1) + bias.squeeze(2)).float()  # (T, H, L)
    weights = torch.exp(scores - scores.amax(-1, keepdim=True)).view(T, H, C, chunk)
    total = weights.sum(-1).cumsum(-1)[..., -1:]  # (T, H, 1)
    parts = (weights.to(values.dtype).unsqueeze(-1) * values.view(T, H, C, chunk, D)).sum(-2)  # (T, H, C, D)
    mixed = parts.cumsum(-2)[..., -1, :]  # (T, H, D)
    return (mixed.float() / total).to(values.dtype)


def in_tiles(
    pass_tile: Callable[[Rows, Tensor], tuple[Tensor, Tensor | None]],
    rows: Rows,
    hidden: Tensor,
    tile_rows: int = TILE_ROWS,
) -> tuple[Tensor, Tensor | None]:
    """A group pass over any number of rows: ``pass_tile`` on tiles of at most ``tile_rows`` of them, in order
    (on the Triton kernels, which take any number of rows, on all of them at once).

    ``hidden`` (R, ...) holds the rows' inputs; the tiles' outputs (and exit
    logits, None when the tiles return none) are concatenated in row order.
    """
    if len(rows) <= tile_rows or on_triton(hidden):  # the Triton kernels take any number of rows
        return pass_tile(rows, hidden)
    outputs, logits = [], []
    for start in range(0, len(rows), tile_rows):
        part = rows.take(np.arange(start, min(start + tile_rows, len(rows))))
        out, exit_logits = pass_tile(part, hidden[start : start + len(part)])
        outputs.append(out)
        if exit_logits is not None:
            logits.append(exit_logits)
    return torch.cat(outputs), (torch.cat(logits) if logits else None)


def tile_index(n: int, tile_rows: int, device: torch.device) -> Tensor:
    """(tile_rows,) indices 0..n-1, the last repeated to fill the tile (n <= tile_rows)."""
    if not 1 <= n <= tile_rows:
        raise ValueError(f"a tile holds 1..{tile_rows} rows, got {n}")
    return torch.arange(tile_rows, device=device).clamp(max=n - 1)
