"""The engine's policies: where to launch a speculative token, when to flush, which rows a step computes.

Small pure functions of plain values, so each is tested on its own.
"""

from __future__ import annotations

from speed.engine.types import Invalidation


def should_launch(loops_done: int, launch_loop: int, p_top: float = 1.0, min_confidence: float = 0.0) -> bool:
    """A token with ``loops_done`` finished loops, whose latest exit has top-1 probability ``p_top``, may launch its
    successor from that exit's prediction."""
    return loops_done >= launch_loop and p_top >= min_confidence


def should_branch(p_top: float, branch_below: float) -> bool:
    """A token whose latest exit has top-1 probability ``p_top`` may carry a branch from its runner-up."""
    return p_top < branch_below


def should_flush(invalidation: Invalidation, loops_done: int, n_loops: int) -> bool:
    """Whether a prediction after ``loops_done`` loops that disagrees with the launched successor flushes it."""
    return invalidation == "eager" or loops_done == n_loops


def budget_rows(in_flight: list[int], budget: int) -> list[int]:
    """Rows each request may compute this step: one per request in order (its committed path) while
    the budget lasts, then speculative rows, one level deeper at a time across requests.

    ``in_flight[i]`` is request i's in-flight token count; the result is a prefix length per
    request, so a speculative token never runs while its predecessor waits.
    """
    take = [0] * len(in_flight)
    left = budget
    for level in range(max(in_flight, default=0)):
        for i, n in enumerate(in_flight):
            if left == 0:
                return take
            if n > level and take[i] == level:
                take[i] += 1
                left -= 1
    return take
