"""The worked schedule (``speed.decode.schedule``): made by the engine, equal to the hand-worked one and the docs."""

from __future__ import annotations

import random
import re

import pytest
from test_decoding_schedule import StubModel, run, target

from speed.decode.schedule import (
    EXAMPLE_LOOPS,
    EXAMPLE_TOKENS,
    example,
    main,
    schedule,
)
from speed.engine import Speculation
from speed.paths import repo_root

MARKERS = re.compile(r"<!-- schedule:begin -->\n(.*?)<!-- schedule:end -->", flags=re.S)


def test_example_is_the_hand_worked_schedule():
    """test_decoding_schedule's M=3 case: position 2's early exits are wrong, so step 3 launches p3 from the
    wrong guess, step 4 launches p4, step 5 (p2's last loop) flushes p3 (2 rows) and p4 (1 row) and relaunches p3."""
    hand = {(p, lo): 99 if (p == 2 and lo < 3) else target(p) for p in range(EXAMPLE_TOKENS) for lo in (1, 2, 3)}
    assert all(example(0, p, lo) == token for (p, lo), token in hand.items())
    steps = schedule(example, EXAMPLE_LOOPS, EXAMPLE_TOKENS)
    assert [t for s in steps for t in s.committed] == [target(p) for p in range(5)]
    assert [s.step for s in steps if s.committed] == [3, 4, 5, 8, 9]
    assert steps[2].launched == [(3, 99)] and steps[3].launched == [(4, target(3))]
    assert steps[4].launched == [(3, target(2))]
    assert [(s.step, s.flushed, s.wasted_rows) for s in steps if s.flushed] == [(5, [3, 4], 3)]
    assert [(r.pos, r.loop) for r in steps[4].rows] == [(2, 3), (3, 2), (4, 1)]
    assert steps[3].lengths == [4, 3, 2] and steps[4].lengths == [3, 3, 3]
    stats = run(StubModel(EXAMPLE_LOOPS, example), max_new_tokens=EXAMPLE_TOKENS).stats
    assert (len(steps), sum(len(s.rows) for s in steps), stats.flushes) == (stats.steps, stats.rows, 1) == (9, 18, 1)


@pytest.mark.parametrize("invalidation", ["eager", "final"])
def test_flushes_and_rows_agree_with_the_engines_counters(invalidation):
    """On random tables (no EOS) the schedule's rows, steps and flushed rows are the engine's own counts."""
    rng = random.Random(3)
    for _ in range(20):
        m, t, launch = rng.randint(2, 4), rng.randint(2, 7), 1
        wrong = {(p, lo): rng.choice([50, 51]) for p in range(t) for lo in range(1, m) if rng.random() < 0.3}

        def table(s, p, lo, wrong=wrong):
            return wrong.get((p, lo), target(p))

        steps = schedule(table, m, t, Speculation(launch, invalidation))
        stats = run(StubModel(m, table), max_new_tokens=t, invalidation=invalidation).stats
        assert [c for s in steps for c in s.committed] == [target(p) for p in range(t)]
        assert len(steps) == stats.steps and sum(len(s.rows) for s in steps) == stats.rows
        assert sum(s.wasted_rows for s in steps) == stats.wasted_rows
        assert steps[-1].lengths == [t] * m


def cells(table: str) -> list[list[str]]:
    """A markdown table's body rows, cell by cell."""
    return [[c.strip() for c in line.strip("|").split("|")] for line in table.splitlines()[2:]]


def test_docs_page_holds_the_generated_table(capsys):
    """``python -m speed.decode.schedule`` prints the hand-worked schedule in words, and docs/decoding.md holds exactly
    that table."""
    main([])
    printed = capsys.readouterr().out
    rows = cells(printed)  # step | rows | committed | launched | flushed | valid KV length per loop
    assert [r[0] for r in rows] == [str(step) for step in range(1, 10)]
    assert {r[0]: r[2] for r in rows if r[2]} == {"3": "the", "4": "cat", "5": "sat", "8": "on", "9": "mats"}
    assert {r[0]: r[4] for r in rows if r[4]} == {"5": "p3, p4 (3 rows)"}
    assert rows[4][1:4] == ["p2 loop 3: sat, p3 loop 2: on, p4 loop 1: mats", "sat", "p3 ← sat"]
    assert (rows[2][3], rows[3][5], rows[8][5]) == ("p3 ← dog", "4 / 3 / 2", "5 / 5 / 5")
    found = MARKERS.findall((repo_root() / "docs" / "decoding.md").read_text())
    assert found == [printed], "regenerate it: python -m speed.decode.schedule"


def test_the_launch_loop_flag_reaches_the_schedule(capsys):
    """Launched after loop 2, each token waits a step longer: p3, launched from p2's wrong "dog" at step 6, is
    flushed after one row when p2's last loop says "sat" at step 7; 12 steps in all."""
    main(["--launch-loop", "2"])
    rows = cells(capsys.readouterr().out)
    launched = {r[0]: r[3] for r in rows if r[3]}
    assert launched == {"2": "p1 ← the", "4": "p2 ← cat", "6": "p3 ← dog", "7": "p3 ← sat", "9": "p4 ← on"}
    assert len(rows) == 12 and {r[0]: r[4] for r in rows if r[4]} == {"7": "p3 (1 row)"}
