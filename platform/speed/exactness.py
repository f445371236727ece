"""Proving SPEED exact: record every loop's logits and compare two decodings bit for bit.

``LogitRecorder`` wraps any ``Stepper`` (the decoding engines cannot tell the
difference) and keeps, for every (cache row, loop, position), the early-exit
logits of the last time that row was computed. In a SPEED run a flushed token
is recomputed at the same (row, loop, position) with its corrected input, and
nothing at a position runs after its token is committed, so the last record
is the committed token's. Tests compare SPEED's records with sequential
decoding's (``torch.equal``); evaluation uses them to report the top-2 gap
where two decodings differ.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from speed.cache import KVCache, Rows


class LogitRecorder:
    """A ``Stepper`` that forwards to ``model`` and records each row's early-exit logits (V,).

    ``logits[(row, loop, pos)]``: loop 0-based, as in ``Rows``. Rows run
    without logits (sequential decoding without a trace skips non-final
    exits) record nothing.
    """

    def __init__(self, model: Any) -> None:
        self.model = model
        self.logits: dict[tuple[int, int, int], Tensor] = {}

    def __getattr__(self, name: str) -> Any:  # n_loops, eos_id, start_id, cache, prepare, embed, eval, ...
        return getattr(self.model, name)

    def step(
        self, memory: Any, cache: KVCache, rows: Rows, hidden: Tensor, with_logits: bool = True
    ) -> tuple[Tensor, Tensor | None]:
        out, logits = self.model.step(memory, cache, rows, hidden, with_logits)
        if logits is not None:
            for r, key in enumerate(zip(rows.seq.tolist(), rows.loop.tolist(), rows.pos.tolist())):
                self.logits[key] = logits[r]
        return out, logits


@dataclass(frozen=True)
class LogitMismatch:
    """Where two recorded decodings' logits differ: cache row, loop (0-based), position, largest difference."""

    row: int
    loop: int
    pos: int
    max_abs_diff: float


def compare_logits(
    reference: LogitRecorder, candidate: LogitRecorder, tokens: list[list[int]], n_loops: int
) -> list[LogitMismatch]:
    """Every (row, loop, position) of the committed ``tokens`` whose logits are not bit-identical.

    A record missing from either side is a mismatch too (``max_abs_diff`` inf).
    """
    mismatches = []
    for row, out in enumerate(tokens):
        for pos in range(len(out)):
            for loop in range(n_loops):
                a = reference.logits.get((row, loop, pos))
                b = candidate.logits.get((row, loop, pos))
                if a is None or b is None:
                    mismatches.append(LogitMismatch(row, loop, pos, float("inf")))
                elif not torch.equal(a, b):
                    mismatches.append(LogitMismatch(row, loop, pos, float((a - b).abs().max())))
    return mismatches


def top2_gap(logits: Tensor) -> float:
    """Largest minus second-largest logit of a (V,) row: how close the greedy choice was to a tie."""
    top = logits.float().topk(2).values
    return float(top[0] - top[1])
