"""The native linears sum in exactly the order their source documents, on whichever vector width this machine
compiled them for (``native.vector_bits``: AVX-512, or AVX2 as two 256-bit halves): checked bit for bit against an
emulation in exact rational arithmetic, each fused multiply-add rounded once to float32 (ties to even), each add
of the lanes' tree rounded by numpy's float32. Passing on both kinds of machine is what makes the kernels give the
same bits on an AVX-512 CPU and on an AVX2 one.

- packed (``linear_packed``): out[r, j] = x[r, 0] w[j, 0], then each next k by one fused multiply-add, in order;
- dot (``linear``): 16 lanes, lane l summing k = l, l + 16, ... by fused multiply-adds (a short last step padded
  with zeros), then the lanes in the tree of GCC's ``_mm512_reduce_add_ps``.
"""

from __future__ import annotations

from fractions import Fraction

import numpy as np
import pytest
import torch

from speed.engine import native

pytestmark = pytest.mark.skipif(
    native.library() is None, reason=f"no native kernels here: {native.unavailable_reason()}"
)


def _f32(q: Fraction) -> np.float32:
    """``q`` rounded to the nearest float32, ties to the even significand (what one IEEE operation gives)."""
    near = np.float32(float(q))
    candidates = (near, np.nextafter(near, np.float32(np.inf)), np.nextafter(near, np.float32(-np.inf)))
    return min(candidates, key=lambda v: (abs(Fraction(float(v)) - q), int(v.view(np.uint32)) & 1))


def _fma(a: np.float32, b: np.float32, c: np.float32) -> np.float32:
    return _f32(Fraction(float(a)) * Fraction(float(b)) + Fraction(float(c)))


def _lane_tree(lanes: list[np.float32]) -> np.float32:
    """GCC's ``_mm512_reduce_add_ps``: lanes 8-15 plus 0-7, then the upper four of those plus the lower four, then
    lanes {0, 2} and {1, 3}, then the two."""
    t3 = [np.float32(lanes[i + 8] + lanes[i]) for i in range(8)]
    t6 = [np.float32(t3[i + 4] + t3[i]) for i in range(4)]
    return np.float32(np.float32(t6[0] + t6[2]) + np.float32(t6[1] + t6[3]))


def _case(rows: int, k: int, n: int, dtype: torch.dtype, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, k, generator=g)
    w = (torch.randn(n, k, generator=g) / k**0.5).to(dtype)
    return x, w


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_packed_linear_sums_each_output_in_k_order_by_fused_multiply_adds(dtype):
    # 300 inputs: AVX2's chunks of 128 k steps, the last one short; 40 outputs: a whole panel of 32 and a padded one
    x, w = _case(8, 300, 40, dtype, seed=1)
    xs, ws = x.numpy(), w.float().numpy()
    want = np.zeros((8, w.shape[0]), dtype=np.float32)
    for r in range(8):
        for j in range(w.shape[0]):
            acc = np.float32(0.0)
            for kk in range(w.shape[1]):
                acc = _fma(xs[r, kk], ws[j, kk], acc)
            want[r, j] = acc
    for rows in range(1, 9):  # every count: on AVX2 two panels at a time (float32 1-5, bfloat16 1-2), else chunked
        got = native.linear_packed(native.pack(w), x[:rows], w.shape[0]).numpy()
        assert np.array_equal(got.view(np.uint32), want[:rows].view(np.uint32)), rows


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_dot_linear_sums_sixteen_lanes_then_their_tree(dtype):
    x, w = _case(4, 41, 9, dtype, seed=2)  # 41 inputs: two whole lane steps and a tail of 9
    xs, ws = x.numpy(), w.float().numpy()
    got = native.linear(w, x).numpy()
    for r in range(x.shape[0]):
        for j in range(w.shape[0]):
            lanes = []
            for lane in range(16):
                acc = np.float32(0.0)
                for kk in range(lane, -(-w.shape[1] // 16) * 16, 16):
                    a, b = (xs[r, kk], ws[j, kk]) if kk < w.shape[1] else (np.float32(0), np.float32(0))
                    acc = _fma(a, b, acc)
                lanes.append(acc)
            want = _lane_tree(lanes)
            assert got[r, j].view(np.uint32) == want.view(np.uint32), (r, j, got[r, j], want)


def test_the_kernels_report_the_vector_width_they_were_built_for():
    assert native.vector_bits() in (256, 512)
