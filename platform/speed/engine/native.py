"""The row-invariant decode kernels compiled for this CPU (``native_kernels.cpp``), loaded on first use: the linear
of 1..8 rows and the attention of one query per row over the paged KV cache.

Decoding at real shapes is bound by memory bandwidth: a group pass reads every weight once, for 1 to
``TILE_ROWS`` rows. oneDNN's GEMM and the plain GEMV stream at a quarter to a half of what the memory allows at
these row counts (docs/benchmarks.md), and oneDNN's one-row call rounds unlike its multi-row calls, so the
kernels ran one row as two. This kernel streams each weight row once for all the rows, sums every output in one
fixed order whatever the row count or thread count, and takes float32 or bfloat16 weights (fp32 accumulation).
The attention (``attend``) reads each row's keys and values in place from the paged cache's pool (no gathered
copy, no (rows, heads, positions, d) temporaries), one (row, head) per thread in one fixed order over that row's
own positions only, so its result depends on nothing but the row's query and cache entries.

It is C++ with AVX-512 intrinsics, or on a CPU without AVX-512 (AMD's before Zen 4, Intel's desktop parts) AVX2
with FMA: the same 16-lane operations as two 256-bit halves, the same sums in the same order, so both compute the
same bits by construction (``vector_bits`` says which a machine runs). It is compiled once per machine kind with
the system's ``g++`` (``$CXX``) into a cache folder (``$SPEED_KERNEL_CACHE``, default ``~/.cache/speed/kernels``),
keyed by the source, the compiler and the CPU's flags, so that nodes of a cluster on different CPUs each build
their own. Where there is no compiler, neither AVX-512 nor AVX2 with FMA, or the build fails, ``library()`` is
None (the reason in ``unavailable_reason()``) and the decode kernels keep oneDNN's path (bfloat16 weights then
widen per call: exact, several times slower): a decoder is exact on either, never across the two.
"""

from __future__ import annotations

import ctypes
import fcntl
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor

SOURCE = Path(__file__).with_name("native_kernels.cpp")
MAX_ROWS = 8  # rows per call: the kernel keeps each row's sums in registers
ABI = 7  # speed_linear_abi() of the source this module calls
PANEL = 32  # outputs per panel of a packed weight (``pack``): speed_linear_panel() of the source

log = logging.getLogger(__name__)
_LOCK = threading.Lock()
_LIB: ctypes.CDLL | None = None
_REASON: str | None = None  # why the library is unavailable; None: not tried yet, or loaded


def cache_dir() -> Path:
    """Where compiled kernels are kept: ``$SPEED_KERNEL_CACHE``, else ``$XDG_CACHE_HOME/speed/kernels``, else
    ``~/.cache/speed/kernels``."""
    if os.environ.get("SPEED_KERNEL_CACHE"):
        return Path(os.environ["SPEED_KERNEL_CACHE"])
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "speed" / "kernels"


def _cpu_flags() -> set[str]:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def _build(compiler: str, flags: set[str]) -> Path:
    """The compiled library for this source, compiler and CPU: from the cache, else built into it."""
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True, check=True).stdout
    key = hashlib.sha256(SOURCE.read_bytes() + version.encode() + " ".join(sorted(flags)).encode()).hexdigest()[:16]
    target = cache_dir() / f"speed_linear-{key}.so"
    if target.is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    # One process builds while the others (a test session's workers, a node's Ray workers) wait for it; built
    # aside, then renamed, so a reader never sees half a library.
    with open(target.with_suffix(".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if target.is_file():
            return target
        with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
            built = Path(tmp) / target.name
            command = [compiler, "-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", str(SOURCE), "-o", str(built)]
            done = subprocess.run(command, capture_output=True, text=True)
            if done.returncode:
                raise RuntimeError(f"{' '.join(command)} failed: {done.stderr.strip()[-400:]}")
            os.replace(built, target)
    return target


def library() -> ctypes.CDLL | None:
    """The compiled kernel library, built on first use; None where it cannot be (see ``unavailable_reason``)."""
    global _LIB, _REASON
    if _LIB is not None or _REASON is not None:
        return _LIB
    with _LOCK:
        if _LIB is None and _REASON is None:
            try:
                _LIB = _load()
            except (OSError, RuntimeError, subprocess.SubprocessError) as err:
                _REASON = str(err)
                log.info("speed: the native decode kernel is unavailable (%s); using oneDNN's", _REASON)
    return _LIB


def _load() -> ctypes.CDLL:
    flags = _cpu_flags()
    if not ({"avx512f", "avx512bw", "avx512vl"} <= flags or {"avx2", "fma"} <= flags):
        raise RuntimeError("this CPU has neither AVX-512 (avx512f, avx512bw, avx512vl) nor AVX2 with FMA")
    compiler = os.environ.get("CXX") or shutil.which("g++")
    if compiler is None:
        raise RuntimeError("no C++ compiler (g++ or $CXX) to build it with")
    lib = ctypes.CDLL(str(_build(compiler, flags)))
    if lib.speed_linear_abi() != ABI:
        raise RuntimeError(f"the compiled kernel's ABI {lib.speed_linear_abi()} is not {ABI}")
    args = [ctypes.c_void_p] * 3 + [ctypes.c_int64] * 3 + [ctypes.c_int]
    if lib.speed_linear_panel() != PANEL:
        raise RuntimeError(f"the compiled kernel's panel {lib.speed_linear_panel()} is not {PANEL}")
    for name in ("speed_linear_f32", "speed_linear_bf16", "speed_linear_packed_f32", "speed_linear_packed_bf16"):
        getattr(lib, name).argtypes = args
        getattr(lib, name).restype = None
    lib.speed_attend_f32.argtypes = [ctypes.c_void_p] * 7 + [ctypes.c_int64] * 7 + [ctypes.c_void_p, ctypes.c_int]
    lib.speed_attend_f32.restype = None
    lib.speed_rms_norm_f32.argtypes = [ctypes.c_void_p] * 3 + [ctypes.c_int64] * 2 + [ctypes.c_float]
    lib.speed_rms_norm_f32.restype = None
    lib.speed_swiglu_f32.argtypes = [ctypes.c_void_p] * 2 + [ctypes.c_int64] * 2
    lib.speed_swiglu_f32.restype = None
    lib.speed_rope_f32.argtypes = [ctypes.c_void_p, ctypes.c_int64] + [ctypes.c_void_p] * 3 + [ctypes.c_int64] * 3
    lib.speed_rope_f32.argtypes += [ctypes.c_int]
    lib.speed_rope_f32.restype = None
    for name in ("speed_lm_block_f32", "speed_lm_block_bf16"):
        getattr(lib, name).argtypes = [ctypes.c_void_p, ctypes.c_void_p]
        getattr(lib, name).restype = None
    return lib


def vector_bits() -> int | None:
    """The vector width the kernels were compiled for on this machine: 512 (AVX-512) or 256 (AVX2 with FMA, the same
    16-lane sums as two halves); None where the library is unavailable."""
    lib = library()
    return None if lib is None else int(lib.speed_vector_bits())


def unavailable_reason() -> str | None:
    """Why ``library()`` is None (after it was asked for); None while it is loaded or not yet tried."""
    return _REASON


def supports(weight: Tensor, x: Tensor) -> bool:
    """Whether ``linear(weight, x)`` runs here: CPU, contiguous weights of float32 or bfloat16, float32 rows."""
    return weight.dim() == 2 and _takes(weight, x)


def _takes(weight: Tensor, x: Tensor) -> bool:
    """What both linears need: a contiguous float32 or bfloat16 weight and 1..``MAX_ROWS`` float32 rows on the CPU,
    the library loaded."""
    return (
        weight.device.type == "cpu"
        and x.device.type == "cpu"
        and weight.dtype in (torch.float32, torch.bfloat16)
        and x.dtype == torch.float32
        and weight.is_contiguous()
        and 1 <= x.shape[0] <= MAX_ROWS
        and library() is not None
    )


def linear(weight: Tensor, x: Tensor) -> Tensor:
    """``x @ weight.T`` (n, out) for 1..``MAX_ROWS`` float32 rows ``x`` (n, in), on the weight as it is stored
    (float32 or bfloat16, no copy), row-invariant, on ``torch.get_num_threads()`` threads. Callers check
    ``supports`` first."""
    lib = library()
    x = x.contiguous()
    n, k = x.shape
    out_features = weight.shape[0]
    if weight.shape[1] != k:
        raise ValueError(f"rows of width {k} against a weight of input width {weight.shape[1]}")
    out = torch.empty(n, out_features, dtype=torch.float32)
    call = lib.speed_linear_f32 if weight.dtype == torch.float32 else lib.speed_linear_bf16
    call(x.data_ptr(), weight.data_ptr(), out.data_ptr(), n, k, out_features, torch.get_num_threads())
    return out


def pack(weight: Tensor) -> Tensor:
    """``weight`` (out, in) in ``linear_packed``'s layout: panels of ``PANEL`` outputs, each (in, PANEL) with one
    input's weights for the panel's outputs side by side, the last panel padded with zeros; (panels, in, PANEL).
    Bfloat16 panels interleave their two halves (output q at 2q, q + 16 at 2q + 1), which the kernel widens into
    outputs 0-15 and 16-31 without crossing lanes. A copy: the caller drops the original (``unpack`` inverts it)."""
    if weight.dim() != 2 or weight.dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(f"a 2-D float32 or bfloat16 weight packs, got {tuple(weight.shape)} {weight.dtype}")
    n, k = weight.shape
    panels = -(-n // PANEL)
    padded = torch.zeros(panels * PANEL, k, dtype=weight.dtype, device=weight.device)
    padded[:n] = weight
    if weight.dtype == torch.float32:
        return padded.view(panels, PANEL, k).transpose(1, 2).contiguous()
    return padded.view(panels, 2, PANEL // 2, k).permute(0, 3, 2, 1).reshape(panels, k, PANEL).contiguous()


def unpack(packed: Tensor, out_features: int) -> Tensor:
    """The (out, in) weight that ``pack`` packed into ``packed``: a copy, bit for bit the original."""
    panels, k, width = packed.shape
    if width != PANEL or not 0 < out_features <= panels * PANEL:
        raise ValueError(f"packed {tuple(packed.shape)} cannot hold {out_features} outputs in panels of {PANEL}")
    if packed.dtype == torch.float32:
        full = packed.transpose(1, 2).reshape(panels * PANEL, k)
    else:
        full = packed.view(panels, k, PANEL // 2, 2).permute(0, 3, 2, 1).reshape(panels * PANEL, k)
    return full[:out_features].contiguous()


def supports_packed(packed: Tensor, x: Tensor) -> bool:
    """Whether ``linear_packed(packed, x, ...)`` runs here: as ``supports``, for a weight packed by ``pack``."""
    return packed.dim() == 3 and packed.shape[2] == PANEL and _takes(packed, x)


def linear_packed(packed: Tensor, x: Tensor, out_features: int) -> Tensor:
    """``linear`` on a weight packed by ``pack`` (``out_features`` of its outputs): (n, out) for 1..``MAX_ROWS``
    float32 rows, row-invariant, on ``torch.get_num_threads()`` threads. The kernel multiplies one input's panel
    row by every row's input at once (no reduction across lanes), which keeps 4-8 rows close to one row's time
    (docs/benchmarks.md); each output is summed over the inputs in order, so its bits differ from ``linear``'s
    (a model decodes on one of the two). Callers check ``supports_packed`` first."""
    lib = library()
    x = x.contiguous()
    n, k = x.shape
    if packed.shape[1] != k or not 0 < out_features <= packed.shape[0] * PANEL:
        raise ValueError(f"rows of width {k} against a packed weight {tuple(packed.shape)} of {out_features} outputs")
    out = torch.empty(n, out_features, dtype=torch.float32)
    call = lib.speed_linear_packed_f32 if packed.dtype == torch.float32 else lib.speed_linear_packed_bf16
    call(x.data_ptr(), packed.data_ptr(), out.data_ptr(), n, k, out_features, torch.get_num_threads())
    return out


def supports_attention(cache_dtype: torch.dtype, device: torch.device) -> bool:
    """Whether ``attend`` runs for a cache of this dtype on this device (float32, CPU, the library loaded): a
    property of the cache, never of the rows, so every pass over it takes the same path."""
    return device.type == "cpu" and cache_dtype == torch.float32 and library() is not None


def attend(
    q: Tensor,
    keys: Tensor,
    values: Tensor,
    side_keys: Tensor | None,
    side_values: Tensor | None,
    offsets: Tensor,
    lengths: Tensor,
    pool_head_stride: int,
    side_head_stride: int,
) -> Tensor:
    """Attention of one query per row, q (R, H, D) float32 (scaled by the caller), over the first ``lengths[r]``
    positions of row r: position p's key and value (kv head 0) sit at element ``offsets[r, p]`` of ``keys`` /
    ``values`` (kv head g ``g * pool_head_stride`` further), or, where the offset is ``-(1 + o)``, at element o of
    ``side_keys`` / ``side_values`` (stride ``side_head_stride``); query head h reads kv head h // (H / K).
    Returns (R, H, D) float32. ``offsets`` (R, L) and ``lengths`` (R,) are int64; ``keys`` and ``values``
    contiguous float32 (callers check ``supports_attention``)."""
    lib = library()
    q = q.contiguous()
    R, H, D = q.shape
    L = offsets.shape[1]
    if offsets.dtype != torch.int64 or lengths.dtype != torch.int64 or not offsets.is_contiguous():
        raise ValueError("offsets and lengths must be contiguous int64")
    if int(lengths.max()) > L or int(lengths.min()) < 1:
        raise ValueError(f"lengths must be in 1..{L}")
    if not (keys.is_contiguous() and values.is_contiguous()):
        raise ValueError("the pool's keys and values must be contiguous")
    side_k = side_keys.data_ptr() if side_keys is not None else keys.data_ptr()
    side_v = side_values.data_ptr() if side_values is not None else values.data_ptr()
    group = H // keys.shape[1]  # query heads per kv head: the pool is (loops, K, blocks, chunk, D)
    out = torch.empty(R, H, D, dtype=torch.float32)
    lib.speed_attend_f32(
        q.data_ptr(),
        keys.data_ptr(),
        values.data_ptr(),
        side_k,
        side_v,
        offsets.data_ptr(),
        lengths.data_ptr(),
        R,
        H,
        D,
        L,
        pool_head_stride,
        side_head_stride,
        group,
        out.data_ptr(),
        torch.get_num_threads(),
    )
    return out


def supports_rows(x: Tensor) -> bool:
    """Whether ``rms_norm`` and ``swiglu`` run on rows like ``x``: float32 on the CPU, the library loaded (a
    property of the model's dtype and device, never of the row count)."""
    return x.device.type == "cpu" and x.dtype == torch.float32 and library() is not None


def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """``x / sqrt(mean(x**2, -1) + eps) * weight`` of float32 rows (R, D), each row alone in one fixed order."""
    x, weight = x.contiguous(), weight.contiguous()
    if weight.dtype != torch.float32 or weight.shape != x.shape[-1:]:
        raise ValueError(f"a float32 weight of shape ({x.shape[-1]},) is needed, got {tuple(weight.shape)}")
    out = torch.empty_like(x)
    R = x.numel() // x.shape[-1]
    library().speed_rms_norm_f32(x.data_ptr(), weight.data_ptr(), out.data_ptr(), R, x.shape[-1], eps)
    return out


def swiglu(x: Tensor) -> Tensor:
    """``silu(gate) * up`` of float32 rows (R, 2F) holding [gate; up]: (R, F), elementwise."""
    x = x.contiguous()
    R, F = x.shape[0], x.shape[-1] // 2
    out = torch.empty(R, F, dtype=torch.float32)
    library().speed_swiglu_f32(x.data_ptr(), out.data_ptr(), R, F)
    return out


def rope(x: Tensor, cos: Tensor, sin: Tensor, pairs: bool) -> Tensor:
    """Rotary positions of rows' heads ``x`` (R, heads, D) float32, each row's heads contiguous (a slice of a fused
    q;k;v row), by cos/sin (R, D): (R, heads, D), bit for bit ``speed.models.lm_blocks.rotate`` (``pairs``:
    ``rotate_pairs``) in float32."""
    R, heads, D = x.shape
    if x.stride(2) != 1 or x.stride(1) != D or D % 2:
        raise ValueError(f"rows of contiguous heads of even width are needed, got strides {x.stride()}")
    cos, sin = cos.contiguous(), sin.contiguous()
    if cos.shape != (R, D) or sin.shape != (R, D) or cos.dtype != torch.float32 or sin.dtype != torch.float32:
        raise ValueError(f"float32 cos and sin of shape ({R}, {D}) are needed, got {tuple(cos.shape)}")
    out = torch.empty(R, heads, D, dtype=torch.float32)
    library().speed_rope_f32(x.data_ptr(), x.stride(0), cos.data_ptr(), sin.data_ptr(), out.data_ptr(), R, heads, D,
                             int(pairs))
    return out


@dataclass(frozen=True)
class BlockWeights:
    """What ``lm_block`` reads of one looped-LM block besides its rows: the four linears packed by ``pack`` (one
    dtype), the norms' float32 gains (an out norm None where the block has none), their eps, whether the out
    norms apply to the residual sums (``norm_sum``), the q/k biases (None: none) and the attention's shape."""

    qkv: Tensor
    o: Tensor
    wi: Tensor
    wo: Tensor
    attn_norm: Tensor
    attn_out_norm: Tensor | None
    mlp_norm: Tensor
    mlp_out_norm: Tensor | None
    eps: tuple[float, float, float, float]
    norm_sum: bool
    q_bias: Tensor | None
    k_bias: Tensor | None
    n_heads: int
    n_kv_heads: int
    head_dim: int
    d_ff: int
    pairs: bool


def lm_block(
    x: Tensor,
    w: BlockWeights,
    cos: Tensor,
    sin: Tensor,
    keys: Tensor,
    values: Tensor,
    offsets: Tensor,
    lengths: Tensor,
    pool_head_stride: int,
) -> Tensor:
    """One looped-LM block on decode rows x (R, d) float32 (``speed.models.lm_blocks.Block.decode``, bit for bit, in
    one call): norms, the packed linears, q/k biases and rotation (cos/sin (R, D)), each row's key and value written
    at its own position (``offsets[r, lengths[r] - 1]`` in the pool ``keys``/``values``, as ``attend`` reads them),
    the attention, SwiGLU and both residual sums. Returns the rows' outputs (R, d). The cache's bookkeeping (its
    lengths, its blocks) is the caller's; no branch rows (no side entries)."""
    lib = library()
    x = x.contiguous()
    R, d = x.shape
    H, D = w.n_heads, w.head_dim
    for t in (cos, sin):
        if t.shape != (R, D) or t.dtype != torch.float32 or not t.is_contiguous():
            raise ValueError(f"contiguous float32 cos and sin of shape ({R}, {D}) are needed, got {tuple(t.shape)}")
    if offsets.dtype != torch.int64 or lengths.dtype != torch.int64 or not offsets.is_contiguous():
        raise ValueError("offsets and lengths must be contiguous int64")
    if not 1 <= R <= MAX_ROWS or not (keys.is_contiguous() and values.is_contiguous()):
        raise ValueError(f"1..{MAX_ROWS} rows and a contiguous pool are needed, got {R} rows")
    out = torch.empty(R, d, dtype=torch.float32)

    def ptr(t: Tensor | None) -> int:
        return 0 if t is None else t.data_ptr()

    ints = (ctypes.c_int64 * 29)(
        x.data_ptr(), out.data_ptr(), R, d, H, w.n_kv_heads, D, w.d_ff,
        ptr(w.attn_norm), ptr(w.attn_out_norm), ptr(w.mlp_norm), ptr(w.mlp_out_norm), int(w.norm_sum),
        w.qkv.data_ptr(), w.o.data_ptr(), w.wi.data_ptr(), w.wo.data_ptr(), ptr(w.q_bias), ptr(w.k_bias),
        cos.data_ptr(), sin.data_ptr(), int(w.pairs), keys.data_ptr(), values.data_ptr(),
        offsets.data_ptr(), lengths.data_ptr(), offsets.shape[1], pool_head_stride, torch.get_num_threads(),
    )  # fmt: skip
    floats = (ctypes.c_float * 5)(*w.eps, D**-0.5)
    call = lib.speed_lm_block_f32 if w.qkv.dtype == torch.float32 else lib.speed_lm_block_bf16
    call(ctypes.addressof(ints), ctypes.addressof(floats))
    return out
