"""Proving SPEED exact: record every loop's logits and compare two decodings bit for bit.

``LogitRecorder`` wraps any ``Stepper`` (the decoding engines cannot tell the
difference) and keeps, for every (engine slot, loop, position), the early-exit
logits of the last time it was computed. In a SPEED run a flushed token is
recomputed at the same (slot, loop, position) with its corrected input, and
nothing at a position runs after its token is committed, so the last record
is the committed token's. A runner-up branch's rows are kept apart until the
engine promotes the branch into the chain (``KVCache.promote``, observed on
the cache the recorder hands out); then they become its position's records.
Tests compare SPEED's records with sequential decoding's (``torch.equal``);
evaluation uses them to report the top-2 gap where two decodings differ.
``generate`` gives batch element b slot b.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from speed.engine import Admitted
from speed.engine.cache import KVCache, Rows
from speed.engine.observer import StepObserver


class LogitRecorder(StepObserver):
    """A ``Stepper`` that forwards to ``model`` and records each row's early-exit logits (V,).

    ``logits[key(slot, loop, pos)]``: loop 0-based, as in ``Rows``. Rows run
    without logits (sequential decoding without a trace skips non-final
    exits) record nothing. Never captured (``capturable`` False): it records in every pass, which a replayed
    CUDA graph does not call; with ``EngineConfig.graphs=True`` it still runs the model's staged pass, eagerly.
    """

    capturable = False

    def __init__(self, model: Any) -> None:
        super().__init__(model)
        self.logits: dict[Any, Tensor] = {}
        self._branches: dict[tuple[int, int, int, int], Tensor] = {}  # (slot, side entry, loop, pos) -> (V,)

    def key(self, slot: int, loop: int, pos: int) -> Any:
        """The record's key (subclasses may name slots otherwise, e.g. by the request holding it)."""
        return (slot, loop, pos)

    def cache(self, n_slots: int, max_prompt_len: int, max_len: int, side: bool = True, **pool: int) -> KVCache:
        """The model's cache (``pool``: its ``blocks``, if asked), whose branch promotions also move the branch's
        records into the chain's."""
        cache = self.model.cache(n_slots, max_prompt_len, max_len, side, **pool)
        promote = cache.promote

        def promote_and_record(slot: int, side: int, pos: int, loops_done: int) -> None:
            promote(slot, side, pos, loops_done)
            for loop in range(loops_done):
                self.logits[self.key(slot, loop, pos)] = self._branches.pop((slot, side, loop, pos))

        cache.promote = promote_and_record  # type: ignore[method-assign]
        return cache

    def after_admit(self, slot: int, prompt: Tensor, admitted: Admitted) -> None:
        """The exits an admission computed (a decoder-only prefill's) are output position 0's."""
        if admitted.exits is not None:
            for loop, logits in enumerate(admitted.exits):
                self.logits[self.key(slot, loop, 0)] = logits

    def after_step(self, rows: Rows, logits: Tensor | None, logit_rows: Sequence[int] | None) -> None:
        """Records the exit logits of the pass's rows ``logit_rows`` names (None: all but a bucket's padding)."""
        if logits is None:
            return
        side = rows.side.tolist() if rows.side is not None else [-1] * len(rows)
        where = list(zip(rows.slot.tolist(), rows.loop.tolist(), rows.pos.tolist(), side))
        real = where[: len(where) - rows.padding]  # a bucket's padding rows (speed.engine.graphs) are no one's
        rows_at = real if logit_rows is None else [where[r] for r in logit_rows]
        for r, (slot, loop, pos, b) in enumerate(rows_at):
            if b < 0:
                self.logits[self.key(slot, loop, pos)] = logits[r]
            else:
                self._branches[(slot, b, loop, pos)] = logits[r]


@dataclass(frozen=True)
class LogitMismatch:
    """Where two recorded decodings' logits differ: engine slot, loop (0-based), position, largest difference."""

    slot: int
    loop: int
    pos: int
    max_abs_diff: float


def compare_logits(
    reference: LogitRecorder, candidate: LogitRecorder, tokens: list[list[int]], n_loops: int
) -> list[LogitMismatch]:
    """Every (slot, loop, position) of the committed ``tokens`` (slot b's at ``tokens[b]``) whose logits are not
    bit-identical.

    A record missing from either side is a mismatch too (``max_abs_diff`` inf).
    """
    mismatches = []
    for slot, out in enumerate(tokens):
        for pos in range(len(out)):
            for loop in range(n_loops):
                a = reference.logits.get((slot, loop, pos))
                b = candidate.logits.get((slot, loop, pos))
                if a is None or b is None:
                    mismatches.append(LogitMismatch(slot, loop, pos, float("inf")))
                elif not torch.equal(a, b):
                    mismatches.append(LogitMismatch(slot, loop, pos, float((a - b).abs().max())))
    return mismatches


def top2_gap(logits: Tensor) -> float:
    """Largest minus second-largest logit of a (V,) row: how close the greedy choice was to a tie."""
    top = logits.float().topk(2).values
    return float(top[0] - top[1])
