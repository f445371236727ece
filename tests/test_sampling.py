"""How exit logits become decisions: top-1, runner-up, confidence."""

import torch

from speed.sampling import exit_choices


def test_exit_choices_top_runner_up_and_confidence():
    scores = torch.tensor([[0.0, 3.0, 1.0, 2.0], [5.0, 5.0, -1.0, 0.0]])
    exits = exit_choices(scores)
    assert exits.token == [1, 0]  # the first maximum on a tie, as argmax
    assert exits.runner_up == [3, 1]
    assert torch.allclose(torch.tensor(exits.p_top), torch.softmax(scores, -1).max(-1).values)


def test_exit_choices_agree_with_argmax_on_random_rows():
    g = torch.Generator().manual_seed(0)
    scores = torch.randn(16, 300, generator=g)
    exits = exit_choices(scores)
    assert exits.token == scores.argmax(-1).tolist()
    assert exits.runner_up == scores.topk(2, -1).indices[:, 1].tolist()
