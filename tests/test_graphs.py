"""The group pass in row-count buckets (``speed.engine.graphs``), run eagerly on the CPU: the bucket bookkeeping,
padding rows in the scratch slot that change no real row's bits nor write a request's place, and SPEED through
the bucketed executor equal to sequential decoding bit for bit (both families, greedy and sampled, branches, an
engine under churn). On CUDA it is the default for a stepper whose pass can be captured (tests/test_gpu_decode.py
runs it there)."""

from __future__ import annotations

import dataclasses
import functools
import random

import numpy as np
import pytest
import torch
from engine_helpers import churn_config, drive, speed_as_sequential
from test_decoding_exact import padded_batch
from test_engine import alone, random_request, tiny_model
from test_lm_decoding import PromptKeyed, churn_request, equals_sequential_alone
from test_lm_decoding import random_model as random_lm

from speed.decode.exactness import LogitRecorder
from speed.decode.generate import DecodeOptions, generate
from speed.engine import Engine, EngineConfig, Request, Speculation
from speed.engine.cache import KVCache, Rows
from speed.engine.graphs import BUCKETS, GraphSteps, StepBuffers, bucket, kv_caches, pad_rows
from speed.engine.kernels import ATTN_CHUNK
from speed.engine.sampling import Sampling, choices_of, decisions, device_gumbel, exit_choices, gumbel

SAMPLED = Sampling(temperature=1.0, top_p=0.9, seed=3, presence_penalty=0.5)
SAMPLINGS = [None, pytest.param(SAMPLED, marks=pytest.mark.slow)]  # greedy in the quick loop, sampled in make test


def test_a_step_takes_the_smallest_bucket_that_holds_its_rows():
    assert [bucket(n) for n in (1, 2, 3, 4, 5, 8, 9, 17, 33, 64)] == [1, 2, 4, 4, 8, 8, 16, 32, 64, 64]
    assert bucket(65) is None  # runs unpadded
    assert bucket(3, (2, 6)) == 6
    with pytest.raises(ValueError, match="at least one row"):
        bucket(0)
    assert BUCKETS == (1, 2, 4, 8, 16, 32, 64)


def test_padding_rows_go_to_the_scratch_slot():
    rows = Rows.build([0, 1, 1], [2, 0, 1], [5, 40, 39])
    padded = pad_rows(rows, 8, scratch=9)
    assert len(padded) == 8 and padded.side is None and padded.padding == 5 and rows.padding == 0
    assert padded.slot.tolist() == [0, 1, 1] + [9] * 5
    assert padded.loop.tolist() == [2, 0, 1] + [0] * 5
    assert padded.pos.tolist() == [5, 40, 39, 0, 0, 0, 0, 0]  # the scratch slot's one place
    assert pad_rows(rows, 3, scratch=9) is rows
    branched = Rows.build([0, 0], [1, 0], [3, 3], [-1, 2], [(), ((3, 1),)])
    padded = pad_rows(branched, 4, scratch=5)
    assert padded.side.tolist() == [-1, 2, -1, -1] and padded.up == ((), ((3, 1),), (), ())
    with pytest.raises(ValueError, match="do not fit"):
        pad_rows(rows, 2, scratch=9)


def test_padding_rows_write_no_request_place_and_count_nowhere():
    """Padding rows' keys land in the scratch slot's own block: every other slot's entries, valid lengths and the
    pool's count stay as they were."""
    cache = KVCache(n_loops=2, n_layers=1, n_slots=3, n_heads=2, max_len=40, d_kv=4, n_side=0)
    cache.set_scratch(2)
    assert cache.blocks_used == 0 and cache.table[2, 0] != 0
    rows = Rows.build([0, 1], [0, 0], [0, 0])
    k = torch.randn(2, 2, 4)
    cache.write(0, rows, k, k + 1)
    before = [cache.slot_entries(0, s, 1) for s in (0, 1)]
    lengths, used = cache.lengths.copy(), cache.blocks_used
    padded = pad_rows(Rows.build([0, 1], [1, 1], [0, 0]), 8, scratch=2)
    for _ in range(2):  # again: the scratch slot takes no valid prefix, so its rows never collide with one
        cache.write(0, padded.take(np.arange(2, 8)), torch.randn(6, 2, 4), torch.randn(6, 2, 4))
    assert np.array_equal(cache.lengths, lengths) and cache.blocks_used == used == 2
    for s, (keys, values) in zip((0, 1), before):
        now = cache.slot_entries(0, s, 1)
        assert torch.equal(now[0], keys) and torch.equal(now[1], values)
    cache.write(0, padded, torch.randn(8, 2, 4), torch.randn(8, 2, 4))  # real rows beside padding: theirs count
    assert cache.lengths[1, 0, :2].tolist() == [1, 1]


def test_the_step_buffers_stay_put_and_the_rows_read_them():
    buffers = StepBuffers.allocate(4, 3, torch.float32, torch.device("cpu"))
    address = buffers.meta.data_ptr(), buffers.hidden.data_ptr()
    steps = Rows.build([0, 1, 2, 3], [0, 1, 2, 0], [4, 5, 6, 7]), Rows.build([3, 3, 1, 0], [1, 1, 0, 0], [1, 2, 3, 4])
    for rows in steps:
        loaded = buffers.load(rows, torch.full((4, 3), float(rows.pos[0])))
        slot_t, loop_t, pos_t = loaded.tensors("cpu")
        assert (buffers.meta.data_ptr(), buffers.hidden.data_ptr()) == address
        assert slot_t.data_ptr() == buffers.meta[0].data_ptr()
        expected = torch.as_tensor(np.stack([rows.slot, rows.loop, rows.pos]))
        assert torch.equal(torch.stack([slot_t, loop_t, pos_t]), expected)
        assert torch.equal(buffers.hidden, torch.full((4, 3), float(rows.pos[0])))
    with pytest.raises(ValueError, match="bucket of 4"):
        buffers.load(Rows.build([0], [0], [0]), torch.zeros(1, 3))


def test_graph_steps_pad_and_return_the_real_rows_only():
    """A stub pass that sees the padded rows: it is called on the bucket's rows, asked for the real rows' logits, and
    only the real rows' outputs come back; more rows than the largest bucket run unpadded."""
    calls = []

    def step(rows, hidden, with_logits, logit_rows):
        calls.append((len(rows), logit_rows, rows.slot.tolist()))
        picked = hidden if logit_rows is None else hidden[logit_rows]
        return hidden * 2, (picked + 1 if with_logits else None)

    graphs = GraphSteps(scratch=7, device=torch.device("cpu"), capture=False, buckets=(2, 4))
    hidden = torch.arange(6.0).reshape(3, 2)
    out, logits = graphs.run(step, Rows.build([0, 1, 2], [0, 0, 0], [0, 0, 0]), hidden, True, [0, 2])
    assert calls[-1] == (4, [0, 2], [0, 1, 2, 7])
    assert torch.equal(out, hidden * 2) and torch.equal(logits, hidden[[0, 2]] + 1)
    out, logits = graphs.run(step, Rows.build([0, 1, 2], [0, 0, 0], [0, 0, 0]), hidden, True, None)
    assert calls[-1] == (4, None, [0, 1, 2, 7]) and torch.equal(logits, hidden + 1)  # the padding's dropped
    out, logits = graphs.run(step, Rows.build([0], [0], [0]), hidden[:1], False, None)
    assert calls[-1] == (2, None, [0, 7]) and logits is None and out.shape == (1, 2)
    graphs.run(step, Rows.build([0] * 5, [0] * 5, list(range(5))), torch.zeros(5, 2), True, None)
    assert calls[-1] == (5, None, [0] * 5)


def stub_pass(device: torch.device, width: int = 16, vocab: int = 11):
    """A pass as a capturable stepper's must be: its row metadata read from ``Rows.tensors`` (the bucket's static
    buffers), no host work; returns ``step(rows, hidden, with_logits, logit_rows)``."""
    g = torch.Generator().manual_seed(0)
    w, head = (torch.randn(*shape, generator=g).to(device) for shape in ((width, width), (width, vocab)))
    tables = [torch.randn(n, width, generator=g).to(device) for n in (8, 8, 64)]  # per slot, loop, position

    def step(rows, hidden, with_logits, logit_rows):
        slot_t, loop_t, pos_t = rows.tensors(hidden.device)
        x = torch.tanh(hidden @ w + tables[0][slot_t] + tables[1][loop_t] + tables[2][pos_t])  # (R, d)
        logits = x @ head if with_logits else None  # (R, V)
        if logits is not None and logit_rows is not None:
            logits = logits.index_select(0, torch.as_tensor(logit_rows, device=hidden.device))
        return x, logits

    return step


def test_a_bucketed_pass_gives_each_row_what_an_unpadded_pass_gives():
    """The stub pass (what tests/test_gpu_decode.py captures on CUDA) through eager buckets, step after step with
    new rows: each real row's output and logits as the pass over the real rows alone gives them."""
    step = stub_pass(torch.device("cpu"))
    graphs = GraphSteps(scratch=5, device=torch.device("cpu"), capture=False)
    rng = random.Random(0)
    for n in [1, 3, 8, 2, 13, 40, 70]:
        rows = Rows.build([rng.randrange(5) for _ in range(n)], [rng.randrange(4) for _ in range(n)],
                          [rng.randrange(30) for _ in range(n)])  # fmt: skip
        hidden = torch.randn(n, 16)
        out, logits = graphs.run(step, rows, hidden, True, None)
        for r in range(n):  # row by row: the stub's matmul is not row-invariant in general, so compare closely
            alone = step(rows.take(np.array([r])), hidden[r : r + 1], True, None)
            assert torch.allclose(out[r], alone[0][0], atol=1e-5) and torch.allclose(logits[r], alone[1][0], atol=1e-4)
    assert sorted(graphs._buffers) == [1, 2, 4, 8, 16, 64]  # 70 rows: one unpadded pass


def test_the_device_decisions_are_the_host_decisions():
    """``decisions`` (one tensor, one copy) gives each row's draw, runner-up, probability and mode exactly as the
    separate reductions do; the noise computed on the logits' device is ``gumbel``'s on the CPU."""
    torch.manual_seed(0)
    scores = torch.randn(6, 50)
    scores[2, 7] = scores[2, 9] = scores[2].max() + 1  # a tie: the first maximum wins
    noise = torch.stack([gumbel(5, p, 50) for p in range(6)])
    for n in (None, noise):
        keys = scores if n is None else scores + n
        got = choices_of(decisions(scores, n).tolist(), n is not None)
        top = keys.argmax(-1)
        assert got.token == top.tolist() == exit_choices(scores, n).token
        assert got.runner_up == keys.scatter(-1, top[:, None], float("-inf")).argmax(-1).tolist()
        p = (scores.gather(-1, top[:, None])[:, 0] - torch.logsumexp(scores, -1)).exp()
        assert got.p_top == p.tolist()
        assert got.mode == (None if n is None else scores.argmax(-1).tolist())
    assert torch.equal(device_gumbel(5, 3, 50, "cpu"), gumbel(5, 3, 50))


def test_kv_caches_finds_the_parts_of_either_family():
    t5 = tiny_model(0, "2x3").stepper().cache(2, 4, 8)
    assert kv_caches(t5) == [t5]
    lm = random_lm(1).stepper().cache(2, 4, 8)
    parts = kv_caches(lm)
    assert parts and all(isinstance(p, KVCache) for p in parts)


@pytest.mark.parametrize("sampling", SAMPLINGS)
def test_t5_speed_through_buckets_equals_sequential(sampling):
    """Every loop's logits bit for bit: padded passes (batch 1, 3 and 8: buckets part-filled) against unpadded
    sequential decoding, SPEED's own speculation and with runner-up branches and lanes."""
    for seed, batch in enumerate((1, 3, 8)):
        rng = random.Random(seed)
        model = tiny_model(seed, ["2x3", "3x4", "1x5"][seed])
        ids, mask = padded_batch(rng, batch, model.config.vocab_size)
        reference = LogitRecorder(model)
        ref = generate(
            reference, ids, mask, DecodeOptions(method="sequential", max_new_tokens=14, sampling=sampling, graphs=False)
        )
        m = model.n_loops
        for speculation in (Speculation(1, "eager"), Speculation(2, "final", branches=m, branch_depth=m)):
            got = speed_as_sequential(
                model, reference, ref, ids, mask, 14, (seed, batch, speculation),
                speculation=speculation, sampling=sampling, graphs=True,
            )  # fmt: skip
            assert got.stats.rows == ref.stats.rows + got.stats.wasted_rows
        padded = generate(
            model, ids, mask, DecodeOptions(method="sequential", max_new_tokens=14, sampling=sampling, graphs=True)
        )
        assert padded.tokens == ref.tokens


@pytest.mark.parametrize("sampling", SAMPLINGS)
def test_lm_speed_through_buckets_equals_sequential(sampling):
    for seed, batch in ((0, 1), (3, 5), (4, 8)):  # variants with GQA, a sandwich norm, injection
        rng = random.Random(seed)
        model = random_lm(seed)
        ids = torch.tensor([[rng.randrange(2, model.vocab_size) for _ in range(6)] for _ in range(batch)])
        mask = torch.ones_like(ids)
        reference = LogitRecorder(model)
        ref = generate(
            reference, ids, mask, DecodeOptions(method="sequential", max_new_tokens=10, sampling=sampling, graphs=False)
        )
        m = model.n_loops
        for speculation in (Speculation(1, "eager"), Speculation(1, "final", branches=m, branch_depth=2)):
            speed_as_sequential(
                model, reference, ref, ids, mask, 10, (seed, batch, speculation),
                speculation=speculation, sampling=sampling, graphs=True,
            )  # fmt: skip


@pytest.mark.slow
def test_an_engine_in_buckets_under_churn_equals_sequential_alone():
    """T5 and LM engines whose requests join, leave and are cancelled under row budgets, every pass padded: each
    request equals its sequential decoding alone (the LM's every loop's logits too), and the pool's counts
    never include the scratch slot's block."""
    cancelled = 0
    for seed in range(2):
        rng = random.Random(300 + seed)
        model = tiny_model(seed, ["2x3", "3x3"][seed])
        config = dataclasses.replace(churn_config(rng, 10, 12, 8), graphs=True)
        engine = Engine(model, config)
        make = functools.partial(random_request, rng, model, 10, 12)
        requests, finished = drive(engine, rng, [rng.randrange(0, 20) for _ in range(6)], make, 0.2, 8)
        assert engine.blocks[0] == 0 and engine.blocks[2] == config.max_active  # every request's blocks back
        for f in finished:
            ref = alone(model, requests[f.id])
            assert f.tokens == ref.tokens[0][: len(f.tokens)]
            cancelled += f.cancelled
            assert f.cancelled or f.tokens == ref.tokens[0]
    rng = random.Random(400)
    model = random_lm(2)
    recorder = PromptKeyed(model)
    engine = Engine(recorder, dataclasses.replace(churn_config(rng, 12, 12, 8), graphs=True))
    make = functools.partial(churn_request, rng, model, iter(range(2, model.vocab_size)))
    requests, finished = drive(engine, rng, [rng.randrange(0, 20) for _ in range(5)], make, 0.25, 8)
    for f in finished:
        equals_sequential_alone(recorder, model, requests[f.id], f)
        cancelled += f.cancelled
    assert cancelled > 0


def test_bucketed_engines_refuse_and_reserve_as_unpadded_ones():
    """The scratch slot's block is the engine's own: a pool of kv_blocks still holds kv_blocks requests' blocks."""
    model = tiny_model(0, "2x3")
    for graphs in (False, True):
        config = EngineConfig(max_active=2, max_source_len=4, max_target_len=100, kv_blocks=2, graphs=graphs)
        engine = Engine(model, config)
        assert engine.blocks == (0, 0, 2)
        with pytest.raises(ValueError, match="holds 2"):
            engine.add(Request([5, 6], 2 * ATTN_CHUNK + 1))  # 3 blocks
        engine.add(Request([5, 6], 2 * ATTN_CHUNK))
        engine.add(Request([5, 6], 2))
        engine.step()
        assert engine.active == 1 and engine.queued == 1  # the second waits for the first's blocks


def test_a_stepper_without_a_kv_cache_runs_unpadded():
    """Bucketed passes need a ``KVCache`` to hold the scratch slot: a stepper whose cache has none (a stub's own)
    runs its passes unpadded, and decodes as it does without buckets."""
    from speed.decode.schedule import TableModel

    class Opaque:  # the stub's cache behind a wrapper that holds it out of sight (no attribute is a KVCache)
        def __init__(self, kv):
            self.__dict__["_get"] = lambda name: getattr(kv, name)

        def __getattr__(self, name):
            return self._get(name)

    class Stub(TableModel):
        def cache(self, *args, **kw):
            return Opaque(super().cache(*args, **kw))

    tokens = {}
    for graphs in (False, True):
        model = Stub(3, lambda slot, p, loop: 10 + (p * 7 + slot) % 5)
        engine = Engine(model, EngineConfig(max_active=2, max_prompt_len=1, max_target_len=6, graphs=graphs))
        assert engine._graphs is None and engine.blocks[2] == 2 * 1
        ids = [engine.add(Request([2], 6, "speed")) for _ in range(2)]
        done = {}
        while engine.has_work:
            done.update((f.id, f.tokens) for f in engine.step().finished)
        tokens[graphs] = [done[i] for i in ids]
        assert all(slot < 2 for call in model.calls for slot, *_ in call)  # no padding row in the scratch slot
    assert tokens[True] == tokens[False]
