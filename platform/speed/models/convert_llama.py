"""Import Hugging Face Llama weights into ``LoopedLM``: plainly, or tied into loops (Relaxed Recursive Transformers).

Only the plain Llama layout converts (``model_type="llama"``: SiLU SwiGLU,
no attention or MLP biases, default rotary embeddings without scaling), as a
pre-norm ``LoopedLM`` without input injection or loop norm; anything else is
refused, naming the field.

Parameter mapping (HF name -> ours, for an HF layer i standing behind our
block ``b``; ``q;k;v`` means rows concatenated)::

    model.embed_tokens                                 -> embed_tokens
    model.layers.i.self_attn.{q;k;v}_proj, o_proj      -> b.attn.qkv, b.attn.o
    model.layers.i.mlp.{gate;up}_proj, down_proj       -> b.mlp.wi, b.mlp.wo
    model.layers.i.input_layernorm                     -> b.attn_norm
    model.layers.i.post_attention_layernorm            -> b.mlp_norm
    model.norm, lm_head                                -> norm, lm_head

A tied checkpoint (``tie_word_embeddings``) converts to a tied model; its
``lm_head.weight``, when present, must equal the embedding. Any other HF
tensor, or a missing one, is an error.

Which HF layers a block stands for (``layer_sources``), for ``P+NxM+C`` from
an L-layer model: prelude block p is layer p, coda block c is layer
L - C + c, and the L' = L - P - C middle layers are tied into the core as in
Relaxed Recursive Transformers (CYCLE sharing, average initialisation):
shared layer j stands for middle layers j, j + N, j + 2N, ... (L'/N of them,
so N must divide L') and each of its weights is their average. When
L' = N * M these are exactly the layers whose places its M runs take (the
run in loop i stands where middle layer i * N + j stood); when L' = N each
shared layer is one HF layer, looped M times. For M = 1 (``P+Nx1+C`` from
P + N + C layers) nothing is averaged and the model computes what the HF
model does (checked by ``tests/test_convert_llama.py`` to 1e-4); for M > 1
the tied model is a starting point for uptraining, not a copy.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from speed.config import LMConfig, SharingPattern
from speed.hf_files import read_config, read_into, tensor_shapes
from speed.models.hf_import import (
    check_names,
    empty_model,
    fill_parameters,
    no_loop_option,
    rope_theta,
    row_destinations,
    weights_dtype,
)
from speed.models.lm_form import LMForm
from speed.models.looped_lm import LoopedLM

if TYPE_CHECKING:
    from transformers import LlamaConfig, LlamaForCausalLM

LLAMA_MODEL_TYPES = ("llama",)
EMBEDDING = "model.embed_tokens.weight"
HEAD = "lm_head.weight"
# Present in checkpoints of older transformers versions; recomputed from the config, never learned.
ROTARY_BUFFER = ".self_attn.rotary_emb.inv_freq"
MAX_POSITIONS = 4096  # an exported config.json's max_position_embeddings: unscaled rotary embeddings ignore it


@dataclass(frozen=True)
class LlamaPlan:
    """Where each of our parameters comes from.

    ``sources[name]``: one tuple of HF tensor names per HF layer averaged
    into ``name``; each tuple's tensors are concatenated (dim 0) first.
    ``skipped[hf_name]``: why that HF tensor is not used.
    """

    sources: dict[str, tuple[tuple[str, ...], ...]]
    skipped: dict[str, str]

    @property
    def used(self) -> set[str]:
        """All HF tensor names that fill one of our parameters."""
        return {hf for groups in self.sources.values() for names in groups for hf in names}


def config_from_llama(hf_config: LlamaConfig, pattern: str | None = None) -> LMConfig:
    """Our ``LMConfig`` for a Llama ``LlamaConfig``; ``pattern`` defaults to ``"{layers}x1"`` (the plain stack)."""
    model_type = getattr(hf_config, "model_type", "llama")
    if model_type not in LLAMA_MODEL_TYPES:
        raise ValueError(f"model_type={model_type!r} is not the Llama layout; expected one of {LLAMA_MODEL_TYPES}")
    if hf_config.hidden_act != "silu":
        raise ValueError(f"hidden_act={hf_config.hidden_act!r}: LoopedLM's SwiGLU uses 'silu'")
    for name in ("attention_bias", "mlp_bias"):
        if getattr(hf_config, name, False):
            raise ValueError(f"{name}=True: LoopedLM has no biases")
    eos_id = hf_config.eos_token_id
    if isinstance(eos_id, (list, tuple)) and len(eos_id) == 1:
        eos_id = eos_id[0]
    if not isinstance(eos_id, int):
        raise ValueError(f"eos_token_id={eos_id}: LoopedLM needs exactly one EOS token")
    n_heads = hf_config.num_attention_heads
    return LMConfig(
        vocab_size=hf_config.vocab_size,
        d_model=hf_config.hidden_size,
        n_heads=n_heads,
        n_kv_heads=getattr(hf_config, "num_key_value_heads", None) or n_heads,
        head_dim=getattr(hf_config, "head_dim", None) or hf_config.hidden_size // n_heads,
        d_ff=hf_config.intermediate_size,
        pattern=pattern if pattern is not None else f"{hf_config.num_hidden_layers}x1",
        rope_theta=rope_theta(hf_config.to_dict()),  # rope_parameters or rope_theta; scaled ones refused
        norm_eps=hf_config.rms_norm_eps,
        tie_embeddings=bool(hf_config.tie_word_embeddings),
        eos_id=eos_id,
    )


def layer_sources(sharing: SharingPattern, n_layers: int) -> dict[str, tuple[int, ...]]:
    """Our block (``prelude.p``, ``core.j``, ``coda.c``) -> the HF layers it stands for (see the module doc)."""
    P, N, C = sharing.prelude, sharing.n_unique, sharing.coda
    middle = n_layers - P - C
    if middle < N or middle % N:
        raise ValueError(
            f"pattern {sharing} ties the {middle} middle layers of a {n_layers}-layer model (after P={P}, C={C}) "
            f"into N={N} shared layers: N must divide them"
        )
    sources = {f"prelude.{p}": (p,) for p in range(P)}
    sources.update({f"core.{j}": tuple(range(P + j, P + middle, N)) for j in range(N)})
    sources.update({f"coda.{c}": (n_layers - C + c,) for c in range(C)})
    return sources


def conversion_plan(config: LMConfig, n_layers: int) -> LlamaPlan:
    """The HF sources of every ``LoopedLM`` parameter, for a Llama of ``n_layers`` layers."""
    if config.norm != "pre" or config.injection or config.loop_norm:
        raise ValueError("a Llama converts to a pre-norm LoopedLM without injection or loop norm")
    sources: dict[str, tuple[tuple[str, ...], ...]] = {
        "embed_tokens.weight": ((EMBEDDING,),),
        "norm.weight": (("model.norm.weight",),),
    }
    if not config.tie_embeddings:
        sources["lm_head.weight"] = ((HEAD,),)
    for block, layers in layer_sources(config.sharing, n_layers).items():
        hf = [f"model.layers.{i}" for i in layers]
        sources[f"{block}.attn.qkv.weight"] = tuple(tuple(f"{h}.self_attn.{x}_proj.weight" for x in "qkv") for h in hf)
        sources[f"{block}.attn.o.weight"] = tuple((f"{h}.self_attn.o_proj.weight",) for h in hf)
        sources[f"{block}.mlp.wi.weight"] = tuple((f"{h}.mlp.gate_proj.weight", f"{h}.mlp.up_proj.weight") for h in hf)
        sources[f"{block}.mlp.wo.weight"] = tuple((f"{h}.mlp.down_proj.weight",) for h in hf)
        sources[f"{block}.attn_norm.weight"] = tuple((f"{h}.input_layernorm.weight",) for h in hf)
        sources[f"{block}.mlp_norm.weight"] = tuple((f"{h}.post_attention_layernorm.weight",) for h in hf)
    skipped = {HEAD: "copy of model.embed_tokens.weight (tied)"} if config.tie_embeddings else {}
    return LlamaPlan(sources, skipped)


def from_llama_state_dict(state_dict: dict[str, Tensor], config: LMConfig, n_layers: int) -> LoopedLM:
    """A ``LoopedLM`` (eval mode, our dtype) filled strictly from a Llama state dict of ``n_layers`` layers.

    Every parameter is filled and every HF tensor used or skipped on purpose;
    anything else, a shape mismatch, or a tied head that differs from the
    embedding is an error.
    """
    plan = conversion_plan(config, n_layers)
    check_names(state_dict, plan.used, lambda name: name in plan.skipped or name.endswith(ROTARY_BUFFER))
    if config.tie_embeddings and HEAD in state_dict and not torch.equal(state_dict[HEAD], state_dict[EMBEDDING]):
        raise ValueError(f"tied checkpoint, but {HEAD} differs from {EMBEDDING}")
    values = {}
    for name, groups in plan.sources.items():
        layers = [torch.cat([state_dict[hf] for hf in names], dim=0) for names in groups]
        # One layer is copied exactly; several are averaged in float32 (checkpoints are often bfloat16).
        value = layers[0] if len(layers) == 1 else torch.stack(layers).float().mean(0)
        values[name] = (value, " + ".join(groups[0]))
    return fill_parameters(LoopedLM(config), values).eval()


def from_llama(hf_model: LlamaForCausalLM, pattern: str | None = None) -> LoopedLM:
    """Convert a loaded ``LlamaForCausalLM``; ``pattern`` defaults to ``"{layers}x1"`` (see the module doc)."""
    config = config_from_llama(hf_model.config, pattern)
    return from_llama_state_dict(hf_model.state_dict(), config, hf_model.config.num_hidden_layers)


def from_pretrained(name_or_path: str, pattern: str | None = None, **kwargs: Any) -> LoopedLM:
    """Load a Llama checkpoint (hub name, e.g. ``HuggingFaceTB/SmolLM2-135M``, or a ``save_pretrained`` folder).

    Extra keyword arguments go to ``AutoModelForCausalLM.from_pretrained``
    (e.g. ``revision``, ``local_files_only``); the tokenizer is the
    checkpoint's own (``AutoTokenizer.from_pretrained(name_or_path)``).
    """
    from transformers import AutoModelForCausalLM

    return from_llama(AutoModelForCausalLM.from_pretrained(name_or_path, **kwargs), pattern)


# ----- the form -----------------------------------------------------------------------------------


class LlamaForm(LMForm):
    """A plain Llama (``model_type: "llama"``) as the pre-norm ``LoopedLM`` ``{layers}x1``; a pre-norm ``LoopedLM``
    (``P+NxM+C``) exports as one, unrolled (``llama_files``)."""

    name = "llama"
    model_type = "llama"
    looped = False
    exports = LoopedLM

    def config(self, hf: Mapping[str, Any], n_loops: int | None = None) -> LMConfig:
        from transformers import LlamaConfig

        no_loop_option(n_loops, f"a {self.name} checkpoint")
        return config_from_llama(LlamaConfig.from_dict(dict(hf)))

    def load(self, path: str | Path, *, dtype: torch.dtype, n_loops: int | None = None) -> LoopedLM:
        """A Llama directory through ``conversion_plan`` (the plain stack, ``{layers}x1``), each stored tensor read
        into its place (a tied head's stored copy compared with the embedding as it is read)."""
        config = self.config(read_config(path), n_loops)
        plan = conversion_plan(config, config.sharing.n_unique)
        shapes = {name: shape for name, (shape, _) in tensor_shapes(path).items()}
        check_names(shapes, plan.used, lambda name: name in plan.skipped or name.endswith(ROTARY_BUFFER))
        model = empty_model(config, dtype)
        sources = {name: groups[0] for name, groups in plan.sources.items()}  # the plain stack: one layer each
        with torch.no_grad():
            destinations = row_destinations(path, model, sources, shapes)
            read_into(path, destinations, {HEAD: EMBEDDING} if config.tie_embeddings else None)
        return model.eval()

    def obstacle(self, model: LoopedLM) -> str | None:
        return llama_obstacle(model.config)

    def files(self, model: LoopedLM) -> tuple[dict[str, Any], dict[str, Tensor]]:
        return llama_files(model)


def llama_obstacle(config: LMConfig) -> str | None:
    """The option that keeps a ``LoopedLM`` of ``config`` from unrolling into a plain Llama; None when it fits."""
    checks = [
        (config.norm != "pre", f"norm={config.norm!r}: a Llama layer is pre-norm only"),
        (config.loop_norm, "loop_norm: it normalises between loops, and a Llama stack has no place for that"),
        (config.exit_gate, "exit_gate: a Llama has no exit gate (its lambdas would be lost)"),
        *common_obstacles(config, "a Llama"),
    ]
    return next((why for failed, why in checks if failed), None)


def common_obstacles(config: LMConfig, name: str) -> list[tuple[bool, str]]:
    """The options neither Llama's layout nor Ouro's (``name``) has: (whether ``config`` holds it, why it is out)."""
    return [
        (config.injection, f"injection: {name} has no input injection adapter"),
        (config.rope_layout != "halves", f"rope_layout={config.rope_layout!r}: {name} rotates halves"),
        (config.qk_bias, f"qk_bias: {name}'s queries and keys have no bias"),
        (config.embed_scale != 1.0, f"embed_scale={config.embed_scale}: {name} does not scale its embedding"),
        (config.coda_norm, f"coda_norm: {name} normalises only before its head"),
    ]


def llama_files(model: LoopedLM) -> tuple[dict[str, Any], dict[str, Tensor]]:
    """A plain Llama's config.json and tensors for ``model`` unrolled: prelude, the core M times, coda, final norm,
    head; P + N*M + C layers, each virtual layer's weights copied. A Llama has one exit, at the end, so only the
    last loop's logits are kept (the coda runs once, after the last loop); the sharing and earlier exits are lost."""
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
        **decoder_fields(c, len(blocks), weights_dtype(model)),
    }
    weights = {EMBEDDING: state["embed_tokens.weight"], "model.norm.weight": state["norm.weight"]}
    if not c.tie_embeddings:
        weights[HEAD] = state["lm_head.weight"]
    for i, block in enumerate(blocks):
        hf = f"model.layers.{i}."
        weights |= llama_layer(state, block, hf, c)
        weights[hf + "input_layernorm.weight"] = state[block + "attn_norm.weight"]
        weights[hf + "post_attention_layernorm.weight"] = state[block + "mlp_norm.weight"]
    return config, weights


def decoder_fields(c: LMConfig, n_layers: int, dtype: torch.dtype) -> dict[str, Any]:
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


def llama_layer(state: Mapping[str, Tensor], ours: str, hf: str, c: LMConfig) -> dict[str, Tensor]:
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
