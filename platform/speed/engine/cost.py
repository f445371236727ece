"""The device's cost of a group pass by its row count (``RowCost``): what the engine's cost model decides from.

``measure_row_cost`` times the stepper's own group pass (``Stepper.step``, with exit logits as a SPEED step runs
it, and without as sequential decoding's early loops do) on dummy plans in a cache and memory of its own: 1 to
``TILE_ROWS`` rows, then whole tiles up to the engine's full pipelines (at most ``MEASURED_ROWS``), each the least
of a few rounds (a shared machine's noise only ever adds time), then made never to fall as rows are added.
It runs once per process for a (model shape, device, dtype, threads): ``row_cost`` keeps what it measured, so a
second engine on the same model (``generate``'s every batch, an evaluation's every method) pays nothing. Measured
rather than fitted from the engine's own steps, since a cost model that never runs a row count could never learn
what it costs.
"""

from __future__ import annotations

import bisect
import threading
import time
from collections.abc import Hashable
from dataclasses import dataclass
from typing import Any

import torch

from speed.engine.kernels import TILE_ROWS
from speed.engine.rows import Rows

PROMPT_TOKENS = 16  # the dummy requests' prompt length (each row attends over one chunk, as a short sentence's)
MEASURED_ROWS = 64  # the most rows measured (8 tiles): an engine's larger steps extrapolate the last tile's slope
REPEATS = 3  # timed rounds over the row counts after one warm-up round; each count's least is kept


@dataclass(frozen=True)
class RowCost:
    """Seconds of one group pass by its row count, measured at ``rows`` (ascending, from 1) on this device."""

    rows: tuple[int, ...]
    seconds: tuple[float, ...]  # the pass at each measured row count, exit logits on (a SPEED step's)
    plain: tuple[float, ...]  # the same without exit logits (a sequential step's, but for its last loop)
    measure_s: float  # how long measuring it took (warm-ups and repeats included)
    key: str  # what it was measured for: model shape, device, dtype, threads

    def __call__(self, n: int, with_logits: bool = True) -> float:
        """A pass of ``n`` rows: 0 for none, linear between the measured counts, the last tile's slope beyond."""
        if n <= 0:
            return 0.0
        rows, secs = self.rows, self.seconds if with_logits else self.plain
        i = bisect.bisect_left(rows, n)
        if i < len(rows) and rows[i] == n:
            return secs[i]
        if i == 0:
            return secs[0]
        if i == len(rows):
            i -= 1  # extrapolate from the last two points
        (r0, r1), (s0, s1) = rows[i - 1 : i + 1], secs[i - 1 : i + 1]
        return s0 + (s1 - s0) * (n - r0) / (r1 - r0)

    def curve(self, most: int) -> list[float]:
        """Seconds of a pass of 0..``most`` rows."""
        return [self(n) for n in range(most + 1)]

    def summary(self) -> dict[str, Any]:
        """What a decode summary states of it: the measured points in milliseconds and the time measuring took."""
        return {
            "row_cost_ms": {str(r): round(s * 1e3, 4) for r, s in zip(self.rows, self.seconds)},
            "row_cost_plain_ms": {str(r): round(s * 1e3, 4) for r, s in zip(self.rows, self.plain)},
            "row_cost_measure_s": round(self.measure_s, 3),
            "row_cost_key": self.key,
        }


def measured_counts(most: int, tile: int = TILE_ROWS) -> tuple[int, ...]:
    """The row counts measured for passes of up to ``most`` rows: 1..``tile``, then whole tiles (and ``most``)."""
    small = list(range(1, min(most, tile) + 1))
    tiles = list(range(2 * tile, most + 1, tile))
    return tuple(sorted({*small, *tiles, most}))


_MEASURED: dict[Hashable, RowCost] = {}
_LOCK = threading.Lock()


def row_cost(stepper: Any, most: int) -> RowCost:
    """The group pass's cost for up to ``most`` rows (at least one tile) of a ``speed.engine.Stepper``, measured
    once per process for its model's shape, device, dtype and thread count (a larger ``most`` than measured before
    measures anew); a stepper without a model (a stub) is measured every time."""
    key = _shape_key(stepper)
    if isinstance(key[0], int):
        return measure_row_cost(stepper, max(most, TILE_ROWS), label=str(key[-1]))
    with _LOCK:
        known = _MEASURED.get(key)
        if known is None or known.rows[-1] < most:
            known = _MEASURED[key] = measure_row_cost(stepper, max(most, TILE_ROWS), label=str(key[-1]))
        return known


def measure_row_cost(stepper: Any, most: int, label: str = "") -> RowCost:
    """Time a ``speed.engine.Stepper``'s group pass on dummy rows at ``measured_counts(most)`` rows (module doc)."""
    begin = time.perf_counter()
    M = stepper.n_loops
    n_slots = -(-most // M)
    slots = list(range(n_slots))
    with torch.inference_mode():
        cache = stepper.cache(n_slots, PROMPT_TOKENS, 2, side=False)
        memory = stepper.memory(n_slots, PROMPT_TOKENS, 2)
        device = cache.device
        prompt = torch.arange(PROMPT_TOKENS, device=device) % stepper.vocab_size
        admitted = stepper.admit(memory, cache, slots, [prompt] * n_slots)
        pos = 0 if admitted[0].exits is None else 1  # an LM's prefill decided output position 0 already
        tokens = torch.full((most,), admitted[0].token, device=device)
        hidden_all = stepper.embed(tokens)  # (most, d)
        counts = measured_counts(most)
        plans = [Rows.build([r // M for r in range(n)], [r % M for r in range(n)], [pos] * n) for n in counts]
        seconds = {True: [float("inf")] * len(counts), False: [float("inf")] * len(counts)}
        # rounds over every count, so that a burst of another process's load spoils one run of each, not all of one
        for k in range(REPEATS + 1):
            for i, (n, rows) in enumerate(zip(counts, plans)):  # a request's M rows at its M loops, slot by slot
                for with_logits, timed in seconds.items():
                    t0 = time.perf_counter()
                    stepper.step(memory, cache, rows, hidden_all[:n], with_logits=with_logits)
                    took = time.perf_counter() - t0
                    if k:  # the first round warms up
                        timed[i] = min(timed[i], took)
                    for s in range(-(-n // M)):
                        cache.invalidate(s, pos)
    took = time.perf_counter() - begin
    return RowCost(counts, _never_less(seconds[True]), _never_less(seconds[False]), took, label)


def _never_less(seconds: list[float]) -> tuple[float, ...]:
    """Each count's time no more than any larger count's: a pass of fewer rows of the same tiles costs no more, so
    a larger count's lower time is the smaller's too (noise on a shared machine only adds)."""
    out = list(seconds)
    for i in range(len(out) - 2, -1, -1):
        out[i] = min(out[i], out[i + 1])
    return tuple(out)


def _shape_key(stepper: Any) -> tuple[Hashable, ...]:
    """What a group pass's cost depends on: the model's parameter shapes and dtypes (a stub's identity), its
    device and the thread count; last, a readable label of it."""
    model = getattr(stepper, "model", None)
    while model is not None and not isinstance(model, torch.nn.Module):  # a stepper's wrapper (a LogitRecorder)
        model = getattr(model, "model", None)
    params = list(model.parameters()) if isinstance(model, torch.nn.Module) else []
    shape = tuple((tuple(p.shape), p.dtype) for p in params) if params else id(stepper)
    device, threads = str(getattr(stepper, "device", "cpu")), torch.get_num_threads()
    dtype = str(params[0].dtype).removeprefix("torch.") if params else "-"
    name = type(model).__name__ if params else type(stepper).__name__
    label = f"{name}, {sum(p.numel() for p in params)} parameters, {device}, {dtype}, {threads} threads"
    return (shape, device, threads, label)
