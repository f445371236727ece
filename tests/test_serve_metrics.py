"""Speculation counted as vLLM counts it, from the engine to the replica's counters and Prometheus metrics.

The engine defines (``speed.engine.RequestStats``): a draft token is a token
launched from an early exit, on the chain or in a runner-up lane; its draft
position is how many uncommitted tokens were ahead of it then; a draft is a
launch at position 1; accepted tokens are draft tokens later committed (a
lane's once promoted). Oracle speculation (the final tokens known) is never
wrong, sequential decoding never drafts, and every committed token is either
accepted or on the committed path.
"""

from __future__ import annotations

import pytest
import torch

from speed import DecodeOptions, SpeedT5, generate, preset
from speed.engine import Engine, EngineConfig, Request, Speculation
from speed.serve.metrics import ServeCounters, ServeMetrics, spec_decode


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(3)
    return SpeedT5(preset("tiny", pattern="2x4")).eval()


def _first_finished(model, request):
    engine = Engine(model, EngineConfig(max_active=1, max_source_len=16, max_target_len=32))
    engine.add(request)
    while True:
        step = engine.step()
        if step.finished:
            return step.finished[0]


IDS = [5, 17, 33, 9, 60, 2, 1]


def test_oracle_speculation_accepts_every_draft_token(model):
    final = generate(model, torch.tensor([IDS]), options=DecodeOptions(method="sequential", max_new_tokens=20)).tokens[
        0
    ]
    f = _first_finished(model, Request(IDS, 20, "speed", Speculation(launch_loop=1), oracle=final))
    st = f.stats
    assert f.tokens == final and st.flushes == 0
    assert st.draft_tokens == st.accepted_tokens == len(final) - 1  # all but the first token were speculated
    assert st.drafts == 1 and len(st.accepted_per_pos) == 3  # one chain, positions 1..M-1
    assert sum(st.accepted_per_pos) == st.accepted_tokens and st.accepted_per_pos[0] >= 1
    assert st.draft_tokens_per_pos == st.accepted_per_pos  # every draft token accepted, position by position


def test_sequential_decoding_never_drafts(model):
    st = _first_finished(model, Request(IDS, 20, "sequential")).stats
    assert (st.drafts, st.draft_tokens, st.accepted_tokens, st.accepted_per_pos) == (0, 0, 0, [0, 0, 0])
    assert st.draft_tokens_per_pos == [0, 0, 0]


@pytest.mark.parametrize("launch_loop", [1, 2, 3])
def test_counters_add_up_under_real_speculation(model, launch_loop):
    f = _first_finished(model, Request(IDS, 24, "speed", Speculation(launch_loop)))
    st = f.stats
    assert st.accepted_tokens == sum(st.accepted_per_pos) <= st.draft_tokens == sum(st.draft_tokens_per_pos)
    assert all(a <= d for a, d in zip(st.accepted_per_pos, st.draft_tokens_per_pos))
    assert st.drafts == st.draft_tokens_per_pos[0]  # a draft: a launch at position 1
    assert st.drafts <= st.draft_tokens and st.drafts >= 1
    # each committed token was accepted or launched on the committed path, which starts a chain or ends one
    assert st.tokens - st.accepted_tokens >= st.drafts - st.flushes
    if launch_loop > 2:  # with 4 loops a token launched after 3 can have at most one token ahead of it
        assert st.accepted_per_pos[1:] == st.draft_tokens_per_pos[1:] == [0, 0]


def test_a_runner_up_lane_s_tokens_are_drafts_and_once_promoted_accepted():
    """The worked schedule of test_decoding_branches (M=3): position 0's loop-1 exit says 20 with runner-up 10,
    loop 2 switches to 10. Step 1 launches the chain successor 20 and the branch 10, both at draft position 1
    (two drafts); step 2 promotes the branch (accepted at position 1 when committed) and launches 11 from it
    at position 2 (accepted too)."""
    from test_decoding_branches import BranchStub, right

    stub = BranchStub(3, lambda s, p, lo: (20, 10, False) if (p == 0 and lo == 1) else right(p))
    f = _first_finished(stub, Request([1, 1, 1], 3, "speed", Speculation(branches=1)))
    st = f.stats
    assert f.tokens == [10, 11, 12] and (st.promotions, st.flushes) == (1, 0)
    assert (st.drafts, st.draft_tokens_per_pos, st.accepted_per_pos) == (2, [2, 1], [1, 1])
    assert (st.draft_tokens, st.accepted_tokens) == (3, 2)


def test_counters_add_up_with_runner_up_lanes(model):
    """A random model with lanes: every committed token is an accepted draft token or launched on the committed
    path. Under final invalidation with a successor always launched (launch_loop 1, EOS never predicted) the
    committed path is the first token and one relaunch per flush, so tokens = accepted + 1 + flushes; a
    promoted lane's committed tokens must be among the accepted ones."""
    from speed.tokenizer import EOS_ID

    torch.manual_seed(5)
    lanes = SpeedT5(preset("tiny", pattern="2x4")).eval()
    with torch.no_grad():
        lanes.lm_head.weight[EOS_ID] = 0  # its logit 0: never the argmax of a random model's exit
    promotions = 0
    for start in range(6):
        ids = [(start * 7 + 3 * i) % 50 + 3 for i in range(6)]
        request = Request(ids, 20, "speed", Speculation(invalidation="final", branches=4, branch_depth=3))
        st = _first_finished(lanes, request).stats
        assert st.tokens == 20 and st.tokens == st.accepted_tokens + 1 + st.flushes
        assert st.accepted_tokens == sum(st.accepted_per_pos) and st.draft_tokens == sum(st.draft_tokens_per_pos)
        assert all(a <= d for a, d in zip(st.accepted_per_pos, st.draft_tokens_per_pos))
        assert st.drafts == st.draft_tokens_per_pos[0]
        promotions += st.promotions
    assert promotions > 0  # not vacuous


def test_spec_decode_rates():
    s = spec_decode(drafts=4, draft_tokens=10, accepted=6, accepted_per_pos=[4, 2, 0], draft_tokens_per_pos=[5, 4, 0])
    assert (s["acceptance_rate"], s["mean_acceptance_length"]) == (0.6, 2.5)
    assert s["acceptance_rate_per_pos"] == [0.8, 0.5, None]
    none = spec_decode(0, 0, 0, [], [])
    assert (none["acceptance_rate"], none["mean_acceptance_length"]) == (None, None)


def test_replica_counters_sum_speculation(model):
    c = ServeCounters()
    for launch_loop in (1, 2):
        finished = _first_finished(model, Request(IDS, 16, "speed", Speculation(launch_loop)))
        c.add_finished({"prompt_tokens": 7}, finished, gaps=[])
    s = c.snapshot(0, 0)["spec_decode"]
    assert s["num_accepted_tokens"] == sum(s["num_accepted_tokens_per_pos"]) and s["num_drafts"] >= 2
    assert s["acceptance_rate"] == s["num_accepted_tokens"] / s["num_draft_tokens"]


class _Recorder:
    """A stand-in for ``ray.serve.metrics``: records every inc, observe and set by metric name."""

    def __init__(self):
        self.seen: dict[str, list] = {}

    def _metric(self, name, *args, **kwargs):
        seen = self.seen.setdefault(name, [])

        class Metric:
            def inc(self, value=1, tags=None):
                seen.append((value, tags))

            def observe(self, value, tags=None):
                seen.append((value, tags))

            def set(self, value, tags=None):
                seen.append((value, tags))

        return Metric()

    Counter = Histogram = Gauge = _metric


def test_prometheus_names_are_vllms_with_a_prefix_and_in_seconds():
    """One event, counted once: the replica's counters serve it in /v1/stats and hand it to Prometheus."""
    from speed.engine import Finished, RequestStats

    rec = _Recorder()
    counters = ServeCounters(export=ServeMetrics(rec))
    row = {"method": "speed", "finish_reason": "stop", "prompt_tokens": 7, "completion_tokens": 10, "flushes": 1}
    row |= {"drafts": 3, "draft_tokens": 8, "accepted_tokens": 6, "accepted_per_pos": [3, 2, 1]}
    row |= {"draft_tokens_per_pos": [3, 3, 2]}
    row |= {"flip_rate": [0.5, 0.1, 0.0], "ttft_ms": 40.0, "total_ms": 250.0, "queued_ms": 5.0}
    stats = RequestStats(10, 12, 30, 1, 0, [0.5, 0.1, 0.0], 0.005, 0.04, 0.25, 3, 8, 6, [3, 2, 1], [3, 3, 2])
    counters.add_finished(row, Finished(0, [5] * 10, stats, None), gaps=[0.02, 0.03])
    counters.add_step(rows=6, active=2, queued=1)
    live = counters.snapshot(active=2, queued=1)
    assert (live["finished"], live["tokens"], live["prompt_tokens"], live["steps"], live["rows"]) == (1, 10, 7, 1, 6)
    assert live["spec_decode"]["num_accepted_tokens_per_pos"] == [3, 2, 1] and live["flip_rate"] == [0.5, 0.1, 0.0]
    got = {name: [v for v, _ in seen] for name, seen in rec.seen.items() if seen}
    assert got["speed_spec_decode_num_drafts"] == [3] and got["speed_spec_decode_num_draft_tokens"] == [8]
    assert got["speed_spec_decode_num_accepted_tokens"] == [6]
    per_pos = {tags["position"]: v for v, tags in rec.seen["speed_spec_decode_num_accepted_tokens_per_pos"]}
    assert per_pos == {"1": 3, "2": 2, "3": 1}
    launched = {tags["position"]: v for v, tags in rec.seen["speed_spec_decode_num_draft_tokens_per_pos"]}
    assert launched == {"1": 3, "2": 3, "3": 2}
    assert got["speed_time_to_first_token_seconds"] == [0.04]
    assert got["speed_inter_token_latency_seconds"] == [0.02, 0.03]
    assert got["speed_e2e_request_latency_seconds"] == [0.25] and got["speed_request_queue_time_seconds"] == [0.005]
    assert got["speed_prompt_tokens"] == [7] and got["speed_generation_tokens"] == [10]
    assert got["speed_flipped_tokens"] == [5, 1] and got["speed_flushes"] == [1]
    assert (got["speed_num_requests_running"], got["speed_num_requests_waiting"]) == ([2], [1])
    assert got["speed_rows_per_step"] == [6]


def test_acceptance_tables_by_temperature_and_position():
    import pyarrow as pa

    from speed.analysis import acceptance, acceptance_by_position

    def row(method, t, drafts, launched, per_pos, tokens=10):
        counts = {"draft_tokens": sum(launched), "accepted_tokens": sum(per_pos), "accepted_per_pos": per_pos}
        counts["draft_tokens_per_pos"] = launched
        return {"method": method, "temperature": t, "completion_tokens": tokens, "drafts": drafts, **counts}

    rows = [row("speed", 0.0, 2, [2, 4], [2, 1]), row("speed", 0.0, 2, [2, 2], [1, 0])]
    rows += [row("speed", 0.8, 4, [4, 4], [2, 0]), row("sequential", 0.0, 0, [0, 0], [0, 0])]
    table = pa.Table.from_pylist(rows)
    overall = {(r["method"], r["temperature"]): r for r in acceptance(table).to_pylist()}
    assert overall["speed", 0.0]["acceptance_rate"] == 4 / 10 and overall["speed", 0.0]["mean_acceptance_length"] == 2
    assert overall["speed", 0.8]["requests"] == 1 and overall["sequential", 0.0]["acceptance_rate"] is None
    by_pos = [
        (r["temperature"], r["position"], r["acceptance_rate"]) for r in acceptance_by_position(table).to_pylist()
    ]
    assert by_pos == [(0.0, 1, 0.75), (0.0, 2, 1 / 6), (0.8, 1, 0.5), (0.8, 2, 0.0)]  # sequential: no rows
