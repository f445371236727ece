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
from speed.engine.outputs import record_commit, record_exits
from speed.engine.policies import (
    Successor,
    budget_rows,
    choose_successor,
    in_budget_order,
    keeps_branch,
    may_branch,
    may_launch,
    should_flush,
    survival_rate,
    worth_rows,
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
        self._curve: list[float] = []  # row_cost(n) with exit logits, by n, as far as a step has needed

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
        cost model's (``_cost_budgets``; capped by a row budget when both are set).

        The budget serves each request's committed path, then chain speculation, then branches; a branch
        runs only in a step that runs its parent, so it never catches up with the keys it reads.
        """
        budget = self.row_budget
        flying = {s.id: s.in_flight() for s in seqs}
        total = sum(map(len, flying.values()))
        self._closed, self._closed_ids = False, set()
        if self.row_cost is None and (budget is None or total <= budget):
            if budget is not None:
                for s in seqs:
                    s.last_served = step_no
            return [(s, t) for s in seqs for t in flying[s.id]]
        order = sorted(seqs, key=lambda s: s.last_served)  # stable: admission order among equals
        chain_budget, branch_budget = (total, total) if budget is None else (budget, budget)
        if self.row_cost is not None:
            chain_cost, branch_cost = self._cost_budgets(order)
            chain_budget, branch_budget = min(chain_budget, chain_cost), min(branch_budget, branch_cost)
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

    def _cost_budgets(self, order: list[RequestState]) -> tuple[int, int]:
        """The cost model's chain and branch budgets for a step over ``order`` (the budget's order of requests).

        Every request's oldest token runs. Speculation is closed (no speculative row, no early exits of SPEED
        requests without a trace: the step scores its last-loop rows only) unless some speculative rows, one per
        chain position each request could fill with its measured acceptance there (the likeliest first,
        ``survival_rate``, decayed toward its prior while the request stays closed), would save more than they and
        the step's exits cost, a surviving row saving what a row of the committed path's pass costs without exits
        (sequential decoding's). Open, the chain's and then the branches' candidate rows run as many as
        ``worth_rows`` finds worth it. A row's exit costs its share of the pass's logits (``RowCost.exits``) and
        what turning them into an exit (its draw, its runner-up) has cost per row in this engine's steps so far
        (``DecodeStats.exit_seconds``).
        """
        cost, M, st, curve = self.row_cost, self.n_loops, self.stats, self._curve
        assert cost is not None
        required = sum(1 for s in order if s.chain)
        last = sum(1 for s in order if s.chain and s.chain[0].loops_done == M - 1)  # scored even when closed
        plain = cost(required, with_logits=False)
        value = plain / max(required, 1)  # seconds a surviving row saves: a committed-path row's share
        per_exit = st.exit_seconds / st.exit_rows if st.exit_rows else 0.0
        closed = plain + cost.exits(last) + per_exit * last  # what the step costs closed

        def worth(base_rows: int, base: float, survival: list[float]) -> int:
            while len(curve) <= base_rows + len(survival):
                curve.append(cost(len(curve)))
            top = base_rows + len(survival) + 1
            seconds = [c + per_exit * n for n, c in zip(range(base_rows, top), curve[base_rows:top])]
            return worth_rows(seconds, base, survival, value)

        sure = [1.0] * (M - 1)  # an oracle's tokens
        rates = {  # each request's chance of a token surviving at draft position 1..M-1
            s.id: sure
            if s.request.oracle is not None
            else [survival_rate(a, d, s.idle) for a, d in zip(s.accepted, s.draft_tokens)]
            for s in order
        }
        # a request whose own rows would not pay is closed alone: no early exits, no speculative rows (its rates
        # 0), and its evidence decays, while others speculate
        shut = [s for s in order if s.launch.launch_loop >= M or not worth(required, closed, sorted(rates[s.id])[::-1])]
        self._closed_ids = {s.id for s in shut}
        for s in shut:
            rates[s.id] = [0.0] * (M - 1)
        potential = sorted((p for s in order if s.id not in self._closed_ids for p in rates[s.id]), reverse=True)
        if not worth(required, closed, potential):
            self._closed = True
            st.closed_steps += 1
            for s in order:
                s.idle += 1
            return required, 0
        for s in shut:
            s.idle += 1
        chains = [[1.0, *rates[s.id][: len(s.chain) - 1]] if s.chain else [] for s in order]
        chain_rows = required + worth(
            required, curve[required] + per_exit * required, in_budget_order(chains)[required:]
        )
        take = budget_rows([len(s.chain) for s in order], chain_rows)
        # a lane token survives only if its branch's runner-up becomes the prediction: at most 1 - p_top
        lanes = [[1.0 - _p(c) for c in s.chain[:n] for _ in c.lane] for s, n in zip(order, take)]
        branch_survival = in_budget_order(lanes)
        return chain_rows, worth(chain_rows, curve[chain_rows] + per_exit * chain_rows, branch_survival)

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


def _p(t: InFlight) -> float:
    """The top-1 probability of ``t``'s latest exit (0 when it was not evaluated)."""
    p = t.exits[-1].p_top if t.exits else float("nan")
    return 0.0 if p != p else p
