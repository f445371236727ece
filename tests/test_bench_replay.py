"""Replaying a model's flips (``speed.benchmarks.replay``): a model's own trace replayed on it gives its own SPEED's
steps and flushes; the output and every logit equal sequential decoding's; patterns from traces of other loop counts
and from agreement rates."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pytest
import torch

from speed import DecodeOptions, LoopedLM, SpeedT5, generate, lm_preset, preset
from speed.benchmarks.replay import (
    STOP,
    FlipPattern,
    ReplayStepper,
    agreement_profile,
    depth_map,
)
from speed.decode.exactness import LogitRecorder, compare_logits
from speed.engine.trace import TraceBuilder


def _t5(seed: int) -> SpeedT5:
    torch.manual_seed(seed)
    return SpeedT5(preset("tiny", pattern="2x4")).eval()


def _lm(seed: int) -> LoopedLM:
    torch.manual_seed(seed)
    return LoopedLM(lm_preset("tiny", pattern="1+1x3+1")).eval()


def _prompts(seed: int, batch: int, length: int, vocab: int) -> torch.Tensor:
    torch.manual_seed(seed + 100)
    return torch.randint(3, vocab, (batch, length))


def _finals(ids: torch.Tensor, tokens: list[list[int]]) -> dict[tuple[int, ...], list[int]]:
    return {tuple(row): out for row, out in zip(ids.tolist(), tokens)}


@pytest.mark.parametrize("make", [_t5, _lm], ids=["t5", "lm"])
@pytest.mark.parametrize("invalidation", ["eager", "final"])
def test_replaying_a_models_own_trace_gives_its_own_schedule(make, invalidation):
    """The model's own flips replayed on it (the known final tokens from sequential decoding): the same steps,
    flushes, rows and wasted rows as its own SPEED, and the same tokens."""
    from speed.engine import Speculation

    model = make(0)
    ids = _prompts(0, 3, 6, model.config.vocab_size)
    spec = Speculation(invalidation=invalidation)
    own = generate(model, ids, options=DecodeOptions(method="speed", max_new_tokens=12, speculation=spec))
    seq = generate(model, ids, options=DecodeOptions(method="sequential", max_new_tokens=12, trace=False))
    assert own.tokens == seq.tokens and own.stats.flushes > 0  # a random model flips
    pattern = FlipPattern.from_trace(own.trace, model.n_loops, frozenset({model.eos_id}))
    assert pattern.loop_map == tuple(range(1, model.n_loops + 1)) and "mapped" not in pattern.source
    replay = ReplayStepper(model, _finals(ids, seq.tokens), pattern)
    got = generate(replay, ids, options=DecodeOptions(method="speed", max_new_tokens=12, speculation=spec))
    assert got.tokens == seq.tokens
    s, o = got.stats, own.stats
    assert (s.steps, s.flushes, s.rows, s.wasted_rows) == (o.steps, o.flushes, o.rows, o.wasted_rows)
    assert len(replay.passes) == s.steps  # every group pass recorded


@pytest.mark.parametrize("make", [_t5, _lm], ids=["t5", "lm"])
def test_a_replay_equals_sequential_decoding_bit_for_bit(make):
    """A pattern from rates replayed by SPEED and by sequential decoding (both traced, so every exit is scored and
    rewritten alike): every logit of every committed (slot, loop, position) torch.equal, the same tokens; the last
    loop's logits are the model's own."""
    model = make(1)
    M = model.n_loops
    ids = _prompts(1, 4, 5, model.config.vocab_size)
    plain = generate(model, ids, options=DecodeOptions(method="sequential", max_new_tokens=10, trace=False))
    pattern = FlipPattern.from_rates(agreement_profile(0.6, M), 4, 10, seed=3)
    finals = _finals(ids, plain.tokens)
    reference, candidate = LogitRecorder(ReplayStepper(model, finals, pattern)), LogitRecorder(model)
    ref = generate(reference, ids, options=DecodeOptions(method="sequential", max_new_tokens=10))
    got_rec = LogitRecorder(ReplayStepper(model, finals, pattern))
    got = generate(got_rec, ids, options=DecodeOptions(method="speed", max_new_tokens=10))
    assert got.tokens == ref.tokens == plain.tokens
    assert compare_logits(reference, got_rec, ref.tokens, M) == []
    generate(candidate, ids, options=DecodeOptions(method="sequential", max_new_tokens=10))  # the model's own exits
    for slot, out in enumerate(ref.tokens):
        for pos in range(len(out)):
            assert torch.equal(reference.logits[slot, M - 1, pos], candidate.logits[slot, M - 1, pos])
    # the replayed early exits agree exactly where the pattern says
    for b, out in enumerate(plain.tokens):
        codes = pattern.sequence(b, len(out))
        for pos, token in enumerate(out):
            for loop in range(M - 1):
                pred = int(reference.logits[b, loop, pos].argmax())
                assert (pred == token) == (codes[pos, loop] == 0)


def test_a_replay_at_a_known_agreement_saves_steps():
    """Full agreement takes the oracle's steps; none takes about sequential's; in between, in between."""
    model = _t5(2)
    M = model.n_loops
    ids = _prompts(2, 2, 6, model.config.vocab_size)
    seq = generate(model, ids, options=DecodeOptions(method="sequential", max_new_tokens=16, trace=False))
    finals = _finals(ids, seq.tokens)
    oracle = generate(
        model, ids, options=DecodeOptions(method="speed", max_new_tokens=16, trace=False), oracle=seq.tokens
    )
    steps = {}
    for a in (1.0, 0.5, 0.0):
        rates = [a + (1 - a) * loop / (M - 1) for loop in range(M)]
        got = generate(
            ReplayStepper(model, finals, FlipPattern.from_rates(rates, 2, 16, 0)),
            ids,
            options=DecodeOptions(method="speed", max_new_tokens=16, trace=False),
        )
        assert got.tokens == seq.tokens
        steps[a] = got.stats.steps
    assert steps[1.0] == oracle.stats.steps < steps[0.5] < steps[0.0]


def test_a_trace_of_another_loop_count_maps_by_fraction_of_depth():
    """A 6-loop trace onto 4 loops: loops 1, 3, 4, 6 (a tie toward the shallower), and the source says so; codes
    keep which wrong predictions repeat, and a stop token's."""
    assert depth_map(6, 4) == (1, 3, 4, 6)
    assert depth_map(4, 4) == (1, 2, 3, 4) and depth_map(2, 6) == (1, 1, 1, 1, 2, 2) and depth_map(6, 3) == (2, 4, 6)
    b = TraceBuilder()
    b.add_token(0, 0, [5, 5, 7, 9, 9, 9])  # wrong 5 twice, then 7, then right
    b.add_token(0, 1, [1, 4, 4, 4, 4, 4])  # a stop token at loop 1
    b.add_token(1, 0, [8, 8, 8, 8, 8, 8])
    pattern = FlipPattern.from_trace(b.table(), 4, frozenset({1}), name="demo")
    assert pattern.loop_map == (1, 3, 4, 6)
    assert "6 loops mapped onto 4" in pattern.source and "loops 1,3,4,6" in pattern.source
    assert [c.tolist() for c in pattern.codes] == [[[1, 2, 0, 0], [STOP, 0, 0, 0]], [[0, 0, 0, 0]]]
    assert pattern.sequence(1, 3).tolist() == [[0, 0, 0, 0], [1, 2, 0, 0], [STOP, 0, 0, 0]]  # continued cyclically


def test_an_evaluations_trace_keys_its_sequences_by_example():
    """Key columns beside the trace's (an evaluation's ``example``) split the sequences, whatever the row order."""
    b = TraceBuilder()
    b.add_token(0, 0, [3, 4])
    b.add_token(0, 1, [4, 4])
    table = b.table()
    table = pa.concat_tables([table, table]).add_column(0, "example", pa.array([7, 7, 7, 7, 2, 2, 2, 2], pa.int32()))
    pattern = FlipPattern.from_trace(table.take([4, 0, 5, 1, 6, 2, 7, 3]), 2)
    assert len(pattern.codes) == 2 and all(c.tolist() == [[1, 0], [0, 0]] for c in pattern.codes)
    with pytest.raises(ValueError, match="not a flip trace"):
        FlipPattern.from_trace(table.drop_columns(["prediction"]), 2)


def test_rates_make_a_settling_pattern_at_those_rates():
    """Drawn from rates: each token agrees from its settle loop on, and before it every loop is a new wrong
    prediction; the shares agreeing per loop are the rates to the nearest token, even over few tokens."""
    rates = agreement_profile(0.7, 4)
    assert rates[0] == pytest.approx(0.7) and rates[-1] == 1.0 and rates == sorted(rates)
    pattern = FlipPattern.from_rates(rates, 8, 2000, seed=1)
    codes = np.concatenate(pattern.codes)
    assert np.allclose(pattern.agreement(), rates, atol=0.5 / 16000)
    assert np.allclose(FlipPattern.from_rates(rates, 1, 20, seed=4).agreement(), rates, atol=0.5 / 20)
    settled = codes == 0
    assert (settled[:, 1:] >= settled[:, :-1]).all()  # once right, right
    loop = np.arange(1, 5)
    assert ((codes == 0) | (codes == loop)).all()  # each wrong loop its own wrong token
    with pytest.raises(ValueError, match="rise to 1"):
        FlipPattern.from_rates([0.5, 0.4, 1.0], 1, 4, 0)
    assert FlipPattern.from_rates(rates, 2, 5, seed=4).codes[1].tolist() == FlipPattern.from_rates(
        rates, 2, 5, seed=4
    ).codes[1].tolist()


def test_the_profile_follows_the_trained_models_by_depth():
    """At 6 loops the profile is the trained 2x6 T5's own disagreement (scaled to loop 1); at 4 loops, its
    interpolation by depth."""
    six = agreement_profile(1 - 0.306, 6)
    assert six == pytest.approx([0.694, 0.796, 0.873, 0.930, 0.966, 1.0], abs=1e-3)
    four = agreement_profile(0.7, 4)
    assert four == pytest.approx([0.7, 0.851, 0.939, 1.0], abs=2e-3)


def test_a_learning_replay_replays_what_it_has_answered():
    """``learn``: the first decoding of a prompt is the model's own and teaches its final tokens; a later SPEED
    decoding of it replays the pattern (its early exits agree exactly where the codes say), the same tokens."""
    model = _t5(3)
    M = model.n_loops
    ids = _prompts(3, 2, 5, model.config.vocab_size)
    pattern = FlipPattern.from_rates(agreement_profile(0.5, M), 2, 10, seed=1)
    replay = ReplayStepper(model, {}, pattern, learn=True)
    first = generate(replay, ids, options=DecodeOptions(method="sequential", max_new_tokens=10, trace=False))
    assert replay.finals == _finals(ids, first.tokens)
    recorder = LogitRecorder(replay)
    got = generate(recorder, ids, options=DecodeOptions(method="speed", max_new_tokens=10))
    assert got.tokens == first.tokens
    for b, out in enumerate(first.tokens):
        codes = pattern.sequence(b, len(out))
        agree = [[int(recorder.logits[b, loop, pos].argmax()) == tok for loop in range(M - 1)] for pos, tok in
                 enumerate(out)]  # fmt: skip
        assert agree == (codes[:, : M - 1] == 0).tolist()
    own = generate(model, ids, options=DecodeOptions(method="speed", max_new_tokens=10))
    assert got.stats.steps != own.stats.steps  # the replay, not the model's own flips
