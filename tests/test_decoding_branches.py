"""Runner-up branches and the confidence gate: exact schedules on stub models, bitwise exactness on random ones.

The stub's exit after loop l at position p names its top-1 token, its
runner-up and whether it is confident, so every branch launch, restart and
promotion can be worked out by hand. The differential test decodes random
tiny models with branches and gates and compares every loop's logits with
sequential decoding's (``torch.equal``).
"""

from __future__ import annotations

import dataclasses
import random

import pytest
import torch
from engine_helpers import BLOCKS, recorded_cases
from test_decoding_exact import random_case
from test_decoding_schedule import EOS, StubModel, target

from speed.decode.generate import DecodeOptions, generate
from speed.engine import Engine, EngineConfig, Request, Speculation, should_branch, should_launch
from speed.engine.cache import Rows


class BranchStub(StubModel):
    """``table(slot, pos, loop)`` -> (top-1, runner-up, confident): confident exits put ~all probability on the
    top-1, unsure ones split it between the two. Records each step's rows as (loop, pos, side) triples."""

    def __init__(self, n_loops, table, vocab: int = 128) -> None:
        super().__init__(n_loops, table, vocab)
        self.steps: list[list[tuple[int, int, int]]] = []

    def step(self, memory, cache, rows: Rows, hidden, with_logits=True):
        side = rows.side.tolist() if rows.side is not None else [-1] * len(rows)
        self.steps.append(list(zip(rows.loop.tolist(), rows.pos.tolist(), side)))
        self.snapshots.append(cache.lengths[:, 0, :].copy())
        z = torch.zeros(len(rows), 1, 1)
        cache.write(0, rows, z, z)
        logits = torch.zeros(len(rows), self.vocab)
        for r, (s, p, lo) in enumerate(zip(rows.slot, rows.pos, rows.loop)):
            top, runner, confident = self.table(int(s), int(p), int(lo) + 1)
            logits[r, top], logits[r, runner] = (30.0, 0.0) if confident else (2.0, 1.9)
        return hidden, logits


def right(p: int) -> tuple[int, int, bool]:
    """A confident, correct exit whose runner-up is EOS (so it never branches)."""
    return target(p), EOS, True


def run(model, max_new_tokens, oracle=None, **speculation):
    """SPEED on the stub, ``speculation`` as ``Speculation`` takes it."""
    prompts = torch.ones(1, 3, dtype=torch.long)
    speculation = Speculation(**speculation)
    return generate(
        model, prompts, options=DecodeOptions(max_new_tokens=max_new_tokens, speculation=speculation), oracle=oracle
    )


def test_policies():
    assert should_launch(1, 1) and not should_launch(0, 1)
    assert should_launch(2, 1, p_top=0.5, min_confidence=0.5) and not should_launch(2, 1, 0.49, 0.5)
    assert should_branch(0.6, 0.7) and not should_branch(0.7, 0.7) and not should_branch(1.0, 1.0)


def test_branch_takes_over_instead_of_a_restart():
    # M=3, 3 tokens. Position 0's loop-1 exit says 20 (runner-up 10, the final token); loop 2 switches to 10.
    # Without a branch: step 2 flushes the successor launched from 20 and relaunches it from 10 (6 steps).
    # With one: step 1 launches the chain successor (20) and a branch (10); step 2 promotes the branch,
    # which already ran its first loop, and flushes the chain (1 row wasted, no restart): 5 steps.
    def table(s, p, lo):
        return (20, 10, False) if (p == 0 and lo == 1) else right(p)

    plain = run(BranchStub(3, table), max_new_tokens=3)
    model = BranchStub(3, table)
    tree = run(model, max_new_tokens=3, branches=1)
    assert plain.tokens == tree.tokens == [[10, 11, 12]]
    p, t = plain.stats, tree.stats
    assert (p.steps, p.rows, p.flushes, p.wasted_rows, p.promotions) == (6, 10, 1, 1, 0)
    assert (t.steps, t.rows, t.flushes, t.wasted_rows, t.promotions) == (5, 10, 0, 1, 1)
    assert model.steps == [
        [(0, 0, -1)],
        [(1, 0, -1), (0, 1, -1), (0, 1, 0)],  # the chain token and the branch at position 1, the branch in side 0
        [(2, 0, -1), (1, 1, -1), (0, 2, -1)],  # the promoted branch runs its second loop on the chain
        [(2, 1, -1), (1, 2, -1)],
        [(2, 2, -1)],
    ]
    # before step 3 loop 0 holds position 0 and the promoted branch's entry at 1 (copied from its side entry)
    assert model.snapshots[2][:, 0].tolist() == [2, 1, 0]


def test_a_lane_keeps_the_branch_s_successors():
    # position 0 flips at its last loop (loops 1, 2: 20 with runner-up 10). A branch that launches nothing is
    # promoted with 2 loops done, but its successor starts only then: 7 steps for 4 tokens. A lane of depth 3
    # grew that successor beside it, so the pipeline stays full: 6 steps, the oracle's (4 + 3 - 1).
    def table(s, p, lo):
        return (20, 10, False) if (p == 0 and lo < 3) else right(p)

    branch = run(BranchStub(3, table), max_new_tokens=4, branches=1)
    model = BranchStub(3, table)
    lane = run(model, max_new_tokens=4, branches=1, branch_depth=3)
    assert branch.tokens == lane.tokens == [[10, 11, 12, 13]]
    b, t = branch.stats, lane.stats
    assert (b.steps, b.rows, b.wasted_rows, b.promotions, b.flushes) == (7, 15, 3, 1, 0)
    assert (t.steps, t.rows, t.wasted_rows, t.promotions, t.flushes) == (6, 15, 3, 1, 0)
    # step 3: the chain (positions 0, 1, 2), then the lane: its branch at 1 (side 0) and the branch's successor
    assert model.steps[2] == [(2, 0, -1), (1, 1, -1), (0, 2, -1), (1, 1, 0), (0, 2, 1)]
    assert model.steps[3] == [(2, 1, -1), (1, 2, -1), (0, 3, -1)]  # promoted: both on the chain, the next launched


def test_branch_restarts_when_the_runner_up_changes():
    # position 0: loop 1 says 20 (runner-up 30), loop 2 says 20 (runner-up 10), loop 3 commits 10.
    # Step 2 drops the branch from 30 (1 row) and launches one from 10; step 3 promotes it (1 loop done)
    # and flushes the chain launched from 20 (its two tokens ran 2 and 1 loops).
    table = {1: (20, 30, False), 2: (20, 10, False)}
    model = BranchStub(3, lambda s, p, lo: table.get(lo, right(p)) if p == 0 else right(p))
    res = run(model, max_new_tokens=3, branches=1)
    assert res.tokens == [[10, 11, 12]]
    s = res.stats
    assert (s.steps, s.promotions, s.flushes, s.wasted_rows, s.rows) == (6, 1, 0, 1 + 2 + 1, 9 + 4)
    assert model.steps[1] == [(1, 0, -1), (0, 1, -1), (0, 1, 0)]
    assert model.steps[2] == [(2, 0, -1), (1, 1, -1), (0, 2, -1), (0, 1, 0)]  # the new branch, in the freed side entry
    assert model.steps[3] == [(1, 1, -1), (0, 2, -1)]  # the promoted branch's second loop, on the chain


def test_confidence_gate_and_branch_threshold():
    # position 0's loop-1 exit is unsure (and wrong); loop 2 is sure and right.
    def table(s, p, lo):
        return (20, 10, False) if (p == 0 and lo == 1) else right(p)

    gated = run(BranchStub(3, table), max_new_tokens=3, min_confidence=0.9)
    # the successor waits for loop 2 instead of launching from the unsure guess: no row wasted, one step later
    # than a branch would be, the same steps as a flush and restart
    assert (gated.stats.steps, gated.stats.wasted_rows, gated.stats.flushes) == (6, 0, 0)
    assert gated.tokens == [[10, 11, 12]]
    # a branch only below branch_below: an unsure exit's top-1 probability is about 0.05 here
    assert run(BranchStub(3, table), max_new_tokens=3, branches=1, branch_below=0.01).stats.promotions == 0
    assert run(BranchStub(3, table), max_new_tokens=3, branches=1, branch_below=0.5).stats.promotions == 1


def test_branches_cap_counts_branches_in_flight():
    # every exit before the last is unsure with the right answer as runner-up: each in-flight token branches
    def table(s, p, lo):
        return (90, target(p), False) if lo < 3 else right(p)

    for cap in range(4):
        model = BranchStub(3, table)
        res = run(model, max_new_tokens=6, branches=cap)
        assert res.tokens == [[target(p) for p in range(6)]]
        assert max(sum(side >= 0 for _, _, side in rows) for rows in model.steps) == min(cap, 2)
        assert res.stats.rows == 6 * 3 + res.stats.wasted_rows


def test_no_branch_under_an_oracle_or_sequential():
    def table(s, p, lo):
        return (90, target(p), False) if lo < 3 else right(p)

    oracle = run(BranchStub(3, table), max_new_tokens=4, branches=3, oracle=[[target(p) for p in range(4)]])
    assert oracle.stats.promotions == oracle.stats.wasted_rows == 0
    seq = generate(
        BranchStub(3, table),
        torch.ones(1, 3, dtype=torch.long),
        options=DecodeOptions(method="sequential", max_new_tokens=4),
    )
    assert seq.stats.rows == 12


def test_row_budget_runs_branches_last():
    def table(s, p, lo):
        return (90, target(p), False) if lo < 3 else right(p)

    model = BranchStub(3, table)
    engine = Engine(model, EngineConfig(max_active=1, max_source_len=3, max_target_len=8, row_budget=3))
    engine.add(Request([5], 6, speculation=Speculation(branches=3)))
    while engine.has_work:
        engine.step()
    for rows in model.steps:
        assert len(rows) <= 3
        kinds = [side >= 0 for _, _, side in rows]
        assert kinds == sorted(kinds)  # chain rows first
    assert any(sum(side >= 0 for _, _, side in rows) == 1 for rows in model.steps)


@pytest.mark.parametrize(
    "kw, fragment",
    [
        ({"branches": 4}, r"branches must be in 0\.\.3 \(the model's loops\), got 4"),
        ({"branches": 1, "branch_depth": 4}, r"branch_depth must be in 1\.\.3 \(the model's loops\), got 4"),
    ],
)
def test_branch_settings_beyond_the_models_loops_are_refused(kw, fragment):
    """``Speculation`` checks what needs no model (``test_speculation``); the engine's ``add`` the loops."""
    engine = Engine(StubModel(3, lambda s, p, lo: 5), EngineConfig(max_active=1, max_source_len=6, max_target_len=8))
    with pytest.raises(ValueError, match=fragment):
        engine.add(Request([3, 4], 4, speculation=Speculation(**kw)))
    assert not engine.has_work


@pytest.mark.parametrize("block", BLOCKS[:3])
def test_branches_equal_sequential_bitwise(block):
    """Random tiny models, branches and gates on: every loop's logits of every token equal sequential's."""
    cases = promotions = restarts = 0
    for case in recorded_cases(random_case, range(block * 8, block * 8 + 8)):
        rng, ref, m = case.rng, case.ref, case.model.n_loops
        for invalidation in ("eager", "final"):
            settings = [(m, 1, 1.0, 0.0), (m, m, 1.0, 0.0)]
            settings.append((rng.randint(0, m), rng.randint(1, m), rng.random(), rng.random() / 4))
            for branches, depth, below, gate in settings:
                speculation = Speculation(rng.randint(1, m), invalidation, branches, depth, max(below, 1e-3), gate)
                got = case.speed((case.seed, invalidation, branches), speculation=speculation)
                assert got.tokens == ref.tokens and got.trace.equals(ref.trace)
                assert got.stats.rows == ref.stats.rows + got.stats.wasted_rows
                promotions += got.stats.promotions
                restarts += got.stats.flushes
                cases += 1
    assert cases == 8 * 2 * 3 and promotions > 0 and restarts > 0


def test_churn_with_branches_equals_sequential_alone():
    """Requests with random branch settings join, leave and are cancelled under row budgets: each is exact."""
    from engine_helpers import churn_config, drive
    from test_engine import alone, random_request, tiny_model

    promotions = 0
    for seed in range(8):
        rng = random.Random(100 + seed)
        model = tiny_model(seed, ["2x3", "1x4", "3x3", "2x6"][seed % 4])
        m = model.n_loops
        engine = Engine(model, churn_config(rng, max_prompt_len=10, max_target_len=16, max_budget=10))

        def make(r=rng, mo=model):
            request = random_request(r, mo, 10, 16)
            speculation = dataclasses.replace(
                request.speculation,
                branches=r.randint(0, mo.n_loops),
                branch_depth=r.randint(1, mo.n_loops),
                branch_below=r.choice([1.0, 0.5]),
                min_confidence=r.choice([0.0, 0.0, 0.1]),
            )
            return dataclasses.replace(request, speculation=speculation)

        requests, finished = drive(engine, rng, [rng.randrange(0, 30) for _ in range(6)], make, 0.2, 10)
        for f in finished:
            ref = alone(model, requests[f.id])
            assert f.tokens == ref.tokens[0][: len(f.tokens)]
            if not f.cancelled:
                assert f.tokens == ref.tokens[0]
                assert f.trace.drop_columns(["sequence"]).equals(ref.trace.drop_columns(["sequence"]))
                assert f.stats.rows == f.stats.tokens * m + f.stats.wasted_rows
            promotions += f.stats.promotions
    assert promotions > 0
