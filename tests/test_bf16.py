"""bf16 weights (``speed.models.precision``): the linear weights bfloat16, everything else float32, and SPEED's
per-loop logits still equal sequential decoding's bit for bit (greedy and seeded sampling, batch 1 and 8), on the
native kernel and on the widened fallback; the logits close to float32's of the same model."""

from __future__ import annotations

import dataclasses
import json
import random

import pytest
import torch
from engine_helpers import BLOCKS, recorded_pair, speed_as_sequential, speed_runs_match
from looped_refs import ouro_reference_logits, write_huginn_checkpoint, write_ouro_checkpoint
from test_decoding_exact import random_case as t5_case
from test_lm_decoding import random_case as lm_case

import speed
from speed.decode.exactness import LogitRecorder
from speed.decode.generate import DecodeOptions, generate
from speed.engine import Speculation, matmuls, native
from speed.engine.sampling import Sampling
from speed.models.precision import WidenedLinear, bf16_weights, with_dtype


def bf16_case(seed: int):
    """``test_lm_decoding``'s random LM case (batch 1 or 8) with bf16 weights."""
    model, ids, mask, max_new, rng = lm_case(seed)
    return bf16_weights(model), ids, mask, max_new, rng


def assert_bf16_weights(model: torch.nn.Module) -> None:
    """Every linear weight bfloat16, every other parameter float32, and at least one of each."""
    linear = {id(m.weight) for m in model.modules() if isinstance(m, torch.nn.Linear)}
    dtypes = {id(p): p.dtype for p in model.parameters()}
    assert linear and len(dtypes) > len(linear)
    assert all(dtype == (torch.bfloat16 if key in linear else torch.float32) for key, dtype in dtypes.items())


@pytest.mark.parametrize("block", BLOCKS[:2])
def test_bf16_weights_speed_equals_sequential(block):
    """Greedy: eager and final invalidation, launch loops 1, random and M, batch 1 and 8."""
    assert_bf16_weights(bf16_case(block * 6)[0])
    runs, flushes = speed_runs_match(bf16_case, range(block * 6, block * 6 + 6))
    assert flushes > 0 and runs >= 6 * 2 * 2


def test_bf16_weights_sampled_speed_equals_sequential_sampling():
    """Seeded sampling, coupled drafts or argmax drafts: the same draws from bit-identical logits."""
    cases = 0
    for seed in range(4):
        model, ids, mask, max_new, rng = bf16_case(500 + seed)
        sampling = Sampling(temperature=rng.choice([0.7, 1.0]), top_k=rng.choice([0, 5]), seed=rng.randrange(2**63))
        reference = LogitRecorder(model)
        ref = generate(
            reference, ids, mask, DecodeOptions(method="sequential", max_new_tokens=max_new, sampling=sampling)
        )
        for coupled in (True, False):
            got = speed_as_sequential(
                model, reference, ref, ids, mask, max_new, (seed, coupled),
                speculation=Speculation(rng.randint(1, model.n_loops), rng.choice(["eager", "final"])),
                sampling=dataclasses.replace(sampling, coupled=coupled),
            )  # fmt: skip
            assert got.trace.equals(ref.trace)
            cases += 1
    assert cases == 8


def test_float32_activations_cache_and_logits_and_half_the_weight_bytes():
    model, ids, mask, max_new, _ = lm_case(1)  # batch 8
    full = sum(m.weight.nbytes for m in model.modules() if isinstance(m, torch.nn.Linear))
    bf16_weights(model)
    assert_bf16_weights(model)
    assert sum(m.weight.nbytes for m in model.modules() if isinstance(m, torch.nn.Linear)) * 2 == full
    assert model.compute_dtype == torch.float32 and all(isinstance(m, WidenedLinear) for m in [model.lm_head])
    cache = model.stepper().cache(2, 4, 8)
    assert {t.dtype for part in cache.inner._parts() for t in part.keys + part.values} == {torch.float32}
    reference, _, _ = recorded_pair(model, ids, mask, max_new)
    assert {t.dtype for t in reference.logits.values()} == {torch.float32}


def test_the_forward_runs_and_its_logits_are_close_to_float32s():
    """The whole-sequence forward (training's, perplexity's) on bf16 weights: equal to float32's forward of the
    same bf16-rounded weights up to the sums' order, within bf16's rounding of float32's own weights."""
    model, ids, _, _, _ = lm_case(2)
    exact = [x.detach() for x in model(ids, return_logits=True).loop_logits]
    rounded = with_dtype(bf16_weights(_copy(model)), torch.float32)  # the bf16 values, widened back
    bf16 = bf16_weights(model)
    got = bf16(ids, return_logits=True).loop_logits
    same_weights = rounded(ids, return_logits=True).loop_logits
    for loop, (a, b, c) in enumerate(zip(got, same_weights, exact)):
        assert a.dtype == torch.float32
        assert torch.allclose(a, b, atol=1e-4), loop
        assert (a - c).abs().max() < 0.05 * c.abs().max(), loop


def _copy(model: torch.nn.Module) -> torch.nn.Module:
    import copy

    return copy.deepcopy(model)


@pytest.mark.parametrize("batch", [1, 8])
def test_an_imported_ouro_loads_as_bf16_weights_and_decodes_exactly(tmp_path, batch):
    """A tiny Ouro stored in bfloat16 (the published layout): ``from_pretrained(dtype=bfloat16)`` holds its stored
    weights as they are, its norms widened; SPEED equals sequential bit for bit; the prefill's logits are close to
    the independent float32 reference's."""
    write_ouro_checkpoint(tmp_path, dtype=torch.bfloat16, layers=2)
    model = speed.from_pretrained(tmp_path, dtype=torch.bfloat16)
    assert_bf16_weights(model)
    rng = random.Random(batch)
    ids = torch.tensor([[rng.randrange(3, model.vocab_size) for _ in range(6)] for _ in range(batch)])
    reference, _, _ = recorded_pair(model, ids, torch.ones_like(ids), 8)
    expected = ouro_reference_logits(tmp_path, ids)  # M x (B, T, V), float32
    for loop, want in enumerate(expected):
        for b in range(batch):
            got = reference.logits[(b, loop, 0)]
            assert torch.allclose(got, want[b, -1], atol=1e-4), (loop, b)


def test_an_imported_huginn_shares_its_tied_bf16_head_with_the_embedding(tmp_path):
    write_huginn_checkpoint(tmp_path, dtype=torch.bfloat16)
    model = speed.from_pretrained(tmp_path, dtype=torch.bfloat16, n_loops=3)
    assert model.lm_head.weight is model.embed_tokens.weight and model.lm_head.weight.dtype == torch.bfloat16
    assert model.embed(torch.tensor([3, 4])).dtype == torch.float32
    ids = torch.randint(3, model.vocab_size, (8, 5))
    recorded_pair(model, ids, torch.ones_like(ids), 6)
    assert model(ids, return_logits=True).loop_logits[-1].dtype == torch.float32


def test_without_the_native_kernel_the_weights_are_widened_and_still_exact(monkeypatch):
    """Off the native kernel (oneDNN's path asked for, or no native kernel): each call widens the weight (slow, exact),
    and the logits are the native kernel's up to the sums' order."""
    model, ids, mask, max_new, _ = bf16_case(3)
    native_run = recorded_pair(model, ids, mask, max_new)[0] if native.library() is not None else None
    monkeypatch.setattr(matmuls, "LINEAR", "onednn")
    widened, _, _ = recorded_pair(model, ids, mask, max_new)
    if native_run is not None:
        for key, logits in native_run.logits.items():
            if key in widened.logits:
                assert torch.allclose(widened.logits[key], logits, atol=1e-4)


def test_t5_decodes_exactly_with_bf16_weights():
    """SpeedT5 too: its encoder memory and cache float32, SPEED == sequential on random cases."""
    for seed in range(3):
        model, ids, mask, max_new, _ = t5_case(seed)
        bf16_weights(model)
        assert_bf16_weights(model)
        assert model.stepper().memory(1, 4, 4).keys[0].dtype == torch.float32
        recorded_pair(model, ids, mask, max_new)


def test_evaluate_job_runs_in_bf16_weights(tmp_path, monkeypatch):
    """``jobs/evaluate.py --dtype bfloat16``: SPEED checked identical to sequential, every loop's perplexity close to
    (and not equal to) the float32 evaluation's of the same checkpoint; the bf16 model decodes on its weights packed
    for the native kernel (where it builds), and its perplexity runs after they are unpacked."""
    from checkpoint_helpers import tiny_checkpoint
    from job_helpers import job_module

    from speed.config import lm_preset
    from speed.models.looped_lm import LoopedLM

    directory = tiny_checkpoint(tmp_path, lambda vocab: LoopedLM(lm_preset("tiny", vocab_size=vocab)))
    job = job_module("evaluate")
    flags = ["--checkpoint", str(directory), "--task", "summarize", "--split", "validation", "--limit", "2"]
    flags += ["--max-new-tokens", "4", "--max-source-len", "32", "--bootstrap-samples", "0", "--threads", "1"]
    packed_calls = []
    linear_packed = native.linear_packed
    monkeypatch.setattr(native, "linear_packed", lambda *a: packed_calls.append(1) or linear_packed(*a))
    runs = {}
    for dtype in job.DTYPES:
        packed_calls.clear()
        runs[dtype] = job.main([*flags, "--dtype", dtype, "--out", str(tmp_path / dtype)])
        assert bool(packed_calls) == (dtype == "bfloat16" and native.library() is not None), dtype
    assert runs["bfloat16"]["decode"]["identical"]
    full, half = (runs[d]["perplexity"]["loss"] for d in ("float32", "bfloat16"))
    assert full != half and half == pytest.approx(full, rel=1e-2)


def train_tiny_lm(root, steps: int = 200):
    """A 2x3 looped LM (d_model 64) trained ``steps`` steps on the pretraining text (rows of 64 tokens, batch 16),
    saved as a checkpoint with its tokenizer: the folder (one thread, ~30 s)."""
    from checkpoint_helpers import train_steps

    from speed.config import lm_preset
    from speed.data import load_records
    from speed.models.checkpoint import save_model
    from speed.models.looped_lm import LoopedLM, next_token_labels
    from speed.tokenizer import train_tokenizer

    texts = [r["text"] for r in load_records("pretrain", "train", limit=400)]
    tok = train_tokenizer(texts, root / "spm.model", vocab_size=500, num_extra=4)
    stream = [t for ids in tok.encode_batch(texts) for t in ids]
    rows = torch.tensor(stream[: len(stream) // 64 * 64]).view(-1, 64)
    torch.manual_seed(0)
    config = lm_preset("tiny", vocab_size=tok.vocab_size, d_model=64, n_heads=4, n_kv_heads=4, d_ff=128, pattern="2x3")
    model = LoopedLM(config)
    order = random.Random(0)

    def batch_loss() -> torch.Tensor:
        batch = rows[order.sample(range(len(rows)), 16)]
        return model(batch, labels=next_token_labels(batch)).loss

    loss = train_steps(model, batch_loss, steps)
    assert loss < 6.0, f"the model did not train (loss {loss:.2f})"
    return save_model(root / "model", model.eval(), tok.path)


@pytest.mark.slow
def test_bf16_tokens_mostly_agree_with_float32s_on_a_trained_lm(tmp_path, capsys):
    """``jobs/bench_agreement.py`` on a trained tiny LM: its line (docs/benchmarks.md) and most tokens
    agreeing at every loop."""
    from job_helpers import job_module

    directory = train_tiny_lm(tmp_path)
    job = job_module("bench_agreement")
    flags = ["--checkpoint", str(directory), "--agreement-prompts", "8", "--prompt-len", "32", "--new-tokens", "64"]
    assert job.main([*flags, "--threads", "1"]) == 0
    line = capsys.readouterr().out.strip().splitlines()[-1]
    assert job.main([*flags, "--threads", "1", "--json"]) == 0
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    with capsys.disabled():
        print(f"\n{line}")
    assert report["positions"] == 8 * 64 and line.startswith("token agreement: ")
    assert all(a >= 0.9 * report["positions"] for a in report["agreeing"])
