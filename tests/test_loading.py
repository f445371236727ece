"""Loading at real sizes (``speed.benchmarks.loading``): a published looped LM loads holding its weights once."""

from __future__ import annotations

import pytest
import torch
from looped_refs import write_ouro_checkpoint

from speed.benchmarks.loading import measure_load
from speed.models.pretrained import from_pretrained


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
