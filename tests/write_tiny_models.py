"""Tiny random model directories in the published Hugging Face layouts, with their tokenizers: what the docs'
"Bring your own looped LM" commands run on (the hub is unreachable here; a downloaded model's folder holds the same
files at full size).

    .venv/bin/python tests/write_tiny_models.py /tmp/tiny-models   # Ouro-tiny, huginn-tiny, llama-tiny, t5-tiny

Ouro and Huginn come from ``tests/looped_refs.py``'s writers (the published config fields and tensor names), Llama
and T5 v1.1 from ``transformers``' own classes; each gets a byte-level BPE ``tokenizer.json`` trained on a few
sentences (Ouro's and Llama's with a ChatML template, Huginn's with its own), as ``tests/test_hf_tokenizer.py``
builds them.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the test helpers beside this file

from imported_helpers import write_chat_ouro  # noqa: E402
from looped_refs import write_huginn_checkpoint  # noqa: E402
from test_hf_tokenizer import HUGINN, OURO_CONFIG, _huginn_like, _qwen_like, _write  # noqa: E402


def write_tiny_models(root: str | Path) -> dict[str, Path]:
    """The four tiny directories under ``root``, by name."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM, T5Config, T5ForConditionalGeneration

    root = Path(root)
    made = {"Ouro-tiny": write_chat_ouro(root / "Ouro-tiny", end_of_turn_bias=0.36)}
    huginn = _huginn_like()
    write_huginn_checkpoint(root / "huginn-tiny", vocab=huginn.get_vocab_size())
    made["huginn-tiny"] = root / "huginn-tiny"
    huginn_config = {"bos_token": "<|begin_text|>", "eos_token": "<|end_text|>", "chat_template": HUGINN}
    huginn_config["tokenizer_class"] = "PreTrainedTokenizerFast"
    _write(root / "huginn-tiny", huginn, tokenizer_config__json=huginn_config)
    qwen = _qwen_like()
    torch.manual_seed(0)
    llama = LlamaConfig(vocab_size=qwen.get_vocab_size(), hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, bos_token_id=0, eos_token_id=0)  # fmt: skip
    LlamaForCausalLM(llama).eval().save_pretrained(root / "llama-tiny")
    _write(root / "llama-tiny", qwen, tokenizer_config__json=OURO_CONFIG)
    t5 = T5Config(vocab_size=qwen.get_vocab_size(), d_model=32, d_kv=8, d_ff=48, num_layers=2, num_heads=4,
                  feed_forward_proj="gated-gelu", tie_word_embeddings=False, decoder_start_token_id=0,
                  pad_token_id=0, eos_token_id=0)  # fmt: skip
    T5ForConditionalGeneration(t5).eval().save_pretrained(root / "t5-tiny")
    _write(root / "t5-tiny", qwen, tokenizer_config__json=OURO_CONFIG)
    made |= {"llama-tiny": root / "llama-tiny", "t5-tiny": root / "t5-tiny"}
    return made


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit(f"usage: {sys.argv[0]} OUT_DIR")
    for name, path in write_tiny_models(sys.argv[1]).items():
        print(f"{name}: {path}")
