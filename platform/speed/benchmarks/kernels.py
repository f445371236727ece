"""How close the decode kernels stream to this machine's memory bandwidth, at a real model's layer shapes
(``jobs/bench_kernels.py``; issue 39's goal: every row count 1..8 at 70 % or more of the read bandwidth).

A decode group pass reads every weight once for its 1..``TILE_ROWS`` rows, so at shapes whose weights do not fit
in any cache its time is the weight bytes over the bandwidth the kernel streams at. This times one pass over
``layers`` distinct layers' linear weights (more than the caches hold) with each kernel and row count, and the
machine's read bandwidth (``torch.sum`` over a buffer as large) in the same run, interleaved: repeat r times every
kernel at every row count and the read pass, in that order, keeping each one's fastest. On a GPU (``device``
"cuda") the same for the Triton linear (``speed.engine.triton_kernels``, 1..64 rows, the row buckets of a step)
and torch's, against the card's read bandwidth, each pass timed between two synchronisations.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import pyarrow as pa
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from speed.engine import kernels, matmuls, native

KERNEL_BENCH_SCHEMA = pa.schema(
    [
        # native | packed (native on weights packed in panels, native.pack) | onednn | plain
        # (speed.engine.matmuls.LINEARS) | torch (F.linear) | triton (speed.engine.triton_kernels.linear)
        pa.field("kernel", pa.string()),
        pa.field("dtype", pa.string()),  # the weights' dtype: float32 | bfloat16 (rows and sums in float32)
        pa.field("rows", pa.int64()),  # rows per call (a group pass's tile)
        pa.field("d_model", pa.int64()),
        pa.field("d_ff", pa.int64()),
        pa.field("weight_bytes", pa.int64()),  # bytes read per pass (every layer's weights once)
        pa.field("seconds", pa.float64()),  # the fastest pass of the repeats
        pa.field("gb_per_s", pa.float64()),  # weight_bytes / seconds
        pa.field("read_gb_per_s", pa.float64()),  # the machine's read bandwidth, measured in the same run (the limit)
        pa.field("of_read", pa.float64()),  # gb_per_s / read_gb_per_s
    ]
)


@dataclass(frozen=True)
class KernelRow:
    """One kernel at one row count and dtype: the fastest pass over the layers' weights and what it streamed."""

    kernel: str
    dtype: str
    rows: int
    d_model: int
    d_ff: int
    weight_bytes: int
    seconds: float
    gb_per_s: float
    read_gb_per_s: float
    of_read: float


def layer_linears(d_model: int, d_ff: int, dtype: torch.dtype) -> list[nn.Linear]:
    """One decoder layer's matmuls as the looped LM runs them: fused q/k/v, the output projection, the fused
    gate/up projection and the down projection (multi-head attention with as many key/value heads as heads)."""
    shapes = [(d_model, 3 * d_model), (d_model, d_model), (d_model, 2 * d_ff), (d_ff, d_model)]
    linears = []
    for inn, out in shapes:
        layer = nn.Linear(inn, out, bias=False)
        with torch.no_grad():
            layer.weight.normal_(0.0, inn**-0.5)
        linears.append(layer.to(dtype).requires_grad_(False))
    return linears


def _synchronize(device: torch.device) -> None:
    """Wait for ``device``'s queued work (a GPU's kernels run after their launch returns)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def read_bandwidth(buffer: Tensor) -> float:
    """GB/s of one read-only pass over ``buffer`` (its sum)."""
    _synchronize(buffer.device)
    start = time.perf_counter()
    buffer.sum()
    _synchronize(buffer.device)
    return buffer.numel() * buffer.element_size() / (time.perf_counter() - start) / 1e9


def _tile(kernel: str) -> Callable[[nn.Linear, Tensor], Tensor]:
    """A decode tile's matmul on ``kernel``: the engine's ``tile_linear`` with that path chosen, or torch's own."""
    if kernel == "torch":
        return lambda layer, x: F.linear(x.to(layer.weight.dtype), layer.weight)  # bfloat16: rows in bfloat16 too
    if kernel == "packed":  # the layer's weight is packed (``packed_copy``): tile_linear takes the packed kernel
        return matmuls.tile_linear
    if kernel == "triton":
        return lambda layer, x: kernels.triton_ops().linear(layer.weight, x)

    def run(layer: nn.Linear, x: Tensor) -> Tensor:
        before, matmuls.LINEAR = matmuls.LINEAR, kernel
        try:
            return matmuls.tile_linear(layer, x)
        finally:
            matmuls.LINEAR = before

    return run


def packed_copy(layer: nn.Linear) -> nn.Linear:
    """A copy of ``layer`` with its weight packed for the native kernel (``native.pack``), whatever its size."""
    copy = nn.Linear(layer.in_features, layer.out_features, bias=False, device="meta")
    copy.weight = nn.Parameter(native.pack(layer.weight.detach()), requires_grad=False)
    return copy


def bench_kernels(
    d_model: int = 2048,
    d_ff: int = 5632,
    layers: int = 6,
    rows: tuple[int, ...] = (1, 2, 4, 8),
    kernels_: tuple[str, ...] = ("native", "onednn", "torch"),
    dtypes: tuple[torch.dtype, ...] = (torch.float32, torch.bfloat16),
    repeats: int = 5,
    device: str = "cpu",
) -> list[KernelRow]:
    """Every kernel x dtype x row count, timed over ``layers`` layers of (d_model, d_ff) linears, interleaved with
    the read pass ``repeats`` times, the fastest of each kept, on ``device``. oneDNN's packed path is float32 only:
    its bfloat16 rows are the plain ``F.linear`` path and are left out."""
    torch.manual_seed(0)
    dev = torch.device(device)
    stacks = {dtype: [[layer.to(dev) for layer in layer_linears(d_model, d_ff, dtype)] for _ in range(layers)]
              for dtype in dtypes}  # fmt: skip
    if "packed" in kernels_:  # the same weights packed: a second copy for this benchmark only
        packed = {dtype: [[packed_copy(layer) for layer in stack] for stack in stacks[dtype]] for dtype in dtypes}
    weight_bytes = {
        dtype: sum(l.weight.numel() * l.weight.element_size() for stack in stacks[dtype] for l in stack)
        for dtype in dtypes
    }
    buffer = torch.ones(max(weight_bytes.values()) // 4, device=dev)
    cases = [(k, dt, r) for k in kernels_ for dt in dtypes for r in rows if not (k == "onednn" and dt != torch.float32)]
    best = {case: float("inf") for case in cases}
    read = 0.0
    inputs = {(r, w): torch.randn(r, w, device=dev) for r in rows for w in (d_model, d_ff)}
    with torch.inference_mode():
        for _ in range(repeats):
            for kernel, dtype, n in cases:
                tile = _tile(kernel)
                _synchronize(dev)
                start = time.perf_counter()
                for stack in (packed if kernel == "packed" else stacks)[dtype]:
                    for layer in stack:
                        tile(layer, inputs[(n, layer.in_features)])
                _synchronize(dev)
                best[(kernel, dtype, n)] = min(best[(kernel, dtype, n)], time.perf_counter() - start)
            read = max(read, read_bandwidth(buffer))
    out = []
    for (kernel, dtype, n), seconds in best.items():
        gbs = weight_bytes[dtype] / seconds / 1e9
        name = str(dtype).removeprefix("torch.")
        out.append(KernelRow(kernel, name, n, d_model, d_ff, weight_bytes[dtype], seconds, gbs, read, gbs / read))
    return out


def format_kernel_rows(rows: list[KernelRow]) -> str:
    """A Markdown table: one line per kernel and dtype, GB/s and share of the read bandwidth per row count."""
    counts = sorted({r.rows for r in rows})
    head = "| kernel | weights | " + " | ".join(f"{n} row{'s' * (n > 1)}" for n in counts) + " |"
    lines = [head, "|" + "---|" * (len(counts) + 2)]
    for kernel, dtype in dict.fromkeys((r.kernel, r.dtype) for r in rows):
        cells = {
            r.rows: f"{r.gb_per_s:.1f} GB/s ({r.of_read:.0%})" for r in rows if (r.kernel, r.dtype) == (kernel, dtype)
        }
        lines.append(f"| {kernel} | {dtype} | " + " | ".join(cells.get(n, "") for n in counts) + " |")
    if rows:
        lines.append(
            f"| read pass (`torch.sum`) | | {rows[0].read_gb_per_s:.1f} GB/s (the limit) |" + " |" * (len(counts) - 1)
        )
    return "\n".join(lines)
