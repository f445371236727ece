"""How exit logits become decisions: top-1, runner-up, confidence."""

import pytest
import torch

from speed.sampling import Draw, Sampling, choice_seed, exit_choices, exit_scores, gumbel, process, uniforms


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


# ----- the Sampling settings and the noise ------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs, name",
    [
        ({"temperature": -0.1}, "temperature"),
        ({"temperature": float("nan")}, "temperature"),
        ({"top_k": -1}, "top_k"),
        ({"top_k": 2.5}, "top_k"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"seed": 1.0}, "seed"),
        ({"presence_penalty": 3.0}, "presence_penalty"),
        ({"frequency_penalty": -2.5}, "frequency_penalty"),
        ({"coupled": 1}, "coupled"),
    ],
)
def test_sampling_validates(kwargs, name):
    with pytest.raises(ValueError, match=name):
        Sampling(**kwargs)


def test_default_sampling_is_plain_greedy():
    assert Sampling().plain and Sampling(presence_penalty=0.5).greedy and not Sampling(presence_penalty=0.5).plain
    assert not Sampling(temperature=0.7).greedy


def test_choice_seed_keeps_choice_zero_and_separates_the_others():
    assert choice_seed(42, 0) == 42
    seeds = {choice_seed(42, i) for i in range(1, 50)} | {choice_seed(43, i) for i in range(1, 50)}
    assert len(seeds) == 98 and all(0 <= s < 2**63 for s in seeds)
    assert choice_seed(42, 3) == choice_seed(42, 3)


def test_noise_is_a_pure_function_of_seed_and_position():
    u = uniforms(7, 3, 5000)
    assert torch.equal(u, uniforms(7, 3, 5000))  # recomputed, not drawn from a stream
    assert torch.equal(u[:100], uniforms(7, 3, 100))  # a prefix does not depend on the vocabulary size
    assert u.unique().numel() == 5000 and 0 < u.min() and u.max() < 1
    assert not torch.equal(u, uniforms(7, 4, 5000)) and not torch.equal(u, uniforms(8, 3, 5000))
    assert abs(u.mean().item() - 0.5) < 0.02  # 5000 uniforms: sd of the mean ~0.004
    g = gumbel(7, 3, 5000)
    assert g.dtype == torch.float32 and abs(g.mean().item() - 0.5772) < 0.06  # Gumbel's mean: Euler's gamma


def test_plain_greedy_rows_keep_their_raw_logits_bit_for_bit():
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(1))
    scores, noise = exit_scores(logits, [None, Draw(Sampling(), 0, None), None])
    assert scores is logits and noise is None
    hot = Draw(Sampling(temperature=0.5, seed=1), 4, None)
    scores, noise = exit_scores(logits, [None, hot, Draw(Sampling(), 2, None)])
    assert torch.equal(scores[0], logits[0]) and torch.equal(scores[2], logits[2])
    assert torch.equal(noise[0], torch.zeros(50)) and torch.equal(scores[1], logits[1] / 0.5)
    assert torch.equal(noise[1], gumbel(1, 4, 50))


def test_penalties_count_the_history():
    logits = torch.zeros(6)
    s = Sampling(presence_penalty=0.5, frequency_penalty=0.25)
    assert process(logits, s, [2, 2, 4]).tolist() == [0, 0, -1.0, 0, -0.75, 0]
    assert torch.equal(process(logits, s, []), logits)
