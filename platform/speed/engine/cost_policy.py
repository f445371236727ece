"""The cost model's choice for one step (``CostPolicy``): which speculative rows pay, as a plain ``CostChoice``.

A query, as ``speed.engine.policies``' rules are: it reads the requests' decoding state and the device's pass cost
(``speed.engine.cost.RowCost``) and changes neither; the scheduler applies what it returns (the budgets, the
closed step or requests, their ``idle`` counts, ``DecodeStats.closed_steps``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from speed.engine.cost import RowCost
from speed.engine.policies import budget_rows, in_budget_order, survival_rate, worth_rows
from speed.engine.state import InFlight, RequestState


@dataclass(frozen=True)
class CostChoice:
    """What the cost model chose for a step: its chain and branch row budgets, and what it closed."""

    chain: int  # rows of the requests' chains the step may run (their committed paths' included)
    branch: int  # rows of runner-up lanes
    closed: bool  # the whole step closed: no speculative row, no early exits of SPEED requests without a trace
    closed_ids: frozenset[int]  # requests closed alone: their own speculation was not worth its rows and exits


class CostPolicy:
    """The cost model of one engine: ``choose`` over its device's pass cost ``cost`` for a model of ``n_loops``
    loops (M). It keeps the pass's cost by row count as far as a step has needed it (a cache of ``cost``, which
    never changes a choice)."""

    def __init__(self, cost: RowCost, n_loops: int) -> None:
        self.cost = cost
        self.n_loops = n_loops
        self._curve: list[float] = []  # cost(n) with exit logits, by n

    def choose(self, order: Sequence[RequestState], per_exit: float) -> CostChoice:
        """The budgets and closed set of a step over ``order`` (the budget's order of requests), an exit costing
        ``per_exit`` seconds a row to turn into draws and runner-ups besides its logits (``DecodeStats.exit_seconds``
        per ``exit_rows`` so far).

        Every request's oldest token runs. Speculation is closed (no speculative row, no early exits of SPEED
        requests without a trace: the step scores its last-loop rows only) unless some speculative rows, one per
        chain position each request could fill with its measured acceptance there (the likeliest first,
        ``survival_rate``, decayed toward its prior while the request stays closed: its ``idle``), would save more
        than they and the step's exits cost, a surviving row saving what a row of the committed path's pass costs
        without exits (sequential decoding's). A request whose own rows would not pay is closed alone (no early
        exits, no speculative rows) while others speculate. Open, the chain's and then the branches' candidate rows
        run as many as ``worth_rows`` finds worth it. A row's exit costs its share of the pass's logits
        (``RowCost.exits``) and ``per_exit``.
        """
        cost, M = self.cost, self.n_loops
        required = sum(1 for s in order if s.chain)
        last = sum(1 for s in order if s.chain and s.chain[0].loops_done == M - 1)  # scored even when closed
        plain = cost(required, with_logits=False)
        value = plain / max(required, 1)  # seconds a surviving row saves: a committed-path row's share
        closed = plain + cost.exits(last) + per_exit * last  # what the step costs closed
        sure = [1.0] * (M - 1)  # an oracle's tokens
        rates = {  # each request's chance of a token surviving at draft position 1..M-1
            s.id: sure
            if s.request.oracle is not None
            else [survival_rate(a, d, s.idle) for a, d in zip(s.accepted, s.draft_tokens)]
            for s in order
        }
        shut = frozenset(  # requests whose own rows would not pay (the likeliest first), or that never speculate
            s.id
            for s in order
            if s.launch.launch_loop >= M
            or not self._worth(required, closed, sorted(rates[s.id])[::-1], value, per_exit)
        )
        for i in shut:
            rates[i] = [0.0] * (M - 1)
        potential = sorted((p for s in order if s.id not in shut for p in rates[s.id]), reverse=True)
        if not self._worth(required, closed, potential, value, per_exit):
            return CostChoice(required, 0, True, shut)
        chains = [[1.0, *rates[s.id][: len(s.chain) - 1]] if s.chain else [] for s in order]
        base = self._pass(required) + per_exit * required
        chain_rows = required + self._worth(required, base, in_budget_order(chains)[required:], value, per_exit)
        take = budget_rows([len(s.chain) for s in order], chain_rows)
        # a lane token survives only if its branch's runner-up becomes the prediction: at most 1 - p_top
        lanes = [[1.0 - _p(c) for c in s.chain[:n] for _ in c.lane] for s, n in zip(order, take)]
        base = self._pass(chain_rows) + per_exit * chain_rows
        branch_rows = self._worth(chain_rows, base, in_budget_order(lanes), value, per_exit)
        return CostChoice(chain_rows, branch_rows, False, shut)

    def _pass(self, n: int) -> float:
        """A pass of ``n`` rows with exit logits."""
        while len(self._curve) <= n:
            self._curve.append(self.cost(len(self._curve)))
        return self._curve[n]

    def _worth(self, base_rows: int, base: float, survival: list[float], value: float, per_exit: float) -> int:
        """How many of the rows with chances ``survival`` (in the order they would run) pay, over a step of
        ``base_rows`` rows costing ``base`` (``worth_rows``, each row's exit priced ``per_exit`` on top)."""
        top = base_rows + len(survival) + 1
        self._pass(top - 1)
        seconds = [c + per_exit * n for n, c in zip(range(base_rows, top), self._curve[base_rows:top])]
        return worth_rows(seconds, base, survival, value)


def _p(t: InFlight) -> float:
    """The top-1 probability of ``t``'s latest exit (0 when it was not evaluated)."""
    p = t.exits[-1].p_top if t.exits else float("nan")
    return 0.0 if p != p else p
