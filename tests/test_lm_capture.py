"""The looped LM's capturable pass (``LMStepper.prepare`` + ``LoopedLM.step_staged``): the host's bookkeeping
staged before the pass, the pass reading device tensors only, so a CUDA graph can replay it.

On the CPU the staged pass runs eagerly on the Triton kernels under the interpreter (``SPEED_DECODE_OPS=triton``),
the path a GPU captures: SPEED through the engine's buckets equals sequential decoding bit for bit (greedy and
seeded sampling, branches and lanes, a prelude and a coda, injection with Huginn's initial state, exit adapters),
each staged pass equals the unstaged pass of the same rows, and it reads nothing of the rows on the host: their
arrays overwritten with garbage after ``prepare``, it gives the same bits. ``tests/test_gpu_decode.py`` replays
the captured graphs on CUDA.
"""

from __future__ import annotations

import dataclasses
import functools
import random

import numpy as np
import pytest
import torch
from engine_helpers import churn_config, drive, random_exits
from test_lm import _randomize
from test_lm_decoding import GQA, MAX_PROMPT, PromptKeyed, churn_request, equals_sequential_alone

tk = pytest.importorskip("speed.engine.triton_kernels")  # before anything imports triton: it sets the interpreter

from capture_helpers import RowSource, any_slots, count_staged, staged_equals_plain, staged_speed_equals_sequential  # noqa: E402

import speed.engine.kernels as kernels  # noqa: E402
from speed.config import lm_preset  # noqa: E402
from speed.decode.exactness import LogitRecorder  # noqa: E402
from speed.decode.generate import DecodeOptions, generate  # noqa: E402
from speed.engine import Engine  # noqa: E402
from speed.engine.graphs import GraphSteps, kv_caches  # noqa: E402
from speed.engine.sampling import Sampling  # noqa: E402
from speed.models.looped_lm import InitialState, LoopedLM  # noqa: E402

pytestmark = pytest.mark.skipif(not tk.interpreted(), reason="a GPU is here: tests/test_gpu_decode.py covers it")


@pytest.fixture(autouse=True)
def triton_ops(monkeypatch):
    """Every decode op on the Triton kernels (under the interpreter), as on a GPU."""
    monkeypatch.setattr(kernels, "DECODE_OPS", "triton")


def huginn_like(seed: int, exits: bool = False) -> LoopedLM:
    """A tiny model with everything the staged pass treats apart: a prelude and a coda, injection with a random
    initial state, sandwich norms, grouped-query attention (and, ``exits``, exit adapters)."""
    config = lm_preset("tiny", pattern="1+2x2+1", norm="sandwich", loop_norm=True, injection=True, **GQA)
    model = _randomize(LoopedLM(config), seed)
    model.initial_state = InitialState(seed=seed, std=1.0)
    return (random_exits(model, seed) if exits else model).eval()


def lm_case(seed: int, pattern: str = "2x3") -> LoopedLM:
    return _randomize(LoopedLM(lm_preset("tiny", pattern=pattern)), seed).eval()


def test_the_stepper_is_capturable_on_the_triton_kernels_only(monkeypatch):
    model = lm_case(0)
    assert model.stepper().capturable
    monkeypatch.setattr(kernels, "DECODE_OPS", "auto")  # the CPU's own kernels: nothing staged, nothing captured
    assert not model.stepper().capturable


@pytest.mark.slow
@pytest.mark.parametrize("case", ["huginn_greedy", "plain_sampled"])
def test_lm_speed_through_staged_passes_equals_sequential(case):
    """Every bucketed pass staged (the spy counts them), SPEED with and without branches equal to sequential decoding
    run unstaged and unpadded: every loop's logits, the tokens. Greedy on a model with a prelude, a coda,
    injection, an initial state and exit adapters; seeded sampling on a plain one."""
    huginn = case == "huginn_greedy"
    model = huginn_like(1, exits=True) if huginn else lm_case(2, "2x3")
    sampling = None if huginn else Sampling(temperature=0.9, top_k=6, seed=11)
    rng = random.Random(len(case))
    ids = torch.tensor([[rng.randrange(2, model.vocab_size) for _ in range(4)] for _ in range(2)])
    mask = torch.ones_like(ids)
    reference = LogitRecorder(model)
    ref = generate(
        reference, ids, mask, DecodeOptions(method="sequential", max_new_tokens=5, sampling=sampling, graphs=False)
    )
    staged_speed_equals_sequential(model, reference, ref, ids, mask, sampling, case)


def admitted(model: LoopedLM, slots: int, rng: random.Random):
    """A stepper, its memory (None) and its cache (a scratch slot after ``slots`` request slots) with a random prompt
    in each slot."""
    stepper = model.stepper()
    cache = stepper.cache(slots + 1, 6, 24, side=True)
    for kv in kv_caches(cache):
        kv.set_scratch(slots)
    lengths = [rng.randint(1, 6) for _ in range(slots)]
    prompts = [torch.tensor([rng.randrange(2, model.vocab_size) for _ in range(n)]) for n in lengths]
    stepper.admit(None, cache, list(range(slots)), prompts)
    return stepper, None, cache


@pytest.mark.slow
def test_a_staged_pass_reads_nothing_of_the_rows_on_the_host():
    """Two caches fed the same prompts and rows, step after step: one through ``GraphSteps`` (padded to buckets,
    ``prepare`` staging each pass, then the rows' host arrays overwritten with garbage before the pass runs),
    the other unstaged and unpadded. Every carry and every row's logits equal, bit for bit: the staged pass read
    only what ``prepare`` staged on the device."""
    rng = random.Random(5)
    model = huginn_like(5, exits=True)
    staged, plain = admitted(model, 5, random.Random(6)), admitted(model, 5, random.Random(6))
    graphs = GraphSteps(scratch=5, device=torch.device("cpu"), capture=False)
    source = RowSource(model, 5, rng, first_pos=1, first_token=2)
    staged_equals_plain(staged, plain, source, any_slots(rng, 5), graphs, 10, poison=True)
    a, b = staged[2], plain[2]
    assert np.array_equal(a.inner.loops.lengths[:, :, :5], b.inner.loops.lengths[:, :, :5])


@pytest.mark.slow
def test_an_engine_of_staged_passes_under_churn_equals_sequential_alone():
    """Requests joining, leaving and cancelled under a row budget, every pass padded and staged (a model with a
    prelude, a coda, injection and an initial state): each request equals its sequential decoding alone, every
    loop's logits too, and every request's blocks come back."""
    rng = random.Random(401)
    model = huginn_like(7)
    recorder = PromptKeyed(model)
    config = dataclasses.replace(churn_config(rng, MAX_PROMPT, 12, 8), max_active=2, graphs=True)
    engine = Engine(recorder, config)
    staged = count_staged(model)
    make = functools.partial(churn_request, rng, model, iter(range(2, model.vocab_size)))
    requests, finished = drive(engine, rng, [rng.randrange(0, 6) for _ in range(3)], make, 0.25, 6)
    assert max(staged) > 1 and engine.blocks[0] == 0 and len(finished) == 3
    for f in finished:
        equals_sequential_alone(recorder, model, requests[f.id], f)
