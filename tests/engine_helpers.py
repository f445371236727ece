"""Driving the continuous-batching engine through a random schedule, shared by the churn tests."""

from __future__ import annotations

import random
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import pytest

from speed.engine import Engine, EngineConfig, Request, Speculation, StepResult

# The blocks of random cases of a differential test: the first in every tier, the others left out of
# `make test-quick` (marked slow), so the inner loop still checks exactness on a few dozen random cases.
BLOCKS = [pytest.param(i, marks=[pytest.mark.slow] if i else []) for i in range(8)]


def drive(
    engine: Engine,
    rng: random.Random,
    arrivals: list[int],
    make_request: Callable[[], Request],
    cancel_p: float,
    cancel_within: int,
    on_step: Callable[[StepResult], None] | None = None,
) -> tuple[dict[int, Request], list]:
    """Step ``engine`` until it is idle, adding a request (``make_request()``) at each step in ``arrivals``.

    Each request is cancelled with probability ``cancel_p`` within ``cancel_within`` steps of its arrival.
    Returns the requests by id and every finished request (cancelled ones included), in finishing order;
    ``on_step`` sees each step's result.
    """
    arrivals = sorted(arrivals)
    requests: dict[int, Request] = {}
    to_cancel: dict[int, int] = {}  # request id -> step at which it is cancelled
    finished, step = [], 0
    while arrivals or engine.has_work:
        while arrivals and arrivals[0] <= step:
            arrivals.pop(0)
            request = make_request()
            rid = engine.add(request)
            requests[rid] = request
            if rng.random() < cancel_p:
                to_cancel[rid] = step + rng.randint(0, cancel_within)
        for rid in [r for r, at in to_cancel.items() if at <= step]:
            del to_cancel[rid]
            if (gone := engine.cancel(rid)) is not None:
                assert gone.cancelled
                finished.append(gone)
        result = engine.step()
        if on_step is not None:
            on_step(result)
        finished.extend(result.finished)
        step += 1
    assert engine.active == engine.queued == 0
    assert sorted(f.id for f in finished) == sorted(requests)
    return requests, finished


def churn_config(rng: random.Random, max_prompt_len: int, max_target_len: int, max_budget: int) -> EngineConfig:
    """A churn test's engine: 1 to 4 slots, and no row budget or one of 1..``max_budget`` rows (drawn from ``rng``)."""
    return EngineConfig(
        max_active=rng.randint(1, 4),
        max_prompt_len=max_prompt_len,
        max_target_len=max_target_len,
        row_budget=rng.choice([None, rng.randint(1, max_budget)]),
    )


def speed_as_sequential(model, reference, ref, ids, mask, max_new: int, context, **settings):
    """Decode ``ids`` with SPEED (``settings``: ``DecodeOptions``' fields, ``speculation``, ``sampling``, ...) under
    a ``LogitRecorder`` and assert every loop's logits and the tokens equal the sequential ``reference``'s run
    ``ref``; return SPEED's result."""
    from speed.decode.exactness import LogitRecorder, compare_logits
    from speed.decode.generate import DecodeOptions, generate

    candidate = LogitRecorder(model)
    got = generate(candidate, ids, mask, DecodeOptions(method="speed", max_new_tokens=max_new, **settings))
    assert compare_logits(reference, candidate, ref.tokens, model.n_loops) == [], context
    assert got.tokens == ref.tokens
    return got


@dataclass
class RecordedCase:
    """One random case of a differential test (what a test file's ``random_case(seed)`` returns) and its sequential
    greedy decoding under a ``LogitRecorder``: the reference every SPEED run of the case is compared with."""

    seed: int
    model: Any
    ids: Any  # (B, S) token ids, right-padded
    mask: Any  # (B, S) attention mask
    max_new: int
    rng: random.Random  # the case's own generator: what a test draws next (launch loops, settings) comes from it
    reference: Any  # the LogitRecorder of the sequential run
    ref: Any  # the sequential run's GenerateResult

    def speed(self, context, **settings):
        """SPEED on this case, checked against the reference by ``speed_as_sequential``; its result."""
        return speed_as_sequential(
            self.model, self.reference, self.ref, self.ids, self.mask, self.max_new, context, **settings
        )


def recorded_cases(random_case: Callable[[int], tuple], seeds: Iterable[int]) -> Iterator[RecordedCase]:
    """``random_case(seed)`` for each seed, decoded sequentially (greedy) under a ``LogitRecorder``."""
    from speed.decode.exactness import LogitRecorder
    from speed.decode.generate import DecodeOptions, generate

    for seed in seeds:
        model, ids, mask, max_new, rng = random_case(seed)
        reference = LogitRecorder(model)
        ref = generate(reference, ids, mask, DecodeOptions(method="sequential", max_new_tokens=max_new))
        yield RecordedCase(seed, model, ids, mask, max_new, rng, reference, ref)


def speed_at_launch_loops(case: RecordedCase) -> Iterator:
    """SPEED on ``case`` with eager and with final invalidation, each at launch loops 1, a random one (from the
    case's ``rng``) and M; every run checked by ``speed_as_sequential``. Yields each run's result."""
    m = case.model.n_loops
    for invalidation in ("eager", "final"):
        for launch_loop in sorted({1, case.rng.randint(1, m), m}):
            yield case.speed((case.seed, invalidation, launch_loop), speculation=Speculation(launch_loop, invalidation))


def speed_runs_match(random_case: Callable[[int], tuple], seeds: Iterable[int]) -> tuple[int, int]:
    """The greedy differential test of ``random_case`` over ``seeds``: every run of ``speed_at_launch_loops`` on
    each ``recorded_cases`` case matches the case's sequential reference in logits, tokens and trace, and counts
    its rows as the reference's plus the wasted ones. Returns (runs, flushes): what the caller asserts covered."""
    runs = flushes = 0
    for case in recorded_cases(random_case, seeds):
        ref = case.ref
        for got in speed_at_launch_loops(case):  # each run's logits and tokens checked against ref's
            assert got.trace.equals(ref.trace)
            assert got.stats.tokens == ref.stats.tokens == sum(map(len, ref.tokens))
            assert got.stats.rows == ref.stats.rows + got.stats.wasted_rows
            flushes += got.stats.flushes
            runs += 1
    return runs, flushes


def recorded_pair(model, ids, mask, max_new: int):
    """Sequential and SPEED greedy decoding of ``ids`` under a ``LogitRecorder`` each, checked equal by
    ``compare_logits``: (the sequential recorder, SPEED's, the sequential result), for tests that then tamper
    with a recorded row to show that the comparison is not vacuous."""
    from speed.decode.exactness import LogitRecorder, compare_logits
    from speed.decode.generate import DecodeOptions, generate

    reference, candidate = LogitRecorder(model), LogitRecorder(model)
    ref = generate(reference, ids, mask, DecodeOptions(method="sequential", max_new_tokens=max_new))
    generate(candidate, ids, mask, DecodeOptions(method="speed", max_new_tokens=max_new))
    assert compare_logits(reference, candidate, ref.tokens, model.n_loops) == []
    return reference, candidate, ref


def random_exits(model, seed: int, scale: float = 1.0):
    """Attach exit adapters (``speed.models.exits``) with random, non-zero weights to ``model``: its early exits change,
    its last loop's must not. Returns the model."""
    import torch

    from speed.models.exits import attach, exits_for

    adapters = exits_for(model, rank=8)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in adapters.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * scale * p.shape[1] ** -0.5)
    return attach(model, adapters.eval())


def exits_change_drafts_only(model, ids, mask, max_new: int, context, **settings):
    """Decode ``ids`` sequentially with ``model``'s exit adapters and without, and with SPEED with them
    (``settings`` as ``generate`` takes them): the tokens and the last loop's logits are the same bit for bit
    all three ways, SPEED's every loop equals sequential's with adapters. Returns (with, without, changed):
    SPEED's results with and without the adapters, and how many early-exit logits the adapters changed."""
    import torch

    from speed.decode.exactness import LogitRecorder
    from speed.decode.generate import DecodeOptions, generate
    from speed.models.exits import attach

    adapters, last = model.exit_adapters, model.n_loops - 1
    sampling = settings.get("sampling")
    attach(model, None)
    plain = LogitRecorder(model)
    plain_ref = generate(
        plain, ids, mask, DecodeOptions(method="sequential", max_new_tokens=max_new, sampling=sampling)
    )
    without = generate(model, ids, mask, DecodeOptions(method="speed", max_new_tokens=max_new, **settings))
    attach(model, adapters)
    adapted = LogitRecorder(model)
    ref = generate(adapted, ids, mask, DecodeOptions(method="sequential", max_new_tokens=max_new, sampling=sampling))
    assert ref.tokens == plain_ref.tokens == without.tokens, context
    changed = 0
    for b, out in enumerate(ref.tokens):
        for pos in range(len(out)):
            assert torch.equal(adapted.logits[(b, last, pos)], plain.logits[(b, last, pos)]), (context, b, pos)
            changed += sum(
                not torch.equal(adapted.logits[(b, loop, pos)], plain.logits[(b, loop, pos)]) for loop in range(last)
            )
    got = speed_as_sequential(model, adapted, ref, ids, mask, max_new, context, **settings)
    return got, without, changed
