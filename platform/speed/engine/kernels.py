"""Batch-invariant decode kernels: a row's result never depends on the other rows of its group pass.

A pipeline step's group pass (the model's call, ``Stepper.step``) computes 1 to M rows per sequence (many more
across a batch or a server's requests), and the rows that share a pass change all the time. A
CPU or GPU kernel may pick its algorithm, blocking or reduction split by the
shape it is given (MKL's GEMM rounds a 3-row product differently from an
8-row one and takes a GEMV for one row; a reduction with one output splits
across threads; attention's softmax is blocked by its key length). So:

- Matmuls run on tiles of at most ``tile_rows`` rows. Tiles of float32 weights
  are one call of oneDNN's linear with the weight packed once for
  ``tile_rows`` rows. Its
  blocking is fixed by the packed weight: a row's result does not depend on
  how many rows (2..tile_rows) the call holds, nor on where the row sits, and
  a call on n rows costs about what n rows need (one row about half a full
  tile, measured). One row alone is the exception: for inputs over 1024 wide
  (a base-size MLP's output projection) oneDNN takes another kernel for a
  one-row call, which rounds differently (measured on this CPU, 1 and 2
  threads), so a single row runs as two copies of itself. Where oneDNN's private ops are missing (or not CPU
  float32), a plain ``F.linear`` runs instead, always on a full tile (the
  rows padded by repeating the last), since the plain GEMM's kernel changes
  with the row count (a GPU's path under ``SPEED_DECODE_OPS=torch``; CUDA
  rows otherwise run on ``speed.engine.triton_kernels``, one kernel for any row count). Decode tiles (up to 8 rows)
  of bfloat16 weights, and of every weight with ``SPEED_LINEAR=native``, run
  on the kernel compiled for this CPU (``speed.engine.native``): it streams
  each weight row once for all the tile's rows and sums every output in one
  fixed order, so a row's bits depend on nothing else and one row costs no
  more than the weight read. On this 2-vCPU machine it streams 1 to 4 float32
  rows faster than oneDNN but 6 to 8 slower (docs/benchmarks.md, "Decode
  kernels"), and keeps no packed copy: so float32 weights of
  ``NATIVE_MIN_BYTES`` or more (a real model's) take it too, smaller ones stay
  on oneDNN. The path is chosen per weight, never by row count: exact either
  way. A looped LM packed for decoding (``pack_linears``) holds those weights
  in panels of 32 outputs, on which the same kernel multiplies each input's
  weights by every row at once: 1 to 8 rows at 88-97 % of the read bandwidth
  in float32 (each output summed over its inputs in order, whatever the rows).
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
import threading
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from speed.engine import native
from speed.engine.rows import Rows

TILE_ROWS = 8  # most rows per kernel call (oneDNN packs weights for it): at least M for one sequence
PREFILL_ROWS = 64  # rows per kernel call of a decoder-only prefill, whose prompts' tokens are its rows
ATTN_CHUNK = 32  # attention sums its key positions in chunks of this many (see ``attend``)


@dataclass(frozen=True)
class _Packed:
    """A oneDNN-packed copy of ``weight``, valid while the weight keeps this identity, version and storage."""

    weight: weakref.ref
    version: int | None  # None for inference tensors, which keep no version counter
    data_ptr: int
    tile_rows: int
    packed: Tensor


_LOCK = threading.Lock()
_PACKED: weakref.WeakKeyDictionary[nn.Linear, dict[int, _Packed]] = weakref.WeakKeyDictionary()  # by tile rows
_ONEDNN: bool | None = None  # whether oneDNN's packed linear works here; probed once, on first use
# Float32 weights of at least this many bytes take the native kernel under "auto": they stream from memory, where it
# reads 1-4 rows close to the bandwidth, and oneDNN would hold a packed copy of each (per tile size: the decode's and
# the prefill's), doubling or tripling a real model's memory. Smaller ones (T5-base's largest is 6 MiB) stay on oneDNN,
# whose 6-8-row tiles run faster here. The choice is per weight, never per row count, so SPEED stays exact.
NATIVE_MIN_BYTES = 8 * 2**20
# The decode tiles' kernel: "auto" (bfloat16 weights and float32 ones of NATIVE_MIN_BYTES or more on the native
# kernel, smaller float32 ones on oneDNN's packed linear),
# "native" (speed.engine.native for every weight, where it builds; else as auto), "onednn" (oneDNN's packed linear,
# else the plain one; bfloat16 weights widened) or "plain" (F.linear on a padded tile, the GPU's path).
LINEARS = ("auto", "native", "onednn", "plain")
LINEAR = os.environ.get("SPEED_LINEAR", "auto")
if LINEAR not in LINEARS:
    raise ValueError(f"SPEED_LINEAR={LINEAR!r}: choose one of {LINEARS}")


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
    return _no_grad(x if weight is None else weight, x) and triton_ops() is not None


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
        and _no_grad(x, x)
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
        if _native_ops() and native.supports_rows(x) and _no_grad(norm.weight, x):
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
    if _native_ops() and contiguous_heads and native.supports_rows(x) and _no_grad(x, x):
        if cos.dtype == torch.float32:
            return native.rope(x, cos, sin, pairs)
    return turn(x, cos.unsqueeze(-2), sin.unsqueeze(-2))


def tile_swiglu(gate_up: Tensor) -> Tensor:
    """``silu(gate) * up`` of decode rows (n, 2F) holding [gate; up]: native (``DECODE_OPS``) or torch's."""
    if _native_ops() and native.supports_rows(gate_up) and _no_grad(gate_up, gate_up):
        return native.swiglu(gate_up)
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def tile_gated(layer: nn.Linear, x: Tensor, act: str) -> Tensor:
    """A gated feed-forward's inner rows act(x gate) * (x up) (n, F) of decode rows x (n, d), ``layer`` holding
    [gate; up] (2F, d); ``act`` "silu" (``tile_swiglu``) or "gelu" (tanh). One fused Triton launch on its path,
    else ``tile_linear`` then the activation (the CPU's bits as they were)."""
    if on_triton(x, layer.weight) and not is_packed(layer) and layer.bias is None:
        return triton_ops().linear(layer.weight, x, act)
    gate_up = tile_linear(layer, x)
    if act == "silu":
        return tile_swiglu(gate_up)
    gate, up = gate_up.chunk(2, dim=-1)
    return F.gelu(gate, approximate="tanh") * up


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


def _onednn_available() -> bool:
    """Probe oneDNN's private linear ops once (some torch builds lack them); never raises."""
    global _ONEDNN
    if _ONEDNN is None:
        try:
            w = torch.ones(4, 4)
            packed = torch.ops.mkldnn._reorder_linear_weight(w, 2)
            out = torch.ops.mkldnn._linear_pointwise(torch.ones(2, 4), packed, None, "none", [], "")
            _ONEDNN = torch.backends.mkldnn.is_available() and bool(torch.equal(out, torch.full((2, 4), 4.0)))
        except (RuntimeError, AttributeError, NotImplementedError):
            _ONEDNN = False
    return _ONEDNN


def _version(weight: Tensor) -> int | None:
    # Inference tensors (made under torch.inference_mode) track no version: they cannot be changed
    # in place outside inference mode, so their storage pointer identifies them.
    return None if weight.is_inference() else weight._version


def _no_grad(weight: Tensor, x: Tensor) -> bool:
    """Nothing asks for a gradient through this call (the native kernel has no backward)."""
    return not torch.is_grad_enabled() or not (weight.requires_grad or x.requires_grad)


def _wants_native(weight: Tensor) -> bool:
    """Whether ``LINEAR`` sends a decode tile on ``weight`` to the native kernel (where it builds)."""
    if LINEAR != "auto":
        return LINEAR == "native"
    return weight.dtype != torch.float32 or weight.numel() * weight.element_size() >= NATIVE_MIN_BYTES


def linear_in_use(weight: Tensor) -> str:
    """The kernel a decode tile on ``weight`` runs on here: "native", "onednn" or "plain" ("packed": a weight that
    ``pack_linears`` packed for the native kernel)."""
    if weight.dim() == 3:
        return "packed"
    if _wants_native(weight) and native.supports(weight, torch.empty(1, weight.shape[-1])):
        return "native"
    if LINEAR != "plain" and weight.device.type == "cpu" and weight.dtype == torch.float32 and _onednn_available():
        return "onednn"
    return "plain"


def _packed_weight(layer: nn.Linear, tile_rows: int) -> Tensor | None:
    """``layer``'s weight packed by oneDNN for ``tile_rows`` rows, cached per module; None where unsupported."""
    weight = layer.weight
    if LINEAR == "plain" or weight.device.type != "cpu" or weight.dtype != torch.float32 or not _onednn_available():
        return None
    version, ptr = _version(weight), weight.data_ptr()
    with _LOCK:  # decoding threads may share a model: pack each weight once, never read a half-built entry
        hit = _PACKED.setdefault(layer, {}).get(tile_rows)
        if hit is not None and hit.weight() is weight and hit.version == version and hit.data_ptr == ptr:
            return hit.packed
        packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), tile_rows)
        _PACKED[layer][tile_rows] = _Packed(weakref.ref(weight), version, ptr, tile_rows, packed)
        return packed


def tile_linear(layer: nn.Linear, x: Tensor, tile_rows: int = TILE_ROWS) -> Tensor:
    """``layer(x)`` (no bias) for one tile of 1..``tile_rows`` rows (n, in) -> (n, out), row-invariant.

    oneDNN runs the n rows on the weight packed for ``tile_rows``; the
    fallback pads them to ``tile_rows`` so that ``F.linear`` always sees one
    shape. On the Triton kernels (``on_triton``) any number of rows, in one call.
    """
    if layer.bias is not None:
        raise ValueError("decode kernels expect bias-free linear layers (T5 has none)")
    if not is_packed(layer) and on_triton(x, layer.weight):  # row-invariant at any row count: no tiles needed
        return triton_ops().linear(layer.weight, x)
    n = x.shape[0]
    if not 1 <= n <= tile_rows:
        raise ValueError(f"a tile holds 1..{tile_rows} rows, got {n}")
    x = x.contiguous()  # strides select kernels too (a stride-0 input takes another GEMM path)
    if is_packed(layer):
        return _packed_tile(layer, x)
    if _wants_native(layer.weight) and tile_rows <= native.MAX_ROWS and _no_grad(layer.weight, x):
        if native.supports(layer.weight, x):
            return native.linear(layer.weight, x)
    if layer.weight.dtype != x.dtype:  # bf16 weights off the native kernel: widened per call (exact, slow)
        return _plain_tile(layer.weight.to(x.dtype), x, tile_rows)
    packed = _packed_weight(layer, tile_rows)
    if packed is not None:
        if n == 1:  # one row runs as two: oneDNN's one-row kernel rounds otherwise when the input is over 1024 wide
            return torch.ops.mkldnn._linear_pointwise(x.expand(2, -1).contiguous(), packed, None, "none", [], "")[:1]
        return torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")
    return _plain_tile(layer.weight, x, tile_rows)


def _plain_tile(weight: Tensor, x: Tensor, tile_rows: int) -> Tensor:
    """``F.linear`` of n <= ``tile_rows`` rows, always on a full tile (the rows padded by repeating the last): the
    plain GEMM's kernel changes with the row count."""
    n = x.shape[0]
    if n < tile_rows:
        return F.linear(x[tile_index(n, tile_rows, x.device)], weight)[:n]
    return F.linear(x, weight)


def rows_linear(layer: nn.Linear, x: Tensor, tile_rows: int = PREFILL_ROWS) -> Tensor:
    """``layer(x)`` for any number of rows (R, in) -> (R, out), in tiles of ``tile_rows`` (``tile_linear``): a row's
    result depends neither on the other rows nor on where it sits among them.

    A weight the native kernel takes (bf16 weights, ``speed.models.precision``, which oneDNN's packed linear does
    not take; float32 ones of ``NATIVE_MIN_BYTES`` or more, which it would copy) runs on it in tiles of
    ``native.MAX_ROWS`` rows (row-invariant at any row count); a bf16 weight without it is widened once for the
    call and runs on the plain tiles."""
    if not is_packed(layer) and layer.bias is None and on_triton(x, layer.weight):
        return triton_ops().linear(layer.weight, x)
    on_native = _wants_native(layer.weight) and _no_grad(layer.weight, x)
    if is_packed(layer) or (on_native and native.supports(layer.weight, x[: native.MAX_ROWS])):
        tile_rows = min(tile_rows, native.MAX_ROWS)  # no packed copy of a real model's weights for the prefill
    elif layer.weight.dtype != x.dtype and layer.bias is None:
        layer = BiasFree(layer.weight.to(x.dtype))
    if x.shape[0] <= tile_rows:
        return tile_linear(layer, x, tile_rows)
    return torch.cat([tile_linear(layer, part, tile_rows) for part in x.split(tile_rows)])


def is_packed(layer: nn.Module | BiasFree) -> bool:
    """Whether ``layer``'s weight is packed for the native kernel (``pack_linears``): 3-D, (panels, in, panel)."""
    return layer.weight.dim() == 3


def _packed_tile(layer: nn.Linear, x: Tensor) -> Tensor:
    if not native.supports_packed(layer.weight, x):
        raise ValueError(
            f"a packed weight {tuple(layer.weight.shape)} {layer.weight.dtype} takes 1..{native.MAX_ROWS} float32 "
            f"rows on the native kernel, got {tuple(x.shape)} {x.dtype} (native: {native.unavailable_reason()})"
        )
    if torch.is_grad_enabled() and x.requires_grad:
        raise ValueError("a packed weight decodes only: the native kernel has no backward (unpack_linears first)")
    return native.linear_packed(layer.weight, x, layer.out_features)


def pack_linears(model: nn.Module) -> int:
    """Pack, in place, every weight of ``model`` that decodes on the native kernel (``linear_in_use``: bf16 weights
    and float32 ones of ``NATIVE_MIN_BYTES`` or more, on a CPU that builds it) into ``native.pack``'s panels, where
    4-8 rows cost little more than one (docs/benchmarks.md, "Decode kernels"): bias-free ``nn.Linear`` layers whose
    weight no other parameter shares (a head tied to the embedding stays as it is). Returns how many were packed.

    For decoding only: a packed layer runs on ``tile_linear`` and ``rows_linear`` (what the looped LM's cached
    decoding and prefill call), without gradients; its own ``forward`` (``F.linear`` on a 3-D weight) fails loudly,
    and so does a checkpoint's ``load_state_dict``. One weight is copied at a time (no second copy of the model).
    A packed layer's outputs are exact across row counts, as on the unpacked kernel, but not the same bits as
    unpacked (each output summed over its inputs in order instead of in 16 lanes): pack before decoding, never
    between two decodings that are compared. ``unpack_linears`` restores the layers bit for bit. Pack after any
    change of dtype: a bf16 panel orders its outputs unlike a float32 one (``native.pack``)."""
    seen: dict[int, int] = {}
    for _, p in model.named_parameters(remove_duplicate=False):
        seen[id(p)] = seen.get(id(p), 0) + 1
    packed = 0
    for layer in model.modules():
        if not isinstance(layer, nn.Linear) or layer.bias is not None or is_packed(layer):
            continue
        weight = layer.weight
        if seen.get(id(weight), 0) != 1 or linear_in_use(weight) != "native":
            continue
        with torch.no_grad():
            layer.weight = nn.Parameter(native.pack(weight.detach()), requires_grad=False)
        layer.unpacked_requires_grad = weight.requires_grad  # what unpack_linears gives back
        packed += 1
    return packed


def unpack_linears(model: nn.Module) -> int:
    """Undo ``pack_linears``: every packed layer's weight back to (out, in), bit for bit; returns how many."""
    unpacked = 0
    for layer in model.modules():
        if isinstance(layer, nn.Linear) and is_packed(layer):
            grad = getattr(layer, "unpacked_requires_grad", True)
            layer.weight = nn.Parameter(native.unpack(layer.weight.detach(), layer.out_features), requires_grad=grad)
            unpacked += 1
    return unpacked


@contextmanager
def packed_while(model: nn.Module) -> Iterator[int]:
    """``model`` packed for decoding (its ``pack_for_decoding``) while the block runs, its layers restored bit for
    bit after (``unpack_linears``, ``requires_grad`` as it was), whatever the block raises; yields how many weights
    were packed. For a job that decodes and then runs the model's ``forward`` (an evaluation's perplexity)."""
    packed = model.pack_for_decoding()
    try:
        yield packed
    finally:
        if packed:
            unpack_linears(model)


class BiasFree:
    """A weight alone, as the row kernels take a layer (no bias): a layer with a bias has it added after, a weight
    widened for one call has no layer."""

    bias = None

    def __init__(self, weight: Tensor) -> None:
        self.weight = weight


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
