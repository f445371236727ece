"""Export a platform model as a Hugging Face directory: ``export(model_or_checkpoint, out_dir, form=None)``.

Three forms, each the exact inverse of its importer, so ``speed.from_pretrained`` reads the directory back:

- ``ouro``: a ``LoopedLM`` whose options are exactly Ouro's (``convert_ouro``: ``Lx{M}``, no prelude or coda,
  sandwich norms, loop norm, exit gate, rotary halves, no injection, query/key bias, embedding scale or coda
  norm) as Ouro's published layout: config.json with Ouro's fields (``model_type: "ouro"``, ``total_ut_steps``,
  an ``auto_map`` naming the public remote code, ``configuration_ouro.py`` and ``modeling_ouro.py``, which are
  not copied: fetch them from ByteDance/Ouro-1.4B to run it under ``transformers``) and the published
  tensor names. Nothing is lost: every loop's logits and exit gate are kept.
- ``llama``: a pre-norm ``LoopedLM`` (``P+NxM+C``) unrolled into a plain ``LlamaForCausalLM``: prelude, the
  core M times, coda, final norm, head; P + N*M + C layers, each virtual layer's weights copied. A Llama has
  one exit, at the end, so only the last loop's logits are kept (the coda runs once, after the last loop);
  the sharing and the earlier exits are lost.
- ``t5``: a ``SpeedT5`` as a T5 v1.1 ``T5ForConditionalGeneration``: the encoder as it is, the ``NxM`` decoder
  unrolled into N*M layers (HF decoder block ``i*N + j`` holds shared layer j; the relative position bias in
  block 0, as HF keeps it). Last loop's logits kept, sharing and earlier exits lost.

Forms that would change the outputs are refused (``ExportError``, one line naming the option that prevents
it). Exit adapters (``speed.models.exits``) are not exported: a checkpoint is read without them, a model
holding them is refused. The weights keep the model's dtype, in ``model.safetensors``.

The tokenizer comes along from where the model came from, one rule for the function and the job: a path
(``source`` a platform checkpoint or run, or an imported Hugging Face directory) brings its own tokenizer; a model
object brings none unless ``tokenizer=`` names one (a SentencePiece ``.model`` file or a tokenizer directory);
``Exported.tokenizer`` says what was written from (None: no tokenizer, and the export is then evaluated with
``--tokenizer``). An imported model's tokenizer (a Hugging Face directory, or a checkpoint finetuned from one,
which keeps it in tokenizer/) is written as its own files, ``tokenizer.json`` among them. A SentencePiece model
is written as ``spiece.model`` and a ``tokenizer_config.json`` for ``T5Tokenizer``, whatever the form, since the
platform's tokenizer is T5's conventions (a unigram SentencePiece model; pad 0, EOS 1, UNK 2, no BOS, EOS appended
as ``Tokenizer.encode`` appends it; ``extra_ids``: the sentinels the platform adds to a model without them),
plus, for an LM whose checkpoint has one, the platform's chat template as Jinja (``chat_template``); no
``tokenizer.json`` then (the fast pipeline, which ``transformers`` builds from ``spiece.model``) and no
generation config.

The directory appears whole or not at all: it is written into a temporary sibling, then renamed.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from speed.chat import ChatTemplate
from speed.config import LMConfig, from_dict
from speed.models.convert_ouro import EMBEDDING, HEAD, NORMS
from speed.models.convert_t5 import EMBEDDING_COPIES, hf_config_from
from speed.models.looped_lm import LoopedLM
from speed.models.pretrained import load_pretrained
from speed.models.t5 import SpeedT5
from speed.storage import locate

FORMS = ("ouro", "llama", "t5")
WEIGHTS = "model.safetensors"
# The remote code a published Ouro config names (ByteDance/Ouro-1.4B); the files themselves are not copied.
OURO_AUTO_MAP = {
    "AutoConfig": "configuration_ouro.OuroConfig",
    "AutoModel": "modeling_ouro.OuroModel",
    "AutoModelForCausalLM": "modeling_ouro.OuroForCausalLM",
}
MAX_POSITIONS = 4096  # config.json's max_position_embeddings: unscaled rotary embeddings do not depend on it


class ExportError(ValueError):
    """The model cannot be written in the form asked for without changing its outputs (one line)."""


@dataclass(frozen=True)
class Exported:
    """What ``export`` wrote: the directory, its form (``FORMS``), its files, and the HF layers of an unrolled
    stack (the decoder's for T5; Ouro's physical layers)."""

    directory: Path
    form: str
    files: tuple[str, ...]
    n_layers: int
    tokenizer: str | None = None  # where the written tokenizer came from; None: none was written


def export(
    source: SpeedT5 | LoopedLM | str | Path,
    out_dir: str | Path,
    *,
    form: str | None = None,
    tokenizer: str | Path | None = None,
    chat_template: ChatTemplate | None = None,
) -> Exported:
    """Write ``source`` (a model; or a path, as ``speed.models.pretrained.load_pretrained`` reads it: a platform
    checkpoint or run, or an imported Hugging Face directory, whose tokenizer and chat template come with it) into
    the new directory ``out_dir`` as ``form`` (default: ``t5`` for a T5, ``ouro`` for a looped LM in Ouro's
    options, else ``llama``); an ``ExportError`` (one line) when that form would change its outputs."""
    if form is not None and form not in FORMS:
        raise ExportError(f"form {form!r}: choose one of {', '.join(FORMS)}")
    if isinstance(source, (SpeedT5, LoopedLM)):
        model = source
        if model.exit_adapters is not None:
            raise ExportError("the model holds exit adapters, which no exported form keeps; export it without them")
    else:
        loaded = load_pretrained(str(source), exits=False)
        model, tokenizer = loaded.model, tokenizer or loaded.tokenizer_path
        stored = loaded.config.get("chat_template")
        if chat_template is None and stored is not None:
            chat_template = from_dict(ChatTemplate, stored, "chat_template")
    form = form or _default_form(model)
    writer = _writer(model, form)
    out = Path(out_dir)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ExportError(f"{out} exists and is not an empty folder; export writes a new one")
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        config, weights = writer(model)
        _write_weights(staging, weights)
        (staging / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
        if tokenizer is not None:
            _write_tokenizer(staging, str(tokenizer), form, chat_template)
        files = tuple(sorted(p.name for p in staging.iterdir()))
        if out.exists():
            out.rmdir()  # empty (checked above)
        staging.rename(out)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    layers = config.get("num_hidden_layers", config.get("num_decoder_layers", 0))
    return Exported(out, form, files, layers, None if tokenizer is None else str(tokenizer))


# ----- which form ---------------------------------------------------------------------------------------


def ouro_obstacle(config: LMConfig) -> str | None:
    """The option that keeps a ``LoopedLM`` of ``config`` out of Ouro's layout, in words; None when it fits."""
    s = config.sharing
    checks = [
        (s.prelude or s.coda, f"pattern {config.pattern}: Ouro loops all of its layers, with no prelude or coda"),
        (config.norm != "sandwich", f"norm={config.norm!r}: Ouro's layers are sandwich-normed"),
        (not config.loop_norm, "loop_norm=False: Ouro feeds each loop the final norm's output"),
        (not config.exit_gate, "exit_gate=False: Ouro's layout holds an exit gate"),
        *_common_obstacles(config, "Ouro"),
    ]
    return next((why for failed, why in checks if failed), None)


def llama_obstacle(config: LMConfig) -> str | None:
    """The option that keeps a ``LoopedLM`` of ``config`` from unrolling into a plain Llama; None when it fits."""
    checks = [
        (config.norm != "pre", f"norm={config.norm!r}: a Llama layer is pre-norm only"),
        (config.loop_norm, "loop_norm: it normalises between loops, and a Llama stack has no place for that"),
        (config.exit_gate, "exit_gate: a Llama has no exit gate (its lambdas would be lost)"),
        *_common_obstacles(config, "a Llama"),
    ]
    return next((why for failed, why in checks if failed), None)


def _common_obstacles(config: LMConfig, name: str) -> list[tuple[bool, str]]:
    return [
        (config.injection, f"injection: {name} has no input injection adapter"),
        (config.rope_layout != "halves", f"rope_layout={config.rope_layout!r}: {name} rotates halves"),
        (config.qk_bias, f"qk_bias: {name}'s queries and keys have no bias"),
        (config.embed_scale != 1.0, f"embed_scale={config.embed_scale}: {name} does not scale its embedding"),
        (config.coda_norm, f"coda_norm: {name} normalises only before its head"),
    ]


def _default_form(model: SpeedT5 | LoopedLM) -> str:
    if isinstance(model, SpeedT5):
        return "t5"
    ouro, llama = ouro_obstacle(model.config), llama_obstacle(model.config)
    if ouro is None:
        return "ouro"
    if llama is None:
        return "llama"
    raise ExportError(f"no exported form keeps this model's outputs: ouro: {ouro}; llama: {llama}")


Writer = Callable[[Any], tuple[dict[str, Any], dict[str, Tensor]]]


def _writer(model: SpeedT5 | LoopedLM, form: str) -> Writer:
    """The writer of ``form`` for ``model``; an ``ExportError`` naming what prevents it."""
    if form == "t5":
        if not isinstance(model, SpeedT5):
            raise ExportError("form t5 is for a SpeedT5; a looped LM exports as ouro or llama")
        return t5_files
    if not isinstance(model, LoopedLM):
        raise ExportError(f"form {form} is for a looped LM; a SpeedT5 exports as t5")
    obstacle = (ouro_obstacle if form == "ouro" else llama_obstacle)(model.config)
    if obstacle is not None:
        raise ExportError(f"cannot export as {form}: {obstacle}")
    return ouro_files if form == "ouro" else llama_files


# ----- the forms ----------------------------------------------------------------------------------------


def ouro_files(model: LoopedLM) -> tuple[dict[str, Any], dict[str, Tensor]]:
    """Ouro's config.json and tensors (published names) for ``model``: the inverse of ``convert_ouro``."""
    c, state = model.config, model.state_dict()
    n = c.sharing.n_unique
    config = {
        "architectures": ["OuroForCausalLM"],
        "attention_dropout": 0.0,
        "auto_map": OURO_AUTO_MAP,
        "early_exit_threshold": 1.0,
        "layer_types": ["full_attention"] * n,
        "max_window_layers": n,
        "model_type": "ouro",
        "rope_scaling": None,
        "sliding_window": None,
        "total_ut_steps": c.sharing.n_loops,
        "use_sliding_window": False,
        **_decoder_fields(c, n, _dtype(model)),
    }
    weights = {EMBEDDING: state["embed_tokens.weight"], "model.norm.weight": state["norm.weight"]}
    weights |= {
        "model.early_exit_gate.weight": state["exit_gate.weight"],
        "model.early_exit_gate.bias": state["exit_gate.bias"],
    }
    if not c.tie_embeddings:
        weights[HEAD] = state["lm_head.weight"]
    for i in range(n):
        weights |= _llama_layer(state, f"core.{i}.", f"model.layers.{i}.", c)
        weights |= {
            f"model.layers.{i}.{theirs}.weight": state[f"core.{i}.{ours}.weight"] for theirs, ours in NORMS.items()
        }
    return config, weights


def llama_files(model: LoopedLM) -> tuple[dict[str, Any], dict[str, Tensor]]:
    """A plain Llama's config.json and tensors for ``model`` unrolled: prelude, core M times, coda."""
    c, state, s = model.config, model.state_dict(), model.config.sharing
    blocks = [f"prelude.{p}." for p in range(s.prelude)]
    blocks += [f"core.{j}." for _ in range(s.n_loops) for j in range(s.n_unique)]
    blocks += [f"coda.{k}." for k in range(s.coda)]
    config = {
        "architectures": ["LlamaForCausalLM"],
        "attention_bias": False,
        "mlp_bias": False,
        "model_type": "llama",
        "rope_scaling": None,
        **_decoder_fields(c, len(blocks), _dtype(model)),
    }
    weights = {EMBEDDING: state["embed_tokens.weight"], "model.norm.weight": state["norm.weight"]}
    if not c.tie_embeddings:
        weights[HEAD] = state["lm_head.weight"]
    for i, block in enumerate(blocks):
        hf = f"model.layers.{i}."
        weights |= _llama_layer(state, block, hf, c)
        weights[hf + "input_layernorm.weight"] = state[block + "attn_norm.weight"]
        weights[hf + "post_attention_layernorm.weight"] = state[block + "mlp_norm.weight"]
    return config, weights


def _decoder_fields(c: LMConfig, n_layers: int, dtype: torch.dtype) -> dict[str, Any]:
    """The config.json fields Ouro and Llama share (``LlamaConfig``'s names)."""
    import transformers

    return {
        "bos_token_id": c.eos_id,
        "eos_token_id": c.eos_id,
        "head_dim": c.head_dim,
        "hidden_act": "silu",
        "hidden_size": c.d_model,
        "initializer_range": 0.02,
        "intermediate_size": c.d_ff,
        "max_position_embeddings": MAX_POSITIONS,
        "num_attention_heads": c.n_heads,
        "num_hidden_layers": n_layers,
        "num_key_value_heads": c.n_kv_heads,
        "rms_norm_eps": c.norm_eps,
        "rope_theta": c.rope_theta,
        "tie_word_embeddings": c.tie_embeddings,
        "torch_dtype": str(dtype).removeprefix("torch."),
        "transformers_version": transformers.__version__,
        "use_cache": True,
        "vocab_size": c.vocab_size,
    }


def _llama_layer(state: Mapping[str, Tensor], ours: str, hf: str, c: LMConfig) -> dict[str, Tensor]:
    """One block's attention and MLP weights under Llama's (and Ouro's) names: fused rows split again."""
    q, kv = c.n_heads * c.head_dim, c.n_kv_heads * c.head_dim
    wq, wk, wv = state[ours + "attn.qkv.weight"].split([q, kv, kv])
    gate, up = state[ours + "mlp.wi.weight"].chunk(2)
    return {
        hf + "self_attn.q_proj.weight": wq,
        hf + "self_attn.k_proj.weight": wk,
        hf + "self_attn.v_proj.weight": wv,
        hf + "self_attn.o_proj.weight": state[ours + "attn.o.weight"],
        hf + "mlp.gate_proj.weight": gate,
        hf + "mlp.up_proj.weight": up,
        hf + "mlp.down_proj.weight": state[ours + "mlp.wo.weight"],
    }


def t5_files(model: SpeedT5) -> tuple[dict[str, Any], dict[str, Tensor]]:
    """A T5 v1.1 config.json and tensors for ``model``, its decoder unrolled: the inverse of ``convert_t5``."""
    c, state, s = model.config, model.state_dict(), model.config.sharing
    config = hf_config_from(c).to_dict() | {"architectures": ["T5ForConditionalGeneration"]}
    config["tie_word_embeddings"] = False  # transformers 5 writes True (v1.1 untied by scale_decoder_outputs=False)
    config["torch_dtype"] = str(_dtype(model)).removeprefix("torch.")
    shared = state["shared.weight"]
    weights = {"shared.weight": shared, "lm_head.weight": state["lm_head.weight"]}
    weights |= dict.fromkeys(EMBEDDING_COPIES, shared)
    weights["encoder.final_layer_norm.weight"] = state["encoder_norm.weight"]
    weights["decoder.final_layer_norm.weight"] = state["decoder_norm.weight"]
    weights["encoder.block.0.layer.0.SelfAttention.relative_attention_bias.weight"] = state[
        "encoder_bias.embedding.weight"
    ]
    weights["decoder.block.0.layer.0.SelfAttention.relative_attention_bias.weight"] = state[
        "decoder_bias.embedding.weight"
    ]
    for i in range(c.n_encoder_layers):
        hf, ours = f"encoder.block.{i}.layer.", f"encoder_layers.{i}."
        weights |= _t5_attention(state, ours + "attn.", hf + "0.SelfAttention.")
        weights[hf + "0.layer_norm.weight"] = state[ours + "attn_norm.weight"]
        weights |= _t5_ffn(state, ours + "ffn.", hf + "1.")
        weights[hf + "1.layer_norm.weight"] = state[ours + "ffn_norm.weight"]
    for v in range(s.depth):
        hf, ours = f"decoder.block.{v}.layer.", f"decoder_layers.{s.physical_layer(v)}."
        weights |= _t5_attention(state, ours + "self_attn.", hf + "0.SelfAttention.")
        weights[hf + "0.layer_norm.weight"] = state[ours + "self_norm.weight"]
        cross = hf + "1.EncDecAttention."
        weights[cross + "q.weight"] = state[ours + "cross_attn.q.weight"]
        weights[cross + "k.weight"], weights[cross + "v.weight"] = state[ours + "cross_attn.kv.weight"].chunk(2)
        weights[cross + "o.weight"] = state[ours + "cross_attn.o.weight"]
        weights[hf + "1.layer_norm.weight"] = state[ours + "cross_norm.weight"]
        weights |= _t5_ffn(state, ours + "ffn.", hf + "2.")
        weights[hf + "2.layer_norm.weight"] = state[ours + "ffn_norm.weight"]
    return config, weights


def _t5_attention(state: Mapping[str, Tensor], ours: str, hf: str) -> dict[str, Tensor]:
    q, k, v = state[ours + "qkv.weight"].chunk(3)
    return {hf + "q.weight": q, hf + "k.weight": k, hf + "v.weight": v, hf + "o.weight": state[ours + "o.weight"]}


def _t5_ffn(state: Mapping[str, Tensor], ours: str, hf: str) -> dict[str, Tensor]:
    dense = hf + "DenseReluDense."
    wi_0, wi_1 = state[ours + "wi.weight"].chunk(2)
    return {dense + "wi_0.weight": wi_0, dense + "wi_1.weight": wi_1, dense + "wo.weight": state[ours + "wo.weight"]}


def _dtype(model: torch.nn.Module) -> torch.dtype:
    """The dtype the model's weights are in (and exported in)."""
    return next(model.parameters()).dtype


# ----- files --------------------------------------------------------------------------------------------


def _write_weights(directory: Path, weights: Mapping[str, Tensor]) -> None:
    """One ``model.safetensors``; every tensor its own contiguous copy (safetensors refuses shared storage)."""
    from safetensors.torch import save_file

    tensors = {name: t.detach().cpu().contiguous().clone() for name, t in weights.items()}
    save_file(tensors, str(directory / WEIGHTS), metadata={"format": "pt"})


def _write_tokenizer(directory: Path, path: str, form: str, chat_template: ChatTemplate | None) -> None:
    """The SentencePiece model and a ``tokenizer_config.json`` (see the module doc); an imported model's tokenizer
    (a checkpoint's tokenizer/ folder, finetuned from a Hugging Face directory) as its own files."""
    import sentencepiece as spm

    from speed.hf_tokenizer import tokenizer_files
    from speed.tokenizer import Tokenizer

    if locate(path).is_dir():
        for name, data in tokenizer_files(path).items():
            if name != "config.json":  # the model's: the exported one describes the model
                (directory / name).parent.mkdir(parents=True, exist_ok=True)
                (directory / name).write_bytes(data)
        return
    raw = locate(path).read_bytes()
    plain = spm.SentencePieceProcessor(model_proto=raw)
    specials = {
        "pad_token": plain.id_to_piece(Tokenizer.pad_id),
        "eos_token": plain.id_to_piece(Tokenizer.eos_id),
        "unk_token": plain.id_to_piece(Tokenizer.unk_id),
    }
    (directory / "spiece.model").write_bytes(raw)
    extra = Tokenizer.load(path).vocab_size - plain.get_piece_size()  # sentinels the platform appends
    config = {"tokenizer_class": "T5Tokenizer", "extra_ids": extra, **specials}
    if form != "t5" and chat_template is not None:
        config["chat_template"] = jinja_template(chat_template)
    config["model_max_length"] = MAX_POSITIONS
    (directory / "tokenizer_config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


def jinja_template(template: ChatTemplate) -> str:
    """``template`` as the Jinja chat template transformers renders (``apply_chat_template``) to the same text."""
    turn = template.turn.replace("{role}", "{{ message['role'] }}").replace("{content}", "{{ message['content'] }}")
    return (
        "{% for message in messages %}"
        + turn
        + "{% endfor %}{% if add_generation_prompt %}"
        + template.cue
        + "{% endif %}"
    )
