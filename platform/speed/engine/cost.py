"""The device's cost of a group pass by its row count (``RowCost``): what the engine's cost model decides from.

``measure_row_cost`` times the stepper's own group pass (``Stepper.step``, with exit logits as a SPEED step runs
it, and without as sequential decoding's early loops do) on dummy plans in a cache and memory of its own: one
tile of 1 to ``TILE_ROWS`` rows, the pass without exit logits the least of a few rounds (a shared machine's noise
only ever adds time), made never to fall as rows are added. The exit logits' share is the median of the rounds'
**paired differences** (each count's pass with and without them, run back to back), fitted never to fall as rows
are added and never below nothing: the difference of the two least times, used before, read 0 to 32 ms for the same
8 rows in two measurements at Ouro-1.4B's shape in bf16 on an AMD EPYC, where the head alone took 14 to 17 ms, and
a cost model that prices exits at nothing opens speculative steps whose exits do not pay (there, at batch 4: a
replay of its schedule, priced with the exits measured, ran 0.94-0.98x sequential's).
Times are read on the cost model's ``clock``: on one thread, the thread's own CPU time, so that another process
taking the core mid-pass adds nothing (its slices can fall at the same point of every round: on the wall clock,
under one busy neighbour, a pass of 8 rows without exit logits read 6.6 ms against 2.8 ms with them: a curve that
prices the closed step dear, and under that load the cost model closed only 16 of batch 8's steps in one run).
More rows are whole tiles run one after the other
(``speed.engine.kernels.in_tiles``), so their cost is the tiles' sum: measuring them too took three times as long
and, on this loaded machine, gave multi-tile times 2-5x apart from run to run.
It runs once per process for a (model shape, device, dtype, threads): ``row_cost`` keeps what it measured, so a
second engine on the same model (``generate``'s every batch, an evaluation's every method) pays nothing. Measured
rather than fitted from the engine's own steps, since a cost model that never runs a row count could never learn
what it costs.
"""

from __future__ import annotations

import statistics
import threading
import time
from collections.abc import Hashable
from dataclasses import dataclass
from typing import Any

import torch

from speed.engine.kernels import TILE_ROWS
from speed.engine.rows import Rows

PROMPT_TOKENS = 16  # the dummy requests' prompt length (each row attends over one chunk, as a short sentence's)
REPEATS = 5  # timed rounds over the row counts after one warm-up round; each count's least is kept


@dataclass(frozen=True)
class RowCost:
    """Seconds of one group pass by its row count (on the cost model's ``clock``), measured for one tile of
    1..``TILE_ROWS`` rows on this device; more rows run as several tiles one after the other
    (``speed.engine.kernels.in_tiles``), so cost their sum."""

    seconds: tuple[float, ...]  # a pass of 1..TILE_ROWS rows (index n - 1), exit logits on (a SPEED step's)
    plain: tuple[float, ...]  # the same without exit logits (a sequential step's, but for its last loop)
    measure_s: float  # how long measuring it took (warm-ups and repeats included)
    key: str  # what it was measured for: model shape, device, dtype, threads

    def __call__(self, n: int, with_logits: bool = True) -> float:
        """A pass of ``n`` rows: its whole tiles and the rest, one after the other, as ``in_tiles`` runs them."""
        secs = self.seconds if with_logits else self.plain
        tiles, rest = divmod(n, len(secs))
        return tiles * secs[-1] + (secs[rest - 1] if rest else 0.0)

    def exits(self, n: int) -> float:
        """The exit logits' share of a pass of ``n`` rows (the head and the adapters: what a pass that scores
        ``n`` rows adds to one that scores none; ``Stepper.step``'s ``logit_rows`` runs them in tiles of their own)."""
        return max(0.0, self(n) - self(n, with_logits=False))

    def summary(self) -> dict[str, Any]:
        """What a decode summary states of it: the measured points in milliseconds and the time measuring took."""
        return {
            "row_cost_ms": {str(r): round(s * 1e3, 4) for r, s in enumerate(self.seconds, start=1)},
            "row_cost_plain_ms": {str(r): round(s * 1e3, 4) for r, s in enumerate(self.plain, start=1)},
            "row_cost_measure_s": round(self.measure_s, 3),
            "row_cost_key": self.key,
        }


def clock() -> float:
    """The cost model's clock, in seconds: this thread's CPU time when torch runs on one thread (what a pass costs,
    without the time other processes take the core from it), else the wall clock (other threads' work counts too)."""
    return time.thread_time() if torch.get_num_threads() == 1 else time.perf_counter()


_MEASURED: dict[Hashable, RowCost] = {}
_LOCK = threading.Lock()


def row_cost(stepper: Any) -> RowCost:
    """The group pass's cost of a ``speed.engine.Stepper``, measured once per process for its model's shape,
    device, dtype and thread count; a stepper without a model (a stub) is measured every time."""
    key = _shape_key(stepper)
    if isinstance(key[0], int):
        return measure_row_cost(stepper, label=str(key[-1]))
    with _LOCK:
        if key not in _MEASURED:
            _MEASURED[key] = measure_row_cost(stepper, label=str(key[-1]))
        return _MEASURED[key]


def measure_row_cost(stepper: Any, label: str = "", tile: int = TILE_ROWS, repeats: int = REPEATS) -> RowCost:
    """Time a ``speed.engine.Stepper``'s group pass on dummy rows, 1..``tile`` of them, the least of ``repeats``
    timed rounds after one warm-up (see the module doc)."""
    begin = time.perf_counter()
    M = stepper.n_loops
    n_slots = -(-tile // M)
    slots = list(range(n_slots))
    with torch.inference_mode():
        cache = stepper.cache(n_slots, PROMPT_TOKENS, 2, side=False)
        memory = stepper.memory(n_slots, PROMPT_TOKENS, 2)
        device = cache.device
        # on a GPU the pass is queued, not run, when the host returns: its time is the device's, to the end of it
        cuda = torch.device(device).type == "cuda"
        timer, done = (time.perf_counter, torch.cuda.synchronize) if cuda else (clock, lambda: None)
        prompt = torch.arange(PROMPT_TOKENS, device=device) % stepper.vocab_size
        admitted = stepper.admit(memory, cache, slots, [prompt] * n_slots)
        pos = 0 if admitted[0].exits is None else 1  # an LM's prefill decided output position 0 already
        hidden_all = stepper.embed(torch.full((tile,), admitted[0].token, device=device))  # (tile, d)
        counts = range(1, tile + 1)
        plans = [Rows.build([r // M for r in range(n)], [r % M for r in range(n)], [pos] * n) for n in counts]
        seconds: dict[bool, list[list[float]]] = {True: [[] for _ in counts], False: [[] for _ in counts]}
        # rounds over every count, so that a burst of another process's load spoils one run of each, not all of one
        for k in range(repeats + 1):
            for i, (n, rows) in enumerate(zip(counts, plans)):  # a request's M rows at its M loops, slot by slot
                for with_logits, timed in seconds.items():
                    done()
                    t0 = timer()
                    stepper.step(memory, cache, rows, hidden_all[:n], with_logits=with_logits)
                    done()
                    took = timer() - t0
                    if k:  # the first round warms up
                        timed[i].append(took)
                    for s in range(-(-n // M)):
                        cache.invalidate(s, pos)
    took = time.perf_counter() - begin
    plain = _never_less([min(t) for t in seconds[False]])
    exits = _rising([statistics.median(w - p for w, p in zip(*pair)) for pair in zip(seconds[True], seconds[False])])
    return RowCost(tuple(p + e for p, e in zip(plain, exits)), plain, took, label)


def _never_less(seconds: list[float]) -> tuple[float, ...]:
    """Each count's time no more than any larger count's: a pass of fewer rows of the same tiles costs no more, so
    a larger count's lower time is the smaller's too (noise on a shared machine only adds)."""
    out = list(seconds)
    for i in range(len(out) - 2, -1, -1):
        out[i] = min(out[i], out[i + 1])
    return tuple(out)


def _rising(values: list[float]) -> tuple[float, ...]:
    """Each of ``values`` floored at 0 (exit logits never save time), then the least-squares fit that never falls
    from one count to the next (pooling adjacent violators): the exits' share by rows, from paired differences whose
    noise goes either way."""
    blocks: list[list[float]] = []  # [sum, count] of each pooled run
    for v in values:
        blocks.append([max(v, 0.0), 1])
        while len(blocks) > 1 and blocks[-2][0] * blocks[-1][1] > blocks[-1][0] * blocks[-2][1]:
            total, n = blocks.pop()
            blocks[-1][0] += total
            blocks[-1][1] += n
    return tuple(total / n for total, n in blocks for _ in range(int(n)))


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
