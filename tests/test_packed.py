"""Packed weights for the native decode kernel (``speed.engine.native.pack``, ``matmuls.pack_linears``): the layout
round-trips bit for bit, and a looped LM packed for decoding decodes with SPEED bit-identical to sequential
decoding, in bf16 and float32 (the packed kernel's rows at any row count, place and thread count:
``tests/test_kernels.py``)."""

from __future__ import annotations

import pytest
import torch
from engine_helpers import speed_as_sequential, speed_runs_match
from test_lm import _randomize
from test_lm_decoding import GQA, prompts
from test_lm_decoding import random_case as lm_case

from speed.config import lm_preset
from speed.decode.exactness import LogitRecorder, compare_logits
from speed.decode.generate import DecodeOptions, generate
from speed.engine import Speculation, kernels, matmuls, native
from speed.engine.sampling import Sampling
from speed.models.looped_lm import LoopedLM
from speed.models.precision import bf16_weights

WIDTHS = [(7, 5), (48, 80), (33, 64), (2048, 2304), (5632, 130)]  # (in, out): odd tails, Ouro-1.4B's widths


@pytest.fixture(autouse=True)
def native_kernel():
    if native.library() is None:
        pytest.skip(f"no native kernel here: {native.unavailable_reason()}")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("inn,out", WIDTHS)
def test_pack_round_trips_bit_for_bit(dtype, inn, out):
    weight = torch.randn(out, inn).to(dtype)
    packed = native.pack(weight)
    assert packed.shape == (-(-out // native.PANEL), inn, native.PANEL) and packed.dtype == dtype
    assert torch.equal(native.unpack(packed, out), weight)


def test_packed_rows_linear_matches_its_tiles():
    """A prefill's rows (more than a tile) on a packed layer: each row's bits as alone."""
    layer = torch.nn.Linear(96, 70, bias=False).to(torch.bfloat16).requires_grad_(False)
    assert matmuls.pack_linears(layer) == 1 and matmuls.is_packed(layer)
    x = torch.randn(21, 96)
    got = matmuls.rows_linear(layer, x)
    for r in (0, 7, 20):
        assert torch.equal(got[r], matmuls.tile_linear(layer, x[r : r + 1])[0])


def packed_case(seed: int):
    """``test_lm_decoding``'s random LM case (batch 1 or 8) with bf16 weights, packed for decoding."""
    model, ids, mask, max_new, rng = lm_case(seed)
    model = bf16_weights(model)
    assert matmuls.pack_linears(model) > 0
    return model, ids, mask, max_new, rng


def test_packed_bf16_lm_speed_equals_sequential():
    """Greedy: every loop's logits of SPEED equal sequential decoding's on the packed model, batch 1 and 8."""
    runs, flushes = speed_runs_match(packed_case, range(900, 904))
    assert flushes > 0 and runs >= 4 * 2 * 2


def test_packed_bf16_lm_sampled_speed_equals_sequential_sampling():
    for seed in range(2):
        model, ids, mask, max_new, rng = packed_case(950 + seed)
        sampling = Sampling(temperature=0.8, top_k=rng.choice([0, 5]), seed=rng.randrange(2**63))
        reference = LogitRecorder(model)
        ref = generate(
            reference, ids, mask, DecodeOptions(method="sequential", max_new_tokens=max_new, sampling=sampling)
        )
        got = speed_as_sequential(
            model, reference, ref, ids, mask, max_new, seed,
            speculation=Speculation(rng.randint(1, model.n_loops), "eager"), sampling=sampling,
        )  # fmt: skip
        assert got.trace.equals(ref.trace)


def test_pack_linears_packs_native_weights_only_and_unpack_restores_them(monkeypatch):
    """Float32 weights below ``NATIVE_MIN_BYTES`` stay (they run on oneDNN), a tied head stays, bf16 weights pack;
    a packed layer refuses its own forward and gradients; unpacking gives the same bits and the same decoding."""
    model, ids, mask, max_new, _ = lm_case(960)
    assert matmuls.pack_linears(model) == 0  # a tiny float32 model: every weight on oneDNN
    model = bf16_weights(model)
    model.lm_head.weight = model.embed_tokens.weight  # tied, as Huginn's
    before = {name: p.clone() for name, p in model.named_parameters()}
    ref = generate(model, ids, mask, DecodeOptions(method="sequential", max_new_tokens=max_new))
    packed = matmuls.pack_linears(model)
    linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    assert packed == len(linears) - 1 and not matmuls.is_packed(model.lm_head)
    assert matmuls.linear_in_use(model.core[0].attn.qkv.weight) == "packed"
    with pytest.raises(RuntimeError):
        model.core[0].attn.qkv(torch.randn(1, model.config.d_model))  # F.linear on a 3-D weight
    with pytest.raises(ValueError, match="decodes only"):
        matmuls.tile_linear(model.core[0].attn.qkv, torch.randn(1, model.config.d_model, requires_grad=True))
    got = generate(model, ids, mask, DecodeOptions(method="speed", max_new_tokens=max_new))
    assert matmuls.unpack_linears(model) == packed
    assert all(torch.equal(p, before[name]) for name, p in model.named_parameters())
    assert generate(model, ids, mask, DecodeOptions(method="sequential", max_new_tokens=max_new)).tokens == ref.tokens
    assert [len(t) for t in got.tokens] == [len(t) for t in ref.tokens]


def test_packed_float32_lm_speed_equals_sequential(monkeypatch):
    """Float32 weights pack where they take the native kernel (here all of them: ``NATIVE_MIN_BYTES`` 0)."""
    monkeypatch.setattr(matmuls, "NATIVE_MIN_BYTES", 0)
    model, ids, mask, max_new, _ = lm_case(970)
    assert matmuls.pack_linears(model) == len([m for m in model.modules() if isinstance(m, torch.nn.Linear)])
    reference = LogitRecorder(model)
    ref = generate(reference, ids, mask, DecodeOptions(method="sequential", max_new_tokens=max_new))
    speed_as_sequential(model, reference, ref, ids, mask, max_new, 970)


def test_packed_while_restores_the_model_bit_for_bit_even_when_the_block_fails():
    """``matmuls.packed_while``: packed inside the block, every parameter back after (values and requires_grad),
    also when the block raises; a model whose family packs none (T5) is left alone."""
    model, ids, mask, max_new, _ = lm_case(980)
    model = bf16_weights(model)
    model.core[0].attn.o.weight.requires_grad_(False)
    before = {name: (p.clone(), p.requires_grad) for name, p in model.named_parameters()}
    with pytest.raises(KeyError), matmuls.packed_while(model) as packed:
        assert packed > 0 and matmuls.is_packed(model.core[0].attn.qkv)
        generate(model, ids, mask, DecodeOptions(method="speed", max_new_tokens=max_new))
        raise KeyError("the block fails")
    after = dict(model.named_parameters())
    assert after.keys() == before.keys()
    for name, (value, grad) in before.items():
        assert torch.equal(after[name], value) and after[name].requires_grad == grad, name


FUSED = {  # the block forms the published looped LMs use, each through native.lm_block
    "ouro": {"pattern": "2x3", "norm": "sandwich", "loop_norm": True},
    "huginn": {"pattern": "1+2x3+1", "norm": "residual", "qk_bias": True, "rope_layout": "pairs", "injection": True}
    | GQA,
    "llama-gqa": {"pattern": "3x2"} | GQA,
}


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
@pytest.mark.parametrize("form", FUSED)
def test_fused_block_gives_the_bits_of_its_kernels_one_by_one(form, dtype, monkeypatch):
    """A packed looped LM's block in one native call (``native.lm_block``, ``SPEED_DECODE_OPS=auto``) gives every
    loop's logits of the same kernels called one by one from Python ("ops"), bit for bit, batch 8, in each block
    form (sandwich norms, Huginn's residual norms with q/k biases, rotated pairs and injection, grouped kv heads);
    and SPEED on it equals that sequential decoding."""
    monkeypatch.setattr(matmuls, "NATIVE_MIN_BYTES", 0)  # the tiny float32 weights pack too
    seed = sorted(FUSED).index(form) * 2 + (dtype == "float32")
    model = _randomize(LoopedLM(lm_preset("tiny", **FUSED[form])), 1000 + seed)
    model = bf16_weights(model) if dtype == "bfloat16" else model
    assert matmuls.pack_linears(model) > 0
    ids, mask = prompts(__import__("random").Random(seed), 8, model.vocab_size)
    monkeypatch.setattr(kernels, "DECODE_OPS", "ops")
    reference = LogitRecorder(model)
    ref = generate(reference, ids, mask, DecodeOptions(method="sequential", max_new_tokens=12))
    monkeypatch.setattr(kernels, "DECODE_OPS", "auto")
    calls = []
    fused = native.lm_block
    monkeypatch.setattr(native, "lm_block", lambda *a: calls.append(1) or fused(*a))
    candidate = LogitRecorder(model)
    got = generate(candidate, ids, mask, DecodeOptions(method="sequential", max_new_tokens=12))
    assert len(calls) >= model.n_loops * len(model.core)  # every decode pass through it (a tile of rows a call)
    assert compare_logits(reference, candidate, ref.tokens, model.n_loops) == [] and got.tokens == ref.tokens
    speed_as_sequential(model, reference, ref, ids, mask, 12, form)
