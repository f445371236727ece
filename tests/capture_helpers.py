"""What the capturable-pass tests of both families share (``tests/test_lm_capture.py``, ``tests/test_t5_capture.py``
on the CPU's interpreted Triton kernels, ``tests/test_gpu_decode.py``'s captured buckets on CUDA): a spy on the
staged passes, valid rows for a cache without an engine, and the staged pass run through ``GraphSteps`` against the
unstaged, unpadded one."""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import Any

import torch
from engine_helpers import speed_as_sequential

from speed.engine.graphs import GraphSteps
from speed.engine.rows import Rows
from speed.engine.types import Speculation


def count_staged(model: Any) -> list[int]:
    """A list that gets, for every staged pass of ``model`` (``step_staged``) from now on, its row count: its first
    tensor argument's, the rows' inputs (the instance's method wrapped)."""
    seen = []
    run = model.step_staged

    def counted(*args, **kw):
        seen.append(next(a for a in args if isinstance(a, torch.Tensor)).shape[0])
        return run(*args, **kw)

    model.step_staged = counted
    return seen


def staged_speed_equals_sequential(model: Any, reference, ref, ids, mask, sampling, case: str) -> None:
    """Every bucketed pass staged (the spy counts them), SPEED with and without branches equal to the sequential
    decoding ``ref`` that ``reference`` recorded unstaged and unpadded: every loop's logits, the tokens."""
    staged = count_staged(model)
    for speculation in (Speculation(1, "eager"), Speculation(1, "final", branches=2, branch_depth=2)):
        speed_as_sequential(
            model, reference, ref, ids, mask, 5, (case, speculation), speculation=speculation,
            sampling=sampling, graphs=True,
        )  # fmt: skip
    assert len(staged) > 10 and max(staged) > 2, staged  # passes of several rows, padded to buckets


class RowSource:
    """Valid rows for a cache's slots without an engine: each slot decodes its own random tokens (from
    ``first_token`` up) loop by loop, from output position ``first_pos`` (an LM's 1: position 0's row was the
    prompt's last), one row a step for each slot a step picks."""

    def __init__(self, model: Any, slots: int, rng: random.Random, first_pos: int, first_token: int) -> None:
        self.stepper, self.rng, self.first_token = model.stepper(), rng, first_token
        self.next = [(first_pos, 0)] * slots  # (output position, loop)
        self.carry: dict[tuple[int, int], torch.Tensor] = {}

    def rows(self, picked: list[int]) -> tuple[Rows, torch.Tensor]:
        """The rows of the slots ``picked`` (ascending) and their inputs (R, d)."""
        hidden = []
        for s in picked:
            pos, loop = self.next[s]
            if loop == 0:
                self.carry[(s, pos)] = self.stepper.embed([self.rng.randrange(self.first_token, self.vocab_size)])[0]
            hidden.append(self.carry[(s, pos)])
        at = [self.next[s] for s in picked]
        return Rows.build(picked, [loop for _, loop in at], [pos for pos, _ in at]), torch.stack(hidden)

    @property
    def vocab_size(self) -> int:
        return self.stepper.vocab_size

    def advance(self, rows: Rows, out: torch.Tensor) -> None:
        """Each row's output is its next loop's input; a last loop's moves its slot to the next position."""
        M = self.stepper.n_loops
        for s, pos, loop, h in zip(rows.slot.tolist(), rows.pos.tolist(), rows.loop.tolist(), out):
            self.carry[(s, pos)] = h
            self.next[s] = (pos, loop + 1) if loop + 1 < M else (pos + 1, 0)


def any_slots(rng: random.Random, slots: int) -> Callable[[], list[int]]:
    """What picks a step's slots: 1 to ``slots`` of them at random, ascending."""
    return lambda: sorted(rng.sample(range(slots), rng.randint(1, slots)))


def staged_equals_plain(
    staged: tuple, plain: tuple, source: RowSource, pick: Callable[[], list[int]], graphs: GraphSteps, steps: int,
    poison: bool,
) -> None:  # fmt: skip
    """``steps`` steps of new rows (``pick``'s slots) through ``graphs`` on the ``staged`` (stepper, memory, cache),
    ``prepare`` staging each pass (and, ``poison``, the rows' host arrays then overwritten with garbage: any host
    read of them indexes out of range or reads another slot), against the unstaged, unpadded pass over the
    ``plain`` one fed the same: every output and every row's logits equal, bit for bit."""
    (stepper, memory_a, a), (reference, memory_b, b) = staged, plain

    def prepare(rows: Rows) -> None:
        stepper.prepare(memory_a, a, rows)
        if poison:
            for array in (rows.slot, rows.loop, rows.pos):
                array[:] = 10**6

    with torch.inference_mode():
        for _ in range(steps):
            rows, hidden = source.rows(pick())
            keep = Rows(rows.slot.copy(), rows.loop.copy(), rows.pos.copy())
            step = lambda r, h, w, picked: stepper.step(memory_a, a, r, h, w)  # noqa: E731
            got, got_logits = graphs.run(step, rows, hidden, True, None, prepare)
            want, want_logits = reference.step(memory_b, b, keep, hidden, True)
            assert torch.equal(got, want) and torch.equal(got_logits, want_logits), keep
            source.advance(keep, want)
