"""The group pass in row-count buckets: rows padded up to a bucket, each bucket's pass captured once as a CUDA graph
over static buffers and replayed (gpt-fast's compiled decode step, vLLM's per-batch-size graphs), or run eagerly.

A pipeline step runs 1 to M rows per request, and the count changes every step. A CUDA graph replays fixed
kernels on fixed addresses, so each bucket (``BUCKETS``: 1, 2, 4, ... 64 rows) gets buffers of its own that never
move (``StepBuffers``: the rows' inputs, their slots, loops and positions; a captured graph owns its outputs), and a
step's rows are padded up to the smallest bucket that holds them (``bucket``, ``pad_rows``). Padding rows run in
the engine's scratch slot (``KVCache.set_scratch``): they write only that slot's own block and count nowhere,
and since every kernel of the pass is row-invariant (``speed.engine.kernels``) they change no real row's bits;
their outputs are dropped. A step of more rows than the largest bucket runs unpadded and eagerly.

What reaches the device each step goes through pinned host buffers with ``non_blocking=True`` copies
(``speed.engine.rows.to_device``), and the step's decisions come back in one copy (``speed.engine.sampling.
decisions``), so the host waits on the device once a step.

Capture needs a pass whose device work is the same kernels on the same addresses whatever the rows' values: a
stepper that offers one says ``capturable = True`` (its ``step`` reads the device tensors of the rows it is given,
``Rows.tensors``, never of parts it takes of them, and every index it makes from buffers that stay put per
bucket; its host bookkeeping is in ``prepare(memory, cache, rows)``, which the engine calls before every replay,
and before every eager bucketed pass too). Both families' steppers offer it on the Triton kernels
(``speed.models.lm_stepper.LMStepper.prepare``, ``speed.models.t5_stepper.T5Stepper.prepare``); a stepper that does not
(on the CPU's own kernels) runs its passes unpadded (padding without a graph only adds rows), with the same copies
and decisions.
``EngineConfig.graphs=True`` runs any stepper bucketed, and eagerly where it is not captured (``GraphSteps.capture``
False), which is how the CPU tests the bookkeeping and, under Triton's interpreter, both families' staged passes.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import Tensor

from speed.engine.cache import KVCache
from speed.engine.rows import Rows, to_device

BUCKETS = (1, 2, 4, 8, 16, 32, 64)  # row counts a pass is padded up to (a step of more rows runs unpadded)


def bucket(n_rows: int, buckets: Sequence[int] = BUCKETS) -> int | None:
    """The smallest bucket holding ``n_rows`` rows; None when none does (the step runs unpadded)."""
    if n_rows < 1:
        raise ValueError(f"a pass has at least one row, got {n_rows}")
    return next((b for b in buckets if b >= n_rows), None)


def pad_rows(rows: Rows, size: int, scratch: int) -> Rows:
    """``rows`` followed by ``size - len(rows)`` padding rows in the ``scratch`` slot (``Rows.padding``): chain rows
    at loop 0, position 0 (all at the one place of the slot's block: what lands there last is never read by a real
    row)."""
    n = size - len(rows)
    if n < 0:
        raise ValueError(f"{len(rows)} rows do not fit a bucket of {size}")
    if n == 0:
        return rows
    slot = np.concatenate([rows.slot, np.full(n, scratch, dtype=np.int64)])
    loop = np.concatenate([rows.loop, np.zeros(n, dtype=np.int64)])
    pos = np.concatenate([rows.pos, np.zeros(n, dtype=np.int64)])
    if rows.side is None:
        return Rows(slot, loop, pos, padding=n)
    side = np.concatenate([rows.side, np.full(n, -1, dtype=np.int64)])
    return Rows(slot, loop, pos, side, (*rows.up, *(((),) * n)), padding=n)


def kv_caches(cache: Any, depth: int = 3) -> list[KVCache]:
    """The ``KVCache`` objects a stepper's cache is made of: itself, or the parts its wrappers hold (an LM's
    ``PromptCache`` holds an ``LMCache`` holding the loops' and the prelude's)."""
    if isinstance(cache, KVCache):
        return [cache]
    if depth == 0 or not hasattr(cache, "__dict__") or isinstance(cache, (Tensor, torch.nn.Module)):
        return []
    return [kv for part in vars(cache).values() for kv in kv_caches(part, depth - 1)]


@dataclass
class StepBuffers:
    """One bucket's static buffers on the device: their addresses never change, so a captured graph reads them."""

    rows: int  # the bucket
    hidden: Tensor  # (rows, W) the rows' inputs
    meta: Tensor  # (3, rows) long: slot, loop, position

    @classmethod
    def allocate(cls, rows: int, width: int, dtype: torch.dtype, device: torch.device) -> StepBuffers:
        meta = torch.zeros(3, rows, dtype=torch.long, device=device)
        return cls(rows, torch.zeros(rows, width, dtype=dtype, device=device), meta)

    def load(self, rows: Rows, hidden: Tensor) -> Rows:
        """Write the padded ``rows`` and their inputs (rows, W) into the buffers and return ``rows`` reading them as
        its device tensors (``Rows.tensors``). The metadata is staged in pinned memory and copied without the host
        waiting (``to_device``; a fresh pinned block each step, which torch reuses only after its copy ran)."""
        if len(rows) != self.rows:
            raise ValueError(f"{len(rows)} rows for a bucket of {self.rows}")
        self.meta.copy_(to_device(np.stack([rows.slot, rows.loop, rows.pos]), self.meta.device))
        self.hidden.copy_(hidden)
        rows._tensors[str(self.meta.device)] = tuple(self.meta.unbind(0))  # Rows.tensors hands these out
        return rows


class GraphSteps:
    """The engine's group pass in buckets: pads a step's rows (``pad_rows``), loads a bucket's buffers, and runs the
    pass, replaying that bucket's CUDA graph when ``capture`` (captured at its first use), else eagerly; returns
    the real rows' outputs and logits."""

    def __init__(self, scratch: int, device: torch.device, capture: bool, buckets: Sequence[int] = BUCKETS) -> None:
        self.scratch, self.device, self.capture, self.buckets = scratch, device, capture, tuple(buckets)
        self._buffers: dict[int, StepBuffers] = {}
        self._graphs: dict[tuple[int, bool], tuple[Any, Tensor, Tensor | None]] = {}  # (bucket, logits) -> graph

    def run(
        self,
        step: Callable[[Rows, Tensor, bool, Sequence[int] | None], tuple[Tensor, Tensor | None]],
        rows: Rows,
        hidden: Tensor,
        with_logits: bool,
        logit_rows: Sequence[int] | None,
        prepare: Callable[[Rows], None] | None = None,
    ) -> tuple[Tensor, Tensor | None]:
        """One group pass over ``rows`` (R) with inputs ``hidden`` (R, W) through ``step(rows, hidden, with_logits,
        logit_rows)``: the outputs (R, W) and the logits (K, V) of ``logit_rows`` (None: all R) if ``with_logits``.
        ``prepare(rows)``: the host's bookkeeping of a captured pass, run before each replay (and before each eager
        bucketed pass too: the CPU runs what a GPU captures)."""
        size = bucket(len(rows), self.buckets)
        if size is None:  # more rows than the largest bucket: one unpadded eager pass
            return step(rows, hidden, with_logits, logit_rows)
        buffers = self._buffers.get(size)
        if buffers is None:
            buffers = self._buffers[size] = StepBuffers.allocate(size, hidden.shape[1], hidden.dtype, self.device)
        padded = buffers.load(pad_rows(rows, size, self.scratch), _pad(hidden, size))
        n = len(rows)
        if prepare is not None:
            prepare(padded)
        if not self.capture:  # every row's logits, the padding's dropped (a slice: no index copied to the device),
            # or the named rows'
            named = None if logit_rows is None else list(logit_rows)
            out, logits = step(padded, buffers.hidden, with_logits, named)
            return out[:n], (logits[:n] if logits is not None and named is None else logits)
        real = list(range(n)) if logit_rows is None else list(logit_rows)
        out, logits = self._replay(size, with_logits, step, padded, buffers)
        if logits is not None:  # every row's logits were computed in the graph: the wanted ones, in order
            logits = logits[:n] if logit_rows is None else logits.index_select(0, to_device(real, self.device))
        return out[:n].clone(), logits  # the graph's output buffer is overwritten by the next replay

    def _replay(
        self, size: int, with_logits: bool, step: Callable, rows: Rows, buffers: StepBuffers
    ) -> tuple[Tensor, Tensor | None]:
        key = (size, with_logits)
        if key not in self._graphs:
            self._graphs[key] = self._capture(step, rows, buffers, with_logits)
        graph, out, logits = self._graphs[key]
        graph.replay()
        return out, logits

    def _capture(self, step: Callable, rows: Rows, buffers: StepBuffers, with_logits: bool) -> tuple:
        """Capture ``step`` over the bucket's buffers (after one warm-up run on a side stream, as CUDA graphs need).
        The warm-up and the capture run the pass on the rows now loaded; the stepper's ``prepare`` made their
        bookkeeping, and writing a row's keys again writes the same bits at the same places."""
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            step(rows, buffers.hidden, with_logits, None)
        torch.cuda.current_stream(self.device).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out, logits = step(rows, buffers.hidden, with_logits, None)
        return graph, out, logits


def _pad(hidden: Tensor, size: int) -> Tensor:
    """``hidden`` (R, W) with its last row repeated up to ``size`` rows (padding rows get finite inputs)."""
    n = size - hidden.shape[0]
    return hidden if n == 0 else torch.cat([hidden, hidden[-1:].expand(n, -1)])
