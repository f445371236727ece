"""How a loop's exit logits become a decision: the exit's token, its runner-up and its confidence.

Every early exit and the last loop go through ``exit_choices``, so SPEED's
speculation and its committed tokens are decided by one function of a row's
scores alone (never of the other rows of the step), and the engine's policies
(launching, branching, gating) read the same three numbers per row.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass(frozen=True)
class ExitChoices:
    """Per row of one step: what its exit decided."""

    token: list[int]  # argmax of the row's scores: the exit's prediction
    runner_up: list[int]  # the second-best token of the same scores
    p_top: list[float]  # probability of ``token`` under softmax(scores): the exit's confidence


def exit_choices(scores: Tensor) -> ExitChoices:
    """The top-1 token, the runner-up and the top-1 probability of each row of ``scores`` (R, V)."""
    top = scores.argmax(-1)  # (R,) first maximum, as greedy decoding always took it
    rest = scores.scatter(-1, top[:, None], float("-inf"))  # (R, V) the top-1 masked out
    runner_up = rest.argmax(-1)  # (R,)
    p_top = (scores.gather(-1, top[:, None])[:, 0] - torch.logsumexp(scores.float(), -1)).exp()  # (R,)
    return ExitChoices(top.tolist(), runner_up.tolist(), p_top.tolist())
