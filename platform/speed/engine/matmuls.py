"""Row-invariant matmuls of decode rows: a linear layer on tiles of rows, its kernel chosen per weight, never by row
count, and weights packed for the native kernel.

Matmuls run on tiles of at most ``tile_rows`` rows. Tiles of float32 weights
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

``tests/test_kernels.py`` checks that a row's result depends neither on its company nor on its position nor on the
number of rows.
"""

from __future__ import annotations

import os
import threading
import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from speed.engine import native
from speed.engine.kernels import PREFILL_ROWS, TILE_ROWS, on_triton, tile_index, tile_swiglu, triton_ops, without_grad


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
    if _wants_native(layer.weight) and tile_rows <= native.MAX_ROWS and without_grad(layer.weight, x):
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
    on_native = _wants_native(layer.weight) and without_grad(layer.weight, x)
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
