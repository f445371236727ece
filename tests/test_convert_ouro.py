"""Ouro into ``LoopedLM``: every loop's logits and exit-gate lambdas equal the independent reference's
(``looped_refs``), for several loop counts and sharded bfloat16 files; the cached path equals the forward;
SPEED equals sequential decoding bit for bit; each refusal is one line."""

from __future__ import annotations

import json
import re
import tempfile

import pytest
import torch
from imported_helpers import (
    assert_loops_match,
    one_line,
    token_ids,
    weights_refusal,
)
from looped_refs import ouro_reference, write_ouro_checkpoint
from safetensors.torch import load_file

from speed.models.convert_ouro import config_from_ouro, load_ouro
from speed.models.hf_import import UnsupportedConfig

SCALE = 2.0  # weights scaled up so that every loop changes the logits


@pytest.fixture(scope="module")
def ouro_dir(tmp_path_factory):
    directory = tmp_path_factory.mktemp("ouro")
    write_ouro_checkpoint(directory, total_ut_steps=3, seed=1, scale=SCALE)
    return directory


@pytest.mark.parametrize("n_loops", [None, 1, 2, 5])
def test_every_loop_equals_the_reference(ouro_dir, n_loops):
    model = load_ouro(ouro_dir, n_loops=n_loops)
    assert model.n_loops == (3 if n_loops is None else n_loops) == model.config.sharing.n_loops
    want = ouro_reference(ouro_dir, token_ids(), n_loops)
    assert_loops_match(model, token_ids(), want.logits)
    with torch.no_grad():
        torch.testing.assert_close(model.exit_lambdas(token_ids()), torch.stack(want.lambdas, -1), atol=1e-5, rtol=0)


def test_sharded_bfloat16_files_and_a_head_dim_of_its_own(tmp_path):
    write_ouro_checkpoint(
        tmp_path, dtype=torch.bfloat16, shards=3, head_dim=12, heads=4, kv_heads=1, rope_theta=500.0, scale=SCALE
    )
    model = load_ouro(tmp_path)
    assert model.config.head_dim == 12 and model.config.n_kv_heads == 1
    assert_loops_match(model, token_ids(1), ouro_reference(tmp_path, token_ids(1)).logits)
    assert load_ouro(tmp_path, dtype=torch.bfloat16).lm_head.weight.dtype == torch.bfloat16


def test_the_converted_config():
    config = config_from_ouro(_config(), n_loops=4)
    assert (config.pattern, config.norm, config.loop_norm, config.exit_gate) == ("2x4", "sandwich", True, True)
    assert (config.injection, config.coda_norm, config.rope_layout, config.embed_scale) == (False, False, "halves", 1.0)


def _config() -> dict:
    with tempfile.TemporaryDirectory() as directory:
        return write_ouro_checkpoint(directory)


@pytest.mark.parametrize(
    "change, message",
    [
        ({"use_sliding_window": True}, "use_sliding_window=True, but LoopedLM attends to every position"),
        ({"rope_scaling": {"rope_type": "yarn", "factor": 2.0}}, "rope_type='yarn', but .*unscaled"),
        ({"rope_parameters": {"rope_type": "linear", "rope_theta": 1e4, "factor": 2.0}}, "rope_type='linear', but"),
        ({"early_exit_threshold": 0.9}, "early_exit_threshold=0.9, but the platform decodes every loop .*exit_gate"),
        ({"early_exit_step": 1}, "early_exit_step=1, but the platform decodes every loop .*exit_step=1"),
        ({"hidden_act": "gelu"}, "hidden_act='gelu', but LoopedLM's SwiGLU uses SiLU"),
        ({"layer_types": ["full_attention", "sliding_attention"]}, r"layer_types holds \['sliding_attention'\]"),
        ({"eos_token_id": [0, 1]}, r"eos_token_id=\[0, 1\]"),
        ({"total_ut_steps": None}, "config.json lacks total_ut_steps"),
    ],
)
def test_a_config_it_cannot_honour_is_one_line(tmp_path, change, message):
    config = write_ouro_checkpoint(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps(config | change))
    with pytest.raises(UnsupportedConfig) as error:
        load_ouro(tmp_path)
    assert re.search(message, one_line(error)), one_line(error)


def test_a_transformers_5_config_keeps_the_rope_theta_under_rope_parameters(tmp_path):
    """transformers 5 writes ``rope_parameters: {rope_theta, rope_type}``: the model computes with that theta, the
    reference's (which reads the same checkpoint written with a top-level ``rope_theta``)."""
    config = write_ouro_checkpoint(tmp_path, rope_theta=500.0, scale=SCALE)
    want = ouro_reference(tmp_path, token_ids(1)).logits
    moved = {k: v for k, v in config.items() if k not in ("rope_theta", "rope_scaling")}
    rope = {"rope_parameters": {"rope_theta": 500.0, "rope_type": "default"}}
    (tmp_path / "config.json").write_text(json.dumps(moved | rope))
    model = load_ouro(tmp_path)
    assert model.config.rope_theta == 500.0
    assert_loops_match(model, token_ids(1), want)


def test_missing_unexpected_and_misshapen_tensors_are_one_line(tmp_path):
    write_ouro_checkpoint(tmp_path)
    weights = load_file(str(tmp_path / "model.safetensors"))
    del weights["model.early_exit_gate.bias"]
    weights["model.layers.0.self_attn.q_proj.bias"] = torch.zeros(32)
    weights["model.norm.weight"] = torch.ones(31)
    text = weights_refusal(tmp_path, weights, load_ouro)
    assert "1 expected tensor missing: model.early_exit_gate.bias" in text
    assert "1 unexpected tensor: model.layers.0.self_attn.q_proj.bias" in text
    assert "model.norm.weight has shape (31,), expected (32,)" in text


def test_n_loops_must_be_positive(ouro_dir):
    with pytest.raises(ValueError, match=r"n_loops \(total_ut_steps\) must be a positive integer, got 0"):
        load_ouro(ouro_dir, n_loops=0)
