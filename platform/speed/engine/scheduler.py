"""The scheduler: which rows a step computes, and after it, what each request's in-flight tokens become.

As vLLM's: ``select`` returns the step's plan as plain data (``StepPlan``: slots, positions, loops, input tokens),
the engine's executor runs it (keeping every token's hidden state), and ``update`` turns the executor's exit
logits into the step's outcome (``Scheduled``: commits and the requests that are done), the one place that
writes the engine's ``DecodeStats``. It decides with the pure rules of ``speed.engine.policies`` and keeps the
decoding state (``RequestState``, ``InFlight``) and the cache's bookkeeping (invalidating and promoting entries)
in step with its decisions; it never runs the model.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import NamedTuple

from torch import Tensor

from speed.engine.cache import KVCache
from speed.engine.cost import RowCost, clock
from speed.engine.cost_policy import CostChoice, CostPolicy
from speed.engine.outputs import record_commit, record_exits
from speed.engine.policies import (
    Successor,
    budget_rows,
    choose_successor,
    keeps_branch,
    may_branch,
    may_launch,
    should_flush,
)
from speed.engine.state import InFlight, RequestState
from speed.engine.types import NO_EXIT, Commit, DecodeStats


class PlannedRow(NamedTuple):
    """One row of a step's plan: an in-flight token through its next loop."""

    key: int  # the token's key (``InFlight.key``): where the executor keeps its hidden state
    token: int  # its input token, embedded when the executor holds no hidden state for it yet
    slot: int
    loops_done: int  # its finished loops: the row runs loop loops_done + 1
    pos: int
    side: int
    up: tuple[tuple[int, int], ...]


@dataclass(frozen=True)
class StepPlan:
    """What one pipeline step computes, for the executor: its rows in order, and which rows' exit logits are
    needed (a last-loop row's always; an early one's for a request that evaluates all exits, unless the cost model
    closed the step)."""

    step_no: int
    rows: list[PlannedRow]
    with_logits: bool  # some row needs its exit logits
    with_gates: bool = False  # an exit_gate request's row is among them: the model's gate lambdas are needed too
    logit_rows: tuple[int, ...] | None = None  # the rows (ascending) that need them, when not all; None: all


@dataclass
class Scheduled:
    """What the scheduler made of a step's results: the tokens committed, in order, and the requests now done."""

    committed: list[Commit] = field(default_factory=list)
    done: list[RequestState] = field(default_factory=list)


class Scheduler:
    """Row selection and the schedule between steps for the requests of one engine (its cache, its totals)."""

    def __init__(
        self,
        cache: KVCache,
        n_loops: int,
        row_budget: int | None,
        stats: DecodeStats | None = None,
        row_cost: RowCost | None = None,
    ) -> None:
        self.cache = cache
        self.n_loops = n_loops
        self.row_budget = row_budget
        self.row_cost = row_cost  # the cost model's device curve (None: no cost model)
        self.stats = DecodeStats() if stats is None else stats  # the engine's totals; only the scheduler writes them
        self.stats.row_cost = row_cost
        self._work: list[tuple[RequestState, InFlight]] = []  # the last plan's rows, as decoding state
        self._closed = False  # the last plan's: the cost model found no speculation worth its exits
        self._closed_ids: set[int] = set()  # the last plan's requests whose own speculation was not worth it
        self._wanted: list[bool] = []  # the last plan's rows whose exits are scored (``_wants_exit``)
        self._policy = None if row_cost is None else CostPolicy(row_cost, n_loops)  # the cost model's choice

    def select(self, seqs: Iterable[RequestState], step_no: int) -> StepPlan:
        """Step ``step_no``'s plan (kept for ``update``): its rows are all in-flight rows, or the row budget's
        choice, in the order of ``seqs`` (admission order)."""
        self._work = work = self._choose(list(seqs), step_no)
        rows = [PlannedRow(t.key, t.token, s.slot, t.loops_done, t.pos, t.side, t.up) for s, t in work]
        self._wanted = wanted = [self._wants_exit(s, t) for s, t in work]
        with_gates = any(s.request.exit_rule is not None for s, _ in work)
        some = any(wanted) and not all(wanted)  # a stepper is asked for a part of its rows' logits only then
        logit_rows = tuple(r for r, w in enumerate(wanted) if w) if some else None
        return StepPlan(step_no, rows, any(wanted), with_gates, logit_rows)

    def update(self, plan: StepPlan, logits: Tensor | None, now: float, gates: Tensor | None = None) -> Scheduled:
        """After the executor ran ``plan``: record each row's exit from its logits (K, V), those of the plan's
        ``logit_rows`` (None: none evaluated; ``gates`` (R,): the exit-gate lambdas of a plan ``with_gates``), count
        the step, and schedule each request that ran (in admission order) at ``now`` (perf_counter)."""
        work = self._work
        assert len(work) == len(plan.rows), "update takes the plan of the last select"
        counted = _counts_a_step(work, self.n_loops)  # before the exits: its rows' loops as planned
        begin = clock()  # the cost model's, as its curve was measured on
        record_exits(work, logits, self.n_loops, gates, self._wanted)
        st = self.stats
        if logits is not None:
            st.exit_seconds += clock() - begin
            st.exit_rows += sum(self._wanted)
        st.steps += counted
        st.group_passes += 1
        st.rows += len(work)
        for seq, _ in work:
            seq.rows += 1
        out = Scheduled()
        for seq in {seq.id: seq for seq, _ in work}.values():  # each request that ran, in admission order
            seq.steps += 1
            self._settle(seq, now, out)
        return out

    def admitted(
        self, seqs: list[RequestState], exits: list[Tensor], now: float, gates: list[Tensor | None] | None = None
    ) -> Scheduled:
        """After admission ran each request's first row through every loop (its logits (M, V) in ``exits``, its
        exit-gate lambdas (M,) in ``gates`` where given): record them, and schedule the requests at ``now`` (commit
        output position 0, launch its successor)."""
        gates = [None] * len(seqs) if gates is None else gates
        for seq, logits, lam in zip(seqs, exits, gates):
            for loop in range(self.n_loops):
                at = slice(loop, loop + 1)
                record_exits([(seq, seq.chain[0])], logits[at], self.n_loops, None if lam is None else lam[at])
        out = Scheduled()
        for seq in seqs:
            self._settle(seq, now, out)
        return out

    def _settle(self, seq: RequestState, now: float, out: Scheduled) -> None:
        """Schedule ``seq`` after its rows ran; record what it committed, and note it if it is done."""
        t = self.schedule(seq)
        if t is not None:
            record_commit(seq, t, now)
            logprob = seq.logprobs[-1] if seq.logprobs is not None else None
            out.committed.append(Commit(seq.id, seq.out[-1], logprob))
        if seq.done:
            out.done.append(seq)

    def _wants_exit(self, seq: RequestState, t: InFlight) -> bool:
        """Whether the row of ``t`` needs its exit: its last loop always; any loop of a request that evaluates every
        exit, but for a SPEED request's early loops in a step the cost model closed (no trace, no gate to feed)."""
        if t.loops_done == self.n_loops - 1:
            return True
        if (self._closed or seq.id in self._closed_ids) and seq.trace is None and seq.request.exit_rule is None:
            return False
        return seq.all_exits

    def _choose(self, seqs: list[RequestState], step_no: int) -> list[tuple[RequestState, InFlight]]:
        """Step ``step_no``'s rows, in the order of ``seqs``: all in-flight rows, or the row budget's choice, or the
        cost model's (``CostPolicy.choose``, applied by ``_apply``; capped by a row budget when both are set).

        The budget serves each request's committed path, then chain speculation, then branches; a branch
        runs only in a step that runs its parent, so it never catches up with the keys it reads.
        """
        budget = self.row_budget
        flying = {s.id: s.in_flight() for s in seqs}
        total = sum(map(len, flying.values()))
        self._closed, self._closed_ids = False, set()
        if self._policy is None and (budget is None or total <= budget):
            if budget is not None:
                for s in seqs:
                    s.last_served = step_no
            return [(s, t) for s in seqs for t in flying[s.id]]
        order = sorted(seqs, key=lambda s: s.last_served)  # stable: admission order among equals
        chain_budget, branch_budget = (total, total) if budget is None else (budget, budget)
        if self._policy is not None:
            st = self.stats
            choice = self._policy.choose(order, st.exit_seconds / st.exit_rows if st.exit_rows else 0.0)
            self._apply(choice, order)
            chain_budget, branch_budget = min(chain_budget, choice.chain), min(branch_budget, choice.branch)
        take = budget_rows([len(s.chain) for s in order], chain_budget)
        branches = [[t for c in s.chain[:n] for t in c.lane] for s, n in zip(order, take)]  # a lane's own order
        branch_take = budget_rows([len(b) for b in branches], min(branch_budget, (budget or total) - sum(take)))
        chosen = {s.id: [*s.chain[:n], *b[:m]] for s, n, b, m in zip(order, take, branches, branch_take)}
        work = []
        for s in seqs:
            if chosen[s.id]:
                s.last_served = step_no
                work.extend((s, t) for t in chosen[s.id])
        self.stats.held_rows += total - len(work)
        return work

    def _apply(self, choice: CostChoice, order: list[RequestState]) -> None:
        """Apply the cost model's ``choice`` for the step over ``order``: its closed flags (for ``_wants_exit``),
        ``DecodeStats.closed_steps``, and ``idle`` of each request that runs closed (all of them in a closed step)."""
        self._closed, self._closed_ids = choice.closed, set(choice.closed_ids)
        self.stats.closed_steps += choice.closed
        for s in order:
            if choice.closed or s.id in choice.closed_ids:
                s.idle += 1

    def schedule(self, seq: RequestState) -> InFlight | None:
        """After a step: commit the oldest token if it finished its last loop (returned; it ends ``seq`` at EOS or
        its last position), then walk the chain oldest first, deciding each token's successor.

        Loops done fall strictly along the chain (a token launches after its predecessor's first loop and runs only
        in steps that run it), so only the oldest can be finished, and the walk stops at the first token with no
        loop done (launched in this step, or left out by the row budget): it has no successor yet.
        """
        ahead, committed = seq.chain, None
        if ahead and ahead[0].loops_done == self.n_loops:
            committed, ahead = ahead[0], self._commit(seq, ahead[0], ahead[1:])
        chain: list[InFlight] = []  # the walked tokens, oldest first
        while ahead and ahead[0].loops_done:
            t, ahead = ahead[0], ahead[1:]
            chain.append(t)
            ahead = self._advance(seq, t, ahead, chain)
        seq.chain = chain + ahead
        return committed

    def cancel(self, seq: RequestState) -> None:
        """Drop every in-flight token of a request that leaves before its end (their rows are wasted)."""
        self._waste(seq, sum(t.loops_done for t in seq.in_flight()))
        seq.chain = []

    def _commit(self, seq: RequestState, t: InFlight, ahead: list[InFlight]) -> list[InFlight]:
        """Commit ``t``'s last-loop prediction; return its successors ``ahead`` as the prediction leaves them
        (kept, a promoted lane, or one relaunched on the committed path), or none when ``seq`` is done."""
        token = t.exits[-1].pred
        seq.out.append(token)
        self.stats.tokens += 1
        if t.gate is not None:
            self.stats.gated_tokens += 1
            self.stats.exit_loops += t.gate.exit_loop + 1
        if token in seq.launch.stop_ids or len(seq.out) >= seq.request.max_new_tokens:
            t.lane = self._drop(seq, t.lane)
            self._flush(seq, ahead, mispredicted=False)
            seq.done = True
            return []
        ahead = self._follow(seq, t, ahead, token)
        t.lane = self._drop(seq, t.lane)  # not taken over: the chain was right
        return ahead or [InFlight(t.pos + 1, token)]

    def _advance(self, seq: RequestState, t: InFlight, ahead: list[InFlight], chain: list[InFlight]) -> list[InFlight]:
        """Decide what follows the chain token ``t`` (``ahead``: its successors; ``chain``: the walked tokens, ``t``
        last) from its latest exit: flush or promote on a misprediction, launch a successor, keep its branch."""
        latest = t.exits[-1]
        if latest.pred == NO_EXIT:  # not evaluated (a step the cost model closed): nothing to decide from
            return ahead
        guess = seq.guess(t)
        if should_flush(seq.request.speculation.invalidation, t.loops_done, self.n_loops):
            ahead = self._follow(seq, t, ahead, guess)
        if not ahead and may_launch(seq.launch, t.loops_done, latest.p_top, guess, t.pos + 1):
            ahead = [self._draft(seq, t.pos + 1, guess)]
        self._keep_branch(seq, t, ahead[0] if ahead else None, guess, chain, ahead)
        t.lane = self._grow_lane(seq, t.lane)
        return ahead

    def _follow(self, seq: RequestState, parent: InFlight, ahead: list[InFlight], token: int) -> list[InFlight]:
        """``parent``'s successors once ``token`` is the next one's input: ``ahead`` if it starts with it, else the
        parent's lane if its branch does (promoted), else none (``ahead`` flushed; the caller relaunches)."""
        choice = choose_successor(
            ahead[0].token if ahead else None, parent.lane[0].token if parent.lane else None, token
        )
        if choice is Successor.KEEP:
            return ahead
        self._flush(seq, ahead, mispredicted=choice is Successor.FLUSH and bool(ahead))
        if choice is Successor.FLUSH:
            return []
        lane, parent.lane = parent.lane, []
        for t in lane:  # in position order: each lands at the end of the prefix its predecessor just extended
            self.cache.promote(seq.slot, t.side, t.pos, t.loops_done)
            heapq.heappush(seq.side_free, t.side)
            t.side, t.up = -1, ()
        seq.promotions += 1
        self.stats.promotions += 1
        return lane

    def _keep_branch(
        self,
        seq: RequestState,
        parent: InFlight,
        succ: InFlight | None,
        guess: int,
        chain: list[InFlight],
        ahead: list[InFlight],
    ) -> None:
        """Keep ``parent``'s branch on its runner-up beside its successor ``succ``: drop it when it no longer is
        one, launch one when allowed (``chain``, ``ahead``: the request's chain tokens, to count its branches)."""
        request, latest = seq.request, parent.exits[-1]
        if parent.lane and not keeps_branch(
            parent.lane[0].token, latest.runner_up, guess, succ.token if succ is not None else None
        ):
            parent.lane = self._drop(seq, parent.lane)
        spec = request.speculation
        if parent.lane or succ is None or request.oracle is not None or not spec.branches:
            return  # (branches are counted only where one may launch)
        branches = sum(bool(c.lane) for c in chain) + sum(bool(c.lane) for c in ahead)
        if may_branch(spec, latest.p_top, latest.runner_up, succ.token, seq.launch.stop_ids, branches):
            side = heapq.heappop(seq.side_free)
            parent.lane = [self._draft(seq, parent.pos + 1, latest.runner_up, side=side)]

    def _grow_lane(self, seq: RequestState, lane: list[InFlight]) -> list[InFlight]:
        """``lane`` after its tokens' latest exits: walked oldest first, each token's successor dropped when its
        prediction flushes it, one launched when the lane has room and the launch rule allows."""
        spec = seq.request.speculation
        grown: list[InFlight] = []  # the walked tokens, oldest first
        while lane and lane[0].loops_done:
            t, lane = lane[0], lane[1:]
            grown.append(t)
            pred = t.exits[-1].pred
            if lane and lane[0].token != pred and should_flush(spec.invalidation, t.loops_done, self.n_loops):
                lane = self._drop(seq, lane)
            if (
                not lane
                and len(grown) < spec.branch_depth
                and may_launch(seq.launch, t.loops_done, t.exits[-1].p_top, pred, t.pos + 1)
            ):
                side, up = heapq.heappop(seq.side_free), (*t.up, (t.pos, t.side))
                lane = [self._draft(seq, t.pos + 1, pred, side=side, up=up)]
        return grown + lane

    def _draft(
        self, seq: RequestState, pos: int, token: int, side: int = -1, up: tuple[tuple[int, int], ...] = ()
    ) -> InFlight:
        """A token launched at ``pos`` from an early exit (on the chain, or in a lane: ``side``, ``up``), counted
        as a draft token at its draft position: the uncommitted tokens ahead of it, chain and lane alike (a lane
        token that is promoted and committed is then an accepted one, as a chain token is)."""
        ahead = pos - len(seq.out)  # the committed path is at len(seq.out); every position up to pos is in flight
        seq.draft_tokens[ahead - 1] += 1
        seq.drafts += ahead == 1
        seq.idle = 0  # its acceptance is evidence at full weight again
        return InFlight(pos, token, ahead=ahead, side=side, up=up)

    def _drop(self, seq: RequestState, lane: list[InFlight]) -> list[InFlight]:
        """Drop lane tokens (their rows are wasted), freeing their side entries; return the empty lane."""
        for t in lane:
            heapq.heappush(seq.side_free, t.side)
            self._waste(seq, t.loops_done)
        return []

    def _flush(self, seq: RequestState, dropped: list[InFlight], mispredicted: bool) -> None:
        """Drop chain tokens (their lanes too) and invalidate their cache entries."""
        if not dropped:
            return
        self.cache.invalidate(seq.slot, dropped[0].pos)
        for t in dropped:
            t.lane = self._drop(seq, t.lane)
        self._waste(seq, sum(t.loops_done for t in dropped))
        seq.flushes += mispredicted
        self.stats.flushes += mispredicted

    def _waste(self, seq: RequestState, rows: int) -> None:
        seq.wasted_rows += rows
        self.stats.wasted_rows += rows


def _counts_a_step(work: list[tuple[RequestState, InFlight]], n_loops: int) -> bool:
    """Whether a step over ``work`` (its rows before the pass) counts in ``DecodeStats.steps``: a step of SPEED's
    (or exit_gate's) pipeline always; one running only sequential requests' rows when it ends a token (a row at its
    last loop), so sequential decoding counts token positions, M passes each."""
    return any(s.request.method != "sequential" or t.loops_done == n_loops - 1 for s, t in work)
