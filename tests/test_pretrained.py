"""``speed.from_pretrained``: one loader for Hugging Face directories of every form (T5 v1.1, Llama, Ouro,
Huginn-0125) and platform checkpoints, never running the directory's code."""

from __future__ import annotations

import json

import pytest
import torch
from imported_helpers import one_line, token_ids
from looped_refs import write_huginn_checkpoint, write_ouro_checkpoint
from transformers import LlamaConfig, LlamaForCausalLM, T5Config, T5ForConditionalGeneration

import speed
from speed.config import lm_preset
from speed.hf_files import ModelFilesError
from speed.models.checkpoint import save_model
from speed.models.convert_huginn import load_huginn
from speed.models.convert_llama import from_llama
from speed.models.convert_ouro import load_ouro
from speed.models.convert_t5 import from_hf_model
from speed.models.looped_lm import LoopedLM
from speed.models.t5 import SpeedT5


def same_weights(a: torch.nn.Module, b: torch.nn.Module) -> bool:
    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


def test_ouro_and_huginn_directories(tmp_path):
    write_ouro_checkpoint(tmp_path / "ouro", total_ut_steps=3)
    write_huginn_checkpoint(tmp_path / "huginn", mean_recurrence=3, prelude=1, core=1, coda=1)
    for form, load in (("ouro", load_ouro), ("huginn", load_huginn)):
        model = speed.from_pretrained(tmp_path / form, n_loops=5)
        assert isinstance(model, LoopedLM) and not model.training and model.n_loops == 5
        assert same_weights(model, load(tmp_path / form))
        assert speed.from_pretrained(str(tmp_path / form)).n_loops == 3
    assert speed.from_pretrained(tmp_path / "ouro", dtype=torch.bfloat16).lm_head.weight.dtype == torch.bfloat16


def test_a_directory_on_object_storage(tmp_path, memory_store):
    write_ouro_checkpoint(tmp_path / "ouro", total_ut_steps=3)
    from speed.storage import locate

    locate(memory_store + "/ouro").upload(tmp_path / "ouro")
    loaded = speed.from_pretrained(memory_store + "/ouro", n_loops=2)
    assert same_weights(loaded, load_ouro(tmp_path / "ouro", n_loops=2))


def test_a_llama_directory(tmp_path):
    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, eos_token_id=2)  # fmt: skip
    hf = LlamaForCausalLM(config).eval()
    hf.save_pretrained(tmp_path)
    model = speed.from_pretrained(tmp_path)
    assert isinstance(model, LoopedLM) and model.config.pattern == "2x1" and same_weights(model, from_llama(hf))
    with torch.no_grad():
        torch.testing.assert_close(model(token_ids() % 64, return_logits=True).loop_logits[-1],
                                   hf(token_ids() % 64).logits, atol=1e-4, rtol=0)  # fmt: skip


def test_a_t5_directory(tmp_path):
    config = T5Config(vocab_size=64, d_model=32, d_kv=8, d_ff=48, num_layers=2, num_heads=4,
                      feed_forward_proj="gated-gelu", tie_word_embeddings=False, decoder_start_token_id=0)  # fmt: skip
    hf = T5ForConditionalGeneration(config).eval()
    hf.save_pretrained(tmp_path)
    model = speed.from_pretrained(tmp_path)
    assert isinstance(model, SpeedT5) and same_weights(model, from_hf_model(hf))


def test_a_platform_checkpoint(tmp_path):
    model = LoopedLM(lm_preset("tiny", pattern="1+2x3", norm="residual", rope_layout="pairs", qk_bias=True))
    save_model(tmp_path / "ckpt", model)
    loaded = speed.from_pretrained(tmp_path / "ckpt")
    assert isinstance(loaded, LoopedLM) and loaded.config == model.config and same_weights(loaded, model)
    with pytest.raises(ValueError, match="n_loops=4: a platform checkpoint loops as its pattern says"):
        speed.from_pretrained(tmp_path / "ckpt", n_loops=4)


def test_the_directory_code_is_never_run(tmp_path):
    config = write_ouro_checkpoint(tmp_path)
    marker = tmp_path / "ran"
    for module in ("configuration_ouro", "modeling_ouro"):
        (tmp_path / f"{module}.py").write_text(f"open({str(marker)!r}, 'w').write('ran')\n")
    assert config["auto_map"]
    speed.from_pretrained(tmp_path)
    assert not marker.exists()


def test_an_unknown_form_is_one_line(tmp_path):
    config = write_ouro_checkpoint(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps(config | {"model_type": "gpt2"}))
    with pytest.raises(ModelFilesError) as error:
        speed.from_pretrained(tmp_path)
    assert "model_type 'gpt2' is not one the platform loads" in one_line(error)


def test_the_docs_tiny_directories_load_with_their_tokenizers(tmp_path):
    """``tests/write_tiny_models.py`` (the docs' worked commands run on its directories) writes one directory per
    form that ``speed.from_pretrained`` and ``load_tokenizer`` read."""
    from write_tiny_models import write_tiny_models

    from speed.hf_tokenizer import load_tokenizer

    made = write_tiny_models(tmp_path)
    assert sorted(made) == ["Ouro-tiny", "huginn-tiny", "llama-tiny", "t5-tiny"]
    for name, directory in made.items():
        model, tok = speed.from_pretrained(directory), load_tokenizer(directory)
        assert isinstance(model, SpeedT5 if name == "t5-tiny" else LoopedLM), name
        assert tok.vocab_size <= model.config.vocab_size and tok.stop_ids, name
