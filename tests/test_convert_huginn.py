"""Huginn-0125 into ``LoopedLM``: every recurrence's exit logits equal the independent reference's
(``looped_refs``, zero initial state), for several step counts, with and without the adapter's bias, the
rotary table and a stored tied head, and from sharded bfloat16 files; the cached path equals the forward;
SPEED equals sequential decoding bit for bit; the published random initial state, seeded, equals the reference
given the same draws, with SPEED equal to sequential under a seed; each refusal is one line."""

from __future__ import annotations

import json
import math
import tempfile

import pytest
import torch
from imported_helpers import (
    assert_cached_equals_forward,
    assert_loops_match,
    assert_speed_exact,
    one_line,
    token_ids,
    weights_refusal,
)
from looped_refs import huginn_random_state, huginn_reference_logits, write_huginn_checkpoint
from safetensors.torch import load_file

from speed.decode.exactness import LogitRecorder, compare_logits
from speed.decode.generate import DecodeOptions, generate
from speed.engine import Speculation
from speed.engine.sampling import truncated_normals
from speed.models.convert_huginn import huginn_initial_state, load_huginn
from speed.models.hf_import import UnsupportedConfig
from speed.models.looped_lm import InitialState

# Unit-scale weights: the loops change the logits by far more than the tolerance, while a larger scale makes
# the recurrence chaotic enough that float32 rounding alone grows past 1e-4 within a few steps.
SMALL = {"prelude": 1, "core": 2, "coda": 1, "mean_recurrence": 3, "seed": 1}


@pytest.fixture(scope="module")
def huginn_dir(tmp_path_factory):
    directory = tmp_path_factory.mktemp("huginn")
    write_huginn_checkpoint(directory, **SMALL)
    return directory


@pytest.mark.parametrize("n_loops", [None, 1, 2, 6])
def test_every_step_equals_the_reference(huginn_dir, n_loops):
    model = load_huginn(huginn_dir, n_loops=n_loops)
    steps = 3 if n_loops is None else n_loops
    assert model.n_loops == steps and model.config.pattern == f"1+2x{steps}+1"
    assert_loops_match(model, token_ids(), huginn_reference_logits(huginn_dir, token_ids(), steps))


@pytest.mark.parametrize(
    "layout",
    [
        {"bias": True, "lm_head": True, "freqs_cis": False},
        {"qk_bias": False, "prelude": 2, "core": 1, "coda": 2},
        {"dtype": torch.bfloat16, "shards": 3, "bias": True},
    ],
)
def test_layouts_and_sharded_bfloat16_files(tmp_path, layout):
    write_huginn_checkpoint(tmp_path, **(SMALL | layout))
    model = load_huginn(tmp_path, n_loops=4)
    assert model.config.adapter_bias == layout.get("bias", False)
    assert model.config.qk_bias == layout.get("qk_bias", True)
    assert model.lm_head.weight is model.embed_tokens.weight  # tied
    assert_loops_match(model, token_ids(2), huginn_reference_logits(tmp_path, token_ids(2), 4))


def test_the_converted_config(huginn_dir):
    config = load_huginn(huginn_dir).config
    assert (config.norm, config.injection, config.coda_norm, config.rope_layout) == ("residual", True, True, "pairs")
    assert config.embed_scale == math.sqrt(32) and config.eos_id == 97 - 3 and config.vocab_size == 97


@pytest.mark.parametrize(
    "change, message",
    [
        ({"test_time_noise": 0.5}, "test_time_noise is on, but random noise cannot be reproduced"),
        ({"injection_type": "add"}, "injection_type='add', but LoopedLM injects through one linear adapter"),
        ({"num_key_value_heads": 2}, "num_key_value_heads=2, but Huginn's fused Wqkv"),
        ({"nonlin_name": "GELU"}, "nonlin_name='GELU'"),
        ({"mean_recurrence": None}, "config.json lacks mean_recurrence"),
        ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 5e4}}, "rope_type='yarn', but LoopedLM's rotary"),
        ({"rope_scaling": {"type": "dynamic", "factor": 2.0}}, "rope_type='dynamic', but LoopedLM's rotary"),
    ],
)
def test_a_config_it_cannot_honour_is_one_line(tmp_path, change, message):
    config = write_huginn_checkpoint(tmp_path, **SMALL)
    (tmp_path / "config.json").write_text(json.dumps(config | change))
    with pytest.raises(UnsupportedConfig) as error:
        load_huginn(tmp_path)
    assert message in one_line(error)


def test_a_rope_base_under_rope_parameters_is_read(tmp_path):
    config = write_huginn_checkpoint(tmp_path, **SMALL, rope_base=2000.0)
    want = huginn_reference_logits(tmp_path, token_ids(2), 3)
    moved = {k: v for k, v in config.items() if k != "rope_base"} | {"rope_parameters": {"rope_theta": 2000.0}}
    (tmp_path / "config.json").write_text(json.dumps(moved))
    model = load_huginn(tmp_path)
    assert model.config.rope_theta == 2000.0
    assert_loops_match(model, token_ids(2), want)


def test_wrong_tensors_and_an_untied_head_are_one_line(tmp_path):
    write_huginn_checkpoint(tmp_path, **SMALL, lm_head=True)
    weights = load_file(str(tmp_path / "model.safetensors"))
    weights["lm_head.weight"] = weights["lm_head.weight"] + 1
    text = weights_refusal(tmp_path, weights, load_huginn)
    assert "tied checkpoint, but lm_head.weight differs from transformer.wte.weight" in text
    del weights["transformer.core_block.1.attn.qk_bias"]
    weights["transformer.adapter.weight"] = weights["transformer.adapter.weight"][:, :32].contiguous()
    text = weights_refusal(tmp_path, weights, load_huginn)
    assert "1 expected tensor missing: transformer.core_block.1.attn.qk_bias" in text
    assert "transformer.adapter.weight has shape (32, 32), expected (32, 64)" in text


# ----- the published random initial state, seeded -------------------------------------------------------------


def _draws(seed: int, positions: int, d: int = 32) -> torch.Tensor:
    return torch.stack([truncated_normals(seed, p, d) for p in range(positions)]).float()  # (T, d)


def test_a_seeded_random_state_equals_the_reference(huginn_dir):
    """``huginn_initial_state``: the published ``initialize_state`` (the reference's, from config.json), on the
    platform's draws at each position; the forward and the cached path agree, and it changes the logits."""
    ids = token_ids(2)
    model = load_huginn(huginn_dir)
    zero = model(ids, return_logits=True).loop_logits
    model.initial_state = huginn_initial_state(huginn_dir, seed=5)
    state = huginn_random_state(huginn_dir, _draws(5, ids.shape[1]))  # (T, d), each sequence's
    want = huginn_reference_logits(huginn_dir, ids, 3, state=state.expand(ids.shape[0], -1, -1))
    assert_loops_match(model, ids, want)
    assert (want[0] - zero[0]).abs().max() > 0.1  # the state matters
    assert_cached_equals_forward(model, seed=3)
    half = huginn_initial_state(huginn_dir, seed=5, init_scale=0.5)
    assert half.std == pytest.approx(model.initial_state.std / 2)


def test_the_draws_are_truncated_normals_of_seed_and_position_alone():
    draws = torch.stack([truncated_normals(11, p, 4096) for p in range(16)])  # (16, 4096)
    assert draws.abs().max() <= 3 and draws.abs().max() > 2.9
    assert abs(draws.mean()) < 0.01 and abs(draws.std() - 0.9866) < 0.01  # a normal truncated at 3 sigma
    assert torch.equal(truncated_normals(11, 7, 64), draws[7, :64])  # a pure function: no RNG stream
    assert not torch.equal(truncated_normals(12, 7, 64), draws[7, :64])
    assert not torch.equal(draws[0], draws[1])


def _speed_and_sequential(model, seed: int) -> tuple[LogitRecorder, LogitRecorder, list[list[int]]]:
    ids = token_ids(seed, batch=3, length=5)
    reference, candidate = LogitRecorder(model), LogitRecorder(model)
    ref = generate(reference, ids, options=DecodeOptions(method="sequential", max_new_tokens=6))
    got = generate(
        candidate, ids, options=DecodeOptions(method="speed", max_new_tokens=6, speculation=Speculation(1, "eager"))
    )
    assert got.tokens == ref.tokens
    assert compare_logits(reference, candidate, ref.tokens, model.n_loops) == []  # torch.equal, every loop
    return reference, candidate, ref.tokens


def test_speed_equals_sequential_under_a_seeded_state_and_seeds_differ(huginn_dir):
    model = load_huginn(huginn_dir, n_loops=4)
    model.initial_state = InitialState(seed=1, std=1.0)
    first, _, _ = _speed_and_sequential(model, seed=6)
    model.initial_state = InitialState(seed=2, std=1.0)
    second, _, _ = _speed_and_sequential(model, seed=6)
    assert not torch.equal(first.logits[(0, 0, 0)], second.logits[(0, 0, 0)])
    model.initial_state = None  # zero, the default, again
    assert load_huginn(huginn_dir).initial_state is None


@pytest.mark.slow
def test_speed_equals_sequential_bit_for_bit_with_a_random_state(huginn_dir):
    model = load_huginn(huginn_dir)
    model.initial_state = huginn_initial_state(huginn_dir, seed=9)
    assert assert_speed_exact(model, seed=4) > 0


def test_the_loaders_seed_option_draws_the_published_state_and_a_checkpoint_keeps_it(huginn_dir, tmp_path):
    """``from_pretrained``/``load_pretrained(..., initial_state_seed=s)`` is ``huginn_initial_state(dir, s)`` (None:
    zero, the default), with SPEED equal to sequential under it; a platform checkpoint saved from such a model
    stores the state (config.json's ``initial_state``) and computes the same logits when loaded, and refuses the
    option itself in one line."""
    from speed import from_pretrained
    from speed.models.checkpoint import load_model, save_model
    from speed.models.pretrained import load_pretrained

    assert from_pretrained(huginn_dir).initial_state is None
    model = from_pretrained(huginn_dir, initial_state_seed=5, n_loops=4)
    assert model.initial_state == huginn_initial_state(huginn_dir, seed=5)
    assert load_pretrained(huginn_dir, initial_state_seed=5).model.initial_state == model.initial_state
    reference, _, _ = _speed_and_sequential(model, seed=6)
    save_model(tmp_path / "ckpt", model)
    assert json.loads((tmp_path / "ckpt" / "config.json").read_text())["initial_state"]["seed"] == 5
    restored = load_model(str(tmp_path / "ckpt")).model
    assert restored.initial_state == model.initial_state
    again, _, _ = _speed_and_sequential(restored, seed=6)
    assert all(torch.equal(again.logits[key], logits) for key, logits in reference.logits.items())
    with pytest.raises(ValueError) as error:
        from_pretrained(tmp_path / "ckpt", initial_state_seed=5)
    assert one_line(error).startswith("initial_state_seed=5: a platform checkpoint keeps the initial state it was")
    with pytest.raises(ValueError, match="initial_state_seed must be an integer >= 0, got -1"):
        from_pretrained(huginn_dir, initial_state_seed=-1)


def test_a_form_without_injection_refuses_the_seed_before_allocating(monkeypatch):
    from looped_refs import write_ouro_checkpoint

    from speed import from_pretrained
    from speed.models import pretrained

    monkeypatch.setattr(pretrained, "check_load", lambda *a, **k: pytest.fail("checked before the refusal"))
    with tempfile.TemporaryDirectory() as directory:
        write_ouro_checkpoint(directory)
        with pytest.raises(ValueError) as error:
            from_pretrained(directory, initial_state_seed=1)
    assert one_line(error) == "initial_state_seed=1: the ouro form has no injected initial state (Huginn's has)"


def test_an_initial_state_needs_injection_and_valid_fields():
    from looped_refs import write_ouro_checkpoint

    from speed.models.convert_ouro import load_ouro

    with tempfile.TemporaryDirectory() as directory:
        write_ouro_checkpoint(directory)
        ouro = load_ouro(directory)
    with pytest.raises(ValueError, match="needs a model with injection"):
        ouro.initial_state = InitialState(0, 1.0)
    with pytest.raises(ValueError, match="std must be a positive number"):
        InitialState(0, 0.0)
    with pytest.raises(ValueError, match="seed must be an integer >= 0"):
        InitialState(-1, 1.0)
