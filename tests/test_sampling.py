"""How exit logits become decisions: greedy or seeded sampling, its noise, its distribution, coupled speculation."""

import pytest
import torch
from test_decoding_schedule import StubModel, target

from speed.config import preset
from speed.decode.exactness import LogitRecorder
from speed.decode.generate import DecodeOptions, generate
from speed.engine import Engine, EngineConfig, Request
from speed.engine.sampling import Draw, Sampling, choice_seed, exit_choices, exit_scores, gumbel, process, uniforms
from speed.models.t5 import SpeedT5


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
    # pinned: a seeded n-choice request answers alike in every process and release (the seeds are in its rows)
    assert [choice_seed(42, i) for i in (1, 2, 3)] == [103931619923104512, 5058443865750890719, 4592043442613748474]


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


# ----- the distribution and the support, through the engine ------------------------------------------


def first_tokens(model, ids: list[int], settings: list[Sampling]) -> list[int]:
    """The first token the engine commits for ``ids`` under each of ``settings`` (one request each)."""
    engine = Engine(model, EngineConfig(max_active=256, max_source_len=len(ids), max_target_len=1, trace=False))
    rid = {engine.add(Request(ids, 1, method="sequential", sampling=s)): i for i, s in enumerate(settings)}
    out = [-1] * len(settings)
    while engine.has_work:
        for c in engine.step().committed:
            out[rid[c.id]] = c.token
    return out


def last_loop_logits(model, ids: list[int]) -> torch.Tensor:
    """The last loop's raw logits (V,) of the first output position."""
    rec = LogitRecorder(model)
    generate(rec, torch.tensor([ids]), options=DecodeOptions(method="sequential", max_new_tokens=1))
    return rec.logits[(0, model.n_loops - 1, 0)]


@pytest.fixture(scope="module")
def peaked_model():
    torch.manual_seed(0)
    model = SpeedT5(preset("tiny", pattern="2x2")).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(2.0)  # far from uniform: a few likely tokens, a long tail of rare ones
    return model


class FixedLogitsStub(StubModel):
    """Every row's exit logits are ``logits`` (V,): a model's distribution without its encoder's cost per request."""

    def __init__(self, n_loops, logits):
        super().__init__(n_loops, lambda s, p, lo: 0, vocab=logits.numel())
        self.fixed = logits

    def step(self, memory, cache, rows, hidden, with_logits=True):
        hidden, _ = super().step(memory, cache, rows, hidden, with_logits)
        return hidden, self.fixed.expand(len(rows), -1).clone()


def test_sampled_first_tokens_follow_the_last_loops_softmax(peaked_model):
    """2000 seeds: the frequencies pass a chi-square test against softmax(logits / T) (fixed seeds: no flake),
    with the tiny model itself at T = 1 and with its logits at T = 0.7."""
    ids, n = [5, 9, 17, 33], 2000
    logits = last_loop_logits(peaked_model, ids)
    for temperature, model in ((1.0, peaked_model), (0.7, FixedLogitsStub(2, logits))):
        probs = (logits.double() / temperature).softmax(-1)  # (V,)
        tokens = first_tokens(model, ids, [Sampling(temperature=temperature, seed=s) for s in range(n)])
        counts = torch.bincount(torch.tensor(tokens), minlength=probs.numel()).double()
        expected = probs * n
        big = expected >= 5  # pool the rare tokens into one cell
        observed = torch.cat([counts[big], counts[~big].sum()[None]])
        expected = torch.cat([expected[big], expected[~big].sum()[None]])
        chi2 = ((observed - expected) ** 2 / expected).sum().item()
        df = observed.numel() - 1
        critical = df * (1 - 2 / (9 * df) + 3.09 * (2 / (9 * df)) ** 0.5) ** 3  # Wilson-Hilferty, p = 0.001
        assert df >= 10, "the test needs a spread distribution"
        assert chi2 < critical, (temperature, chi2, critical)
        # and it is a real test: the same draws against the distribution at another temperature fail it
        wrong = (logits.double() / (temperature * 1.5)).softmax(-1) * n
        pooled = torch.cat([wrong[big], wrong[~big].sum()[None]])
        assert ((observed - pooled) ** 2 / pooled).sum().item() > critical


def test_top_k_and_top_p_restrict_the_support(peaked_model):
    ids, n = [5, 9, 17, 33], 1500
    logits = last_loop_logits(peaked_model, ids)
    model = FixedLogitsStub(2, logits)  # the model's distribution, 1500 requests cheaply
    ranked = logits.argsort(descending=True).tolist()
    k_tokens = set(first_tokens(model, ids, [Sampling(temperature=1.5, top_k=4, seed=s) for s in range(n)]))
    assert k_tokens == set(ranked[:4])  # never outside the 4 best, and each of them drawn
    p = 0.6
    probs = logits.softmax(-1)[ranked]  # best first
    nucleus = set(ranked[: int((probs.cumsum(0) < p).sum()) + 1])  # the smallest prefix reaching p
    assert 1 < len(nucleus) < 40
    p_tokens = set(first_tokens(model, ids, [Sampling(temperature=1.0, top_p=p, seed=s) for s in range(n)]))
    assert p_tokens == nucleus
    free = set(first_tokens(model, ids, [Sampling(temperature=1.0, seed=s) for s in range(n)]))
    assert not free <= nucleus  # without top-p the same seeds leave it


def test_temperature_zero_is_greedy(peaked_model):
    ids = [5, 9, 17, 33]
    greedy = int(last_loop_logits(peaked_model, ids).argmax())
    assert (
        first_tokens(peaked_model, ids, [Sampling(temperature=0.0, seed=s, top_k=3) for s in range(5)]) == [greedy] * 5
    )


def test_rows_are_scored_alone():
    """A row's scores and noise inside a batch equal its scores alone, bit for bit (top-p sort included)."""
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(7, 3000, generator=g) * 3
    draws = [
        Draw(Sampling(temperature=0.7, top_p=0.9, seed=r, presence_penalty=0.5), r, [1, 2, 2, r]) if r % 3 else None
        for r in range(7)
    ]
    scores, noise = exit_scores(logits, draws)
    exits = exit_choices(scores, noise)
    for r in range(7):
        s1, n1 = exit_scores(logits[r : r + 1].clone(), draws[r : r + 1])
        assert torch.equal(s1[0], scores[r])
        assert (n1 is None and not noise[r].any()) or torch.equal(n1[0], noise[r])
        one = exit_choices(s1, n1)
        assert (one.token[0], one.runner_up[0]) == (exits.token[r], exits.runner_up[r])


# ----- coupled speculation -------------------------------------------------------------------------------


class EmbedRecordingStub(StubModel):
    """The schedule tests' stub with soft logits (one-hot scaled), recording the tokens it embeds."""

    def __init__(self, n_loops, table, scale):
        super().__init__(n_loops, table)
        self.scale, self.embedded = scale, []

    def embed(self, tokens):
        self.embedded.append(tokens.tolist())
        return super().embed(tokens)

    def step(self, memory, cache, rows, hidden, with_logits=True):
        hidden, logits = super().step(memory, cache, rows, hidden, with_logits)
        return hidden, logits * self.scale


def test_coupled_speculation_launches_from_the_draw_uncoupled_from_the_argmax():
    """Loop 1 predicts 10 at position 0 with a soft one-hot: its draw under the position's noise is usually
    another token. Coupled, the successor launches with that draw; uncoupled, with 10; both commit the same."""
    seed = next(
        s
        for s in range(100)
        if exit_choices(
            *exit_scores(torch.eye(128)[10:11] * 3.0, [Draw(Sampling(temperature=1.0, seed=s), 0, None)])
        ).token[0]
        != 10
    )
    hot = exit_choices(*exit_scores(torch.eye(128)[10:11] * 3.0, [Draw(Sampling(temperature=1.0, seed=seed), 0, None)]))
    committed = {}
    for coupled in (True, False):
        model = EmbedRecordingStub(3, lambda s, p, lo: target(p), 3.0)
        engine = Engine(model, EngineConfig(1, 3, 4))
        engine.add(Request([5], 1 + 1, sampling=Sampling(temperature=1.0, seed=seed, coupled=coupled)))
        tokens = []
        while engine.has_work:
            tokens += [c.token for c in engine.step().committed]
        assert model.embedded[1] == [hot.token[0] if coupled else 10]  # step 2 embeds the launched successor
        committed[coupled] = tokens
    assert committed[True] == committed[False]
