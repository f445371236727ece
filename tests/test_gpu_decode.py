"""Decoding and evaluation on a CUDA device: every decode tensor on the model's device, SPEED exact there too.

Greedy and sampled, batch 1, 8 and 32 (padded), float32 and bfloat16, both families, runner-up branches and
lanes, the engine under churn: every loop's logits of every committed token equal sequential decoding's on the
same device, bit for bit. The engine's CUDA path copies without the host waiting and decides on the device; one
test runs its passes in row-count buckets (``speed.engine.graphs``) against unpadded ones, one replays a captured
bucket against the eager pass, another counts the host's synchronisations in a step (at most one: the step's
decisions). Skipped, with the reason, where no CUDA device
is present; run them on a GPU machine with ``pytest -m gpu`` (``jobs/gpu_check.py`` does, on a machine without
Ray or the data libraries: only the evaluate job's test needs those, and it is skipped, with the reason, without
them).
"""

from __future__ import annotations

import dataclasses
import json
import random

import pytest
import torch
from engine_helpers import drive, speed_as_sequential
from test_decoding_exact import padded_batch
from test_engine import alone, random_request, tiny_model

from speed import LoopedLM, SpeedT5, preset
from speed.benchmarks.gpu_timing import count_syncs
from speed.config import lm_preset
from speed.decode.exactness import LogitRecorder
from speed.decode.generate import DecodeOptions, generate
from speed.engine import Engine, EngineConfig, Request, Speculation
from speed.engine.cache import Rows
from speed.engine.sampling import Sampling

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device; this machine has none"),
]

SAMPLINGS = [None, Sampling(temperature=1.0, top_p=0.9, seed=3, presence_penalty=0.5)]


def cuda_case(seed: int, pattern: str, batch: int, dtype: torch.dtype = torch.float32):
    """A random tiny model on CUDA and a padded batch of ``batch`` CPU inputs of 1-9 tokens (the model moves
    them to its device)."""
    rng = random.Random(seed)
    torch.manual_seed(seed)
    model = SpeedT5(preset("tiny", pattern=pattern)).eval().to("cuda", dtype)
    return (model, *padded_batch(rng, batch, model.config.vocab_size))


@pytest.mark.parametrize("sampling", SAMPLINGS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("pattern", ["2x6", "3x4", "1x5"])
def test_speed_logits_equal_sequential_on_cuda(pattern, dtype, sampling):
    for seed, batch in enumerate((1, 8)):
        model, ids, mask = cuda_case(seed, pattern, batch, dtype)
        reference = LogitRecorder(model)
        ref = generate(reference, ids, mask, DecodeOptions(method="sequential", max_new_tokens=24, sampling=sampling))
        assert next(iter(reference.logits.values())).device.type == "cuda"
        for launch_loop, invalidation in [(1, "eager"), (2, "final")]:
            speed_as_sequential(
                model, reference, ref, ids, mask, 24, (seed, batch, launch_loop),
                speculation=Speculation(launch_loop, invalidation), sampling=sampling,
            )  # fmt: skip


@pytest.mark.parametrize("sampling", SAMPLINGS)
def test_branches_and_lanes_equal_sequential_on_cuda(sampling):
    promotions = 0
    for seed, (pattern, batch) in enumerate([("2x6", 1), ("2x6", 8), ("3x4", 1), ("3x4", 8)]):
        model, ids, mask = cuda_case(100 + seed, pattern, batch)
        m = model.n_loops
        reference = LogitRecorder(model)
        ref = generate(reference, ids, mask, DecodeOptions(method="sequential", max_new_tokens=20, sampling=sampling))
        lanes = [
            Speculation(invalidation="eager", branches=m, branch_depth=1),
            Speculation(invalidation="final", branches=m, branch_depth=m),
            Speculation(invalidation="eager", branches=2, branch_depth=m, branch_below=0.5, min_confidence=0.1),
        ]
        for speculation in lanes:
            got = speed_as_sequential(
                model, reference, ref, ids, mask, 20, (seed, speculation), speculation=speculation, sampling=sampling
            )
            assert got.stats.rows == ref.stats.rows + got.stats.wasted_rows
            promotions += got.stats.promotions
    assert promotions > 0  # a branch took over somewhere: the lane path ran on the device


def test_engine_churn_on_cuda():
    """Requests (greedy and sampled, random policies and branch settings) join, leave and are cancelled
    under row budgets in an engine on CUDA: each equals its sequential decoding alone."""
    flushes = cancelled = 0
    for seed in range(6):
        rng = random.Random(200 + seed)
        model = tiny_model(seed, ["2x3", "1x4", "3x3", "2x6"][seed % 4]).to("cuda")
        config = EngineConfig(
            max_active=rng.randint(1, 4),
            max_source_len=10,
            max_target_len=16,
            row_budget=rng.choice([None, rng.randint(1, 10)]),
        )

        def make(r=rng, mo=model):
            request = random_request(r, mo, 10, 16)
            levers = {"branches": r.randint(0, mo.n_loops), "branch_depth": r.randint(1, mo.n_loops)}
            return dataclasses.replace(request, speculation=dataclasses.replace(request.speculation, **levers))

        arrivals = [rng.randrange(0, 30) for _ in range(6)]
        requests, finished = drive(Engine(model, config), rng, arrivals, make, 0.2, 10)
        for f in finished:
            ref = alone(model, requests[f.id])
            assert f.tokens == ref.tokens[0][: len(f.tokens)]
            if f.cancelled:
                cancelled += 1
            else:
                assert f.tokens == ref.tokens[0], f"request {f.id} of seed {seed}: {requests[f.id]}"
                assert f.stats.rows == f.stats.tokens * model.n_loops + f.stats.wasted_rows
            flushes += f.stats.flushes
    assert flushes > 0 and cancelled > 0  # speculation was flushed and requests left early, on the device


def test_evaluate_job_on_cuda(tmp_path):
    for module in ("datasets", "rouge_score"):  # the evaluate job reads records and scores ROUGE with them
        pytest.importorskip(module, reason=f"the evaluate job needs {module}, which this machine lacks")
    from checkpoint_helpers import tiny_checkpoint
    from job_helpers import job_module

    directory = tiny_checkpoint(tmp_path, lambda vocab: SpeedT5(preset("tiny", vocab_size=vocab)))
    job = job_module("evaluate")
    out = tmp_path / "eval"
    flags = ["--checkpoint", str(directory), "--split", "test", "--limit", "8", "--batch-size", "4"]
    summary = job.main([*flags, "--max-new-tokens", "12", "--check-sequential", "--device", "cuda", "--out", str(out)])
    assert summary["decode"]["identical"] and summary["decode"]["mismatches"] == []
    assert json.loads((out / "summary.json").read_text()) == summary


def lm_case(seed: int, batch: int, dtype: torch.dtype, pattern: str = "1+2x3+1"):
    """A random tiny looped LM (a prelude and a coda) on CUDA and ``batch`` CPU prompts of 1-9 tokens."""
    rng = random.Random(seed)
    torch.manual_seed(seed)
    model = LoopedLM(lm_preset("tiny", pattern=pattern)).eval().to("cuda", dtype)
    return (model, *padded_batch(rng, batch, model.vocab_size))


@pytest.mark.parametrize(("dtype", "sampling"), [(torch.float32, SAMPLINGS[0]), (torch.bfloat16, SAMPLINGS[1])])
def test_both_families_at_batch_32_equal_sequential_on_cuda(dtype, sampling):
    """Batch 1, 8 and 32 of a T5 and of a looped LM: SPEED's every logit is sequential decoding's."""
    for seed, batch in enumerate((1, 8, 32)):
        for model, ids, mask in (cuda_case(seed, "2x6", batch, dtype), lm_case(seed, batch, dtype)):
            reference = LogitRecorder(model)
            ref = generate(
                reference, ids, mask, DecodeOptions(method="sequential", max_new_tokens=10, sampling=sampling)
            )
            speed_as_sequential(
                model, reference, ref, ids, mask, 10, (seed, batch, type(model).__name__),
                speculation=Speculation(1, "eager"), sampling=sampling,
            )  # fmt: skip


def test_bucketed_passes_equal_unpadded_ones_on_cuda():
    """The row-count buckets (padding rows in the scratch slot) against unpadded passes on the same device: every
    logit equal, T5 and LM, greedy and sampled, with runner-up branches."""
    for seed, (batch, dtype) in enumerate([(3, torch.float32), (8, torch.bfloat16)]):
        for model, ids, mask in (cuda_case(seed, "3x4", batch, dtype), lm_case(seed, batch, dtype)):
            for sampling in SAMPLINGS:
                reference = LogitRecorder(model)
                ref = generate(
                    reference,
                    ids,
                    mask,
                    DecodeOptions(method="sequential", max_new_tokens=12, sampling=sampling, graphs=False),
                )
                speculation = Speculation(1, "final", branches=2, branch_depth=2)
                speed_as_sequential(
                    model, reference, ref, ids, mask, 12, (seed, batch), speculation=speculation, sampling=sampling,
                    graphs=True,
                )  # fmt: skip


@pytest.mark.parametrize("family", ["t5", "lm"])
def test_a_step_synchronises_the_host_at_most_once(family):
    """After admission, each engine step of a batch of greedy and sampled SPEED requests makes at most one
    synchronising CUDA call (``torch.cuda.set_sync_debug_mode``): the copy of the step's decisions."""
    model, ids, mask = (cuda_case(0, "2x6", 4) if family == "t5" else lm_case(0, 4, torch.bfloat16))[:3]
    engine = Engine(model, EngineConfig(max_active=4, max_prompt_len=ids.shape[1], max_target_len=12))
    for b, (row, keep) in enumerate(zip(ids.tolist(), mask.tolist())):
        sampling = Sampling() if b % 2 else Sampling(temperature=1.0, top_k=20, seed=b)
        engine.add(Request([t for t, k in zip(row, keep) if k], 12, "speed", sampling=sampling))
    with torch.inference_mode():
        engine.step()  # admission: prompts encoded or prefilled
        engine.step()  # first passes: each bucket's buffers allocated
        counts = []
        while engine.has_work:
            graphs = captured(engine)
            syncs = count_syncs(engine.step, "cuda")
            if captured(engine) == graphs:  # a step that captured a bucket's graph waits for the capture: not counted
                counts.append(syncs)
    assert counts and max(counts) <= 1, counts
    assert captured(engine) > 0  # the passes were replayed graphs (both families' steppers are capturable)


def captured(engine: Engine) -> int:
    """CUDA graphs the engine has captured (its buckets' passes)."""
    return 0 if engine._graphs is None else len(engine._graphs._graphs) * engine._graphs.capture


def test_a_captured_bucket_replays_new_rows_bit_for_bit():
    """``GraphSteps`` with capture on CUDA: each bucket's pass captured once as a CUDA graph, then replayed with new
    rows and inputs in its static buffers, gives what the same pass run eagerly gives, bit for bit, step after step
    (a stub pass that reads the rows' slots, loops and positions from ``Rows.tensors``, as a capturable stepper
    must)."""
    from test_graphs import stub_pass

    from speed.engine.graphs import GraphSteps

    device = torch.device("cuda")
    step = stub_pass(device)
    captured, eager = (GraphSteps(scratch=5, device=device, capture=c) for c in (True, False))
    rng = random.Random(0)
    for n in [1, 3, 3, 8, 2, 13, 1, 40, 7, 3, 70]:
        rows = Rows.build([rng.randrange(5) for _ in range(n)], [rng.randrange(4) for _ in range(n)],
                          [rng.randrange(30) for _ in range(n)])  # fmt: skip
        hidden = torch.randn(n, 16, device=device)
        picked = sorted(rng.sample(range(n), max(1, n // 2))) if rng.random() < 0.3 else None
        got, want = (g.run(step, rows, hidden, True, picked) for g in (captured, eager))
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]), n
    assert len(captured._graphs) == 6  # buckets 1, 4, 8, 2, 16, 64, each captured once (70 rows: unpadded)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_captured_lm_bucket_replays_new_rows_bit_for_bit(dtype):
    """The looped LM's pass captured per bucket (``LMStepper.prepare`` staging each step's index, then a replay):
    step after step of new rows, every carry and logit equal to the unstaged, unpadded eager pass's over a second
    cache fed the same, bit for bit (a prelude, a coda, injection with Huginn's initial state, exit adapters)."""
    from capture_helpers import RowSource, any_slots, staged_equals_plain
    from test_lm_capture import admitted, huginn_like

    from speed.engine.graphs import GraphSteps

    device = torch.device("cuda")
    model = huginn_like(5, exits=True).to(device, dtype)
    assert model.stepper().capturable
    staged, plain = admitted(model, 6, random.Random(6)), admitted(model, 6, random.Random(6))
    graphs = GraphSteps(scratch=6, device=device, capture=True)
    rng = random.Random(5)
    source = RowSource(model, 6, rng, first_pos=1, first_token=2)
    staged_equals_plain(staged, plain, source, any_slots(rng, 6), graphs, 24, poison=False)
    assert len(graphs._graphs) >= 3  # several buckets captured, each replayed


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_captured_t5_bucket_replays_new_rows_bit_for_bit(dtype):
    """T5's pass captured per bucket (``T5Stepper.prepare`` staging each step's cache index, then a replay): step
    after step of new rows of slots with prompts of different lengths, every output and logit equal to the
    unstaged, unpadded eager pass's over a second cache and memory fed the same, bit for bit."""
    from capture_helpers import RowSource, any_slots, staged_equals_plain
    from test_t5_capture import admitted

    from speed.engine.graphs import GraphSteps

    device = torch.device("cuda")
    model = cuda_case(1, "2x3", 1, dtype)[0]
    assert model.stepper().capturable
    staged, plain = (admitted(model, 6, random.Random(6)) for _ in range(2))
    graphs = GraphSteps(scratch=6, device=device, capture=True)
    rng = random.Random(5)
    source = RowSource(model, 6, rng, first_pos=0, first_token=3)
    staged_equals_plain(staged, plain, source, any_slots(rng, 6), graphs, 24, poison=False)
    assert len(graphs._graphs) >= 3  # several buckets captured, each replayed


@pytest.mark.parametrize("sampling", SAMPLINGS)
def test_t5_speed_through_captured_graphs_equals_sequential_on_cuda(sampling):
    """The engine's default on CUDA for T5 too: every pass a replayed graph of its bucket, SPEED's tokens (with and
    without runner-up branches) sequential decoding's, run unpadded and eagerly."""
    for seed, (batch, dtype) in enumerate([(1, torch.float32), (8, torch.bfloat16), (32, torch.bfloat16)]):
        model, ids, mask = cuda_case(seed, "2x6", batch, dtype)
        assert model.stepper().capturable
        ref = generate(
            model, ids, mask, DecodeOptions(method="sequential", max_new_tokens=12, sampling=sampling, graphs=False)
        )
        for speculation in (Speculation(1, "eager"), Speculation(1, "final", branches=2, branch_depth=2)):
            got = generate(
                model,
                ids,
                mask,
                DecodeOptions(method="speed", max_new_tokens=12, speculation=speculation, sampling=sampling),
            )
            assert got.tokens == ref.tokens, (seed, batch, speculation)


@pytest.mark.parametrize("sampling", SAMPLINGS)
def test_lm_speed_through_captured_graphs_equals_sequential_on_cuda(sampling):
    """The engine's default on CUDA for the looped LM: every pass a replayed graph of its bucket. SPEED's tokens
    (with and without runner-up branches) are sequential decoding's, run unpadded and eagerly (the logits are
    compared bit for bit by ``test_a_captured_lm_bucket_replays_new_rows_bit_for_bit``: a recorder is not
    captured)."""
    for seed, (batch, dtype) in enumerate([(1, torch.float32), (8, torch.bfloat16), (32, torch.bfloat16)]):
        model, ids, mask = lm_case(seed, batch, dtype)
        assert model.stepper().capturable
        ref = generate(
            model, ids, mask, DecodeOptions(method="sequential", max_new_tokens=12, sampling=sampling, graphs=False)
        )
        for speculation in (Speculation(1, "eager"), Speculation(1, "final", branches=2, branch_depth=2)):
            got = generate(
                model,
                ids,
                mask,
                DecodeOptions(method="speed", max_new_tokens=12, speculation=speculation, sampling=sampling),
            )
            assert got.tokens == ref.tokens, (seed, batch, speculation)
