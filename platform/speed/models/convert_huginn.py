"""Import Huginn-0125 (``model_type == "huginn_raven"``, tomg-group-umd/huginn-0125) into ``LoopedLM``, exactly.

Huginn is ``P+NxM+C``: a prelude of ``n_layers_in_prelude`` blocks, a core of ``n_layers_in_recurrent_block``
run ``num_steps`` times (default ``mean_recurrence``), a coda of ``n_layers_in_coda``; each recurrence's
input is ``adapter([state, e])`` (injection), e the prelude's output and the state the raw core output; the
exit is ``ln_f(coda(ln_f(state)))`` (``coda_norm``: the same final norm twice). Blocks norm each residual sum
(``norm="residual"``), add a learned bias to queries and keys before the rotary embedding (``qk_bias``), which
turns adjacent pairs (``rope_layout="pairs"``); the embedding is scaled by sqrt(n_embd) (``embed_scale``, as
the model computes it); the head is tied to the embedding.

The initial state is zero by default (``init_scale=0`` in Huginn's forward). Huginn's own default draws it at
random (``initialize_state``: truncated normals of std ``init_values.std * init_scale`` within +-3 std, times
the embedding scale), which no two runs reproduce; ``huginn_initial_state(directory, seed)`` is that draw made
reproducible (``speed.models.looped_lm.InitialState``: a function of the seed and the token's position), set as
``model.initial_state``. The rotary base is ``rope_parameters.rope_theta`` (transformers 5) or ``rope_base``. Refused,
naming the field: test-time noise, another injection, block, MLP, activation or norm than the published
ones, grouped-query attention.

Parameter mapping (published name -> ours; ``part`` is prelude, core_block or coda, ours prelude, core,
coda)::

    transformer.wte, transformer.ln_f                        -> embed_tokens (and the tied head), norm
    transformer.part.i.norm_1, norm_2, norm_3, norm_4        -> part.i.attn_norm, attn_out_norm, mlp_norm, mlp_out_norm
    transformer.part.i.attn.Wqkv, attn.proj                  -> part.i.attn.qkv, part.i.attn.o
    transformer.part.i.attn.qk_bias[0, 0], [1, 0]            -> part.i.attn.q_bias, part.i.attn.k_bias
    transformer.part.i.mlp.fc (gate; up), mlp.proj           -> part.i.mlp.wi, part.i.mlp.wo
    transformer.adapter.weight, .bias                        -> adapter.weight, adapter_bias

``freqs_cis`` (the rotary table, a buffer) is accepted and ignored: the angles are recomputed;
``lm_head.weight``, when stored, must equal the embedding. Any other tensor, or a missing one, is an error.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from speed.config import LMConfig, SharingPattern
from speed.hf_files import check_shapes, read_config, read_into, tensor_shapes
from speed.models.hf_import import UnsupportedConfig, empty_model, expect, field, loop_count, rope_theta, single_eos
from speed.models.lm_form import LMForm
from speed.models.looped_lm import InitialState, LoopedLM

EMBEDDING, HEAD, FREQS = "transformer.wte.weight", "lm_head.weight", "freqs_cis"
PARTS = {"prelude": "prelude", "core_block": "core", "coda": "coda"}  # published -> ours
NORMS = {"norm_1": "attn_norm", "norm_2": "attn_out_norm", "norm_3": "mlp_norm", "norm_4": "mlp_out_norm"}


def config_from_huginn(hf: Mapping[str, Any], n_loops: int | None = None) -> LMConfig:
    """Our ``LMConfig`` for Huginn's config.json; ``n_loops`` (Huginn's ``num_steps``) defaults to its
    ``mean_recurrence``."""
    if field(hf, "test_time_noise", 0):
        raise UnsupportedConfig("config.json: test_time_noise is on, but random noise cannot be reproduced")
    expect(hf, "injection_type", "linear", "LoopedLM injects through one linear adapter")
    expect(hf, "block_class_name", "SandwichBlock", "LoopedLM computes Huginn's published block")
    expect(hf, "mlp_class_name", "GatedMLP", "LoopedLM's MLP is gated")
    expect(hf, "nonlin_name", "SiLU", "LoopedLM's SwiGLU uses SiLU")
    expect(hf, "norm_class_name", "RMSNorm_llama", "LoopedLM's norms are RMS norms")
    d, n_heads = field(hf, "n_embd"), field(hf, "n_heads")
    expect(hf, "num_key_value_heads", n_heads, "Huginn's fused Wqkv has as many key/value heads as query heads")
    expect(hf, "head_dim", d // n_heads, "Huginn's head size is n_embd / n_heads")
    steps = loop_count(n_loops, field(hf, "mean_recurrence"), "num_steps")
    sharing = SharingPattern(
        field(hf, "n_layers_in_recurrent_block"), steps, field(hf, "n_layers_in_prelude"), field(hf, "n_layers_in_coda")
    )
    return LMConfig(
        vocab_size=field(hf, "padded_vocab_size", field(hf, "vocab_size")),
        d_model=d,
        n_heads=n_heads,
        n_kv_heads=n_heads,
        head_dim=d // n_heads,
        d_ff=field(hf, "intermediate_size"),
        pattern=str(sharing),
        norm="residual",
        injection=True,
        rope_theta=rope_theta(hf, "rope_base"),
        rope_layout="pairs",
        qk_bias=bool(field(hf, "qk_bias", False)),
        embed_scale=math.sqrt(d),
        coda_norm=True,
        adapter_bias=bool(field(hf, "bias", False)),
        norm_eps=float(field(hf, "norm_eps")),
        tie_embeddings=bool(field(hf, "tie_embeddings", field(hf, "tie_word_embeddings", True))),
        eos_id=single_eos(hf),
    )


def huginn_initial_state(directory: str | Path, seed: int, init_scale: float = 1.0) -> InitialState:
    """Huginn's published random initial state (its forward's default, ``init_scale=1``) as a seeded
    ``InitialState``: std ``init_values.std * init_scale`` (config.json; sqrt(2 / (5 n_embd)) without it) times
    the embedding scale sqrt(n_embd), as ``initialize_state`` computes it. ``model.initial_state = ...`` uses it."""
    hf = read_config(directory)
    d = field(hf, "n_embd")
    std = float(field(hf, "init_values", {}).get("std", math.sqrt(2 / (5 * d))))
    if not init_scale > 0:
        raise ValueError(f"init_scale must be positive (0 is the zero state: no InitialState), got {init_scale!r}")
    return InitialState(seed, std * init_scale * math.sqrt(d))


def huginn_shapes(config: LMConfig, block_size: int) -> dict[str, tuple[int, ...]]:
    """The published tensors of a Huginn of ``config`` and their shapes; ``freqs_cis``, the rotary table of
    ``block_size`` positions, and a tied head may be absent (``optional``)."""
    d, H, D, ff = config.d_model, config.n_heads, config.head_dim, config.d_ff
    shapes = {EMBEDDING: (config.vocab_size, d), "transformer.adapter.weight": (d, 2 * d)}
    if config.adapter_bias:
        shapes["transformer.adapter.bias"] = (d,)
    for hf, _ in _blocks(config):
        shapes |= {hf + norm + ".weight": (d,) for norm in NORMS}
        shapes |= {
            hf + "attn.Wqkv.weight": (3 * d, d),
            hf + "attn.proj.weight": (d, d),
            hf + "mlp.fc.weight": (2 * ff, d),
            hf + "mlp.proj.weight": (d, ff),
        }
        if config.qk_bias:
            shapes[hf + "attn.qk_bias"] = (2, 1, H, D)
    shapes |= {"transformer.ln_f.weight": (d,), HEAD: (config.vocab_size, d), FREQS: (1, block_size, 1, D // 2, 2)}
    return shapes


def optional(config: LMConfig) -> tuple[str, ...]:
    """The published tensors a Huginn directory may lack: the rotary table, and the head when tied."""
    return (FREQS, HEAD) if config.tie_embeddings else (FREQS,)


def huginn_destinations(model: LoopedLM) -> tuple[dict[str, Tensor], dict[str, Tensor]]:
    """Where each of Huginn's published tensors goes in ``model`` (the module doc's mapping), and the query/key
    biases' own tensors: each block's ``attn.qk_bias`` (2, 1, H, D) is read into a small tensor of its own
    (``qk_biases``, to be split by ``split_qk_biases``), everything else straight into its parameter. A tied
    model's head is its embedding, and is not a destination."""
    c = model.config
    found = {EMBEDDING: model.embed_tokens.weight, "transformer.ln_f.weight": model.norm.weight}
    found["transformer.adapter.weight"] = model.adapter.weight
    if c.adapter_bias:
        found["transformer.adapter.bias"] = model.adapter_bias
    if not c.tie_embeddings:
        found[HEAD] = model.lm_head.weight
    ours = dict(model.named_parameters())
    qk_biases = {}
    for hf, block in _blocks(c):
        found |= {f"{hf}{theirs}.weight": ours[f"{block}{norm}.weight"] for theirs, norm in NORMS.items()}
        found |= {
            hf + "attn.Wqkv.weight": ours[block + "attn.qkv.weight"],
            hf + "attn.proj.weight": ours[block + "attn.o.weight"],
            hf + "mlp.fc.weight": ours[block + "mlp.wi.weight"],  # rows [gate; up], as ours
            hf + "mlp.proj.weight": ours[block + "mlp.wo.weight"],
        }
        if c.qk_bias:
            bias = ours[block + "attn.q_bias"]
            qk_biases[hf + "attn.qk_bias"] = torch.empty((2, 1, *bias.shape), dtype=bias.dtype)
    return found, qk_biases


def split_qk_biases(model: LoopedLM, qk_biases: Mapping[str, Tensor]) -> None:
    """Each block's published ``qk_bias`` (2, 1, H, D) into its query and key biases (``[0, 0]``, ``[1, 0]``)."""
    ours = dict(model.named_parameters())
    for hf, block in _blocks(model.config):
        if hf + "attn.qk_bias" in qk_biases:
            bias = qk_biases[hf + "attn.qk_bias"]
            ours[block + "attn.q_bias"].copy_(bias[0, 0])
            ours[block + "attn.k_bias"].copy_(bias[1, 0])


def load_huginn(directory: str | Path, *, dtype: torch.dtype = torch.float32, n_loops: int | None = None) -> LoopedLM:
    """A Huginn-0125 directory (config.json and safetensors; its code is never run) as a ``LoopedLM`` (eval
    mode, ``dtype``) recurring ``n_loops`` times (Huginn's ``num_steps``; default its ``mean_recurrence``).

    The model is allocated once, empty, and each published tensor read into its place, converted chunk by chunk
    where its dtype differs (the published float32 shards into bf16 weights): loading holds the weights once,
    plus one chunk. A tied head stored beside the embedding (as published) is compared with it as it is read."""
    hf = read_config(directory)
    config = config_from_huginn(hf, n_loops)
    found = {name: shape for name, (shape, _) in tensor_shapes(directory).items()}
    check_shapes(directory, found, huginn_shapes(config, field(hf, "block_size")), optional(config))
    model = empty_model(config, dtype)
    destinations, qk_biases = huginn_destinations(model)
    with torch.no_grad():
        read_into(directory, destinations | qk_biases, {HEAD: EMBEDDING} if config.tie_embeddings else None)
        split_qk_biases(model, qk_biases)
    return model.eval()


def _blocks(config: LMConfig) -> list[tuple[str, str]]:
    """Every block's published prefix and ours: ``("transformer.core_block.0.", "core.0.")``, ..."""
    sharing = config.sharing
    counts = {"prelude": sharing.prelude, "core_block": sharing.n_unique, "coda": sharing.coda}
    return [(f"transformer.{part}.{i}.", f"{PARTS[part]}.{i}.") for part, n in counts.items() for i in range(n)]


# ----- the form -----------------------------------------------------------------------------------


class HuginnForm(LMForm):
    """Huginn-0125 (``model_type: "huginn_raven"``) as a ``LoopedLM`` ``P+Nx{num_steps}+C`` with injection and its
    seeded random initial state; the platform writes no Huginn directory (``exports`` None, so neither
    ``obstacle`` nor ``files`` is asked)."""

    name = "huginn"
    model_type = "huginn_raven"
    looped = True
    seeded_state = True
    exports = None
    config = staticmethod(config_from_huginn)
    load = staticmethod(load_huginn)

    def shapes(self, hf: Mapping[str, Any]) -> dict[str, tuple[int, ...]]:
        return huginn_shapes(config_from_huginn(hf), hf["block_size"])

    def initial_state(self, path: str | Path, seed: int) -> InitialState:
        return huginn_initial_state(path, seed)
