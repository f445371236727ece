"""The paged KV cache in the engine: a request's logits are the same bit for bit whatever the pool holds and
whatever blocks it got; a request waits for its blocks, one that could never fit is refused at add, and blocks
go back on finish and cancel."""

from __future__ import annotations

import functools
import random

import numpy as np
import pytest
import torch
from engine_helpers import drive
from test_lm_decoding import PromptKeyed, assert_same_logits, churn_request, equals_sequential_alone, random_model

from speed.config import ModelConfig
from speed.decode.generate import DecodeOptions, generate
from speed.engine import Engine, EngineConfig, Request, Speculation
from speed.engine.cache import KVCache, Rows
from speed.engine.kernels import ATTN_CHUNK
from speed.engine.sampling import Sampling
from speed.models.t5 import SpeedT5

MAX_PROMPT, MAX_NEW = 40, 40  # a request spans up to three blocks of ATTN_CHUNK positions


class Scattered(PromptKeyed):
    """``PromptKeyed`` that notes whether a slot ever held blocks out of order or with gaps (freed by others)."""

    scattered = False

    def step(self, memory, cache, rows, hidden, with_logits=True):
        table = cache.inner.loops.table
        for slot in set(rows.slot.tolist()):
            held = table[slot][table[slot] != 0]
            self.scattered |= bool(len(held) > 1 and (np.diff(held) != 1).any())
        return super().step(memory, cache, rows, hidden, with_logits)


def long_request(r: random.Random, model, counter) -> Request:
    """``churn_request`` with a longer prompt and output, so a request spans several blocks."""
    request = churn_request(r, model, counter)
    prompt = request.input_ids + [r.randrange(2, model.vocab_size) for _ in range(r.randint(0, MAX_PROMPT - 12))]
    return Request(prompt, r.randint(1, MAX_NEW), request.method, request.speculation, sampling=request.sampling)


@pytest.mark.parametrize("pool", ["small", pytest.param("big", marks=pytest.mark.slow)])
def test_churn_in_a_small_and_a_big_pool_equals_sequential_alone(pool):
    """Random arrivals and cancellations, SPEED with branches and sequential, greedy and sampled, in a pool of
    a few requests' blocks (requests wait for theirs, and get blocks others freed, scattered) or of many: each
    finished request's logits (every loop) and tokens equal its sequential decoding alone in a default engine."""
    scattered = waited = 0
    for seed in range(3):
        rng = random.Random(3000 + seed)
        model = random_model(seed)
        per_request = -(-(MAX_PROMPT - 1 + MAX_NEW) // ATTN_CHUNK)
        blocks = per_request + 2 if pool == "small" else 8 * per_request
        config = EngineConfig(max_active=4, max_prompt_len=MAX_PROMPT, max_target_len=MAX_NEW, kv_blocks=blocks)
        recorder = Scattered(model)
        engine = Engine(recorder, config)
        counter = iter(range(2, model.vocab_size))
        make = functools.partial(long_request, rng, model, counter)

        def watch(_, engine=engine, blocks=blocks):
            nonlocal waited
            taken, reserved, total = engine.blocks
            assert taken <= reserved <= total == blocks  # never more taken than reserved, nor reserved than held
            waited += engine.queued > 0 and engine.active < 4

        requests, finished = drive(engine, rng, [rng.randrange(0, 40) for _ in range(7)], make, 0.2, 15, watch)
        assert engine.blocks == (0, 0, blocks)  # every block back in the pool
        scattered += recorder.scattered
        for f in finished:
            equals_sequential_alone(recorder, model, requests[f.id], f)
    if pool == "small":
        assert waited > 0 and scattered > 0  # the pool was the limit, and blocks came back out of order


@pytest.mark.parametrize("sampling", [Sampling(), Sampling(temperature=1.0, top_k=8, seed=3)], ids=["greedy", "seeded"])
def test_t5_speed_with_branches_equals_sequential_in_a_tight_pool(sampling):
    """T5, requests that cannot all run at once (a pool of two requests' blocks): SPEED with branches equals each
    request's sequential decoding alone in a default engine, every loop's logits bit for bit."""
    torch.manual_seed(0)
    config = ModelConfig(vocab_size=64, d_model=32, n_heads=2, d_kv=8, d_ff=64, n_encoder_layers=1, pattern="2x3")
    model = SpeedT5(config).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(8.0)  # far from uniform exits, so speculation flushes and branches
    prompts = [torch.randint(2, 64, (6,)).tolist() for _ in range(5)]
    recorder = PromptKeyed(model)
    engine = Engine(recorder, EngineConfig(max_active=5, max_prompt_len=6, max_target_len=70, kv_blocks=2 * 3))
    speculation = Speculation(launch_loop=1, branches=2, branch_depth=2)
    for prompt in prompts:
        engine.add(Request(prompt, 70, "speed", speculation, sampling=sampling, stop_ids=[0]))
    finished, most = [], 0
    while engine.has_work:
        finished += engine.step().finished
        most = max(most, engine.active)
    assert most == 2 and sum(f.stats.flushes for f in finished) > 0  # the pool was the limit; speculation missed
    for f in finished:
        prompt = prompts[f.id]
        reference = PromptKeyed(model)
        ref = generate(
            reference,
            torch.tensor([prompt]),
            options=DecodeOptions(method="sequential", max_new_tokens=70, sampling=sampling, stop_ids=[0]),
        )
        assert f.tokens == ref.tokens[0]
        assert_same_logits(recorder, reference, tuple(prompt), len(f.tokens), model.n_loops)


def test_a_request_that_could_never_fit_is_refused_at_add_one_that_cannot_yet_waits():
    model = random_model(0)
    engine = Engine(model, EngineConfig(max_active=2, max_prompt_len=40, max_target_len=64, kv_blocks=3))
    with pytest.raises(ValueError, match="need 4 key/value blocks, but the engine's cache holds 3"):
        engine.add(Request([5] * 40, 64))
    first, second = engine.add(Request([5] * 33, 60)), engine.add(Request([6] * 2, 3))  # 3 blocks, then 1
    engine.step()
    assert (engine.active, engine.queued) == (1, 1) and engine.blocks[1:] == (3, 3)
    assert engine.blocks[0] == 2  # taken as written: the prompt's 32 positions and output position 0's row
    engine.cancel(first)
    assert engine.blocks == (0, 0, 3)  # a cancelled request's blocks go back at once
    finished = []
    while engine.has_work:
        finished += engine.step().finished
    assert [f.id for f in finished] == [second] and engine.blocks == (0, 0, 3)


def test_invalidation_frees_whole_blocks_past_the_new_length_and_reads_ignore_the_pool():
    """A slot's chunks map onto whatever blocks it got: after another slot's blocks are freed in between, a
    read equals the positions written, and invalidating gives back exactly the blocks wholly past the cut."""
    cache = KVCache(n_loops=2, n_layers=1, n_slots=2, n_heads=1, max_len=4 * ATTN_CHUNK, d_kv=2, n_blocks=5)
    data = torch.randn(2, 1, 4 * ATTN_CHUNK, 2)  # per slot (H, T, D)
    cache.write_span(0, 0, 0, 0, data[0][:, :ATTN_CHUNK], data[0][:, :ATTN_CHUNK])  # slot 0: block 1
    cache.write_span(0, 0, 1, 0, data[1][:, : 2 * ATTN_CHUNK], data[1][:, : 2 * ATTN_CHUNK])  # slot 1: 2, 3
    cache.reset(1)
    cache.write_span(0, 0, 0, ATTN_CHUNK, data[0][:, ATTN_CHUNK:], data[0][:, ATTN_CHUNK:])  # slot 0: 2, 3, 4
    assert cache.table[0].tolist() == [1, 2, 3, 4] and cache.blocks_used == 4
    rows = Rows.build([0], [0], [4 * ATTN_CHUNK - 1])
    keys, _ = cache.read(0, rows, 4 * ATTN_CHUNK)
    assert torch.equal(keys[0], data[0])
    cache.invalidate(0, ATTN_CHUNK + 1)  # the second chunk keeps a valid position: only chunks 2, 3 go
    assert cache.table[0].tolist() == [1, 2, 0, 0] and cache.blocks_used == 2 and cache.lengths[0, 0, 0] == 33
    assert torch.equal(cache.read(0, Rows.build([0], [0], [32]), ATTN_CHUNK * 2)[0][0, :, :33], data[0][:, :33])
    cache.reset(0)
    assert cache.blocks_used == 0 and (cache.table == 0).all()
