"""The contract: SPEED's per-loop logits equal sequential decoding's bit for bit, and so do the tokens.

A differential oracle in the spirit of LayerSkip's correctness check: many
random models (patterns 1xM, Nx1, 2x6, 3x4, odd M), seeds, batch sizes, input
lengths, both invalidation policies and several launch loops. Every loop's
early-exit logits of every committed token are recorded from both engines
(``speed.decode.exactness.LogitRecorder``) and compared with ``torch.equal``: no
tolerance, no near-tie exemption.
"""

from __future__ import annotations

import dataclasses
import random

import pytest
import torch
from engine_helpers import (
    BLOCKS,
    exits_change_drafts_only,
    random_exits,
    recorded_pair,
    speed_as_sequential,
    speed_runs_match,
)

from speed.config import preset
from speed.decode.exactness import LogitRecorder, compare_logits
from speed.decode.generate import DecodeOptions, generate
from speed.engine import Speculation
from speed.engine.sampling import Sampling
from speed.losses import shift_right
from speed.models.t5 import SpeedT5

PATTERNS = ["1x4", "4x1", "2x6", "3x4", "2x3", "1x5", "3x3", "1x1"]


def random_case(seed: int):
    rng = random.Random(seed)
    torch.manual_seed(seed)
    pattern = PATTERNS[seed % len(PATTERNS)]
    model = SpeedT5(preset("tiny", pattern=pattern)).eval()
    if seed % 3 == 0:  # make EOS likely so that sequences end at different times
        with torch.no_grad():
            model.lm_head.weight[model.eos_id] *= 3.0
    ids, mask = padded_batch(rng, rng.randint(1, 4), model.config.vocab_size)
    return model, ids, mask, rng.randint(1, 20), rng


def padded_batch(rng: random.Random, batch: int, vocab_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``batch`` random inputs of 1-9 tokens (lengths from ``rng``, tokens from torch's generator), right-padded:
    (ids, attention mask)."""
    lengths = [rng.randint(1, 9) for _ in range(batch)]
    ids = torch.zeros(batch, max(lengths), dtype=torch.long)
    mask = torch.zeros_like(ids)
    for b, n in enumerate(lengths):
        ids[b, :n] = torch.randint(3, vocab_size, (n,))
        mask[b, :n] = 1
    return ids, mask


@pytest.mark.parametrize("block", BLOCKS[:8])
def test_speed_equals_sequential(block):
    runs, flushes = speed_runs_match(random_case, range(block * 25, block * 25 + 25))
    assert flushes > 0  # random models mispredict: the invalidation path was exercised
    assert runs >= 50


@pytest.mark.parametrize("block", BLOCKS[:3])
def test_sampled_speed_equals_sequential_sampling(block):
    """Seeded sampling: SPEED (coupled or argmax guesses) draws exactly sequential sampling's tokens from
    bit-identical logits, over random models, temperatures, supports, penalties, seeds and policies."""
    cases = flushes = differ = 0
    for seed in range(block * 12, block * 12 + 12):
        model, ids, mask, max_new, rng = random_case(1000 + seed)
        sampling = Sampling(
            temperature=rng.choice([0.5, 0.7, 1.0, 1.5]),
            top_k=rng.choice([0, 0, 5, 30]),
            top_p=rng.choice([1.0, 0.95, 0.7]),
            seed=rng.randrange(2**63),
            presence_penalty=rng.choice([0.0, 0.5]),
            frequency_penalty=rng.choice([0.0, 0.8]),
        )
        reference = LogitRecorder(model)
        ref = generate(
            reference, ids, mask, DecodeOptions(method="sequential", max_new_tokens=max_new, sampling=sampling)
        )
        greedy = generate(model, ids, mask, DecodeOptions(method="sequential", max_new_tokens=max_new, trace=False))
        differ += ref.tokens != greedy.tokens
        m = model.n_loops
        for coupled in (True, False):
            for invalidation in ("eager", "final"):
                launch_loop = rng.randint(1, m)
                got = speed_as_sequential(
                    model, reference, ref, ids, mask, max_new, (seed, coupled, invalidation),
                    speculation=Speculation(launch_loop, invalidation),
                    sampling=dataclasses.replace(sampling, coupled=coupled),
                )  # fmt: skip
                assert got.trace.equals(ref.trace)  # every loop's draw too
                flushes += got.stats.flushes
                cases += 1
    assert flushes > 0 and differ > 0 and cases == 48  # sampling changed the outputs; flushes were exercised


def test_a_logit_difference_is_caught():
    """The comparison is not vacuous: one flipped bit in one recorded row is reported."""
    model, ids, mask, _, _ = random_case(3)
    reference, candidate, ref = recorded_pair(model, ids, mask, 6)
    key = (0, model.n_loops - 1, len(ref.tokens[0]) - 1)
    row = candidate.logits[key].clone()
    row[5] = torch.nextafter(row[5], torch.tensor(float("inf")))
    candidate.logits[key] = row
    (mismatch,) = compare_logits(reference, candidate, ref.tokens, model.n_loops)
    assert (mismatch.slot, mismatch.loop, mismatch.pos) == key and 0 < mismatch.max_abs_diff < 1e-5


def test_oracle_speculation_matches_and_never_flushes():
    model, ids, mask, _, _ = random_case(5)
    ref = generate(model, ids, mask, DecodeOptions(method="sequential", max_new_tokens=16, trace=False))
    got = generate(model, ids, mask, DecodeOptions(method="speed", max_new_tokens=16), oracle=ref.tokens)
    assert got.tokens == ref.tokens
    assert got.stats.flushes == 0


def test_exits_match_teacher_forced_forward():
    """The cached decode path and the training forward agree on every loop's early exit."""
    for seed in range(4):
        model, ids, mask, _, _ = random_case(seed)
        res = generate(model, ids, mask, DecodeOptions(method="sequential", max_new_tokens=12))
        trace = res.trace.to_pandas()
        for b, toks in enumerate(res.tokens):
            labels = torch.tensor([toks])
            with torch.no_grad():
                out = model(ids[b : b + 1], shift_right(labels), mask[b : b + 1], return_logits=True)
            for loop, logits in enumerate(out.loop_logits, start=1):
                rows = trace[(trace.sequence == b) & (trace.loop == loop)].sort_values("position")
                assert rows.prediction.tolist() == logits[0].argmax(-1).tolist()


@pytest.mark.parametrize("sampling", [None, Sampling(temperature=1.0, top_p=0.9, seed=5)])
def test_batch_equals_one_at_a_time(sampling):
    model, ids, mask, _, _ = random_case(7)
    together = generate(model, ids, mask, DecodeOptions(method="speed", max_new_tokens=10, sampling=sampling)).tokens
    alone = [
        generate(
            model,
            ids[b : b + 1, : int(mask[b].sum())],
            options=DecodeOptions(method="speed", max_new_tokens=10, sampling=sampling),
        )
        for b in range(len(ids))
    ]
    assert together == [a.tokens[0] for a in alone]


def test_generate_restores_training_mode():
    model, ids, mask, _, _ = random_case(1)
    model.train()
    generate(model, ids, mask, DecodeOptions(max_new_tokens=3))
    assert model.training


@pytest.mark.parametrize("block", BLOCKS[:2])
def test_exit_adapters_change_drafts_never_the_output(block):
    """Exit adapters (``speed.models.exits``) on random models, batch 1 and 8, greedy and seeded sampling, both policies
    the tokens and the last loop's logits are bitwise those without them, SPEED's every loop equals sequential
    decoding's with them, and the adapters do change the early exits and SPEED's schedule."""
    changed_logits = changed_runs = cases = 0
    for seed in range(block * 6, block * 6 + 6):
        rng = random.Random(seed)
        torch.manual_seed(seed)
        pattern = rng.choice(["1x4", "2x3", "3x4", "2x6"])  # M >= 2: early exits to adapt
        model = random_exits(SpeedT5(preset("tiny", pattern=pattern)).eval(), seed)
        ids, mask = padded_batch(rng, [1, 8][seed % 2], model.config.vocab_size)
        sampling = Sampling(temperature=1.0, top_p=0.9, seed=seed) if seed % 4 >= 2 else None
        speculation = Speculation(rng.randint(1, model.n_loops - 1), rng.choice(["eager", "final"]))
        got, without, changed = exits_change_drafts_only(
            model, ids, mask, 10, seed, speculation=speculation, sampling=sampling
        )
        changed_logits += changed
        changed_runs += (got.stats.rows, got.stats.flushes) != (without.stats.rows, without.stats.flushes)
        cases += 1
    assert cases == 6 and changed_logits > 0 and changed_runs > 0


def test_a_stop_set_is_exact_and_ends_at_its_first_member():
    """A stop set besides EOS (an imported chat model's end of turn): SPEED equals sequential decoding with the
    same set bit for bit (greedy and sampled, with branches); sequential with the set ends each sequence at the
    first member the plain run produced, and says so in ``stopped``."""
    cut = runs = 0
    for seed in range(12):
        model, ids, mask, _, rng = random_case(2000 + seed)
        plain = generate(model, ids, mask, DecodeOptions(method="sequential", max_new_tokens=12, trace=False))
        produced = [t for tokens in plain.tokens for t in tokens[:-1] if t != model.eos_id]
        stops = {model.eos_id, *rng.sample(produced, min(2, len(produced)))}
        for sampling in (None, Sampling(temperature=1.0, top_k=5, seed=rng.randrange(2**63))):
            reference = LogitRecorder(model)
            ref = generate(
                reference,
                ids,
                mask,
                DecodeOptions(method="sequential", max_new_tokens=12, sampling=sampling, stop_ids=stops),
            )
            for b, tokens in enumerate(ref.tokens):
                assert ref.stopped[b] == (tokens[-1] in stops)
                assert not set(tokens[:-1]) & stops  # nothing follows a stop token
            if sampling is None:
                for b, tokens in enumerate(plain.tokens):  # the plain run, cut at its first stop token
                    first = next((i for i, t in enumerate(tokens) if t in stops), len(tokens) - 1)
                    assert ref.tokens[b] == tokens[: first + 1]
                    cut += first + 1 < len(tokens)
            m = model.n_loops
            for speculation in (Speculation(1, "eager"), Speculation(rng.randint(1, m), "final", branches=min(2, m))):
                got = speed_as_sequential(
                    model, reference, ref, ids, mask, 12, (seed, sampling, speculation),
                    speculation=speculation, sampling=sampling, stop_ids=stops,
                )  # fmt: skip
                assert got.stopped == ref.stopped
                runs += 1
    assert cut > 0 and runs == 48  # the stop set ended sequences early


def test_a_decoder_keeps_its_engine_and_decodes_as_generate(monkeypatch):
    """``Decoder``: one engine built for all its calls (what a benchmark's timed rounds reuse), each call's tokens,
    stats and trace ``generate``'s for its batch: greedy and oracle SPEED, sequential, a smaller batch after a
    larger one, the graphs' buckets too."""
    import speed.decode.generate as gen

    built = []
    engine = gen.Engine
    monkeypatch.setattr(gen, "Engine", lambda *a, **kw: built.append(1) or engine(*a, **kw))
    model, ids, mask, _, _ = random_case(5)
    ids, mask = ids[:2].repeat(2, 1), mask[:2].repeat(2, 1)  # 4 sequences
    ref = generate(model, ids, mask, DecodeOptions(method="sequential", max_new_tokens=6))
    for method, oracle, graphs in (("sequential", None, None), ("speed", None, True), ("speed", ref.tokens, None)):
        decoder = gen.Decoder(model, *ids.shape, gen.DecodeOptions(method=method, max_new_tokens=6, graphs=graphs))
        built.clear()
        for batch in (4, 4, 1):
            want = generate(
                model,
                ids[:batch],
                mask[:batch],
                DecodeOptions(method=method, max_new_tokens=6, graphs=graphs),
                oracle=None if oracle is None else oracle[:batch],
            )
            got = decoder(ids[:batch], mask[:batch], None if oracle is None else oracle[:batch])
            assert got.tokens == want.tokens == ref.tokens[:batch] and got.stats == want.stats, (method, batch)
            assert got.trace.equals(want.trace) and got.decode_s >= 0 and got.first_token_s >= 0
        assert len(built) == 3  # generate's three engines: the decoder built none
    with pytest.raises(ValueError, match="batch <= 4"):
        decoder(ids.repeat(2, 1))
