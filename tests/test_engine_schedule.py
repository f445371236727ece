"""The engine's decisions on plain data: the launch, successor and branch rules (``speed.engine.policies``), the
exit records a step leaves on its tokens (``speed.engine.outputs``), and the scheduler's walk over hand-made
chains (``speed.engine.scheduler``), with a cache that only records what it was told."""

from __future__ import annotations

import math

import pytest
import torch

from speed.engine.outputs import record_exits
from speed.engine.policies import (
    LaunchRule,
    Successor,
    choose_successor,
    keeps_branch,
    may_branch,
    may_launch,
)
from speed.engine.sampling import Sampling
from speed.engine.scheduler import Scheduler
from speed.engine.state import Exit, InFlight, RequestState
from speed.engine.types import NO_EXIT, DecodeStats, Request, Speculation

EOS = 1
STOPS = frozenset({EOS})
M = 3
RULE = LaunchRule(launch_loop=1, min_confidence=0.5, stop_ids=STOPS, max_new_tokens=8)


def test_may_launch_needs_every_condition():
    assert may_launch(RULE, loops_done=1, p_top=0.5, token=7, pos=7)
    assert not may_launch(RULE, loops_done=0, p_top=0.9, token=7, pos=3)  # before the launch loop
    assert not may_launch(RULE, loops_done=2, p_top=0.49, token=7, pos=3)  # an unsure exit
    assert not may_launch(RULE, loops_done=2, p_top=0.9, token=EOS, pos=3)  # nothing follows EOS
    assert not may_launch(RULE, loops_done=2, p_top=0.9, token=7, pos=8)  # past the last position
    sequential = LaunchRule(launch_loop=M, min_confidence=0.0, stop_ids=STOPS, max_new_tokens=8)
    assert not may_launch(sequential, M - 1, 1.0, 7, 3) and may_launch(sequential, M, 1.0, 7, 3)


def test_choose_successor_keeps_then_promotes_then_flushes():
    assert choose_successor(succ=5, branch=6, token=5) is Successor.KEEP
    assert choose_successor(succ=5, branch=5, token=5) is Successor.KEEP  # the chain wins a tie
    assert choose_successor(succ=5, branch=6, token=6) is Successor.PROMOTE
    assert choose_successor(succ=None, branch=6, token=6) is Successor.PROMOTE
    assert choose_successor(succ=5, branch=6, token=7) is Successor.FLUSH
    assert choose_successor(succ=5, branch=None, token=6) is Successor.FLUSH
    assert choose_successor(succ=None, branch=None, token=6) is Successor.FLUSH


def test_keeps_branch():
    assert keeps_branch(branch=6, runner_up=6, guess=5, succ=5)
    assert keeps_branch(branch=6, runner_up=9, guess=6, succ=5)  # now the guess: about to take over
    assert not keeps_branch(branch=6, runner_up=9, guess=5, succ=5)  # neither runner-up nor guess any more
    assert not keeps_branch(branch=6, runner_up=6, guess=6, succ=6)  # the same token as the successor
    assert not keeps_branch(branch=6, runner_up=6, guess=5, succ=None)  # no successor to stand beside


def test_may_branch():
    spec = Speculation(branches=2, branch_below=0.8)
    assert may_branch(spec, p_top=0.5, runner_up=6, succ=5, stop_ids=STOPS, branches=1)
    assert not may_branch(spec, 0.5, 6, 5, STOPS, branches=2)  # as many in flight as allowed
    assert not may_branch(spec, 0.8, 6, 5, STOPS, 0)  # a confident exit
    for runner_up in (5, EOS, NO_EXIT):  # the successor itself, EOS, an exit not evaluated
        assert not may_branch(spec, 0.5, runner_up, 5, STOPS, 0)
    assert not may_branch(Speculation(), 0.5, 6, 5, STOPS, 0)  # branches off


def sequence(spec: Speculation = Speculation(), max_new: int = 8, sampling: Sampling = Sampling()) -> RequestState:  # noqa: B008
    request = Request([2], max_new, "speed", spec, sampling=sampling)
    rule = LaunchRule(spec.launch_loop, spec.min_confidence, STOPS, max_new)
    return RequestState(
        0,
        request,
        rule,
        all_exits=True,
        added=0.0,
        slot=0,
        flips=[0] * M,
        accepted=[0] * (M - 1),
        draft_tokens=[0] * (M - 1),
        side_free=list(range(M * M)),
    )


def token(pos: int, inp: int, *exits: tuple[int, int, float], ahead: int = 0) -> InFlight:
    """An in-flight token whose finished loops' exits are (prediction, runner-up, top-1 probability)."""
    return InFlight(pos, inp, exits=[Exit(p, r, pt, p) for p, r, pt in exits], ahead=ahead)


class Recorder:
    """A cache that records what the scheduler tells it."""

    def __init__(self) -> None:
        self.calls: list[tuple] = []

    def invalidate(self, slot: int, from_pos: int) -> None:
        self.calls.append(("invalidate", slot, from_pos))

    def promote(self, slot: int, side: int, pos: int, loops_done: int) -> None:
        self.calls.append(("promote", slot, side, pos, loops_done))


def scheduler() -> tuple[Scheduler, Recorder]:
    cache = Recorder()
    return Scheduler(cache, M, None, DecodeStats()), cache


def test_record_exits_one_record_per_row():
    seq = sequence()
    a, b = InFlight(0, 0), InFlight(1, 5)
    logits = torch.tensor([[0.0, 1.0, 3.0, 2.0], [4.0, 0.0, 0.0, 5.0]])  # (R=2, V=4)
    record_exits([(seq, a), (seq, b)], logits, M)
    assert [(e.pred, e.runner_up, e.mode) for e in (a.exits[0], b.exits[0])] == [(2, 3, 2), (3, 0, 3)]
    assert a.exits[0].p_top == pytest.approx(torch.softmax(logits[0], -1).max().item())
    record_exits([(seq, a)], None, M)  # no exit evaluated this step
    assert a.loops_done == 2 and a.preds == [2, NO_EXIT] and a.exits[1].runner_up == a.exits[1].mode == NO_EXIT
    assert math.isnan(a.exits[1].p_top) and b.loops_done == 1


def test_record_exits_logprob_after_the_last_loop_only():
    seq = sequence()
    seq.request = Request([2], 8, logprobs=1)
    t = InFlight(0, 0)
    logits = torch.tensor([[0.0, 1.0, 3.0, 2.0]])
    for _ in range(M - 1):
        record_exits([(seq, t)], logits, M)
        assert t.logprob is None
    record_exits([(seq, t)], logits, M)
    assert t.logprob is not None and t.logprob.logprob == pytest.approx(torch.log_softmax(logits[0], -1)[2].item())


def test_walk_keeps_a_right_chain_and_launches_at_its_end():
    sched, cache = scheduler()
    seq = sequence()
    chain = [token(0, 0, (10, 2, 0.9), (10, 2, 0.9)), token(1, 10, (11, 2, 0.9), ahead=1)]
    seq.chain = list(chain)
    before = list(seq.chain)
    assert sched.schedule(seq) is None
    assert before == chain  # the walked list is never changed in place
    assert seq.chain[:2] == chain and [(t.pos, t.token, t.ahead) for t in seq.chain[2:]] == [(2, 11, 2)]
    assert cache.calls == [] and seq.draft_tokens == [0, 1]


def test_walk_eager_flush_relaunches_from_the_new_guess():
    sched, cache = scheduler()
    seq = sequence()
    succ = token(1, 10, (11, 2, 0.9), ahead=1)
    seq.chain = [token(0, 0, (10, 2, 0.9), (12, 2, 0.9)), succ, token(2, 11, ahead=2)]
    sched.schedule(seq)
    assert [(t.pos, t.token) for t in seq.chain] == [(0, 0), (1, 12)]
    assert seq.chain[1] is not succ and seq.chain[1].loops_done == 0
    assert cache.calls == [("invalidate", 0, 1)]
    assert (seq.flushes, seq.wasted_rows, sched.stats.flushes, sched.stats.wasted_rows) == (1, 1, 1, 1)


def test_walk_final_invalidation_waits_for_the_last_loop():
    sched, cache = scheduler()
    seq = sequence(Speculation(invalidation="final"))
    seq.chain = [token(0, 0, (10, 2, 0.9), (12, 2, 0.9)), token(1, 10, (11, 2, 0.9), ahead=1)]
    sched.schedule(seq)
    assert [(t.pos, t.token) for t in seq.chain] == [(0, 0), (1, 10), (2, 11)] and cache.calls == []


def test_commit_then_walk_the_successor_in_the_same_call():
    sched, _ = scheduler()
    seq = sequence()
    head = token(0, 0, (10, 2, 0.9), (10, 2, 0.9), (10, 2, 0.9))
    seq.chain = [head, token(1, 10, (11, 2, 0.9), (11, 2, 0.9), ahead=1), token(2, 11, (12, 2, 0.9), ahead=2)]
    assert sched.schedule(seq) is head and seq.out == [10]
    assert [(t.pos, t.token) for t in seq.chain] == [(1, 10), (2, 11), (3, 12)]  # the walk went on after it


def test_commit_on_a_misprediction_relaunches_on_the_committed_path():
    sched, cache = scheduler()
    seq = sequence()
    seq.chain = [token(0, 0, (10, 2, 0.9), (10, 2, 0.9), (13, 2, 0.9)), token(1, 10, (11, 2, 0.9), ahead=1)]
    sched.schedule(seq)
    assert seq.out == [13] and [(t.pos, t.token, t.ahead) for t in seq.chain] == [(1, 13, 0)]
    assert cache.calls == [("invalidate", 0, 1)] and seq.flushes == 1


def test_commit_of_eos_ends_the_request_and_drops_everything():
    sched, cache = scheduler()
    seq = sequence()
    seq.chain = [token(0, 0, (10, 2, 0.9), (10, 2, 0.9), (EOS, 2, 0.9)), token(1, 10, (11, 2, 0.9), ahead=1)]
    sched.schedule(seq)
    assert seq.done and seq.out == [EOS] and seq.chain == []
    assert cache.calls == [("invalidate", 0, 1)] and seq.flushes == 0 and seq.wasted_rows == 1


def test_branch_launches_from_the_runner_up_and_is_promoted():
    sched, cache = scheduler()
    seq = sequence(Speculation(branches=1, branch_below=0.8))
    parent = token(0, 0, (10, 20, 0.6))  # unsure: its runner-up 20 gets a branch beside the successor 10
    seq.chain = [parent]
    sched.schedule(seq)
    assert [(t.pos, t.token) for t in seq.chain] == [(0, 0), (1, 10)]
    assert [(t.pos, t.token, t.side) for t in parent.lane] == [(1, 20, 0)] and seq.side_free[0] == 1
    for t in seq.chain[1:] + parent.lane:  # the step runs their first loops
        t.exits.append(Exit(11, 2, 0.9, 11))
    parent.exits.append(Exit(20, 10, 0.9, 20))  # loop 2 switches to the runner-up: the branch takes over
    branch = parent.lane[0]
    sched.schedule(seq)
    assert seq.chain[1] is branch and branch.side == -1 and parent.lane == []
    assert cache.calls == [("invalidate", 0, 1), ("promote", 0, 0, 1, 1)]
    assert (seq.promotions, seq.flushes, seq.wasted_rows) == (1, 0, 1) and 0 in seq.side_free


def test_lane_grows_to_its_depth_and_drops_on_a_flush():
    sched, _ = scheduler()
    seq = sequence(Speculation(branches=1, branch_depth=2, branch_below=0.8))
    parent = token(0, 0, (10, 20, 0.6))
    seq.chain = [parent]
    sched.schedule(seq)
    for t in seq.chain[1:] + parent.lane:
        t.exits.append(Exit(21 if t.side >= 0 else 11, 2, 0.9, 0))
    parent.exits.append(Exit(10, 20, 0.6, 10))
    sched.schedule(seq)
    assert [(t.pos, t.token) for t in parent.lane] == [(1, 20), (2, 21)]  # depth 2: one successor, no more
    assert parent.lane[1].up == ((1, 0),)
    parent.lane[1].exits.append(Exit(22, 2, 0.9, 22))
    parent.lane[0].exits.append(Exit(23, 2, 0.9, 23))  # its second loop no longer predicts 21
    seq.chain[1].exits.append(Exit(11, 2, 0.9, 11))  # (the parent's third loop waits: the budget, say)
    wasted = seq.wasted_rows
    sched.schedule(seq)
    assert [(t.pos, t.token) for t in parent.lane] == [(1, 20), (2, 23)]  # dropped, relaunched from 23
    assert seq.wasted_rows == wasted + 1


def test_walk_stops_at_a_token_with_no_loop_done():
    sched, cache = scheduler()
    seq = sequence()
    chain = [token(0, 0, (10, 2, 0.9)), token(1, 10, ahead=1)]  # launched in the last step: no exit yet
    seq.chain = list(chain)
    sched.schedule(seq)
    assert seq.chain == chain and seq.chain[1] is chain[1] and cache.calls == [] and seq.draft_tokens == [0, 0]


def test_cancel_wastes_every_row_in_flight():
    sched, _ = scheduler()
    seq = sequence(Speculation(branches=1, branch_below=0.8))
    parent = token(0, 0, (10, 20, 0.6), (10, 20, 0.6))
    parent.lane = [token(1, 20, (21, 2, 0.9), ahead=1)]
    seq.chain = [parent, token(1, 10, (11, 2, 0.9), ahead=1)]
    sched.cancel(seq)
    assert seq.chain == [] and seq.wasted_rows == sched.stats.wasted_rows == 4


def test_every_stop_id_ends_a_chain():
    stops = frozenset({EOS, 9})  # an imported chat model's: its EOS and its end of turn
    rule = LaunchRule(launch_loop=1, min_confidence=0.0, stop_ids=stops, max_new_tokens=8)
    assert may_launch(rule, 1, 1.0, token=7, pos=3) and not may_launch(rule, 1, 1.0, token=9, pos=3)
    assert not may_branch(Speculation(branches=1), 0.5, runner_up=9, succ=5, stop_ids=stops, branches=0)
