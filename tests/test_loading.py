"""Loading at real sizes: a published model loads holding its weights once (``speed.benchmarks.loading``), read
into its place chunk by chunk where converted, its stored tied copies compared on the way (``speed.hf_files``),
after a memory check that names what fits (``speed.models.pretrained.check_load``)."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch
from imported_helpers import one_line
from looped_refs import write_huginn_checkpoint, write_ouro_checkpoint

from speed import hf_files
from speed.benchmarks.checkpoints import PUBLISHED, write_checkpoint
from speed.benchmarks.loading import measure_load
from speed.engine.memory import MEMORY_LIMIT_ENV, MemoryBudgetError, size
from speed.engine.types import EngineConfig
from speed.hf_files import WeightsError
from speed.models import convert_huginn
from speed.models.precision import with_dtype
from speed.models.pretrained import check_load, from_pretrained


@pytest.mark.parametrize("dtype,mib", [(torch.float32, 200), (torch.bfloat16, 100)])
def test_an_ouro_checkpoint_loads_without_a_second_copy(tmp_path, dtype, mib):
    """A ~110 MB bf16 Ouro loaded as float32 (220 MB), or as bf16 weights (its linear weights as stored, its norms
    and embedding widened: 110 MB): the load's peak resident set stays within 1.2x the weights (a memory map's
    resident pages or the fused q;k;v and gate;up parts kept beside the model reach 1.5x)."""
    big, tiny = tmp_path / "big", tmp_path / "tiny"
    write_ouro_checkpoint(
        big, hidden=512, layers=16, heads=8, kv_heads=8, intermediate=1408, vocab=4096, dtype=torch.bfloat16
    )
    write_ouro_checkpoint(tiny, dtype=torch.bfloat16)
    report = measure_load(big, dtype, warm=tiny)
    assert report.weights_bytes > mib * 2**20
    assert report.peak_over_weights <= 1.2, report
    assert report.seconds > 0


def test_loading_reads_every_tensor_exactly(tmp_path):
    """The file reader returns each stored tensor bit for bit, as stored or converted (bf16 -> float32 exact)."""
    write_ouro_checkpoint(tmp_path, dtype=torch.bfloat16, layers=2)
    as_stored = from_pretrained(tmp_path, dtype=torch.bfloat16)
    widened = from_pretrained(tmp_path, dtype=torch.float32)
    from safetensors.torch import load_file

    stored = load_file(tmp_path / "model.safetensors")
    assert torch.equal(as_stored.lm_head.weight, stored["lm_head.weight"])
    assert torch.equal(widened.lm_head.weight, stored["lm_head.weight"].float())
    q, k, v = (stored[f"model.layers.1.self_attn.{x}_proj.weight"] for x in "qkv")
    assert torch.equal(as_stored.core[1].attn.qkv.weight, torch.cat([q, k, v]))


def _huginn_tensors(directory):
    from safetensors.torch import load_file

    return {name: t for path in sorted(directory.glob("*.safetensors")) for name, t in load_file(path).items()}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_published_huginn_is_read_chunk_by_chunk_exactly(tmp_path, monkeypatch, dtype):
    """Huginn's float32 shards, the tied embedding stored twice across two shards, read in chunks of 256 bytes (every
    tensor over several): each parameter is its stored tensor converted to the model's dtype, bit for bit."""
    monkeypatch.setattr(hf_files, "CHUNK_BYTES", 256)
    write_huginn_checkpoint(tmp_path, shards=3, lm_head=True)
    stored = _huginn_tensors(tmp_path)
    model = from_pretrained(tmp_path, dtype=dtype)
    linear = model.embed_tokens.weight.dtype  # bf16 weights: the tied embedding is the head's bfloat16 weight
    assert linear == dtype and model.lm_head.weight is model.embed_tokens.weight
    assert torch.equal(model.embed_tokens.weight, stored["transformer.wte.weight"].to(dtype))
    assert torch.equal(model.core[1].mlp.wi.weight, stored["transformer.core_block.1.mlp.fc.weight"].to(dtype))
    assert torch.equal(model.prelude[0].attn.q_bias, stored["transformer.prelude.0.attn.qk_bias"][0, 0])
    assert torch.equal(model.coda[1].attn.k_bias, stored["transformer.coda.1.attn.qk_bias"][1, 0])
    assert torch.equal(model.norm.weight, stored["transformer.ln_f.weight"])


def test_a_tied_copy_that_differs_in_one_element_is_refused(tmp_path, monkeypatch):
    """The stored head is compared with the embedding chunk by chunk as it is read: a difference in the last element
    of the last chunk is one line, for every dtype."""
    from safetensors.torch import load_file, save_file

    monkeypatch.setattr(hf_files, "CHUNK_BYTES", 256)
    write_huginn_checkpoint(tmp_path, shards=3, lm_head=True)
    (shard,) = [p for p in tmp_path.glob("*.safetensors") if "lm_head.weight" in load_file(p)]
    tensors = load_file(shard)
    tensors["lm_head.weight"][-1, -1] += 1.0
    save_file(tensors, str(shard), metadata={"format": "pt"})
    for dtype in (torch.float32, torch.bfloat16):
        with pytest.raises(WeightsError) as error:
            from_pretrained(tmp_path, dtype=dtype)
        assert one_line(error).endswith("tied checkpoint, but lm_head.weight differs from transformer.wte.weight")


def test_the_memory_check_refuses_before_allocating_and_names_what_fits(tmp_path, monkeypatch):
    """With a faked available memory (``SPEED_MEMORY_LIMIT``) between what Huginn takes as bf16 weights and as
    float32, float32 is refused in one line naming bfloat16 as what fits, before any tensor is allocated; bf16 loads;
    an engine capacity beside the weights counts; below both, the line says nothing fits."""
    write_huginn_checkpoint(tmp_path, lm_head=True)
    monkeypatch.setenv(MEMORY_LIMIT_ENV, str(2**40))
    f32, bf16 = (check_load(tmp_path, dtype=d) for d in (torch.float32, torch.bfloat16))
    model = from_pretrained(tmp_path)
    assert f32.total == f32.weights == sum(p.nbytes for p in model.parameters())
    assert bf16.weights == sum(p.nbytes for p in from_pretrained(tmp_path, dtype=torch.bfloat16).parameters())
    capacity = EngineConfig(max_active=2, max_prompt_len=16, max_target_len=16)
    served = check_load(tmp_path, dtype=torch.bfloat16, capacity=capacity)
    assert served.weights == bf16.weights and served.cache > 0 and served.side > 0

    def no_allocation(*args, **kwargs):
        raise AssertionError("allocated before the memory check")

    monkeypatch.setattr(convert_huginn, "empty_model", no_allocation)
    monkeypatch.setenv(MEMORY_LIMIT_ENV, str((bf16.total + f32.total) // 2))
    with pytest.raises(MemoryBudgetError) as error:
        from_pretrained(tmp_path, dtype=torch.float32)
    assert one_line(error).startswith(f"{tmp_path.name} as float32 needs {size(f32.total)} for its weights, ")
    assert one_line(error).endswith(f"available ({MEMORY_LIMIT_ENV}): bfloat16 ({size(bf16.total)}) fits")
    monkeypatch.setenv(MEMORY_LIMIT_ENV, str(bf16.total + served.allocated // 2))
    with pytest.raises(MemoryBudgetError, match=r"as bfloat16 needs .* cache .*: nothing fits \(float32 needs "):
        from_pretrained(tmp_path, dtype=torch.bfloat16, capacity=capacity)
    monkeypatch.undo()
    monkeypatch.setenv(MEMORY_LIMIT_ENV, str(bf16.total))
    assert from_pretrained(tmp_path, dtype=torch.bfloat16).embed_tokens.weight.dtype == torch.bfloat16


def test_t5_and_llama_read_into_their_places_and_compare_stored_copies(tmp_path):
    """A T5 v1.1 and a Llama directory load as ``dtype`` straight from their files (q;k;v rows in place), equal to
    the converted ``transformers`` models; T5's stored copy of ``shared`` and a tied Llama head that differ are
    refused in one line."""
    from safetensors.torch import load_file, save_file
    from transformers import LlamaConfig, LlamaForCausalLM, T5Config, T5ForConditionalGeneration

    from speed.models.convert_llama import from_llama
    from speed.models.convert_t5 import from_hf_model

    torch.manual_seed(0)
    t5_config = T5Config(vocab_size=64, d_model=16, d_kv=4, d_ff=24, num_layers=2, num_heads=4,
                         feed_forward_proj="gated-gelu", tie_word_embeddings=False, decoder_start_token_id=0,
                         pad_token_id=0, eos_token_id=1)  # fmt: skip
    t5 = T5ForConditionalGeneration(t5_config).eval()
    t5.save_pretrained(tmp_path / "t5")
    llama = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=24, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True,
                                         bos_token_id=0, eos_token_id=1)).eval()  # fmt: skip
    llama.save_pretrained(tmp_path / "llama")
    for directory, reference in ((tmp_path / "t5", from_hf_model(t5)), (tmp_path / "llama", from_llama(llama))):
        for dtype in (torch.float32, torch.bfloat16):
            loaded = from_pretrained(directory, dtype=dtype).state_dict()
            want = with_dtype(reference, dtype).state_dict()
            assert loaded.keys() == want.keys()
            assert all(torch.equal(loaded[name], want[name]) for name in want), directory
    for directory, copy, original in ((tmp_path / "t5", "encoder.embed_tokens.weight", "shared.weight"),
                                      (tmp_path / "llama", "lm_head.weight", "model.embed_tokens.weight")):  # fmt: skip
        tensors = load_file(directory / "model.safetensors")
        tensors[copy] = tensors[original].clone()
        tensors[copy][3, 2] += 1
        save_file(tensors, str(directory / "model.safetensors"), metadata={"format": "pt"})
        with pytest.raises(WeightsError) as error:
            from_pretrained(directory)
        assert one_line(error).endswith(f"tied checkpoint, but {copy} differs from {original}")


@pytest.mark.parametrize("name", list(PUBLISHED))
def test_the_full_size_writer_at_a_tiny_size(tmp_path, name):
    """``speed.benchmarks.checkpoints`` with each published layout's fields at a tiny size: shards of at most the
    limit (a tensor alone may pass it) with their index, Huginn's tied embedding stored twice, equal; the importer
    loads it; the tokenizer decodes every id and renders a chat."""
    from safetensors.torch import load_file

    from speed.hf_tokenizer import load_tokenizer

    published = PUBLISHED[name]
    tiny = {"vocab_size": 4096, "padded_vocab_size": 4096, "hidden_size": 32, "n_embd": 32, "num_attention_heads": 4,
            "n_heads": 4, "num_key_value_heads": 4, "head_dim": 8, "intermediate_size": 48, "num_hidden_layers": 2,
            "block_size": 64, "bos_token_id": 4000, "eos_token_id": 4001}  # fmt: skip
    specials = {4000 + i: token for i, token in enumerate(published.specials.values())}
    small = replace(published, config=published.config | tiny, specials=specials)
    written = write_checkpoint(tmp_path, small, shard_bytes=200_000)
    stored = _huginn_tensors(tmp_path)
    assert len(written.files) > 1 and set(stored) == set(small.tensors())
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())["weight_map"]
    assert set(index.values()) == set(written.files)
    for file in written.files:
        tensors = load_file(tmp_path / file)
        assert len(tensors) == 1 or sum(t.nbytes for t in tensors.values()) <= 200_000
        assert {t.dtype for n, t in tensors.items() if n != "freqs_cis"} <= {published.dtype}
    assert written.bytes == sum(t.nbytes for t in stored.values())
    if published.tied_copy:
        assert torch.equal(stored["lm_head.weight"], stored["transformer.wte.weight"])
    model = from_pretrained(tmp_path, dtype=torch.bfloat16)
    assert model.config.vocab_size == 4096 and model.n_loops == small.lm_config().sharing.n_loops
    tokenizer = load_tokenizer(tmp_path)
    assert tokenizer.decode(list(range(0, 4000, 7))).split() == [f"w{i}" for i in range(0, 4000, 7)]
    assert tokenizer.encode("w5 w3999")[:2] == [5, 3999]
    assert tokenizer.chat_template is not None


def test_a_platform_checkpoint_is_checked_from_its_config_before_it_is_read(tmp_path, monkeypatch):
    """``model.pt`` gets the same check as a directory, from its config.json (the weights as asked, and an engine
    of ``capacity``): refused in one line before ``load_model`` runs; the job's loader checks it too."""
    from speed.models import pretrained
    from speed.models.checkpoint import save_model
    from speed.models.pretrained import load_pretrained

    write_ouro_checkpoint(tmp_path / "ouro")
    model = from_pretrained(tmp_path / "ouro")
    save_model(tmp_path / "ckpt", model)
    monkeypatch.setenv(MEMORY_LIMIT_ENV, str(2**40))
    need, bf16 = check_load(tmp_path / "ckpt"), check_load(tmp_path / "ckpt", dtype=torch.bfloat16)
    assert need == check_load(tmp_path / "ouro") and need.weights == sum(p.nbytes for p in model.parameters())

    monkeypatch.setattr(pretrained, "load_model", lambda *a, **k: pytest.fail("read before the memory check"))
    monkeypatch.setenv(MEMORY_LIMIT_ENV, str(need.weights - 1))
    for load in (from_pretrained, load_pretrained):
        with pytest.raises(MemoryBudgetError) as error:
            load(str(tmp_path / "ckpt"))
        assert one_line(error).startswith(f"ckpt as float32 needs {size(need.weights)} for its weights, ")
        assert one_line(error).endswith(f"available ({MEMORY_LIMIT_ENV}): bfloat16 ({size(bf16.total)}) fits")


def test_the_engine_counted_is_what_it_allocates_at_least(tmp_path, monkeypatch):
    """Without ``kv_blocks`` an engine caps its default pool by what is available down to one request at its
    longest, so the check counts that pool; with ``kv_blocks``, that many blocks."""
    write_ouro_checkpoint(tmp_path)
    monkeypatch.setenv(MEMORY_LIMIT_ENV, str(2**40))
    model = from_pretrained(tmp_path)
    stepper = model.stepper()
    capacity = EngineConfig(max_active=4, max_prompt_len=40, max_target_len=30, branches=False)
    longest = stepper.memory_need(1, 40, 30, side=False).blocks  # 70 positions: 3 blocks of 32
    assert longest == 3
    want = stepper.memory_need(4, 40, 30, side=False, blocks=longest)
    assert check_load(tmp_path, capacity=capacity) == want
    assert check_load(tmp_path, capacity=replace(capacity, kv_blocks=20)).blocks == 20
