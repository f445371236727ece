"""The engine's policies: where to launch a speculative token, when to flush, what follows a token, when a token
carries a branch, which rows a step computes.

Small pure functions of plain values, so each is tested on its own; the scheduler (``speed.engine.scheduler``)
only applies them.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from speed.engine.types import NO_EXIT, Invalidation, Speculation


def should_launch(loops_done: int, launch_loop: int, p_top: float = 1.0, min_confidence: float = 0.0) -> bool:
    """A token with ``loops_done`` finished loops, whose latest exit has top-1 probability ``p_top``, may launch its
    successor from that exit's prediction."""
    return loops_done >= launch_loop and p_top >= min_confidence


@dataclass(frozen=True)
class LaunchRule:
    """One request's bounds on launching: what ``may_launch`` reads besides the token's own state."""

    launch_loop: int  # loops a token runs before it may launch (M for sequential decoding: never early)
    min_confidence: float  # the least top-1 probability of the exit it launches from
    stop_ids: frozenset[int]  # nothing follows a stop token (the request's, else the model's EOS)
    max_new_tokens: int  # nor the request's last position


def may_launch(rule: LaunchRule, loops_done: int, p_top: float, token: int, pos: int) -> bool:
    """A token with ``loops_done`` finished loops, whose latest exit has top-1 probability ``p_top``, may launch a
    successor with input ``token`` at position ``pos``: the one launch rule of chains and lanes alike."""
    return (
        should_launch(loops_done, rule.launch_loop, p_top, rule.min_confidence)
        and token not in rule.stop_ids
        and pos < rule.max_new_tokens
    )


class Successor(enum.Enum):
    """What follows a token once its successor's input is decided (``choose_successor``)."""

    KEEP = "keep"  # the successor in flight has that input: it stays
    PROMOTE = "promote"  # its branch has it: the branch's lane replaces the successors
    FLUSH = "flush"  # neither: the successors are dropped (and relaunched when allowed)


def choose_successor(succ: int | None, branch: int | None, token: int) -> Successor:
    """What follows a token whose successor's input is now ``token``, its successor in flight having input
    ``succ`` and its branch ``branch`` (None: none in flight)."""
    if succ is not None and succ == token:
        return Successor.KEEP
    if branch is not None and branch == token:
        return Successor.PROMOTE
    return Successor.FLUSH


def keeps_branch(branch: int, runner_up: int, guess: int, succ: int | None) -> bool:
    """Whether a token's branch with input ``branch`` stays: it is still the latest exit's runner-up or its
    guess (about to be promoted), and differs from the successor in flight (input ``succ``; None: none, so
    nothing for the branch to stand beside)."""
    return succ is not None and branch in (runner_up, guess) and branch != succ


def may_branch(
    spec: Speculation, p_top: float, runner_up: int, succ: int, stop_ids: frozenset[int], branches: int
) -> bool:
    """Whether a token whose successor has input ``succ`` may launch a branch from its latest exit's runner-up
    ``runner_up`` (top-1 probability ``p_top``; a stop token launches none), ``branches`` of its request's branches
    being in flight."""
    return (
        runner_up not in (succ, NO_EXIT)
        and runner_up not in stop_ids
        and branches < spec.branches
        and should_branch(p_top, spec.branch_below)
    )


def should_branch(p_top: float, branch_below: float) -> bool:
    """A token whose latest exit has top-1 probability ``p_top`` may carry a branch from its runner-up."""
    return p_top < branch_below


def should_flush(invalidation: Invalidation, loops_done: int, n_loops: int) -> bool:
    """Whether a prediction after ``loops_done`` loops that disagrees with the launched successor flushes it."""
    return invalidation == "eager" or loops_done == n_loops


def budget_order(in_flight: list[int]) -> list[int]:
    """The order a row budget serves rows in: each entry the request index of the next row, one per request (its
    committed path) first, then speculative rows one level deeper at a time across requests.

    ``in_flight[i]`` is request i's in-flight token count; a request's rows come in its chain's order, so a
    speculative token never runs while its predecessor waits.
    """
    return [i for level in range(max(in_flight, default=0)) for i, n in enumerate(in_flight) if n > level]


def budget_rows(in_flight: list[int], budget: int) -> list[int]:
    """Rows each request may compute this step: the first ``budget`` rows of ``budget_order``, as a prefix length
    per request."""
    take = [0] * len(in_flight)
    for i in budget_order(in_flight)[:budget]:
        take[i] += 1
    return take


def in_budget_order(values: list[list[float]]) -> list[float]:
    """Per-request values of their rows (``values[i][j]``: request i's row j, in its own order) in the order a
    row budget serves the rows (``budget_order``)."""
    seen = [0] * len(values)
    out = []
    for i in budget_order([len(v) for v in values]):
        out.append(values[i][seen[i]])
        seen[i] += 1
    return out


def worth_rows(seconds: list[float], base: float, survival: list[float], row_value: float) -> int:
    """How many of the speculative rows a step may add pay for themselves: the ``k`` (0..len(survival)) with the
    largest expected saving ``row_value * sum(survival[:k]) - (seconds[k] - base)``, the fewest on a tie, none
    unless it saves more than nothing.

    ``seconds[k]``: a group pass with the step's required rows and the first ``k`` candidates (``RowCost``
    from the required row count on); ``base``: the pass the step runs anyway; ``survival[i]``: candidate i's chance
    of being committed unchanged, in the order a budget serves them; ``row_value``: the seconds a surviving row
    saves (a row of the committed path's pass: ``seconds of the required rows / their count``).
    """
    best, best_k, gain = 0.0, 0, 0.0
    for k, p in enumerate(survival, start=1):
        gain += row_value * p
        net = gain - (seconds[k] - base)
        if net > best:
            best, best_k = net, k
    return best_k


IDLE_HALF_LIFE = 16  # closed steps that halve the weight of a request's acceptance evidence (``survival_rate``)


def survival_rate(accepted: int, drafted: int, idle: int = 0, half_life: float = IDLE_HALF_LIFE) -> float:
    """A draft position's chance that a token launched there is committed: its accepted share so far, with one
    accepted and one flushed token as the prior (0.5 before any draft).

    ``idle``: the steps its request has run closed since it last drafted (a closed step launches nothing, so
    learns nothing). The evidence weighs ``0.5 ** (idle / half_life)``, so a request that the cost model closed
    drifts back toward the prior and reopens to draft again: once in about ``half_life`` steps or more (the lower
    its acceptance, the longer), a probe whose outcome is evidence at full weight again.
    """
    w = 0.5 ** (idle / half_life)
    return (accepted * w + 1) / (drafted * w + 2)
