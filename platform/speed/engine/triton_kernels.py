"""Row-invariant decode kernels in Triton: the GPU's linear, attention over the paged KV cache, norms and rotary.

The CPU's kernels (``speed.engine.kernels``, ``speed.engine.native``) make a row's bits independent of the rows
beside it, of its position among them and of how many there are; these do the same on a GPU, where cuBLAS and
torch's reductions pick their blocking, split-K and reduction trees by shape. The rule every kernel here keeps:
**one compiled kernel for every row count, and one reduction order per output, that of the row alone.**

- Every block size is a constant (``LINEAR_BLOCKS``, ``CHUNK``) or one of the widths (a layer's inputs, a head's,
  the cache's table), never the number of rows: 1 row and 64 rows run the same binary, the rows past the count
  masked. The row count is passed with ``do_not_specialize``, so Triton does not compile a second kernel for 1
  row or for a multiple of 16. The loops' trip counts are compile-time widths too (a layer's inputs, the table's
  chunks, T5's key span): Triton's interpreter cannot loop to a bound it reads at run time (numpy 2.4 refuses
  ``int()`` of its one-element arrays), and the attention skips the chunks past a row's length instead.
- Programs never combine rows: a linear's program owns ``BLOCK_M`` rows by ``BLOCK_N`` outputs and sums each
  output over its inputs alone, in ``BLOCK_K`` chunks taken in order; the other kernels run one program per
  row (or per row and head). No split-K, no atomics, no cross-program reduction.
- Within a program a reduction is ``tl.sum`` over a fixed-shape tile (``tl.sum(x[:, :, None] * w[None], 1)``),
  never ``tl.dot``: Triton lowers the sum with one layout per tile shape, the same tree for every row of the
  tile, while ``tl.dot`` is an MMA on the GPU (TF32 unless told otherwise) and numpy's ``matmul`` (BLAS, whose
  edge rows take other micro-kernels) under the interpreter. With float32 activations the MMA would not use the
  tensor cores anyway (IEEE float32 ``tl.dot`` runs on FMA units too), so the sum costs no bandwidth: decode is bound by
  the weight read, which each program does once for its ``BLOCK_M`` rows (the row blocks of one output tile are
  neighbouring programs, so a bucket of up to 64 rows reads each weight tile from memory once, from L2 after).
- Attention runs one program per (row, key/value head): its query heads against its own positions only, read
  in place through the block table in chunks of ``CHUNK`` (the cache's block, ``ATTN_CHUNK``) in position order,
  with the online softmax's running max and sums updated chunk after chunk: the same sequence of operations
  whatever the other rows, their lengths, or the pool.

bf16 weights are read as they are and widened in registers (no float32 copy of the weight); everything
accumulates in float32. Outputs are new tensors of shapes fixed by the inputs' (no host synchronisation, no
``.item()``, no size read from the device), so every function here may be captured in a CUDA graph.

On a machine without CUDA the kernels run under Triton's interpreter (``TRITON_INTERPRET=1``, set here before
the kernels are defined, so only where no GPU is): slow, for the CPU tests at tiny sizes
(``tests/test_triton_kernels.py``), which check the same invariances as the CPU kernels' tests.
"""

from __future__ import annotations

import os
import sys

import torch
from torch import Tensor

if not torch.cuda.is_available():  # read when each kernel is defined: the CPU's tests run them interpreted
    if "triton" in sys.modules and os.environ.get("TRITON_INTERPRET") != "1":
        # Triton's own kernels (tl.sum's, tl.max's) were defined compiled: the interpreter cannot call them
        raise ImportError("Triton was imported before TRITON_INTERPRET=1 was set, on a machine without CUDA")
    os.environ.setdefault("TRITON_INTERPRET", "1")

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

CHUNK = 32  # key positions per attention step: the paged cache's block (speed.engine.kernels.ATTN_CHUNK)
GATES = {"none": 0, "silu": 1, "gelu": 2}  # a gated linear's activation: silu(gate) * up, gelu_tanh(gate) * up


def interpreted() -> bool:
    """Whether the kernels run under Triton's interpreter (on CPU tensors) rather than compiled for a GPU."""
    return os.environ.get("TRITON_INTERPRET") == "1"


# The linear's tiles (BLOCK_M rows, BLOCK_N outputs, BLOCK_K inputs summed per step): one for every row count. On a
# GPU 8 rows (a bucket of 64 rows is 8 neighbouring programs per output tile, which read it from memory once) by
# 32 outputs by 64 inputs (128 contiguous bytes of a bf16 weight row). The interpreter runs each program in Python
# at some milliseconds whatever its size, so it takes fewer, larger ones (its tests' invariance is the same
# argument; ``tests/test_triton_kernels.py`` runs the GPU's tiles too).
LINEAR_BLOCKS = (64, 128, 64) if interpreted() else (8, 32, 64)


# ----- linear: out[r, o] = sum_i x[r, i] w[o, i], i in BLOCK_K chunks in order ---------------------------------


@triton.jit(do_not_specialize=["n_rows"])
def _linear_kernel(
    x_ptr, w_ptr, out_ptr, n_rows, n_out, stride_x, stride_w, stride_out, n_in: tl.constexpr,
    GATE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    outs = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    ks = tl.arange(0, BLOCK_K)
    y = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, n_in, BLOCK_K):
        k = k0 + ks
        x_mask = (rows[:, None] < n_rows) & (k[None, :] < n_in)
        x = tl.load(x_ptr + rows[:, None] * stride_x + k[None, :], mask=x_mask, other=0.0)  # (BLOCK_M, BLOCK_K)
        w_at = w_ptr + outs[None, :] * stride_w + k[:, None]
        w_mask = (outs[None, :] < n_out) & (k[:, None] < n_in)
        w = tl.load(w_at, mask=w_mask, other=0.0).to(tl.float32)  # (BLOCK_K, BLOCK_N): bf16 widened in registers
        y += tl.sum(x[:, :, None] * w[None, :, :], axis=1)  # each output's chunk sum, the chunks added in order
        if GATE != 0:  # the weight is [gate; up]: output o's up is weight row n_out + o
            w = tl.load(w_at + n_out * stride_w, mask=w_mask, other=0.0).to(tl.float32)
            up += tl.sum(x[:, :, None] * w[None, :, :], axis=1)
    if GATE == 1:  # silu(y) up, the sigmoid in a form that never overflows
        e = tl.exp(-tl.abs(y))
        y = y * tl.where(y < 0, e / (1.0 + e), 1.0 / (1.0 + e)) * up
    elif GATE == 2:  # gelu_tanh(y) up; tl has no tanh the interpreter runs too: (1 - e) / (1 + e), e = exp(-2|t|)
        t = 0.7978845608028654 * (y + 0.044715 * y * y * y)
        e = tl.exp(-2.0 * tl.abs(t))
        tanh = tl.where(t < 0, -1.0, 1.0) * (1.0 - e) / (1.0 + e)
        y = 0.5 * y * (1.0 + tanh) * up
    mask = (rows[:, None] < n_rows) & (outs[None, :] < n_out)
    tl.store(out_ptr + rows[:, None] * stride_out + outs[None, :], y, mask=mask)


def linear(weight: Tensor, x: Tensor, gate: str = "none") -> Tensor:
    """x (n, in) float32 times weight (out, in) float32 or bf16, read in place: (n, out) float32, any n; with
    ``gate`` "silu" or "gelu" the weight is [gate; up] (2F, in) and the result act(gate) * up (n, F), fused."""
    if weight.dim() != 2 or x.dim() != 2 or x.shape[1] != weight.shape[1]:
        raise ValueError(f"linear takes x (n, in) and weight (out, in), got {tuple(x.shape)}, {tuple(weight.shape)}")
    x, weight = x.contiguous(), weight.contiguous()  # strides are compiled into the kernel: one layout for all
    n, n_in = x.shape
    n_out = weight.shape[0] // 2 if gate != "none" else weight.shape[0]
    out = torch.empty(n, n_out, dtype=torch.float32, device=x.device)
    block_m, block_n, _ = LINEAR_BLOCKS
    grid = (triton.cdiv(n, block_m), triton.cdiv(n_out, block_n))  # axis 0 (fastest): the row blocks of a tile
    _linear_kernel[grid](
        x, weight, out, n, n_out, x.stride(0), weight.stride(0), out.stride(0), n_in,
        GATES[gate], *LINEAR_BLOCKS,
    )  # fmt: skip
    return out


# ----- RMS norm and the residual stream: one program per row ------------------------------------------------------


@triton.jit
def _residual_kernel(
    x_ptr, y_ptr, out_w_ptr, next_w_ptr, x_out_ptr, h_out_ptr, d, stride_x, stride_y, eps_out, eps_next,
    HAS_Y: tl.constexpr, HAS_OUT: tl.constexpr, NORM_SUM: tl.constexpr, HAS_NEXT: tl.constexpr,
    BLOCK_D: tl.constexpr,
):  # fmt: skip
    r = tl.program_id(0)
    cols = tl.arange(0, BLOCK_D)
    s = tl.load(x_ptr + r * stride_x + cols, mask=cols < d, other=0.0)
    if HAS_Y:  # the residual sum: x + out_norm(y), or out_norm(x + y) (NORM_SUM); out_norm the identity without
        y = tl.load(y_ptr + r * stride_y + cols, mask=cols < d, other=0.0)
        if NORM_SUM:
            y = s + y
        if HAS_OUT:  # rms(v) = v rsqrt(mean(v^2) + eps) w (the lanes past d hold 0)
            w = tl.load(out_w_ptr + cols, mask=cols < d, other=0.0)
            y = y * (1.0 / tl.sqrt(tl.sum(y * y, axis=0) / d + eps_out)) * w
        if NORM_SUM:
            s = y
        else:
            s = s + y
        tl.store(x_out_ptr + r * d + cols, s, mask=cols < d)
    if HAS_NEXT:  # the next sublayer's input norm of the new stream
        w = tl.load(next_w_ptr + cols, mask=cols < d, other=0.0)
        h = s * (1.0 / tl.sqrt(tl.sum(s * s, axis=0) / d + eps_next)) * w
        tl.store(h_out_ptr + r * d + cols, h, mask=cols < d)


def _row_warps(d: int) -> int:
    return 4 if d <= 4096 else 8  # a function of the width alone, never of the rows


def rms_norm(x: Tensor, weight: Tensor | None, eps: float) -> Tensor:
    """RMSNorm of rows x (n, d) with gain ``weight`` (d,; None: 1): x * rsqrt(mean(x^2) + eps) * weight, float32."""
    weight = torch.ones(x.shape[1], device=x.device) if weight is None else weight  # times 1: exact
    _, h = residual(x, None, None, 0.0, False, weight, eps)
    return h


def residual(
    x: Tensor, y: Tensor | None, out_w: Tensor | None, out_eps: float, norm_sum: bool, next_w: Tensor | None,
    next_eps: float,
) -> tuple[Tensor, Tensor | None]:  # fmt: skip
    """A block's residual step on rows (n, d), one launch: the stream x + rms(y) (``norm_sum``: rms(x + y); rms
    with gain ``out_w``, the identity where None; x itself where y is None) and, with ``next_w``, the next
    sublayer's input rms(stream) with that gain (else None)."""
    x = x.contiguous()
    n, d = x.shape
    y = x if y is None else y.contiguous()
    stream = torch.empty_like(x) if y is not x else x
    h = torch.empty_like(x) if next_w is not None else None
    _residual_kernel[(n,)](
        x, y, x if out_w is None else out_w, x if next_w is None else next_w, stream, x if h is None else h, d,
        x.stride(0), y.stride(0), float(out_eps), float(next_eps), y is not x, out_w is not None, norm_sum,
        next_w is not None, triton.next_power_of_2(d), num_warps=_row_warps(d),
    )  # fmt: skip
    return stream, h


# ----- rotary: biases, rotation and the query's scale, queries and keys in one launch -----------------------------


@triton.jit
def _rope_kernel(
    qkv_ptr, cos_ptr, sin_ptr, q_bias_ptr, k_bias_ptr, q_ptr, k_ptr, n_q, n_kv, head_dim, stride_qkv, stride_cs,
    scale, PAIRS: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    r, head = tl.program_id(0), tl.program_id(1)  # head < n_q: a query head, else key head head - n_q
    d = tl.arange(0, BLOCK_D)
    live = d < head_dim
    if PAIRS:  # (2i, 2i + 1) -> (a cos - b sin, b cos + a sin)
        partner, sign = d ^ 1, tl.where(d % 2 == 0, -1.0, 1.0)
    else:  # (i, i + D/2), the halves
        half = head_dim // 2
        partner, sign = tl.where(d < half, d + half, d - half), tl.where(d < half, -1.0, 1.0)
    row = qkv_ptr + r * stride_qkv + head * head_dim
    x = tl.load(row + d, mask=live, other=0.0)
    xp = tl.load(row + partner, mask=live, other=0.0)
    if HAS_BIAS:  # Huginn's: added before the rotation
        if head < n_q:
            bias = q_bias_ptr + head * head_dim
        else:
            bias = k_bias_ptr + (head - n_q) * head_dim
        x = x + tl.load(bias + d, mask=live, other=0.0)
        xp = xp + tl.load(bias + partner, mask=live, other=0.0)
    cos = tl.load(cos_ptr + r * stride_cs + d, mask=live, other=0.0)
    sin = tl.load(sin_ptr + r * stride_cs + d, mask=live, other=0.0)
    turned = x * cos + (sign * xp) * sin
    if head < n_q:
        tl.store(q_ptr + (r * n_q + head) * head_dim + d, turned * scale, mask=live)
    else:
        tl.store(k_ptr + (r * n_kv + head - n_q) * head_dim + d, turned, mask=live)


def rope_qkv(
    qkv: Tensor, cos: Tensor, sin: Tensor, n_q: int, n_kv: int, q_bias: Tensor | None, k_bias: Tensor | None,
    pairs: bool, scale: float,
) -> tuple[Tensor, Tensor, Tensor]:  # fmt: skip
    """A fused projection's rows (n, (H + 2K) D) split into queries (n, H, D), biased, rotated by cos/sin (n, D)
    and times ``scale``; keys (n, K, D), biased and rotated; values (n, K, D) (a view): one launch."""
    n = qkv.shape[0]
    D = cos.shape[-1]
    qkv, cos, sin = qkv.contiguous(), cos.contiguous(), sin.contiguous()
    q = torch.empty(n, n_q, D, dtype=qkv.dtype, device=qkv.device)
    k = torch.empty(n, n_kv, D, dtype=qkv.dtype, device=qkv.device)
    has_bias = q_bias is not None
    _rope_kernel[(n, n_q + n_kv)](
        qkv, cos, sin, q_bias if has_bias else qkv, k_bias if has_bias else qkv, q, k, n_q, n_kv, D, qkv.stride(0),
        cos.stride(0), float(scale), pairs, has_bias, triton.next_power_of_2(D),
    )  # fmt: skip
    v = qkv.view(n, n_q + 2 * n_kv, D)[:, n_q + n_kv :]
    return q, k, v


# ----- attention: one program per (row, kv head), positions in CHUNK steps in order, online softmax --------------


@triton.jit
def _paged_attend_kernel(
    q_ptr, k_ptr, v_ptr, side_k_ptr, side_v_ptr, loop_ptr, length_ptr, table_ptr, lane_pos_ptr, lane_entry_ptr,
    bias_ptr, out_ptr, n_kv, group, head_dim, n_pool, n_entries, stride_table, lane_width, stride_br, stride_bh,
    N_CHUNKS: tl.constexpr, CHUNK: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_S: tl.constexpr, HAS_LANES: tl.constexpr, HAS_BIAS: tl.constexpr,
):  # fmt: skip
    r, h = tl.program_id(0), tl.program_id(1)
    g, d, p = tl.arange(0, BLOCK_G), tl.arange(0, BLOCK_D), tl.arange(0, CHUNK)
    heads = h * group + g  # the query heads sharing kv head h
    q_mask = (g[:, None] < group) & (d[None, :] < head_dim)
    q = tl.load(q_ptr + (r * n_kv * group + heads[:, None]) * head_dim + d[None, :], mask=q_mask, other=0.0)
    loop = tl.load(loop_ptr + r)
    length = tl.load(length_ptr + r)  # positions 0..length-1 (its own, written, the last)
    pool = (loop * n_kv + h) * n_pool  # its virtual layer's head h: n_pool blocks of CHUNK positions
    m = tl.full((BLOCK_G,), float("-inf"), tl.float32)
    total = tl.zeros((BLOCK_G,), tl.float32)
    acc = tl.zeros((BLOCK_G, BLOCK_D), tl.float32)
    if HAS_LANES:  # a branch row: the positions of its lane are read from its side entries
        s_i = tl.arange(0, BLOCK_S)
        lane_pos = tl.load(lane_pos_ptr + r * lane_width + s_i, mask=s_i < lane_width, other=-1)
        lane_entry = tl.load(lane_entry_ptr + r * lane_width + s_i, mask=s_i < lane_width, other=0)
    # The trip count is the table's width, a constant of the cache, and chunks past the row's length are skipped:
    # a loop bound read from the device cannot run under the interpreter (numpy 2.4 refuses int() of its scalars).
    for c in range(0, N_CHUNKS):
        if c * CHUNK < length:
            block = tl.load(table_ptr + r * stride_table + c)
            pos = c * CHUNK + p
            kv_mask = (pos[:, None] < length) & (d[None, :] < head_dim)
            at = ((pool + block) * CHUNK + p[:, None]) * head_dim + d[None, :]  # (CHUNK, BLOCK_D)
            k = tl.load(k_ptr + at, mask=kv_mask, other=0.0).to(tl.float32)
            v = tl.load(v_ptr + at, mask=kv_mask, other=0.0).to(tl.float32)
            if HAS_LANES:
                hit = pos[:, None] == lane_pos[None, :]  # (CHUNK, BLOCK_S)
                on_lane = tl.max(hit.to(tl.int32), axis=1) > 0
                entry = tl.sum(tl.where(hit, lane_entry[None, :], 0), axis=1)  # (CHUNK,): its side entry
                side_at = ((loop * n_entries + entry[:, None]) * n_kv + h) * head_dim + d[None, :]
                side_mask = on_lane[:, None] & kv_mask
                k = tl.where(side_mask, tl.load(side_k_ptr + side_at, mask=side_mask, other=0.0).to(tl.float32), k)
                v = tl.where(side_mask, tl.load(side_v_ptr + side_at, mask=side_mask, other=0.0).to(tl.float32), v)
            visible = tl.where(pos < length, 0.0, float("-inf"))[None, :]
            s = tl.sum(q[:, None, :] * k[None, :, :], axis=2) + visible  # (G, CHUNK) scores
            if HAS_BIAS:  # T5's relative-position bias of each query head at each position
                b_at = bias_ptr + r * stride_br + heads[:, None] * stride_bh + pos[None, :]
                s += tl.load(b_at, mask=(g[:, None] < group) & (pos[None, :] < length), other=0.0)
            top = tl.maximum(m, tl.max(s, axis=1))  # the running max
            alpha = tl.exp(m - top)  # 1 exactly where the max held: chunks that add nothing change nothing
            weight = tl.exp(s - top[:, None])
            total = total * alpha + tl.sum(weight, axis=1)
            acc = acc * alpha[:, None] + tl.sum(weight[:, :, None] * v[None, :, :], axis=1)
            m = top
    out = acc / total[:, None]
    tl.store(out_ptr + (r * n_kv * group + heads[:, None]) * head_dim + d[None, :], out, mask=q_mask)


def paged_attend(
    q: Tensor, keys: Tensor, values: Tensor, loop: Tensor, length: Tensor, table: Tensor,
    side_keys: Tensor | None = None, side_values: Tensor | None = None, lane_pos: Tensor | None = None,
    lane_entry: Tensor | None = None, bias: Tensor | None = None,
) -> Tensor:  # fmt: skip
    """Each row's attention (n, H, D), float32: its query heads q (n, H, D) (scaled) against positions
    0..length[r]-1 of its virtual layer ``loop[r]`` in one layer's pool, keys/values (loops, K, blocks, CHUNK, D),
    its chunk c in block ``table[r, c]`` (n, C >= its chunks); a branch row's lane positions ``lane_pos[r]`` (n,
    S; -1 pads) read from side entries ``lane_entry[r]`` of side_keys/side_values (loops, entries, K, D).
    H/K query heads share each kv head. With ``bias`` (n, H, >= C * CHUNK) each query head's additive score bias
    at each position (T5's relative positions; read up to the row's length only). Every index is a device tensor:
    nothing is read on the host."""
    n, H, D = q.shape
    K, n_pool = keys.shape[1], keys.shape[2]
    if keys.shape[3] != CHUNK or not keys.is_contiguous() or not values.is_contiguous():
        raise ValueError(f"a pool (loops, K, blocks, {CHUNK}, D), contiguous, got {tuple(keys.shape)}")
    q, table = q.contiguous(), table.contiguous()
    out = torch.empty(n, H, D, dtype=torch.float32, device=q.device)
    lanes = lane_pos is not None
    width = lane_pos.shape[1] if lanes else 1
    if bias is not None and (bias.shape[:2] != (n, H) or bias.shape[2] < table.shape[1] * CHUNK):
        raise ValueError(f"a bias (n, H, >= {table.shape[1] * CHUNK}) for q {tuple(q.shape)}, got {tuple(bias.shape)}")
    has_bias = bias is not None
    bias = bias.contiguous() if has_bias else q
    _paged_attend_kernel[(n, K)](
        q, keys, values, side_keys if lanes else keys, side_values if lanes else values, loop, length, table,
        lane_pos.contiguous() if lanes else length, lane_entry.contiguous() if lanes else length, bias, out, K,
        H // K, D, n_pool, side_keys.shape[1] if lanes else 0, table.stride(0), width,
        bias.stride(0) if has_bias else 0, bias.stride(1) if has_bias else 0, table.shape[1], CHUNK,
        triton.next_power_of_2(H // K), triton.next_power_of_2(D), triton.next_power_of_2(width), lanes, has_bias,
    )  # fmt: skip
    return out


@triton.jit
def _attend_kernel(
    q_ptr, k_ptr, v_ptr, bias_ptr, source_ptr, out_ptr, n_heads, head_dim, stride_qr, stride_qh, stride_kr,
    stride_kh, stride_kl, stride_vr, stride_vh, stride_vl, stride_br, stride_bh, n_keys: tl.constexpr,
    CHUNK: tl.constexpr, BLOCK_D: tl.constexpr, HAS_SOURCE: tl.constexpr,
):  # fmt: skip
    r, h = tl.program_id(0), tl.program_id(1)
    d, p = tl.arange(0, BLOCK_D), tl.arange(0, CHUNK)
    q = tl.load(q_ptr + r * stride_qr + h * stride_qh + d, mask=d < head_dim, other=0.0)[None, :]  # (1, BLOCK_D)
    if HAS_SOURCE:  # the row reads keys, values and bias at its source (its slot of T5's encoder memory)
        at = tl.load(source_ptr + r)
        k_ptr += at * stride_kr
        v_ptr += at * stride_vr
        bias_ptr += at * stride_br
    else:
        k_ptr += r * stride_kr
        v_ptr += r * stride_vr
        bias_ptr += r * stride_br
    m = tl.full((1,), float("-inf"), tl.float32)
    total = tl.zeros((1,), tl.float32)
    acc = tl.zeros((1, BLOCK_D), tl.float32)
    for c in range(0, tl.cdiv(n_keys, CHUNK)):
        pos = c * CHUNK + p
        kv_mask = (pos[:, None] < n_keys) & (d[None, :] < head_dim)
        k_at = k_ptr + h * stride_kh + pos[:, None] * stride_kl + d[None, :]
        v_at = v_ptr + h * stride_vh + pos[:, None] * stride_vl + d[None, :]
        k = tl.load(k_at, mask=kv_mask, other=0.0)  # masked lanes are 0, never undefined: 0 * weight 0 adds 0
        v = tl.load(v_at, mask=kv_mask, other=0.0)
        bias = tl.load(bias_ptr + h * stride_bh + pos, mask=pos < n_keys, other=float("-inf"))
        k, v, visible = k.to(tl.float32), v.to(tl.float32), bias[None, :]
        # _paged_attend_kernel's online-softmax step, written out in both: a nested @triton.jit call costs the
        # interpreter as much as the step itself (the CPU's attention tests ran twice as long with a helper)
        s = tl.sum(q[:, None, :] * k[None, :, :], axis=2) + visible  # (G, CHUNK) scores
        top = tl.maximum(m, tl.max(s, axis=1))  # the running max
        alpha = tl.exp(m - top)  # 1 exactly where the max held: chunks that add nothing change nothing
        weight = tl.exp(s - top[:, None])
        total = total * alpha + tl.sum(weight, axis=1)
        acc = acc * alpha[:, None] + tl.sum(weight[:, :, None] * v[None, :, :], axis=1)
        m = top
    tl.store(out_ptr + (r * n_heads + h) * head_dim + d[None, :], acc / total[:, None], mask=d[None, :] < head_dim)


def attend(q: Tensor, keys: Tensor, values: Tensor, bias: Tensor, source: Tensor | None = None) -> Tensor:
    """``speed.engine.kernels.attend`` on the GPU: one query per row, q (n, H, D) against keys/values (n, H, L, D)
    (strided views welcome: an expanded request's keys are not copied), additive bias (n, H or 1, 1, L); the
    positions in CHUNK steps in order, so masked positions after the real ones add exact zeros. (n, H, D).
    With ``source`` (n,) long on the device, row r reads keys, values and bias at ``source[r]`` of theirs (C, ...)
    instead (T5's slots of encoder memory, picked on the device: nothing copied, nothing read on the host)."""
    n, H, D = q.shape
    L = keys.shape[2]
    if keys.stride(-1) != 1 or values.stride(-1) != 1 or q.stride(-1) != 1 or bias.stride(-1) != 1:
        raise ValueError("attend reads q, keys, values and bias along contiguous last dimensions")
    out = torch.empty(n, H, D, dtype=torch.float32, device=q.device)
    bias_h = bias.stride(1) if bias.shape[1] > 1 else 0
    has_source = source is not None
    _attend_kernel[(n, H)](
        q, keys, values, bias, source.contiguous() if has_source else q, out, H, D, q.stride(0), q.stride(1),
        *keys.stride()[:3], *values.stride()[:3], bias.stride(0), bias_h, L, CHUNK, triton.next_power_of_2(D),
        has_source,
    )  # fmt: skip
    return out
