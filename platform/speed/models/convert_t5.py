"""Import Hugging Face T5 v1.1 weights into ``SpeedT5``.

Only the T5 v1.1 layout converts: gated-GELU feed-forward (``feed_forward_proj=
"gated-gelu"``) and an LM head that reads the final-norm output unscaled (old
configs: ``tie_word_embeddings=False``; transformers 5: ``scale_decoder_outputs=
False``). T5 v1.0 (ReLU FFN, decoder output scaled by d_model**-0.5 before a
tied head) is refused, naming the field.

Parameter mapping (HF name -> ours; ``q;k;v`` means rows concatenated)::

    shared                                              -> shared
    encoder.block.i.layer.0.SelfAttention.{q;k;v}, o    -> encoder_layers[i].attn.qkv, .attn.o
    encoder.block.i.layer.0.layer_norm                  -> encoder_layers[i].attn_norm
    encoder.block.i.layer.1.DenseReluDense.{wi_0;wi_1}  -> encoder_layers[i].ffn.wi (wo -> ffn.wo)
    encoder.block.i.layer.1.layer_norm                  -> encoder_layers[i].ffn_norm
    encoder.block.0.layer.0.SelfAttention.relative_attention_bias -> encoder_bias.embedding
    encoder.final_layer_norm                            -> encoder_norm
    decoder.block.L.layer.0.SelfAttention.{q;k;v}, o    -> decoder_layers[j].self_attn.qkv, .self_attn.o
    decoder.block.L.layer.0.layer_norm                  -> decoder_layers[j].self_norm
    decoder.block.L.layer.1.EncDecAttention.q, {k;v}, o -> decoder_layers[j].cross_attn.q, .kv, .o
    decoder.block.L.layer.1.layer_norm                  -> decoder_layers[j].cross_norm
    decoder.block.L.layer.2.DenseReluDense.{wi_0;wi_1}  -> decoder_layers[j].ffn.wi (wo -> ffn.wo)
    decoder.block.L.layer.2.layer_norm                  -> decoder_layers[j].ffn_norm
    decoder.block.0.layer.0.SelfAttention.relative_attention_bias -> decoder_bias.embedding
    decoder.final_layer_norm, lm_head                   -> decoder_norm, lm_head

with ``L = layer_map[j]``. Deliberately skipped: ``encoder.embed_tokens`` and
``decoder.embed_tokens`` (HF's copies of ``shared``; checked equal to it, since
HF embeds with them), ``decoder.block.0.layer.1.EncDecAttention.
relative_attention_bias`` (in some old checkpoints, unused by HF too), and the
decoder blocks that ``layer_map`` does not pick. Any other HF tensor, or any
missing one, is an error.

Choice of decoder layers for ``NxM`` (N shared layers from an L-layer decoder):
``layer_map[j] = j * L // N`` by default, i.e. evenly spaced (2 from 12: layers
0 and 6). In CYCLE order shared layer j runs at relative position j/N inside
every loop, so taking it from relative depth j/N of the pretrained stack keeps
each layer at the depth it was trained for, spans the whole stack (low-level
and high-level layers) rather than only its bottom, and for ``Nx1`` with N = L
reduces to the identity, where the conversion is exact. Pass ``layer_map`` to
choose others (e.g. the last N layers). The decoder's relative position bias
always comes from HF block 0, which computes it for the whole stack.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from speed.config import ModelConfig
from speed.hf_files import ModelFilesError, read_config, read_into, tensor_shapes
from speed.models.hf_import import (
    check_names,
    empty_model,
    fill_parameters,
    no_loop_option,
    row_destinations,
    weights_dtype,
)
from speed.models.t5 import SpeedT5

if TYPE_CHECKING:
    from transformers import T5Config, T5ForConditionalGeneration

# HF stores the same embedding under these names as well as ``shared.weight``.
EMBEDDING_COPIES = ("encoder.embed_tokens.weight", "decoder.embed_tokens.weight")
# Present in some old checkpoints; HF itself ignores it (cross-attention has no position bias).
UNUSED_CROSS_BIAS = "decoder.block.0.layer.1.EncDecAttention.relative_attention_bias.weight"
# Model types with exactly the T5 v1.1 parameter layout (mT5 is T5 v1.1 with a larger vocabulary).
T5_MODEL_TYPES = ("t5", "mt5")
# T5Config's default feed-forward is "relu": the original T5 (v1.0), which the platform lacks.
T5_FEED_FORWARD = "gated-gelu"
TOKENIZER_FILE = "spiece.model"  # a T5 v1.1 directory's SentencePiece model (T5 reads SentencePiece ids)
HEAD = "lm_head.weight"
# Both are the tanh approximation of GELU that our GatedFFN computes.
TANH_GELUS = ("gelu_new", "gelu_pytorch_tanh")
# Our ModelConfig field -> the T5Config field that holds the same value (both directions of the conversion).
HF_FIELDS = {
    "vocab_size": "vocab_size",
    "d_model": "d_model",
    "n_heads": "num_heads",
    "d_kv": "d_kv",
    "d_ff": "d_ff",
    "n_encoder_layers": "num_layers",
    "dropout": "dropout_rate",
    "relative_buckets": "relative_attention_num_buckets",
    "relative_max_distance": "relative_attention_max_distance",
    "layer_norm_eps": "layer_norm_epsilon",
    "pad_id": "pad_token_id",
}


@dataclass(frozen=True)
class ConversionPlan:
    """Where each of our parameters comes from, and which HF tensors are skipped on purpose.

    ``sources[name]``: the HF tensor names concatenated (dim 0) into our
    parameter ``name``. ``skipped[hf_name]``: why that HF tensor is not used.
    """

    sources: dict[str, tuple[str, ...]]
    skipped: dict[str, str]

    @property
    def used(self) -> set[str]:
        """All HF tensor names that fill one of our parameters."""
        return {hf for names in self.sources.values() for hf in names}


# ----- configs ------------------------------------------------------------------------------------


def config_from_hf(hf_config: T5Config, pattern: str | None = None) -> ModelConfig:
    """Our ``ModelConfig`` for a T5 v1.1 ``T5Config``; ``pattern`` defaults to ``"{decoder layers}x1"``.

    Refuses other layouts (ReLU FFN, scaled tied LM head, non-T5 model types,
    a decoder start token other than pad) with an error naming the field.
    """
    model_type = getattr(hf_config, "model_type", "t5")
    if model_type not in T5_MODEL_TYPES:
        raise ValueError(f"model_type={model_type!r} is not a T5 layout; expected one of {T5_MODEL_TYPES}")
    ffn = hf_config.feed_forward_proj
    if not getattr(hf_config, "is_gated_act", ffn.startswith("gated-")):
        raise ValueError(
            f"feed_forward_proj={ffn!r} is the T5 v1.0 layout (ungated FFN); only T5 v1.1 'gated-gelu' converts"
        )
    act = getattr(hf_config, "dense_act_fn", "gelu_new")
    if act not in TANH_GELUS:
        raise ValueError(
            f"feed_forward_proj={ffn!r} (activation {act!r}) is not gated tanh-GELU; only T5 v1.1 'gated-gelu' converts"
        )
    if _scales_decoder_output(hf_config):
        raise ValueError(
            "T5 v1.0 layout: the LM head is tied to the embedding and reads the decoder output scaled by "
            "d_model**-0.5 (tie_word_embeddings=True / scale_decoder_outputs=True); only the untied, unscaled "
            "T5 v1.1 head converts"
        )
    pad_id = hf_config.pad_token_id
    start_id = getattr(hf_config, "decoder_start_token_id", None)
    if start_id is not None and start_id != pad_id:
        raise ValueError(f"decoder_start_token_id={start_id} differs from pad_token_id={pad_id}; SpeedT5 starts at pad")
    eos_id = hf_config.eos_token_id
    if isinstance(eos_id, (list, tuple)):
        if len(eos_id) != 1:
            raise ValueError(f"eos_token_id={eos_id}: SpeedT5 supports exactly one EOS token")
        eos_id = eos_id[0]
    same = {ours: getattr(hf_config, hf) for ours, hf in HF_FIELDS.items()}
    return ModelConfig(
        **(same | {"dropout": float(same["dropout"])}),
        pattern=pattern if pattern is not None else f"{hf_decoder_depth(hf_config)}x1",
        eos_id=eos_id,
    )


def hf_decoder_depth(hf_config: T5Config) -> int:
    """Number of decoder layers of an HF T5 config (``num_decoder_layers``, defaulting to ``num_layers``)."""
    n_decoder = getattr(hf_config, "num_decoder_layers", None)
    return hf_config.num_layers if n_decoder is None else n_decoder


def _scales_decoder_output(hf_config: T5Config) -> bool:
    """Whether HF multiplies the decoder output by d_model**-0.5 before the LM head (T5 v1.0)."""
    scale = getattr(hf_config, "scale_decoder_outputs", None)  # transformers >= 5 (ties always, scales v1.0 only)
    return bool(hf_config.tie_word_embeddings if scale is None else scale)


def hf_config_from(config: ModelConfig, n_decoder_layers: int | None = None) -> T5Config:
    """A T5 v1.1 ``T5Config`` with our dimensions.

    ``n_decoder_layers`` defaults to the virtual depth N*M, the dense decoder
    doing the same per-token work as ours (for ``Nx1``: N, so
    ``config_from_hf(hf_config_from(c)) == c``).
    """
    from transformers import T5Config

    n_decoder = n_decoder_layers if n_decoder_layers is not None else config.sharing.depth
    if n_decoder < 1:
        raise ValueError(f"n_decoder_layers must be positive, got {n_decoder}")
    return T5Config(
        **{hf: getattr(config, ours) for ours, hf in HF_FIELDS.items()},
        num_decoder_layers=n_decoder,
        feed_forward_proj="gated-gelu",
        tie_word_embeddings=False,
        eos_token_id=config.eos_id,
        decoder_start_token_id=config.pad_id,
    )


# ----- weights ------------------------------------------------------------------------------------


def default_layer_map(n_unique: int, hf_decoder_layers: int) -> list[int]:
    """Evenly spaced pretrained decoder layers for N shared layers: ``[j * L // N for j in range(N)]``."""
    return [j * hf_decoder_layers // n_unique for j in range(n_unique)]


def conversion_plan(config: ModelConfig, hf_decoder_layers: int, layer_map: list[int] | None = None) -> ConversionPlan:
    """The HF source of every ``SpeedT5`` parameter and the HF tensors skipped on purpose.

    ``layer_map[j]`` is the HF decoder block that initialises shared layer j
    (default: ``default_layer_map``); it must have one entry per shared layer,
    each in ``[0, hf_decoder_layers)``.
    """
    n_unique = config.sharing.n_unique
    if hf_decoder_layers < 1:
        raise ValueError(f"hf_decoder_layers must be positive, got {hf_decoder_layers}")
    layer_map = default_layer_map(n_unique, hf_decoder_layers) if layer_map is None else list(layer_map)
    if len(layer_map) != n_unique:
        raise ValueError(
            f"layer_map {layer_map} has {len(layer_map)} entries; pattern {config.pattern} has {n_unique} shared layers"
        )
    for j, src in enumerate(layer_map):
        if isinstance(src, bool) or not isinstance(src, int) or not 0 <= src < hf_decoder_layers:
            raise ValueError(
                f"layer_map[{j}]={src!r} is not a decoder layer index in [0, {hf_decoder_layers}) "
                f"(the HF model has {hf_decoder_layers} decoder layers)"
            )

    sources: dict[str, tuple[str, ...]] = {
        "shared.weight": ("shared.weight",),
        "encoder_bias.embedding.weight": ("encoder.block.0.layer.0.SelfAttention.relative_attention_bias.weight",),
        "encoder_norm.weight": ("encoder.final_layer_norm.weight",),
        "decoder_bias.embedding.weight": ("decoder.block.0.layer.0.SelfAttention.relative_attention_bias.weight",),
        "decoder_norm.weight": ("decoder.final_layer_norm.weight",),
        "lm_head.weight": ("lm_head.weight",),
    }
    for i in range(config.n_encoder_layers):
        hf, ours = f"encoder.block.{i}.layer", f"encoder_layers.{i}"
        sources.update(_attention(f"{hf}.0.SelfAttention", f"{ours}.attn"))
        sources[f"{ours}.attn_norm.weight"] = (f"{hf}.0.layer_norm.weight",)
        sources.update(_ffn(f"{hf}.1", f"{ours}.ffn"))
        sources[f"{ours}.ffn_norm.weight"] = (f"{hf}.1.layer_norm.weight",)
    for j, src in enumerate(layer_map):
        hf, ours = f"decoder.block.{src}.layer", f"decoder_layers.{j}"
        sources.update(_attention(f"{hf}.0.SelfAttention", f"{ours}.self_attn"))
        sources[f"{ours}.self_norm.weight"] = (f"{hf}.0.layer_norm.weight",)
        cross = f"{hf}.1.EncDecAttention"
        sources[f"{ours}.cross_attn.q.weight"] = (f"{cross}.q.weight",)
        sources[f"{ours}.cross_attn.kv.weight"] = (f"{cross}.k.weight", f"{cross}.v.weight")
        sources[f"{ours}.cross_attn.o.weight"] = (f"{cross}.o.weight",)
        sources[f"{ours}.cross_norm.weight"] = (f"{hf}.1.layer_norm.weight",)
        sources.update(_ffn(f"{hf}.2", f"{ours}.ffn"))
        sources[f"{ours}.ffn_norm.weight"] = (f"{hf}.2.layer_norm.weight",)

    skipped = {name: "copy of shared.weight" for name in EMBEDDING_COPIES}
    skipped[UNUSED_CROSS_BIAS] = "unused by HF T5 (cross-attention has no position bias)"
    for src in sorted(set(range(hf_decoder_layers)) - set(layer_map)):
        skipped[f"decoder.block.{src}.*"] = f"decoder layer not picked by layer_map {layer_map}"
    return ConversionPlan(sources, skipped)


def _attention(hf: str, ours: str) -> dict[str, tuple[str, ...]]:
    return {
        f"{ours}.qkv.weight": (f"{hf}.q.weight", f"{hf}.k.weight", f"{hf}.v.weight"),
        f"{ours}.o.weight": (f"{hf}.o.weight",),
    }


def _ffn(hf: str, ours: str) -> dict[str, tuple[str, ...]]:
    dense = f"{hf}.DenseReluDense"
    return {
        f"{ours}.wi.weight": (f"{dense}.wi_0.weight", f"{dense}.wi_1.weight"),
        f"{ours}.wo.weight": (f"{dense}.wo.weight",),
    }


def is_skipped(name: str, skipped: dict[str, str]) -> bool:
    """Whether the HF tensor ``name`` is one ``skipped`` names (exactly, or under a ``prefix.*``)."""
    return name in skipped or any(key.endswith(".*") and name.startswith(key[:-1]) for key in skipped)


def from_hf_state_dict(
    state_dict: dict[str, Tensor], config: ModelConfig, hf_decoder_layers: int, layer_map: list[int] | None = None
) -> SpeedT5:
    """A ``SpeedT5`` (eval mode, our dtype) filled strictly from an HF T5 v1.1 state dict.

    Every one of our parameters is filled and every HF tensor is used or
    skipped on purpose (see the module docstring); anything else, a shape
    mismatch, or an embedding copy that differs from ``shared`` is an error.
    """
    plan = conversion_plan(config, hf_decoder_layers, layer_map)
    check_names(state_dict, plan.used, lambda name: is_skipped(name, plan.skipped))
    shared = state_dict["shared.weight"]
    for name in EMBEDDING_COPIES:
        if name in state_dict and not torch.equal(state_dict[name], shared):
            raise ValueError(f"{name} differs from shared.weight; HF would embed with it, SpeedT5 cannot")
    values = {
        name: (torch.cat([state_dict[hf] for hf in hf_names], dim=0), " + ".join(hf_names))
        for name, hf_names in plan.sources.items()
    }
    return fill_parameters(SpeedT5(config), values).eval()


def from_hf_model(
    hf_model: T5ForConditionalGeneration, pattern: str | None = None, layer_map: list[int] | None = None
) -> SpeedT5:
    """Convert a loaded HF ``T5ForConditionalGeneration`` (v1.1 layout); ``pattern`` defaults to ``"{L}x1"``."""
    config = config_from_hf(hf_model.config, pattern)
    return from_hf_state_dict(hf_model.state_dict(), config, hf_decoder_depth(hf_model.config), layer_map)


def from_pretrained(
    name_or_path: str, pattern: str | None = None, layer_map: list[int] | None = None, **kwargs: Any
) -> SpeedT5:
    """Load an HF T5 v1.1 checkpoint (hub name or local ``save_pretrained`` directory) as a ``SpeedT5``.

    Extra keyword arguments go to ``T5ForConditionalGeneration.from_pretrained``
    (e.g. ``revision``, ``local_files_only``). The SentencePiece model of a
    hub checkpoint is its ``spiece.model``; pass it to
    ``speed.models.checkpoint.save_model`` to make a SpeedT5 checkpoint.
    """
    from transformers import T5ForConditionalGeneration

    hf_model = T5ForConditionalGeneration.from_pretrained(name_or_path, **kwargs)
    return from_hf_model(hf_model, pattern, layer_map)


# ----- the form -----------------------------------------------------------------------------------


class T5Form:
    """T5 v1.1 (``model_type: "t5"``, ``feed_forward_proj: "gated-gelu"``) as ``SpeedT5``: its decoder loaded as
    its ``{L}x1`` stack, or re-looped into a finetuning job's pattern (``job_pattern``: ``layer_map``)."""

    name = "t5"
    model_type = "t5"
    tokenizer_file = TOKENIZER_FILE
    looped = False
    job_pattern = True
    chat = False  # a T5 reads source texts, not chats
    prompt_eos = True  # its encoder's inputs end in EOS
    seeded_state = False
    exports = SpeedT5

    def check(self, hf: Mapping[str, Any]) -> None:
        feed_forward = hf.get("feed_forward_proj", "relu")
        if feed_forward != T5_FEED_FORWARD:
            raise ModelFilesError(
                f"config.json: a T5 with feed_forward_proj {feed_forward!r}; only T5 v1.1 ({T5_FEED_FORWARD!r}) loads"
            )

    def config(self, hf: Mapping[str, Any], n_loops: int | None = None) -> ModelConfig:
        from transformers import T5Config

        no_loop_option(n_loops, f"a {self.name} checkpoint")
        return config_from_hf(T5Config.from_dict(dict(hf)))

    def load(self, path: str | Path, *, dtype: torch.dtype, n_loops: int | None = None) -> SpeedT5:
        """A T5 v1.1 directory through ``conversion_plan``, each stored tensor read into its place (the embedding's
        stored copies compared with it as it is read)."""
        from transformers import T5Config

        no_loop_option(n_loops, f"a {self.name} checkpoint")
        hf = T5Config.from_dict(read_config(path))
        config = config_from_hf(hf)
        plan = conversion_plan(config, hf_decoder_depth(hf))
        shapes = {name: shape for name, (shape, _) in tensor_shapes(path).items()}
        head_from_shared = hf.tie_word_embeddings and HEAD not in shapes  # transformers ties it to ``shared``
        used = plan.used - {HEAD} if head_from_shared else plan.used
        check_names(shapes, used, lambda name: is_skipped(name, plan.skipped))
        model = empty_model(config, dtype)
        copied = {HEAD} if head_from_shared else set()
        sources = {name: names for name, names in plan.sources.items() if name not in copied}
        with torch.no_grad():
            destinations = row_destinations(path, model, sources, shapes, copied)
            read_into(path, destinations, dict.fromkeys(EMBEDDING_COPIES, "shared.weight"))
            if head_from_shared:
                model.lm_head.weight.copy_(model.shared.weight)
        return model.eval()

    def tokenizer(self, directory: Path) -> Path:
        if not (directory / TOKENIZER_FILE).is_file():
            raise FileNotFoundError(f"{directory} holds no {TOKENIZER_FILE}: a T5's split needs its SentencePiece")
        return directory / TOKENIZER_FILE

    def initial_state(self, path: str | Path, seed: int) -> None:
        return None

    def obstacle(self, model: SpeedT5) -> str | None:
        return None  # every SpeedT5 unrolls into a T5 v1.1

    def files(self, model: SpeedT5) -> tuple[dict[str, Any], dict[str, Tensor]]:
        return t5_files(model)

    def hub_config(self, name: str, pattern: str) -> ModelConfig:
        """The config of the T5 at ``name`` (a hub name or a directory) in a job's ``pattern``."""
        from transformers import T5Config

        return config_from_hf(T5Config.from_pretrained(name), pattern)

    def hub_model(self, name: str, pattern: str) -> SpeedT5:
        """The T5 at ``name`` re-looped into a job's ``pattern`` (``layer_map``'s layers)."""
        return from_pretrained(name, pattern=pattern)


def t5_files(model: SpeedT5) -> tuple[dict[str, Any], dict[str, Tensor]]:
    """A T5 v1.1 config.json and tensors for ``model``, its decoder unrolled into N*M layers (HF decoder block
    ``i*N + j`` holds shared layer j; the relative position bias in block 0, as HF keeps it): the inverse of the
    conversion. The last loop's logits are kept; the sharing and the earlier exits are lost."""
    c, state, s = model.config, model.state_dict(), model.config.sharing
    config = hf_config_from(c).to_dict() | {"architectures": ["T5ForConditionalGeneration"]}
    config["tie_word_embeddings"] = False  # transformers 5 writes True (v1.1 untied by scale_decoder_outputs=False)
    config["torch_dtype"] = str(weights_dtype(model)).removeprefix("torch.")
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
