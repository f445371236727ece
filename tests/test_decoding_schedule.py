"""Stub-model tests: exact SPEED schedules, flushes and cache lengths.

The stub (``speed.decode.schedule.TableModel``)'s early exit for output position p
after loop l is a fixed table entry, so every schedule can be worked out by hand.
"""

from __future__ import annotations

import pytest
import torch

from speed.decode.generate import DecodeOptions, generate
from speed.decode.schedule import TableModel as StubModel
from speed.engine import Speculation

EOS = StubModel.eos_id


def target(p: int) -> int:
    return 10 + p


def run(model, max_new_tokens, batch=1, oracle=None, **speculation):
    """SPEED on the stub, ``speculation`` as ``Speculation`` takes it."""
    prompts = torch.ones(batch, 3, dtype=torch.long)
    speculation = Speculation(**speculation)
    return generate(
        model, prompts, options=DecodeOptions(max_new_tokens=max_new_tokens, speculation=speculation), oracle=oracle
    )


@pytest.mark.parametrize("m, t", [(3, 5), (6, 12), (1, 4)])
def test_always_right_commits_one_token_per_step_after_fill(m, t):
    res = run(StubModel(m, lambda s, p, lo: target(p)), max_new_tokens=t)
    assert res.tokens == [[target(p) for p in range(t)]]
    s = res.stats
    assert (s.steps, s.group_passes, s.rows, s.flushes, s.wasted_rows) == (t + m - 1, t + m - 1, t * m, 0, 0)


@pytest.mark.parametrize("invalidation", ["eager", "final"])
def test_always_wrong_constant_guess(invalidation):
    m, t = 4, 6
    res = run(StubModel(m, lambda s, p, lo: target(p) if lo == m else 50), max_new_tokens=t, invalidation=invalidation)
    assert res.tokens == [[target(p) for p in range(t)]]
    s = res.stats
    # Every token waits for its predecessor's last loop. Meanwhile the wrong successor launched its own
    # successors (a chain p+1..p+m-1 that ran m-1, m-2, ..., 1 loops), all flushed at once.
    chain = sum(m - k for p in range(t - 1) for k in range(1, min(m - 1, t - 1 - p) + 1))
    assert chain == 26
    assert (s.steps, s.flushes, s.wasted_rows) == (t * m, t - 1, chain)
    assert s.rows == t * m + s.wasted_rows


def test_always_wrong_changing_guess_eager_vs_final():
    m, t = 4, 5

    def table(s, p, lo):
        return target(p) if lo == m else 40 + lo  # a different wrong guess after every loop

    eager = run(StubModel(m, table), max_new_tokens=t, invalidation="eager").stats
    final = run(StubModel(m, table), max_new_tokens=t, invalidation="final").stats
    # eager flushes after loops 2..m, before the successor could launch its own (1 loop wasted each);
    # final lets the wrong chain grow and drops it once per token (as in the constant-guess case)
    chain = sum(m - k for p in range(t - 1) for k in range(1, min(m - 1, t - 1 - p) + 1))
    assert (eager.steps, eager.flushes, eager.wasted_rows) == (t * m, (t - 1) * (m - 1), (t - 1) * (m - 1))
    assert (final.steps, final.flushes, final.wasted_rows) == (t * m, t - 1, chain)


def test_sometimes_wrong_exact_schedule_and_cache_lengths():
    # M=3, 5 tokens; only position 2's early exits are wrong. Worked out by hand (tP = the token at position P):
    # step 3: t2 (loop 1) launches t3 from the wrong guess; step 4: t3 (loop 1) launches t4;
    # step 5: t2 finishes with the true token: flush t3 (2 rows) and t4 (1 row), relaunch t3.
    # Before step 5, loop 0 holds t0..t3, loop 1 t0..t2, loop 2 t0..t1; after the flush all hold t0..t2.
    model = StubModel(3, lambda s, p, lo: 99 if (p == 2 and lo < 3) else target(p))
    res = run(model, max_new_tokens=5)
    assert res.tokens == [[target(p) for p in range(5)]]
    s = res.stats
    assert (s.steps, s.flushes, s.wasted_rows, s.rows) == (9, 1, 3, 18)
    # valid lengths per loop before step 5 (t2..t4 in flight) and step 6 (after the flush)
    assert model.snapshots[4][:, 0].tolist() == [4, 3, 2]
    assert model.snapshots[5][:, 0].tolist() == [3, 3, 3]
    assert run(StubModel(3, lambda s, p, lo: target(p)), max_new_tokens=5).stats.steps == 7  # cost: M-1 steps


def test_eos_stops_and_discards_speculation():
    model = StubModel(3, lambda s, p, lo: EOS if (p == 3 and lo == 3) else target(p))
    res = run(model, max_new_tokens=10)
    assert res.tokens == [[10, 11, 12, EOS]]
    assert res.stats.flushes == 0  # speculation past the end is waste, not a misprediction
    assert res.stats.wasted_rows == 2 + 1  # t4 ran 2 loops, t5 ran 1
    assert res.stats.rows == 4 * 3 + 3


def test_no_speculation_from_an_early_eos():
    # early exits say EOS at position 1, the last loop disagrees: nothing is launched past the EOS guess
    model = StubModel(3, lambda s, p, lo: EOS if (p == 1 and lo < 3) else target(p))
    res = run(model, max_new_tokens=3)
    assert res.tokens == [[10, 11, 12]]
    assert res.stats.wasted_rows == 0 and res.stats.flushes == 0


def test_batch_sequences_progress_independently():
    def table(s, p, lo):
        if s == 0 and p == 2:
            return EOS
        return 99 if (s == 1 and lo < 3) else target(p)

    res = run(StubModel(3, table), batch=2, max_new_tokens=6)
    assert res.tokens == [[10, 11, EOS], [target(p) for p in range(6)]]
    assert res.stats.tokens == 9


def test_launch_loop_m_means_no_speculation():
    res = run(StubModel(3, lambda s, p, lo: target(p)), max_new_tokens=4, launch_loop=3)
    assert (res.stats.steps, res.stats.rows, res.stats.wasted_rows) == (12, 12, 0)
    later = run(StubModel(4, lambda s, p, lo: target(p)), max_new_tokens=6, launch_loop=2)
    assert later.stats.steps == 2 * 5 + 4  # a token every 2 steps, then the last one's 4 loops


def test_oracle_speculation_never_flushes():
    model = StubModel(3, lambda s, p, lo: target(p) if lo == 3 else 77)
    res = run(model, max_new_tokens=5, oracle=[[target(p) for p in range(5)]])
    assert res.tokens == [[target(p) for p in range(5)]]
    assert (res.stats.steps, res.stats.flushes) == (5 + 2, 0)
    assert set(res.trace.column("prediction").to_pylist()) == {77, *[target(p) for p in range(5)]}  # real exits traced


def test_trace_rows_and_flip_flags():
    model = StubModel(3, lambda s, p, lo: [5, 6, 6][lo - 1] if p == 0 else target(p))
    res = run(model, max_new_tokens=2)
    tr = res.trace.to_pylist()
    assert len(tr) == 2 * 3
    first = [(r["loop"], r["prediction"], r["token"], r["flipped_prev"], r["flipped_final"]) for r in tr[:3]]
    assert first == [(1, 5, 6, False, True), (2, 6, 6, True, False), (3, 6, 6, False, False)]


# Settings that generate and the engine's Request (tests/test_engine.py) reject alike, with the same message
BAD_SETTINGS = [
    ({"method": "beam"}, "method must be"),
    ({"speculation": Speculation(launch_loop=4)}, r"launch_loop must be in 1\.\.3 \(the model's loops\), got 4"),
    ({"speculation": {"launch_loop": 2}}, "speculation must be a speed.engine.Speculation, got dict"),
    ({"max_new_tokens": 0}, "max_new_tokens must be at least 1"),
]


@pytest.mark.parametrize("kwargs, fragment", BAD_SETTINGS)
def test_bad_arguments(kwargs, fragment):
    with pytest.raises(ValueError, match=fragment):
        generate(StubModel(3, lambda s, p, lo: 5), torch.ones(1, 2, dtype=torch.long), options=DecodeOptions(**kwargs))
