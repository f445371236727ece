"""The engine's cost model: the pure decision (``worth_rows``), the measured curve (``speed.engine.cost``), and
SPEED under it equal to sequential decoding bit for bit, greedy and seeded sampling, with branches, batch 1 and 8."""

from __future__ import annotations

import time

import pytest
import torch

from speed.config import preset
from speed.decode.exactness import LogitRecorder, compare_logits
from speed.decode.generate import DecodeOptions, generate
from speed.engine import Speculation
from speed.engine.cost import RowCost, clock, row_cost
from speed.engine.kernels import TILE_ROWS
from speed.engine.policies import budget_order, budget_rows, in_budget_order, survival_rate, worth_rows
from speed.engine.sampling import Sampling
from speed.models.t5 import SpeedT5

M = 3


def test_worth_rows_takes_the_rows_that_pay():
    flat = [1.0] * 6  # extra rows cost nothing: every row with any chance pays
    assert worth_rows(flat, 1.0, [0.9, 0.5, 0.1, 0.0, 0.0], row_value=1.0) == 3
    steep = [1.0 + k for k in range(6)]  # each row costs a whole row's value: none pays, even sure ones
    assert worth_rows(steep, 1.0, [1.0] * 5, row_value=1.0) == 0
    # a new tile costs 2 at its first row and nothing after: one row does not pay, four do
    tile = [1.0, 3.0, 3.0, 3.0, 3.0]
    assert worth_rows(tile, 1.0, [0.8] * 4, row_value=1.0) == 4
    assert worth_rows(tile, 1.0, [0.8], row_value=1.0) == 0
    # the base counts: a step whose exits alone cost 0.5 more than sequential's needs rows that save more
    assert worth_rows([1.5, 1.5], 1.0, [0.4], row_value=1.0) == 0
    assert worth_rows([1.5, 1.5], 1.0, [0.6], row_value=1.0) == 1
    assert worth_rows([1.0], 1.0, [], row_value=1.0) == 0


def test_budget_order_is_budget_rows_order():
    in_flight = [3, 1, 0, 2]
    order = budget_order(in_flight)
    assert order == [0, 1, 3, 0, 3, 0]
    for budget in range(len(order) + 2):
        take = budget_rows(in_flight, budget)
        assert take == [order[:budget].count(i) for i in range(len(in_flight))]
    assert in_budget_order([[1, 2, 3], [4], [], [5, 6]]) == [1, 4, 5, 2, 6, 3]
    assert survival_rate(0, 0) == 0.5 and survival_rate(9, 10) == pytest.approx(10 / 12)


def test_row_cost_adds_up_tiles():
    cost = RowCost((1.0, 1.0, 1.5, 2.0), (0.5, 0.5, 0.75, 1.0), 0.0, "stub")  # tiles of 4 rows
    assert cost(0) == 0.0 and cost(1) == 1.0 and cost(4) == 2.0 and cost(5) == 3.0 and cost(11) == 5.5
    assert cost(7, with_logits=False) == 1.75


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return SpeedT5(preset("tiny", pattern=f"2x{M}")).eval()


def test_row_cost_is_measured_once_per_shape(model):
    first = row_cost(model.stepper())
    again = row_cost(LogitRecorder(model))  # another stepper of the same model: what was measured
    assert again is first and len(first.seconds) == len(first.plain) == TILE_ROWS and min(first.seconds) > 0
    assert list(first.seconds) == sorted(first.seconds) and first.measure_s > 0
    assert list(first.plain) == sorted(first.plain) and all(p <= s for p, s in zip(first.plain, first.seconds))
    assert "SpeedT5" in first.key and f"{torch.get_num_threads()} threads" in first.key


def test_rising_is_the_least_squares_fit_that_never_falls():
    from speed.engine.cost import _rising

    assert _rising([3.0, 1.0, 2.0, 5.0, -1.0, 4.0]) == (2.0, 2.0, 2.0, 2.5, 2.5, 4.0)  # floored at 0, pooled
    assert _rising([1.0, 2.0, 3.0]) == (1.0, 2.0, 3.0) and _rising([-2.0, -1.0, 1.0, 0.5]) == (0.0, 0.0, 0.75, 0.75)


class _Scripted:
    """A real stepper whose passes take scripted times on a fake clock: a pass of n rows ``base * n`` seconds times
    its round's speed (the machine drifting between rounds) and a jitter of up to ``jitter`` of it (seeded), plus
    ``head * n`` with exit logits."""

    def __init__(self, stepper, base: float, head: float, jitter: float) -> None:
        import random

        self.stepper, self.base, self.head, self.jitter = stepper, base, head, jitter
        self.now, self.calls, self.rng = 0.0, 0, random.Random(0)

    def __getattr__(self, name):
        return getattr(self.stepper, name)

    def step(self, memory, cache, rows, hidden, with_logits=True, logit_rows=None):
        out = self.stepper.step(memory, cache, rows, hidden, with_logits=with_logits)
        speed = (1.0, 1.6, 0.7, 1.3)[(self.calls // (2 * TILE_ROWS)) % 4]  # a round's every pass, both kinds
        self.calls += 1
        n, jitter = len(rows), 1 + self.jitter * self.rng.random()
        self.now += speed * (self.base * n * jitter + (self.head * n if with_logits else 0))
        return out


def test_the_exits_share_is_read_from_paired_passes(model, monkeypatch):
    """The exit logits' share of a pass is the median of each round's pass with them less the same count's pass
    without them, run back to back (then fitted never to fall as rows are added): within a few percent of the
    head's scripted time on a machine whose speed moves 0.7-1.6x between rounds and whose passes jitter by up to
    twice the head's time; the passes without exits the least of the rounds."""
    from speed.engine import cost as cost_mod

    base, head = 0.010, 0.001
    stub = _Scripted(model.stepper(), base, head, jitter=0.2)
    monkeypatch.setattr(cost_mod, "clock", lambda: stub.now)
    got = cost_mod.measure_row_cost(stub, label="scripted", repeats=5)
    for n in range(1, TILE_ROWS + 1):
        assert got.exits(n) == pytest.approx(head * n, rel=0.5, abs=0.0)  # the drift moves it, never to nothing
        assert base * n * 0.7 <= got(n, with_logits=False) <= base * n * 0.7 * 1.2
    assert list(got.seconds) == sorted(got.seconds) and list(got.plain) == sorted(got.plain)


def test_clock_counts_only_this_threads_work():
    """On one thread the cost model's clock is the thread's CPU time: time off the CPU (here a sleep; on a shared
    machine, another process's slice) does not count, so it cannot make a row count look dear."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        c0, w0 = clock(), time.perf_counter()
        time.sleep(0.05)
        assert time.perf_counter() - w0 >= 0.05 and clock() - c0 < 0.01
    finally:
        torch.set_num_threads(threads)


def _forced(monkeypatch, per_row: float) -> None:
    """The engine's cost model on a made-up curve: a tile costs 1 + per_row per row beyond the first."""
    seconds = tuple(1.0 + per_row * n for n in range(TILE_ROWS))
    monkeypatch.setattr("speed.engine.engine.measured_row_cost", lambda stepper: RowCost(seconds, seconds, 0.0, "made"))


CASES = [
    pytest.param(Sampling(), Speculation(), id="greedy"),
    pytest.param(Sampling(), Speculation(branches=2), id="greedy-branches"),
    pytest.param(Sampling(temperature=0.8, top_k=20, seed=5), Speculation(branches=2, branch_depth=2), id="sampled"),
]


@pytest.mark.parametrize("batch", [1, 8])
@pytest.mark.parametrize(("sampling", "spec"), CASES)
@pytest.mark.parametrize("per_row", [None, 0.0, 0.3, 2.0], ids=["measured", "free", "some", "dear"])
def test_speed_with_cost_model_equals_sequential(model, monkeypatch, batch, sampling, spec, per_row):
    if per_row is not None:
        _forced(monkeypatch, per_row)
    ids = torch.randint(3, 100, (batch, 6), generator=torch.Generator().manual_seed(batch))
    reference, candidate = LogitRecorder(model), LogitRecorder(model)
    ref = generate(reference, ids, options=DecodeOptions(method="sequential", max_new_tokens=10, sampling=sampling))
    out = generate(
        candidate, ids, options=DecodeOptions(max_new_tokens=10, sampling=sampling, speculation=spec, cost_model=True)
    )
    assert out.tokens == ref.tokens
    assert compare_logits(reference, candidate, ref.tokens, M) == []  # traced: every loop's logits are compared
    # untraced, a closed step skips the early exits: the tokens and the last loop's logits still equal
    plain = LogitRecorder(model)
    quiet = generate(
        plain,
        ids,
        options=DecodeOptions(max_new_tokens=10, sampling=sampling, speculation=spec, trace=False, cost_model=True),
    )
    assert quiet.tokens == ref.tokens
    for b, tokens in enumerate(ref.tokens):
        for pos in range(len(tokens)):
            assert torch.equal(plain.logits[(b, M - 1, pos)], reference.logits[(b, M - 1, pos)])
    assert quiet.stats.row_cost is not None


def test_dear_rows_run_as_sequential_decoding(model, monkeypatch):
    """Where every extra row costs more than it can save, SPEED runs sequential decoding's rows and passes and
    evaluates no early exit; where rows are free, it runs its whole pipeline as without the cost model."""
    ids = torch.randint(3, 100, (8, 6), generator=torch.Generator().manual_seed(1))
    seq = generate(model, ids, options=DecodeOptions(method="sequential", max_new_tokens=10, trace=False))
    _forced(monkeypatch, 2.0)
    recorder = LogitRecorder(model)
    dear = generate(recorder, ids, options=DecodeOptions(max_new_tokens=10, trace=False, cost_model=True))
    assert dear.tokens == seq.tokens
    assert (dear.stats.rows, dear.stats.group_passes) == (seq.stats.rows, seq.stats.group_passes)
    assert dear.stats.closed_steps == dear.stats.steps and dear.stats.flushes == 0
    assert {loop for _, loop, _ in recorder.logits} == {M - 1}  # only the last loop's exits were computed
    _forced(monkeypatch, 0.0)
    free = generate(model, ids[:1], options=DecodeOptions(max_new_tokens=10, trace=False, cost_model=True))
    plain = generate(model, ids[:1], options=DecodeOptions(max_new_tokens=10, trace=False))
    assert (free.stats.rows, free.stats.steps, free.stats.closed_steps) == (plain.stats.rows, plain.stats.steps, 0)


def test_idle_evidence_decays_toward_the_prior():
    """A closed request's acceptance weighs less with every closed step: half at ``half_life``, the prior 0.5 in
    the end, from below and from above, never past it; no idle steps: the plain accepted share with its prior."""
    assert survival_rate(3, 10, idle=0) == survival_rate(3, 10) == 4 / 12
    assert survival_rate(3, 10, idle=8, half_life=8) == pytest.approx(2.5 / 7)  # the evidence halved: 1.5 of 5
    low = [survival_rate(0, 20, idle=k, half_life=8) for k in range(0, 400, 8)]
    high = [survival_rate(20, 20, idle=k, half_life=8) for k in range(0, 400, 8)]
    assert low == sorted(low) and high == sorted(high, reverse=True)
    assert low[-1] < 0.5 < high[-1] and low[-1] == pytest.approx(0.5) and high[-1] == pytest.approx(0.5)


def _late_agreement(slot: int, pos: int, loop: int) -> int:
    """A 2-loop stub's table: loop 1's exit wrong (99) before position 8, right from there; loop 2 always right."""
    from test_decoding_schedule import target

    return target(pos) if loop == 2 or pos >= 8 else 99


def test_a_closed_request_reopens(monkeypatch):
    """A request whose early drafts all failed is closed; while closed it learns nothing, so with its evidence
    kept at full weight it stays closed for good, and misses the later positions where its exits agree. Decayed
    (``survival_rate``'s ``idle``), it drafts again, finds them, and decodes in fewer steps; the same tokens."""
    from test_decoding_schedule import StubModel

    _forced(monkeypatch, 0.45)  # a row pays at a survival rate over 0.45: the prior 0.5 does, one failure not
    ids = torch.ones(1, 3, dtype=torch.long)

    def decode():
        return generate(
            StubModel(2, _late_agreement), ids, options=DecodeOptions(max_new_tokens=60, trace=False, cost_model=True)
        )

    decayed = decode()
    monkeypatch.setattr("speed.engine.cost_policy.survival_rate", lambda a, d, idle: survival_rate(a, d))
    kept = decode()
    assert decayed.tokens == kept.tokens
    assert kept.stats.closed_steps > 100 and kept.stats.steps >= 2 * 60 - 4  # closed for good: no gain at all
    assert 0 < decayed.stats.closed_steps < kept.stats.closed_steps / 2 and decayed.stats.steps < kept.stats.steps - 30


def _one_good_slot(slot: int, pos: int, loop: int) -> int:
    """A 2-loop stub's table: slot 1's loop-1 exits always right, slot 0's always wrong (99); loop 2 right."""
    from test_decoding_schedule import target

    return target(pos) if loop == 2 or slot == 1 else 99


def test_a_request_closes_alone(monkeypatch):
    """Beside a request whose drafts pay, one whose drafts fail is closed alone: it evaluates early exits only in
    its first steps and its rare probes, while the other speculates; the tokens are sequential decoding's."""
    from test_decoding_schedule import StubModel

    class Stub(StubModel):  # the schedule tests' stub, with no logits where none were asked for
        def step(self, memory, cache, rows, hidden, with_logits=True, logit_rows=None):
            hidden, logits = super().step(memory, cache, rows, hidden, with_logits, logit_rows)
            return hidden, logits if with_logits else None

    _forced(monkeypatch, 0.3)  # at batch 2 a row saves 0.65 if it survives: the prior pays, one failure not
    ids = torch.ones(2, 3, dtype=torch.long)
    seq = generate(
        StubModel(2, _one_good_slot), ids, options=DecodeOptions(method="sequential", max_new_tokens=60, trace=False)
    )
    recorder = LogitRecorder(Stub(2, _one_good_slot))
    out = generate(recorder, ids, options=DecodeOptions(max_new_tokens=60, trace=False, cost_model=True))
    assert out.tokens == seq.tokens
    early = [sum(1 for s, loop, _ in recorder.logits if s == slot and loop == 0) for slot in (0, 1)]
    assert early[1] > 50 and early[0] < 12, early  # slot 1 speculates at every token, slot 0 probes now and then


def test_cost_benchmark_rows(model):
    """``jobs/bench_cost.py``'s table: a row per (case, variant) in its schema, every output sequential's, the
    ratios to sequential decoding on the wall clock and on CPU time (1 for sequential itself)."""
    from speed.benchmarks.cost import COST_BENCH_SCHEMA, VARIANTS, CostCase, format_cost_table, run_cost_benchmark

    inputs = torch.randint(3, 100, (3, 5), generator=torch.Generator().manual_seed(2)).tolist()
    table = run_cost_benchmark(model, inputs, [CostCase("b2 greedy", 2)], max_new_tokens=6, pad_id=0)
    assert table.schema == COST_BENCH_SCHEMA and table.column("variant").to_pylist() == list(VARIANTS)
    rows = table.to_pylist()
    assert all(r["identical"] and r["tokens"] == rows[0]["tokens"] for r in rows)
    assert rows[0]["vs_sequential"] == rows[0]["cpu_vs_sequential"] == 1.0 and rows[0]["rows_per_token"] == M
    assert all(r["cpu_ms_per_token"] > 0 for r in rows) and "cpu vs seq" in format_cost_table(table)
