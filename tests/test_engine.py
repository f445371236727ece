"""The continuous-batching engine: exactness under churn, row budget, cancellation, validation, threads.

The differential test drives random arrival and cancellation schedules over
random tiny models: every request that finishes must equal decoding it alone
with sequential greedy decoding, token for token and exit for exit.
"""

from __future__ import annotations

import math
import random
import threading

import pyarrow.compute as pc
import pytest
import torch
from engine_helpers import BLOCKS, churn_config, drive, random_exits
from test_decoding_schedule import BAD_SETTINGS, EOS, StubModel, target

from speed.config import preset
from speed.decode.exactness import LogitRecorder
from speed.decode.generate import DecodeOptions, generate
from speed.engine import Engine, EngineConfig, Request, Speculation, budget_rows
from speed.engine.sampling import Sampling
from speed.engine.trace import flip_rates
from speed.models.exits import attach
from speed.models.t5 import SpeedT5

PATTERNS = ["1x4", "4x1", "2x6", "3x4", "2x3", "1x5", "3x3", "1x1"]


def tiny_model(seed: int, pattern: str) -> SpeedT5:
    torch.manual_seed(seed)
    model = SpeedT5(preset("tiny", pattern=pattern)).eval()
    if seed % 2 == 0:  # make EOS likely so that requests end at different times
        with torch.no_grad():
            model.lm_head.weight[model.eos_id] *= 3.0
    return model


def alone(model, request: Request):
    """Reference: the request decoded alone sequentially (greedy, or sampled with its own settings)."""
    ids = torch.tensor([request.input_ids])
    return generate(
        model,
        ids,
        options=DecodeOptions(method="sequential", max_new_tokens=request.max_new_tokens, sampling=request.sampling),
    )


def random_sampling(rng: random.Random) -> Sampling:
    """Greedy half the time, else sampling with a random seed, temperature, support and penalties."""
    if rng.random() < 0.5:
        return Sampling()
    return Sampling(
        temperature=rng.choice([0.0, 0.5, 0.7, 1.0, 1.5]),
        top_k=rng.choice([0, 0, 1, 5, 40]),
        top_p=rng.choice([1.0, 1.0, 0.9, 0.5]),
        seed=rng.randrange(2**63),
        presence_penalty=rng.choice([0.0, 0.0, 0.6]),
        frequency_penalty=rng.choice([0.0, 0.0, -0.4, 1.0]),
        coupled=rng.random() < 0.7,
    )


def random_request(rng: random.Random, model: SpeedT5, max_source: int, max_target: int) -> Request:
    m = model.n_loops
    ids = [rng.randrange(3, model.vocab_size) for _ in range(rng.randint(1, max_source))]
    n, method = rng.randint(1, max_target), rng.choice(["speed", "speed", "speed", "sequential"])
    speculation = Speculation(rng.choice(sorted({1, rng.randint(1, m), m})), rng.choice(["eager", "final"]))
    return Request(ids, n, method, speculation, sampling=random_sampling(rng))


@pytest.mark.parametrize("block", BLOCKS[:4])
def test_churn_equals_sequential_alone(block):
    """Random arrivals, cancellations, capacities, budgets, policies, greedy and sampled requests mixed:
    each finished request is exact."""
    flushes = budget_bound = cancelled = sampled = 0
    for seed in range(block * 10, block * 10 + 10):
        rng = random.Random(seed)
        model = tiny_model(seed, PATTERNS[seed % len(PATTERNS)])
        config = churn_config(rng, max_prompt_len=10, max_target_len=16, max_budget=8)
        engine = Engine(model, config)

        def budgeted(result, budget=config.row_budget):
            nonlocal budget_bound
            assert budget is None or result.rows <= budget
            budget_bound += budget is not None and result.rows == budget

        arrivals = [rng.randrange(0, 40) for _ in range(rng.randint(3, 9))]
        requests, finished = drive(
            engine, rng, arrivals, lambda r=rng, m=model: random_request(r, m, 10, 16), 0.25, 12, on_step=budgeted
        )
        for f in finished:
            ref = alone(model, requests[f.id])
            assert f.stats.tokens == len(f.tokens)
            if f.cancelled:
                cancelled += 1
                assert f.tokens == ref.tokens[0][: len(f.tokens)]
                continue
            assert f.tokens == ref.tokens[0], f"request {f.id} of seed {seed}: {requests[f.id]}"
            # the same per-loop early exits as the reference, whoever shared the steps
            exits = f.trace.drop_columns(["sequence"])
            assert exits.equals(ref.trace.drop_columns(["sequence"]))
            assert set(f.trace.column("sequence").to_pylist()) <= {f.id}
            rates = flip_rates(ref.trace).column("flip_rate_final").to_pylist()
            assert f.stats.flip_rate == pytest.approx(rates)
            assert f.stats.rows == f.stats.tokens * model.n_loops + f.stats.wasted_rows
            assert 0 <= f.stats.queued_s <= f.stats.ttft_s <= f.stats.latency_s
            flushes += f.stats.flushes
            sampled += not requests[f.id].sampling.greedy
    assert flushes > 0 and budget_bound > 0 and cancelled > 0 and sampled > 0  # every path was exercised


def test_budget_rows_committed_path_first():
    assert budget_rows([3, 1, 2], 10) == [3, 1, 2]
    assert budget_rows([3, 1, 2], 4) == [2, 1, 1]  # one per request, then one level deeper in order
    assert budget_rows([3, 1, 2], 2) == [1, 1, 0]  # not even every committed-path row fits
    assert budget_rows([3, 1, 2], 5) == [2, 1, 2]
    assert budget_rows([], 3) == []


class RecordingStub(StubModel):
    """The schedule tests' stub, recording each step's rows as (slot, loop, position) triples."""

    def __init__(self, n_loops, table):
        super().__init__(n_loops, table)
        self.steps: list[list[tuple[int, int, int]]] = []

    def step(self, memory, cache, rows, hidden, with_logits=True):
        self.steps.append(list(zip(rows.slot.tolist(), rows.loop.tolist(), rows.pos.tolist())))
        return super().step(memory, cache, rows, hidden, with_logits)


def run_all(engine: Engine) -> dict[int, list[int]]:
    out = {}
    while engine.has_work:
        out.update((f.id, f.tokens) for f in engine.step().finished)
    return out


def test_row_budget_serves_the_committed_path_first():
    model = RecordingStub(3, lambda s, p, lo: target(p))
    engine = Engine(model, EngineConfig(max_active=2, max_source_len=3, max_target_len=8, row_budget=3))
    a, b = (engine.add(Request([5], 4)) for _ in range(2))
    assert run_all(engine) == {a: [target(p) for p in range(4)], b: [target(p) for p in range(4)]}
    # step 1: both first tokens; then both committed-path rows and one speculative row (request a's)
    assert model.steps[:3] == [
        [(0, 0, 0), (1, 0, 0)],
        [(0, 1, 0), (0, 0, 1), (1, 1, 0)],
        [(0, 2, 0), (0, 1, 1), (1, 2, 0)],
    ]
    assert all(len(rows) <= 3 for rows in model.steps)
    # every step computed each unfinished request's oldest in-flight token
    unlimited = RecordingStub(3, lambda s, p, lo: target(p))
    free = Engine(unlimited, EngineConfig(max_active=2, max_source_len=3, max_target_len=8))
    for _ in range(2):
        free.add(Request([5], 4))
    run_all(free)
    assert len(unlimited.steps) == 4 + 3 - 1 < len(model.steps)
    assert max(map(len, unlimited.steps)) == 6  # M rows each, when nothing limits


def test_row_budget_below_active_requests_takes_turns():
    model = RecordingStub(2, lambda s, p, lo: target(p))
    engine = Engine(model, EngineConfig(max_active=3, max_source_len=3, max_target_len=8, row_budget=1))
    ids = [engine.add(Request([5], 2)) for _ in range(3)]
    assert run_all(engine) == {i: [10, 11] for i in ids}
    assert [rows[0][0] for rows in model.steps[:6]] == [0, 1, 2, 0, 1, 2]  # one row a step, in rotation
    assert len(model.steps) == 3 * 2 * 2  # no speculation fits: 2 tokens x 2 loops each


def test_cancel_frees_the_slot_for_a_waiting_request():
    model = RecordingStub(3, lambda s, p, lo: target(p))
    engine = Engine(model, EngineConfig(max_active=1, max_source_len=3, max_target_len=10))
    first = engine.add(Request([5], 10))
    second = engine.add(Request([6, 7], 3))
    for _ in range(5):
        engine.step()
    assert (engine.active, engine.queued) == (1, 1)
    gone = engine.cancel(first)
    assert gone.cancelled and gone.tokens == [10, 11, 12]  # committed after steps 3, 4 and 5
    assert gone.stats.wasted_rows == 2 + 1  # its two speculative tokens in flight
    assert (engine.active, engine.queued) == (0, 1)
    assert engine.cancel(first) is None and engine.cancel(99) is None
    assert engine._cache.lengths[:, 0, 0].tolist() == [0, 0, 0]  # emptied: its blocks went back to the pool
    assert engine.blocks == (0, 0, engine._cache.n_blocks)
    result = engine.step()
    assert model.steps[-1] == [(0, 0, 0)]  # the waiting request took slot 0 from position 0
    assert result.rows == 1
    assert run_all(engine) == {second: [10, 11, 12]}


def test_cancel_a_queued_request():
    engine = Engine(StubModel(2, lambda s, p, lo: target(p)), EngineConfig(max_active=1, max_target_len=4))
    engine.add(Request([5], 4))
    queued = engine.add(Request([5], 4))
    engine.step()
    gone = engine.cancel(queued)
    assert gone.cancelled and gone.tokens == [] and math.isnan(gone.stats.queued_s)
    assert engine.queued == 0


def test_step_result_reports_commits_in_order():
    engine = Engine(StubModel(2, lambda s, p, lo: EOS if (s == 1 and p == 1) else target(p)), EngineConfig(4, 3, 6))
    a = engine.add(Request([5], 3))
    b = engine.add(Request([5], 3, method="sequential"))
    committed, finished = [], []
    while engine.has_work:
        r = engine.step()
        committed += r.committed
        finished += r.finished
    assert [c.token for c in committed if c.id == a] == [10, 11, 12]
    assert [c.token for c in committed if c.id == b] == [10, EOS]
    assert all(c.logprob is None for c in committed)  # not asked for
    assert {f.id: f.tokens for f in finished} == {a: [10, 11, 12], b: [10, EOS]}
    assert engine.stats.tokens == 5
    seq_stats = next(f.stats for f in finished if f.id == b)
    assert (seq_stats.steps, seq_stats.rows, seq_stats.flushes) == (4, 4, 0)  # 2 tokens x 2 loops, one row a step


def test_sequential_without_trace_skips_early_exits():
    calls = []
    model = StubModel(3, lambda s, p, lo: target(p))
    original = model.step

    def step(memory, cache, rows, hidden, with_logits=True):
        calls.append(with_logits)
        return original(memory, cache, rows, hidden, with_logits)

    model.step = step
    engine = Engine(model, EngineConfig(1, 3, 4, trace=False))
    engine.add(Request([5], 2, method="sequential"))
    (done,) = [f for _ in range(6) for f in engine.step().finished]
    assert calls == [False, False, True] * 2  # the head runs at the last loop only
    assert done.tokens == [10, 11] and done.stats.flip_rate == [] and done.trace is None


@pytest.mark.parametrize(
    "request_kw, fragment",
    [
        *BAD_SETTINGS,
        ({"max_new_tokens": 9}, "max_new_tokens must be at most 8 .the engine's max_target_len"),
        ({"max_new_tokens": 2.5}, "max_new_tokens must be at least 1"),
        ({"input_ids": []}, "non-empty list of token ids"),
        ({"input_ids": "hello"}, "non-empty list of token ids"),
        ({"input_ids": [3] * 7}, "7 tokens, more than 6 .the engine's max_source_len"),
        ({"input_ids": [3, 128]}, r"token ids in \[0, 128\), got 128"),
        ({"input_ids": [3, -1]}, r"token ids in \[0, 128\), got -1"),
        ({"input_ids": [3, 4.0]}, r"got 4\.0"),
        ({"method": "sequential", "oracle": [1]}, "oracle needs method='speed'"),
        ({"sampling": {"temperature": 1.0}}, "sampling must be a speed.engine.sampling.Sampling"),
        ({"logprobs": 21}, r"logprobs must be None or an integer in 0\.\.20"),
        ({"logprobs": -1}, r"logprobs must be None or an integer in 0\.\.20"),
        ({"logprobs": True}, r"logprobs must be None or an integer in 0\.\.20"),
    ],
)
def test_add_rejects_bad_requests(request_kw, fragment):
    engine = Engine(StubModel(3, lambda s, p, lo: 5), EngineConfig(max_active=1, max_source_len=6, max_target_len=8))
    kw = {"input_ids": [3, 4], "max_new_tokens": 4} | request_kw
    with pytest.raises(ValueError, match=fragment):
        engine.add(Request(**kw))
    assert not engine.has_work


def test_config_and_model_mode_are_checked():
    with pytest.raises(ValueError, match="max_active must be at least 1"):
        EngineConfig(max_active=0)
    with pytest.raises(ValueError, match="row_budget must be at least 1"):
        EngineConfig(row_budget=0)
    with pytest.raises(ValueError, match="eval mode"):
        Engine(SpeedT5(preset("tiny", pattern="1x2")).train())


def test_inference_mode_and_threads():
    """Built under inference_mode or not, stepped in one thread while another adds: the same tokens."""
    model = tiny_model(3, "2x3")
    rng = random.Random(0)
    requests = [random_request(rng, model, 8, 10) for _ in range(6)]
    expected = [alone(model, r).tokens[0] for r in requests]
    with torch.inference_mode():
        engine = Engine(model, EngineConfig(max_active=3, max_source_len=8, max_target_len=10))
    ids: list[int] = []
    finished: dict[int, list[int]] = {}

    def producer():
        for r in requests:
            ids.append(engine.add(r))

    thread = threading.Thread(target=producer)
    thread.start()
    while thread.is_alive() or engine.has_work:
        finished.update((f.id, f.tokens) for f in engine.step().finished)
    thread.join()
    assert [finished[i] for i in ids] == expected
    with torch.inference_mode():  # and stepped inside an outer inference_mode
        again = Engine(model, EngineConfig(max_active=2, max_source_len=8, max_target_len=10))
        first = again.add(requests[0])
        assert run_all(again) == {first: expected[0]}


def test_flip_rate_matches_trace():
    model = tiny_model(4, "2x3")
    engine = Engine(model, EngineConfig(max_active=2, max_source_len=8, max_target_len=12))
    engine.add(Request([5, 6, 7], 12))
    engine.add(Request([8, 9], 12, speculation=Speculation(launch_loop=2)))
    for f in (f for _ in range(60) for f in engine.step().finished):
        trace = f.trace
        assert pc.all(pc.equal(trace.column("sequence"), f.id)).as_py()
        assert f.stats.flip_rate == pytest.approx(flip_rates(trace).column("flip_rate_final").to_pylist())
        assert len(f.stats.flip_rate) == model.n_loops and f.stats.flip_rate[-1] == 0.0


def test_logprobs_are_the_last_loops_log_softmax():
    """Each committed token carries its log-probability and the k best under the last loop's raw logits,
    the same in the step's commits and in the finished request, and the same under SPEED as sequentially."""
    model = tiny_model(5, "2x3")
    ids = [5, 6, 7, 8]
    hot = Sampling(temperature=1.0, seed=11)
    results = {}
    for method in ("speed", "sequential"):
        engine = Engine(model, EngineConfig(max_active=2, max_source_len=8, max_target_len=10))
        a = engine.add(Request(ids, 10, method=method, sampling=hot, logprobs=3))
        b = engine.add(Request(ids, 10, method=method, sampling=hot))  # none asked for
        commits, done = [], {}
        while engine.has_work:
            step = engine.step()
            commits += step.committed
            done.update((f.id, f) for f in step.finished)
        assert [c.logprob for c in commits if c.id == a] == done[a].logprobs
        assert all(c.logprob is None for c in commits if c.id == b) and done[b].logprobs is None
        assert [lp.token for lp in done[a].logprobs] == done[a].tokens == done[b].tokens
        results[method] = done[a].logprobs
    assert results["speed"] == results["sequential"]  # exact floats, not close ones
    rec = LogitRecorder(model)
    tokens = generate(
        rec, torch.tensor([ids]), options=DecodeOptions(method="sequential", max_new_tokens=10, sampling=hot)
    ).tokens[0]
    for p, lp in enumerate(results["speed"]):
        ref = rec.logits[(0, model.n_loops - 1, p)].log_softmax(-1)  # the last loop's raw logits
        assert lp.logprob == ref[tokens[p]].item()
        assert [t for t, _ in lp.top] == ref.topk(3).indices.tolist()
        assert [v for _, v in lp.top] == sorted((v for _, v in lp.top), reverse=True)


@pytest.mark.slow
def test_churn_with_exit_adapters_equals_plain_sequential_alone():
    """Exit adapters (``speed.models.exits``) under random arrivals, cancellations, capacities and budgets, greedy and
    sampled: every finished request's tokens, and its last loop's predictions, are those of the request decoded
    alone, sequentially, without adapters; its early exits are those of the adapted model alone."""
    finished_n = changed = 0
    for seed in range(4):
        rng = random.Random(500 + seed)
        model = random_exits(tiny_model(seed, ["2x3", "1x4", "3x4", "2x6"][seed]), seed)
        adapters, m = model.exit_adapters, model.n_loops
        config = EngineConfig(max_active=rng.randint(2, 4), max_source_len=10, max_target_len=16,
                              row_budget=rng.choice([None, 5]))  # fmt: skip
        engine = Engine(model, config)
        arrivals = [rng.randrange(0, 30) for _ in range(6)]
        requests, finished = drive(
            engine, rng, arrivals, lambda r=rng, mo=model: random_request(r, mo, 10, 16), 0.2, 10
        )
        for f in (f for f in finished if not f.cancelled):
            request = requests[f.id]
            adapted = alone(model, request)
            attach(model, None)
            plain = alone(model, request)
            attach(model, adapters)
            assert f.tokens == plain.tokens[0] == adapted.tokens[0], (seed, request)
            exits = f.trace.drop_columns(["sequence"])
            assert exits.equals(adapted.trace.drop_columns(["sequence"]))
            last = pc.equal(plain.trace.column("loop"), m)
            assert plain.trace.filter(last).column("prediction").equals(f.trace.filter(last).column("prediction"))
            changed += not plain.trace.drop_columns(["sequence"]).equals(exits)
            finished_n += 1
    assert finished_n > 5 and changed > 0
