"""Import ByteDance's Ouro (``model_type == "ouro"``, e.g. ByteDance/Ouro-1.4B) into ``LoopedLM``, exactly.

Ouro runs all of its L layers ``total_ut_steps`` times: here the pattern ``Lx{M}``, no prelude or coda,
sandwich norms, loop norm (the final norm's output feeds the next loop and is that loop's exit), rotary
embeddings in Llama's halves layout, untied head, and the exit gate (``exit_gate``: each loop's lambda,
``LoopedLM.exit_lambdas``). Keys and values: one entry per (loop, layer), as Ouro's cache keeps them.
The rotary base is ``rope_parameters.rope_theta`` (transformers 5) or ``rope_theta``. Refused, naming the field:
another activation than SiLU, a sliding window, scaled rotary embeddings, attention or MLP biases, and an early
exit by default (``early_exit_threshold`` below 1, the published 1.0 being full depth, or an ``early_exit_step``):
the platform decodes every loop, and Ouro's early exit is the lossy ``exit_gate`` method, asked per request.

Parameter mapping (published name -> ours; ``q;k;v`` means rows concatenated)::

    model.embed_tokens, model.norm, lm_head                  -> embed_tokens, norm, lm_head
    model.layers.i.self_attn.{q;k;v}_proj, o_proj            -> core.i.attn.qkv, core.i.attn.o
    model.layers.i.mlp.{gate;up}_proj, down_proj             -> core.i.mlp.wi, core.i.mlp.wo
    model.layers.i.input_layernorm, input_layernorm_2        -> core.i.attn_norm, core.i.attn_out_norm
    model.layers.i.post_attention_layernorm(_2)              -> core.i.mlp_norm (mlp_out_norm)
    model.early_exit_gate                                    -> exit_gate

No other tensor is accepted, none may be missing (``speed.hf_files.check_shapes``); with
``tie_word_embeddings`` the head is the embedding (``lm_head.weight``, when stored, must equal it).
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from speed.config import LMConfig
from speed.hf_files import check_shapes, read_config, read_into, tensor_shapes
from speed.models.convert_llama import common_obstacles, decoder_fields, llama_layer
from speed.models.hf_import import (
    UnsupportedConfig,
    empty_model,
    expect,
    field,
    loop_count,
    rope_theta,
    single_eos,
    weights_dtype,
)
from speed.models.lm_form import LMForm
from speed.models.looped_lm import LoopedLM

EMBEDDING, HEAD = "model.embed_tokens.weight", "lm_head.weight"
# The remote code a published Ouro config names (ByteDance/Ouro-1.4B); an export names it and copies no file of it.
OURO_AUTO_MAP = {
    "AutoConfig": "configuration_ouro.OuroConfig",
    "AutoModel": "modeling_ouro.OuroModel",
    "AutoModelForCausalLM": "modeling_ouro.OuroForCausalLM",
}
# published sandwich norm -> ours, in each layer
NORMS = {
    "input_layernorm": "attn_norm",
    "input_layernorm_2": "attn_out_norm",
    "post_attention_layernorm": "mlp_norm",
    "post_attention_layernorm_2": "mlp_out_norm",
}


def config_from_ouro(hf: Mapping[str, Any], n_loops: int | None = None) -> LMConfig:
    """Our ``LMConfig`` for Ouro's config.json; ``n_loops`` (Ouro's ``total_ut_steps``) defaults to its own."""
    expect(hf, "hidden_act", "silu", "LoopedLM's SwiGLU uses SiLU")
    expect(hf, "use_sliding_window", False, "LoopedLM attends to every position")
    expect(hf, "attention_bias", False, "Ouro's attention has no biases")
    expect(hf, "mlp_bias", False, "Ouro's MLP has no biases")
    windowed = sorted({kind for kind in field(hf, "layer_types", []) if kind != "full_attention"})
    if windowed:
        raise UnsupportedConfig(f"config.json: layer_types holds {windowed}, but LoopedLM attends to every position")
    _full_depth(hf)
    n_heads = field(hf, "num_attention_heads")
    loops = loop_count(n_loops, field(hf, "total_ut_steps"), "total_ut_steps")
    return LMConfig(
        vocab_size=field(hf, "vocab_size"),
        d_model=field(hf, "hidden_size"),
        n_heads=n_heads,
        n_kv_heads=field(hf, "num_key_value_heads", n_heads),
        head_dim=field(hf, "head_dim", field(hf, "hidden_size") // n_heads),
        d_ff=field(hf, "intermediate_size"),
        pattern=f"{field(hf, 'num_hidden_layers')}x{loops}",
        norm="sandwich",
        loop_norm=True,
        rope_theta=rope_theta(hf, default=10000.0),
        norm_eps=float(field(hf, "rms_norm_eps")),
        tie_embeddings=bool(field(hf, "tie_word_embeddings", False)),
        exit_gate=True,
        eos_id=single_eos(hf),
    )


def _full_depth(hf: Mapping[str, Any]) -> None:
    """An ``UnsupportedConfig`` where the published forward would exit early by default: ``early_exit_threshold``
    below 1 (the logits of the first loop whose cumulative exit probability reaches it) or an ``early_exit_step``.
    The platform decodes every loop; that lossy mode is the ``exit_gate`` method (``speed.engine.ExitRule``)."""
    threshold, step = field(hf, "early_exit_threshold", 1.0), hf.get("early_exit_step")
    if step is not None:
        raise UnsupportedConfig(
            f"config.json: early_exit_step={step!r}, but the platform decodes every loop (Ouro's early exit is the "
            f"lossy method 'exit_gate' with exit_kind='step', exit_step={step}; early_exit_step=null loads it whole)"
        )
    if not isinstance(threshold, (int, float)) or isinstance(threshold, bool) or threshold < 1:
        raise UnsupportedConfig(
            f"config.json: early_exit_threshold={threshold!r}, but the platform decodes every loop (Ouro's early "
            f"exit is the lossy method 'exit_gate' with exit_threshold={threshold}; early_exit_threshold=1.0 loads "
            "it whole)"
        )


def ouro_shapes(config: LMConfig) -> dict[str, tuple[int, ...]]:
    """The published tensors of an Ouro of ``config`` and their shapes (all required but a tied head)."""
    d, q, kv = config.d_model, config.n_heads * config.head_dim, config.n_kv_heads * config.head_dim
    shapes = {EMBEDDING: (config.vocab_size, d)}
    for i in range(config.sharing.n_unique):
        p = f"model.layers.{i}."
        shapes |= {
            p + "self_attn.q_proj.weight": (q, d),
            p + "self_attn.k_proj.weight": (kv, d),
            p + "self_attn.v_proj.weight": (kv, d),
            p + "self_attn.o_proj.weight": (d, q),
            p + "mlp.gate_proj.weight": (config.d_ff, d),
            p + "mlp.up_proj.weight": (config.d_ff, d),
            p + "mlp.down_proj.weight": (d, config.d_ff),
        }
        shapes |= {p + norm + ".weight": (d,) for norm in NORMS}
    shapes |= {"model.norm.weight": (d,), "model.early_exit_gate.weight": (1, d), "model.early_exit_gate.bias": (1,)}
    shapes[HEAD] = (config.vocab_size, d)
    return shapes


def ouro_destinations(model: LoopedLM) -> dict[str, Tensor]:
    """Where each of Ouro's published tensors goes in ``model`` (the module doc's mapping): a parameter, or the
    rows of a fused one (q;k;v, gate;up), so that loading writes the model's memory once and concatenates
    nothing; a tied model's head is its embedding, and is not a destination."""
    c = model.config
    q, kv = c.n_heads * c.head_dim, c.n_kv_heads * c.head_dim
    found = {
        EMBEDDING: model.embed_tokens.weight,
        "model.norm.weight": model.norm.weight,
        "model.early_exit_gate.weight": model.exit_gate.weight,
        "model.early_exit_gate.bias": model.exit_gate.bias,
    }
    if not c.tie_embeddings:
        found[HEAD] = model.lm_head.weight
    for i, block in enumerate(model.core):
        hf = f"model.layers.{i}."
        qkv, wi = block.attn.qkv.weight, block.mlp.wi.weight
        found |= {
            hf + "self_attn.q_proj.weight": qkv[:q],
            hf + "self_attn.k_proj.weight": qkv[q : q + kv],
            hf + "self_attn.v_proj.weight": qkv[q + kv :],
            hf + "self_attn.o_proj.weight": block.attn.o.weight,
            hf + "mlp.gate_proj.weight": wi[: c.d_ff],
            hf + "mlp.up_proj.weight": wi[c.d_ff :],
            hf + "mlp.down_proj.weight": block.mlp.wo.weight,
        }
        found |= {f"{hf}{theirs}.weight": getattr(block, norm).weight for theirs, norm in NORMS.items()}
    return found


def load_ouro(directory: str | Path, *, dtype: torch.dtype = torch.float32, n_loops: int | None = None) -> LoopedLM:
    """An Ouro directory (config.json and safetensors; its code is never run) as a ``LoopedLM`` (eval mode,
    ``dtype``) looping ``n_loops`` times (Ouro's ``total_ut_steps``; default the checkpoint's own).

    The model is allocated once, empty, and each published tensor copied into its place (``ouro_destinations``):
    loading holds the weights once, plus one chunk; a tied head stored beside the embedding is compared with it
    as the embedding is read."""
    config = config_from_ouro(read_config(directory), n_loops)
    optional = (HEAD,) if config.tie_embeddings else ()
    found = {name: shape for name, (shape, _) in tensor_shapes(directory).items()}
    check_shapes(directory, found, ouro_shapes(config), optional)
    model = empty_model(config, dtype)
    with torch.no_grad():
        read_into(directory, ouro_destinations(model), {HEAD: EMBEDDING} if config.tie_embeddings else None)
    return model.eval()


# ----- the form -----------------------------------------------------------------------------------


def ouro_obstacle(config: LMConfig) -> str | None:
    """The option that keeps a ``LoopedLM`` of ``config`` out of Ouro's layout, in words; None when it fits."""
    s = config.sharing
    checks = [
        (s.prelude or s.coda, f"pattern {config.pattern}: Ouro loops all of its layers, with no prelude or coda"),
        (config.norm != "sandwich", f"norm={config.norm!r}: Ouro's layers are sandwich-normed"),
        (not config.loop_norm, "loop_norm=False: Ouro feeds each loop the final norm's output"),
        (not config.exit_gate, "exit_gate=False: Ouro's layout holds an exit gate"),
        *common_obstacles(config, "Ouro"),
    ]
    return next((why for failed, why in checks if failed), None)


def ouro_files(model: LoopedLM) -> tuple[dict[str, Any], dict[str, Tensor]]:
    """Ouro's config.json (its fields, ``total_ut_steps``, an ``auto_map`` naming the public remote code) and
    tensors (published names) for ``model``: the inverse of ``load_ouro``; every loop's logits and exit gate kept."""
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
        **decoder_fields(c, n, weights_dtype(model)),
    }
    weights = {EMBEDDING: state["embed_tokens.weight"], "model.norm.weight": state["norm.weight"]}
    weights |= {
        "model.early_exit_gate.weight": state["exit_gate.weight"],
        "model.early_exit_gate.bias": state["exit_gate.bias"],
    }
    if not c.tie_embeddings:
        weights[HEAD] = state["lm_head.weight"]
    for i in range(n):
        weights |= llama_layer(state, f"core.{i}.", f"model.layers.{i}.", c)
        weights |= {
            f"model.layers.{i}.{theirs}.weight": state[f"core.{i}.{ours}.weight"] for theirs, ours in NORMS.items()
        }
    return config, weights


class OuroForm(LMForm):
    """Ouro (``model_type: "ouro"``) as a ``LoopedLM`` ``Lx{total_ut_steps}``; a ``LoopedLM`` in exactly Ouro's
    options exports as one, losing nothing (``ouro_files``)."""

    name = "ouro"
    model_type = "ouro"
    looped = True
    exports = LoopedLM
    config = staticmethod(config_from_ouro)
    load = staticmethod(load_ouro)
    files = staticmethod(ouro_files)

    def obstacle(self, model: LoopedLM) -> str | None:
        return ouro_obstacle(model.config)

    def shapes(self, hf: Mapping[str, Any]) -> dict[str, tuple[int, ...]]:
        return ouro_shapes(config_from_ouro(hf))
