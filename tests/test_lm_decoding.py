"""SPEED on the decoder-only looped LM: every loop's logits and every token equal sequential decoding's, bit for bit.

The same differential oracle as T5's (``test_decoding_exact``, ``test_decoding_branches``, ``test_engine``),
over random ``LoopedLM``s: patterns with and without prelude and coda, grouped-query attention, sandwich norms,
input injection and loop norm; greedy and seeded sampling (coupled drafts or not), batch 1 and 8, eager and
final invalidation, several launch loops, runner-up branches and lanes, the confidence gate, and server churn
with cancellations. Each request's prompt is prefilled at admission, on its own: its tokens and logits do not
depend on the requests admitted with it.
"""

from __future__ import annotations

import dataclasses
import functools
import random

import pytest
import torch
from engine_helpers import (
    BLOCKS,
    churn_config,
    drive,
    exits_change_drafts_only,
    random_exits,
    recorded_pair,
    speed_as_sequential,
    speed_runs_match,
)
from test_lm import _randomize

from speed.config import lm_preset
from speed.decode.exactness import LogitRecorder, compare_logits
from speed.decode.generate import DecodeOptions, generate
from speed.engine import Engine, EngineConfig, Request, Speculation
from speed.engine.sampling import Sampling
from speed.models.exits import attach
from speed.models.looped_lm import LoopedLM

PATTERNS = ["2x3", "1x4", "3x2", "1+2x3", "2x3+1", "1+2x2+1"]
GQA = {"n_heads": 4, "n_kv_heads": 2, "head_dim": 8}
VARIANTS = [
    {},
    GQA,
    {"norm": "sandwich", "loop_norm": True},
    {"injection": True, **GQA},
    {"norm": "sandwich", "injection": True, "loop_norm": True},
]
MAX_PROMPT = 12


def random_model(seed: int) -> LoopedLM:
    """A tiny random LM (pattern and variant from ``seed``) at unit-variance weight scales, so that its exits
    are far from uniform and differ between loops; EOS made likely for some seeds."""
    pattern = PATTERNS[seed % len(PATTERNS)]
    model = _randomize(LoopedLM(lm_preset("tiny", pattern=pattern, **VARIANTS[seed % len(VARIANTS)])), seed)
    if seed % 3 == 0:
        with torch.no_grad():
            model.lm_head.weight[model.eos_id] *= 2.0
    return model.eval()


def prompts(rng: random.Random, batch: int, vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``batch`` random prompts of 1..MAX_PROMPT tokens, right-padded: (ids, attention mask)."""
    lengths = [rng.randint(1, MAX_PROMPT) for _ in range(batch)]
    ids = torch.zeros(batch, max(lengths), dtype=torch.long)
    mask = torch.zeros_like(ids)
    for b, n in enumerate(lengths):
        ids[b, :n] = torch.tensor([rng.randrange(2, vocab) for _ in range(n)])
        mask[b, :n] = 1
    return ids, mask


def random_case(seed: int):
    rng = random.Random(seed)
    model = random_model(seed)
    ids, mask = prompts(rng, [1, 8][seed % 2], model.vocab_size)
    return model, ids, mask, rng.randint(1, 14), rng


@pytest.mark.parametrize("block", BLOCKS[:3])
def test_lm_speed_equals_sequential(block):
    """Greedy: eager and final invalidation, launch loops 1, random and M, batch 1 and 8."""
    runs, flushes = speed_runs_match(random_case, range(block * 6, block * 6 + 6))
    assert flushes > 0 and runs >= 6 * 2 * 2


@pytest.mark.parametrize("block", BLOCKS[:2])
def test_lm_sampled_speed_equals_sequential_sampling(block):
    """Seeded sampling, coupled drafts or argmax drafts: the same draws from bit-identical logits."""
    cases = differ = 0
    for seed in range(block * 6, block * 6 + 6):
        model, ids, mask, max_new, rng = random_case(500 + seed)
        sampling = Sampling(
            temperature=rng.choice([0.7, 1.0, 1.5]),
            top_k=rng.choice([0, 5]),
            top_p=rng.choice([1.0, 0.9]),
            seed=rng.randrange(2**63),
            frequency_penalty=rng.choice([0.0, 0.5]),
        )
        reference = LogitRecorder(model)
        ref = generate(
            reference, ids, mask, DecodeOptions(method="sequential", max_new_tokens=max_new, sampling=sampling)
        )
        greedy = generate(model, ids, mask, DecodeOptions(method="sequential", max_new_tokens=max_new, trace=False))
        differ += ref.tokens != greedy.tokens
        for coupled in (True, False):
            invalidation = rng.choice(["eager", "final"])
            got = speed_as_sequential(
                model, reference, ref, ids, mask, max_new, (seed, coupled),
                speculation=Speculation(rng.randint(1, model.n_loops), invalidation),
                sampling=dataclasses.replace(sampling, coupled=coupled),
            )  # fmt: skip
            assert got.trace.equals(ref.trace)
            cases += 1
    assert differ > 0 and cases == 12


@pytest.mark.parametrize("block", BLOCKS[:2])
def test_lm_branches_and_gate_equal_sequential(block):
    """Runner-up branches and lanes (with a prelude too: its cache keeps the lanes' side entries) and the
    confidence gate change the schedule, never a logit. Batches of 8 with every branch and the longest lanes
    at launch loop 1 promote lanes of several tokens, several at once (the first block's seeds catch a lane
    read at the wrong cache positions and prelude side entries shared between slots)."""
    promotions = cases = 0
    for seed in range(900 + block * 10, 900 + block * 10 + 10):
        rng = random.Random(seed)
        model = random_model(seed)
        ids, mask = prompts(rng, 8, model.vocab_size)
        reference = LogitRecorder(model)
        ref = generate(reference, ids, mask, DecodeOptions(method="sequential", max_new_tokens=14))
        m = model.n_loops
        for launch_loop, branches, depth, below, gate in [
            (1, m, m, 1.0, 0.0),
            (rng.randint(1, m), rng.randint(1, m), rng.randint(1, m), 0.7, 0.1),
        ]:
            speculation = Speculation(launch_loop, rng.choice(["eager", "final"]), branches, depth, below, gate)
            got = speed_as_sequential(
                model, reference, ref, ids, mask, 14, (seed, branches, depth), speculation=speculation
            )
            assert got.trace.equals(ref.trace)
            promotions += got.stats.promotions
            cases += 1
    assert promotions > 0 and cases == 20


class PromptKeyed(LogitRecorder):
    """Records keyed by the prompt of the request holding the slot, not the slot (churn moves requests
    between slots; the tests' prompts are distinct)."""

    def __init__(self, model) -> None:
        super().__init__(model)
        self.owner: dict[int, tuple[int, ...]] = {}

    def key(self, slot, loop, pos):
        return (self.owner[slot], loop, pos)

    def admit(self, memory, cache, slots, prompts):
        for slot, prompt in zip(slots, prompts):
            self.owner[slot] = tuple(prompt.tolist())
        return super().admit(memory, cache, slots, prompts)


def assert_same_logits(a: LogitRecorder, b: LogitRecorder, prompt: tuple[int, ...], n_tokens: int, m: int) -> None:
    for pos in range(n_tokens):
        for loop in range(m):
            key = (prompt, loop, pos)
            assert key in a.logits and key in b.logits and torch.equal(a.logits[key], b.logits[key]), key


def equals_sequential_alone(recorder: PromptKeyed, model: LoopedLM, request: Request, f):
    """Assert that a finished request's tokens (a cancelled one's: a prefix) and, unless cancelled, every loop's
    logits in ``recorder`` equal its sequential decoding alone; that decoding's result."""
    reference = PromptKeyed(model)
    ref = generate(
        reference,
        torch.tensor([request.input_ids]),
        options=DecodeOptions(method="sequential", max_new_tokens=request.max_new_tokens, sampling=request.sampling),
    )
    assert f.tokens == ref.tokens[0][: len(f.tokens)]
    if not f.cancelled:
        assert f.tokens == ref.tokens[0], request
        assert_same_logits(recorder, reference, tuple(request.input_ids), len(f.tokens), model.n_loops)
    return ref


def churn_request(r: random.Random, model: LoopedLM, counter) -> Request:
    """A random request of the churn tests: a distinct prompt (its first token from ``counter``), SPEED or
    sequential, random policies and levers, greedy or sampled."""
    m = model.n_loops
    sampling = Sampling() if r.random() < 0.5 else Sampling(temperature=1.0, top_k=8, seed=r.randrange(99))
    prompt = [next(counter)] + [r.randrange(2, model.vocab_size) for _ in range(r.randint(0, MAX_PROMPT - 1))]
    n, method = r.randint(1, 12), r.choice(["speed", "speed", "sequential"])
    launch_loop, invalidation = r.randint(1, m), r.choice(["eager", "final"])
    sampling = dataclasses.replace(sampling, coupled=r.random() < 0.7)  # the draws in the order they were
    levers = {"branches": r.choice([0, 0, r.randint(1, m)]), "branch_depth": r.randint(1, m)}
    speculation = Speculation(launch_loop, invalidation, **levers, min_confidence=r.choice([0.0, 0.1]))
    return Request(prompt, n, method, speculation, sampling=sampling)


@pytest.mark.parametrize("block", BLOCKS[:2])
def test_lm_churn_equals_sequential_alone(block):
    """Random arrivals and cancellations, capacities, row budgets, policies, branches, greedy and sampled:
    each finished request's logits (every loop) and tokens equal its sequential decoding alone."""
    cancelled = flushes = 0
    for seed in range(block * 4, block * 4 + 4):
        rng = random.Random(2000 + seed)
        model = random_model(seed)
        m = model.n_loops
        config = churn_config(rng, max_prompt_len=MAX_PROMPT, max_target_len=12, max_budget=8)
        recorder = PromptKeyed(model)
        engine = Engine(recorder, config)
        counter = iter(range(2, model.vocab_size))
        make = functools.partial(churn_request, rng, model, counter)
        requests, finished = drive(engine, rng, [rng.randrange(0, 30) for _ in range(6)], make, 0.25, 10)
        for f in finished:
            ref = equals_sequential_alone(recorder, model, requests[f.id], f)
            if f.cancelled:
                cancelled += 1
                continue
            assert f.trace.drop_columns(["sequence"]).equals(ref.trace.drop_columns(["sequence"]))
            assert f.stats.rows == (f.stats.tokens - 1) * m + f.stats.wasted_rows  # token 0: the prefill's
            assert 0 <= f.stats.queued_s <= f.stats.ttft_s <= f.stats.latency_s
            flushes += f.stats.flushes
    assert cancelled > 0 and flushes > 0


def test_prefill_does_not_depend_on_company():
    """A request's tokens and logits are the same admitted alone, in a batch of 8, or with other prompts."""
    model, ids, mask, _, rng = random_case(1)
    assert ids.shape[0] == 8
    together = LogitRecorder(model)
    got = generate(together, ids, mask, DecodeOptions(method="speed", max_new_tokens=8))
    others, other_mask = prompts(rng, 8, model.vocab_size)
    for b in range(8):
        ids_b = ids[b : b + 1, : int(mask[b].sum())]
        alone = LogitRecorder(model)
        one = generate(alone, ids_b, options=DecodeOptions(method="speed", max_new_tokens=8))
        assert one.tokens[0] == got.tokens[b]
        for pos in range(len(one.tokens[0])):
            for loop in range(model.n_loops):
                assert torch.equal(alone.logits[(0, loop, pos)], together.logits[(b, loop, pos)]), (b, loop, pos)
        width = max(ids.shape[1], others.shape[1])  # the prompt among others, in another slot
        mixed_ids = torch.zeros(8, width, dtype=torch.long)
        mixed_mask = torch.zeros_like(mixed_ids)
        mixed_ids[:, : others.shape[1]], mixed_mask[:, : others.shape[1]] = others, other_mask
        slot = (b + 3) % 8
        mixed_ids[slot], mixed_mask[slot] = 0, 0
        mixed_ids[slot, : ids_b.shape[1]], mixed_mask[slot, : ids_b.shape[1]] = ids_b[0], 1
        assert (
            generate(model, mixed_ids, mixed_mask, DecodeOptions(method="speed", max_new_tokens=8)).tokens[slot]
            == one.tokens[0]
        )


def test_first_token_and_exits_match_the_forward():
    """The prefill's last position gives token 0; every loop's predictions equal the teacher-forced forward's
    argmax over the prompt and the tokens (no near ties in these models)."""
    for seed in (2, 3, 4, 5):
        model, ids, mask, _, _ = random_case(seed)
        res = generate(model, ids, mask, DecodeOptions(method="sequential", max_new_tokens=10))
        trace = res.trace.to_pandas()
        for b, toks in enumerate(res.tokens):
            prompt = ids[b, : int(mask[b].sum())].tolist()
            with torch.no_grad():
                out = model(torch.tensor([prompt + toks]), return_logits=True)
            P = len(prompt)
            for loop, logits in enumerate(out.loop_logits, start=1):
                rows = trace[(trace.sequence == b) & (trace.loop == loop)].sort_values("position")
                assert rows.prediction.tolist() == logits[0, P - 1 : P - 1 + len(toks)].argmax(-1).tolist()


def test_a_prompt_longer_than_the_limit_is_refused_at_add():
    engine = Engine(random_model(0), EngineConfig(max_active=2, max_prompt_len=5, max_target_len=4))
    with pytest.raises(ValueError, match="6 tokens, more than 5"):
        engine.add(Request([3] * 6, 4))
    assert engine.add(Request([3] * 5, 4)) == 0  # at the limit: accepted
    with pytest.raises(ValueError, match="non-empty"):
        engine.add(Request([], 4))


def test_max_new_tokens_one_and_eos_at_admission():
    """A request whose only token comes from the prefill finishes in the step that admits it, with no rows."""
    model = random_model(1)
    engine = Engine(model, EngineConfig(max_active=1, max_prompt_len=4, max_target_len=4))
    rid = engine.add(Request([5, 6, 7], 1))
    result = engine.step()
    assert [f.id for f in result.finished] == [rid] and result.rows == 0
    assert [c.token for c in result.committed] == result.finished[0].tokens and len(result.finished[0].tokens) == 1
    ref = generate(model, torch.tensor([[5, 6, 7]]), options=DecodeOptions(method="sequential", max_new_tokens=1))
    assert ref.tokens == [result.finished[0].tokens]


def test_compare_logits_covers_the_prefilled_position():
    model, ids, mask, _, _ = random_case(3)
    reference, candidate, ref = recorded_pair(model, ids, mask, 4)
    del candidate.logits[(0, 0, 0)]
    assert len(compare_logits(reference, candidate, ref.tokens, model.n_loops)) == 1


@pytest.mark.parametrize("block", BLOCKS[:2])
def test_lm_exit_adapters_change_drafts_never_the_output(block):
    """Exit adapters (``speed.models.exits``, applied in the prefill's exits too): batch 1 and 8, greedy and sampled,
    the tokens and the last loop's logits are bitwise those without them; SPEED's every loop equals sequential's
    with them; the early exits and SPEED's schedule change."""
    changed_logits = changed_runs = 0
    for seed in range(block * 6, block * 6 + 6):
        model, ids, mask, max_new, rng = random_case(3000 + seed)
        random_exits(model, seed)
        sampling = Sampling(temperature=1.0, top_k=8, seed=seed) if seed % 4 >= 2 else None
        speculation = Speculation(rng.randint(1, model.n_loops - 1), rng.choice(["eager", "final"]), branches=seed % 2)
        got, without, changed = exits_change_drafts_only(
            model, ids, mask, max_new + 4, seed, speculation=speculation, sampling=sampling
        )
        changed_logits += changed
        changed_runs += (got.stats.rows, got.stats.flushes) != (without.stats.rows, without.stats.flushes)
    assert changed_logits > 0 and changed_runs > 0


@pytest.mark.slow
def test_lm_churn_with_exit_adapters_equals_plain_sequential():
    """Random arrivals, cancellations and row budgets with exit adapters: each finished request's tokens and
    last-loop logits equal its sequential decoding alone without them."""
    finished_n = 0
    for seed in range(3):
        rng = random.Random(4000 + seed)
        model = random_model(seed)
        m = model.n_loops
        adapters = random_exits(model, seed).exit_adapters
        config = EngineConfig(max_active=rng.randint(2, 4), max_prompt_len=MAX_PROMPT, max_target_len=12,
                              row_budget=rng.choice([None, 5]))  # fmt: skip
        recorder = PromptKeyed(model)
        engine = Engine(recorder, config)
        counter = iter(range(2, model.vocab_size))
        make = functools.partial(churn_request, rng, model, counter)
        requests, finished = drive(engine, rng, [rng.randrange(0, 20) for _ in range(6)], make, 0.2, 8)
        attach(model, None)
        for f in finished:
            if f.cancelled:
                continue
            request, reference = requests[f.id], PromptKeyed(model)
            ref = generate(
                reference,
                torch.tensor([request.input_ids]),
                options=DecodeOptions(
                    method="sequential", max_new_tokens=request.max_new_tokens, sampling=request.sampling
                ),
            )
            assert f.tokens == ref.tokens[0], (seed, request)
            prompt = tuple(request.input_ids)
            for pos in range(len(f.tokens)):
                key = (prompt, m - 1, pos)
                assert torch.equal(recorder.logits[key], reference.logits[key]), key
            finished_n += 1
        attach(model, adapters)
    assert finished_n > 5
