"""Independent references for two published looped LMs, and tiny checkpoints in their published layouts.

Nothing here comes from ``speed``: plain PyTorch over whole sequences (causal mask, no cache), weights read
with ``safetensors.torch.load_file``, so that the platform's loaders can be checked against it.

Ouro (ByteDance Seed, ``model_type == "ouro"``; ``modeling_ouro.py`` / ``configuration_ouro.py`` on the hub
under ByteDance/Ouro-1.4B, as in vLLM's ``vllm/model_executor/models/ouro.py``): ``num_hidden_layers``
layers looped ``total_ut_steps`` times. Per layer (four RMSNorms, "sandwich"):
``h = h + input_layernorm_2(attn(input_layernorm(h)))``,
``h = h + post_attention_layernorm_2(mlp(post_attention_layernorm(h)))``; after every loop
``h = model.norm(h)`` feeds the next loop and ``lm_head(h)`` is that loop's exit, and the exit gate gives
``lambda_t = sigmoid(model.early_exit_gate(h_t))``, ``p_t = lambda_t * prod_{j<t} (1 - lambda_j)``, the last
loop taking the rest. Rotary embeddings in Llama's halves layout (``rotate_half``), base ``rope_theta``,
computed once and shared by every loop; SwiGLU MLP; no biases but the gate's; untied head.

Huginn-0125 (``model_type == "huginn_raven"``, ``architectures == ["RavenForCausalLM"]``;
``raven_modeling_minimal.py`` / ``raven_config_minimal.py`` in seal-rg/recurrent-pretraining and on the hub
under tomg-group-umd/huginn-0125): ``e = prelude(wte(ids) * embed_scale)`` (``embed_scale = sqrt(n_embd)``),
then ``num_steps`` times ``x = core_block(adapter(cat([x, e])))`` from a zero state (``init_scale=0``; by
default the state starts random: ``initialize_state``, truncated normals of std ``init_values.std * init_scale``
within +-3 std, times ``embed_scale``: ``huginn_random_state``, given the draws), and the exit
``lm_head(ln_f(coda(ln_f(x))))`` (the same ``ln_f`` twice;
``lm_head`` tied to ``wte``). Per block (``SandwichBlock``): ``x = norm_2(x + attn(norm_1(x)))``,
``x = norm_4(x + mlp(norm_3(x)))``. Attention: fused ``Wqkv``, a learned bias ``qk_bias`` of shape
``(2, 1, n_heads, head_dim)`` added to q and k before the rotary embedding, which rotates adjacent pairs
``(x[2i], x[2i+1])`` by ``freqs_cis`` (base ``rope_base``); the MLP is ``proj(silu(a) * b)`` with
``a, b = fc(x).chunk(2)``. Its training forward (``iterate_forward`` with ``num_steps=(n, k)``): n recurrences
under ``torch.no_grad()``, then k with gradients, the exit and the loss after the last one only
(``huginn_reference_training``).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from torch import Tensor

NORMS_OURO = ("input_layernorm", "input_layernorm_2", "post_attention_layernorm", "post_attention_layernorm_2")
NORMS_HUGINN = ("norm_1", "norm_2", "norm_3", "norm_4")

# ------------------------------------------------------------------------------------------------ checkpoints


def ouro_shapes(config: dict) -> dict[str, tuple[int, ...]]:
    """Ouro's tensors (published names, in ``OuroForCausalLM``'s order) and their shapes for ``config``."""
    d, hd = config["hidden_size"], _ouro_head_dim(config)
    q, kv, ff = config["num_attention_heads"] * hd, config["num_key_value_heads"] * hd, config["intermediate_size"]
    shapes = {"model.embed_tokens.weight": (config["vocab_size"], d)}
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}."
        shapes |= {
            p + "self_attn.q_proj.weight": (q, d),
            p + "self_attn.k_proj.weight": (kv, d),
            p + "self_attn.v_proj.weight": (kv, d),
            p + "self_attn.o_proj.weight": (d, q),
            p + "mlp.gate_proj.weight": (ff, d),
            p + "mlp.up_proj.weight": (ff, d),
            p + "mlp.down_proj.weight": (d, ff),
        }
        shapes |= {p + norm + ".weight": (d,) for norm in NORMS_OURO}
    shapes |= {
        "model.norm.weight": (d,),
        "model.early_exit_gate.weight": (1, d),
        "model.early_exit_gate.bias": (1,),
        "lm_head.weight": (config["vocab_size"], d),
    }
    return shapes


def write_ouro_checkpoint(
    directory: str | Path,
    *,
    hidden: int = 32,
    layers: int = 2,
    heads: int = 4,
    kv_heads: int = 2,
    intermediate: int = 64,
    vocab: int = 97,
    total_ut_steps: int = 4,
    seed: int = 0,
    scale: float = 1.0,
    head_dim: int | None = None,
    rope_theta: float = 10000.0,
    early_exit_threshold: float = 1.0,
    dtype: torch.dtype = torch.float32,
    shards: int = 1,
) -> dict:
    """Write a tiny random Ouro checkpoint (``config.json``, and ``model.safetensors`` or ``shards`` shards with
    an index) in the published layout; returns the config. Its fields are all those ByteDance/Ouro-1.4B's
    ``config.json`` carries (``OuroConfig``'s arguments and what ``PretrainedConfig`` adds), with tiny values."""
    config = {
        "architectures": ["OuroForCausalLM"],
        "attention_dropout": 0.0,
        "auto_map": {
            "AutoConfig": "configuration_ouro.OuroConfig",
            "AutoModel": "modeling_ouro.OuroModel",
            "AutoModelForCausalLM": "modeling_ouro.OuroForCausalLM",
        },
        "bos_token_id": 0,
        "eos_token_id": 0,
        "early_exit_threshold": early_exit_threshold,
        "head_dim": head_dim if head_dim is not None else hidden // heads,
        "hidden_act": "silu",
        "hidden_size": hidden,
        "initializer_range": 0.02,
        "intermediate_size": intermediate,
        "layer_types": ["full_attention"] * layers,
        "max_position_embeddings": 128,
        "max_window_layers": layers,
        "model_type": "ouro",
        "num_attention_heads": heads,
        "num_hidden_layers": layers,
        "num_key_value_heads": kv_heads,
        "rms_norm_eps": 1e-6,
        "rope_scaling": None,
        "rope_theta": rope_theta,
        "sliding_window": None,
        "tie_word_embeddings": False,
        "torch_dtype": _dtype_name(dtype),
        "total_ut_steps": total_ut_steps,
        "transformers_version": "4.55.0",
        "use_cache": True,
        "use_sliding_window": False,
        "vocab_size": vocab,
    }
    tensors = _random_tensors(ouro_shapes(config), seed, scale)
    _write(Path(directory), config, tensors, dtype, shards)
    return config


def huginn_shapes(config: dict, *, freqs_cis: bool = True, lm_head: bool = False) -> dict[str, tuple[int, ...]]:
    """Huginn's tensors (published names, in ``RavenForCausalLM``'s order) and their shapes for ``config``.

    ``freqs_cis`` is a persistent buffer (``register_buffer(..., persistent=True)``), so it is in the state
    dict; ``lm_head.weight`` is tied to ``transformer.wte.weight`` and left out of saved files."""
    d, heads, ff = config["n_embd"], config["n_heads"], config["intermediate_size"]
    hd = d // heads
    shapes = {"transformer.wte.weight": (config["padded_vocab_size"], d)}

    def blocks(part: str, count: int) -> None:
        for i in range(count):
            p = f"transformer.{part}.{i}."
            shapes.update({
                p + "norm_1.weight": (d,),
                p + "attn.Wqkv.weight": (3 * d, d),
                **({p + "attn.qk_bias": (2, 1, heads, hd)} if config["qk_bias"] else {}),
                p + "attn.proj.weight": (d, d),
                p + "norm_2.weight": (d,),
                p + "mlp.fc.weight": (2 * ff, d),
                p + "mlp.proj.weight": (d, ff),
                p + "norm_3.weight": (d,),
                p + "norm_4.weight": (d,),
            })

    blocks("prelude", config["n_layers_in_prelude"])
    shapes["transformer.adapter.weight"] = (d, 2 * d)
    if config["bias"]:
        shapes["transformer.adapter.bias"] = (d,)
    blocks("core_block", config["n_layers_in_recurrent_block"])
    blocks("coda", config["n_layers_in_coda"])
    shapes["transformer.ln_f.weight"] = (d,)
    if lm_head:
        shapes["lm_head.weight"] = (config["padded_vocab_size"], d)
    if freqs_cis:
        shapes["freqs_cis"] = (1, config["block_size"], 1, hd // 2, 2)
    return shapes


def write_huginn_checkpoint(
    directory: str | Path,
    *,
    hidden: int = 32,
    heads: int = 4,
    intermediate: int = 64,
    vocab: int = 97,
    prelude: int = 2,
    core: int = 4,
    coda: int = 2,
    mean_recurrence: int = 4,
    block_size: int = 64,
    seed: int = 0,
    scale: float = 1.0,
    rope_base: float = 50000.0,
    qk_bias: bool = True,
    bias: bool = False,
    dtype: torch.dtype = torch.float32,
    shards: int = 1,
    freqs_cis: bool = True,
    lm_head: bool = False,
) -> dict:
    """Write a tiny random Huginn checkpoint in the published layout; returns the config. ``freqs_cis`` (float32,
    as the buffer is kept) is written unless ``freqs_cis=False``; ``lm_head.weight`` (a copy of the embedding,
    being tied) only with ``lm_head=True``. The config's fields are all those tomg-group-umd/huginn-0125's
    carries (``RavenConfig``'s arguments, its derived fields, and what ``PretrainedConfig`` adds)."""
    depth = prelude + coda + core * mean_recurrence
    std = math.sqrt(2 / (5 * hidden))
    config = {
        "activation_checkpoint_impl": "per-iteration",
        "architecture_class_name": "RecurrentGPT",
        "architectures": ["RavenForCausalLM"],
        "auto_map": {
            "AutoConfig": "raven_config_minimal.RavenConfig",
            "AutoModelForCausalLM": "raven_modeling_minimal.RavenForCausalLM",
        },
        "bias": bias,
        "block_class_name": "SandwichBlock",
        "block_size": block_size,
        "bos_token_id": vocab - 4,  # 65504, 65505, 65509 of 65536 in the published one
        "eos_token_id": vocab - 3,
        "pad_token_id": vocab - 1,
        "effective_expected_depth": depth,
        "head_dim": hidden // heads,
        "init_orthogonal": False,
        "init_strategy": "takase",
        "init_values": {
            "std": std,
            "out_proj": std / math.sqrt(2 * depth),
            "embedding": std,
            "embed_scale": math.sqrt(hidden),
        },
        "injection_type": "linear",
        "intermediate_size": intermediate,
        "mean_backprop_depth": max(1, mean_recurrence // 4),
        "mean_recurrence": mean_recurrence,
        "mlp_class_name": "GatedMLP",
        "model_type": "huginn_raven",
        "n_embd": hidden,
        "n_heads": heads,
        "n_layers": prelude + core + coda,
        "n_layers_in_coda": coda,
        "n_layers_in_prelude": prelude,
        "n_layers_in_recurrent_block": core,
        "nonlin_name": "SiLU",
        "norm_class_name": "RMSNorm_llama",
        "norm_eps": 1e-6,
        "num_key_value_heads": heads,
        "padded_vocab_size": vocab,
        "padding_multiple": 4096,
        "qk_bias": qk_bias,
        "rope_base": rope_base,
        "sampling_scheme": "poisson-lognormal-filling",
        "state_init": "like-init",
        "test_time_noise": 0,
        "test_time_noise_type": "fixed",
        "tie_embeddings": True,
        "tie_word_embeddings": True,
        "torch_dtype": _dtype_name(dtype),
        "transformers_version": "4.47.1",
        "vocab_size": vocab,
    }
    shapes = huginn_shapes(config, freqs_cis=False, lm_head=False)
    tensors = _random_tensors(shapes, seed, scale)
    if lm_head:
        tensors["lm_head.weight"] = tensors["transformer.wte.weight"].clone()
    keep = {}
    if freqs_cis:
        keep["freqs_cis"] = huginn_freqs_cis(hidden // heads, block_size, rope_base)
    _write(Path(directory), config, tensors, dtype, shards, keep)
    return config


# ------------------------------------------------------------------------------------------------ references


@dataclass(frozen=True)
class OuroOutputs:
    logits: list[Tensor]  # per loop, (B, T, V): lm_head(norm(h_t))
    lambdas: list[Tensor]  # per loop, (B, T): sigmoid(early_exit_gate(norm(h_t)))


def ouro_reference(
    directory: str | Path, input_ids: Tensor, n_loops: int | None = None, dtype: torch.dtype = torch.float32
) -> OuroOutputs:
    """Every loop's logits and exit-gate lambda (``n_loops``: the config's ``total_ut_steps`` by default)."""
    config, w = load_checkpoint(directory, dtype)
    if config.get("use_sliding_window") or config.get("rope_scaling"):
        raise NotImplementedError("the reference computes full attention with default rotary embeddings only")
    n_loops = config["total_ut_steps"] if n_loops is None else n_loops
    eps, heads, kv_heads = config["rms_norm_eps"], config["num_attention_heads"], config["num_key_value_heads"]
    hd = _ouro_head_dim(config)
    T = input_ids.shape[1]
    cos, sin = _halves_rotary(hd, T, config["rope_theta"], dtype)
    h = w["model.embed_tokens.weight"][input_ids]
    logits, lambdas = [], []
    for _ in range(n_loops):
        for i in range(config["num_hidden_layers"]):
            p = f"model.layers.{i}."
            x = _rms(h, w[p + "input_layernorm.weight"], eps)
            q = _heads(x @ w[p + "self_attn.q_proj.weight"].T, heads)
            k = _heads(x @ w[p + "self_attn.k_proj.weight"].T, kv_heads)
            v = _heads(x @ w[p + "self_attn.v_proj.weight"].T, kv_heads)
            q, k = q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin
            k, v = k.repeat_interleave(heads // kv_heads, dim=1), v.repeat_interleave(heads // kv_heads, dim=1)
            a = _causal_attention(q, k, v, hd**-0.5) @ w[p + "self_attn.o_proj.weight"].T
            h = h + _rms(a, w[p + "input_layernorm_2.weight"], eps)
            x = _rms(h, w[p + "post_attention_layernorm.weight"], eps)
            m = (F.silu(x @ w[p + "mlp.gate_proj.weight"].T) * (x @ w[p + "mlp.up_proj.weight"].T)) @ w[
                p + "mlp.down_proj.weight"
            ].T
            h = h + _rms(m, w[p + "post_attention_layernorm_2.weight"], eps)
        h = _rms(h, w["model.norm.weight"], eps)
        logits.append(h @ w["lm_head.weight"].T)
        gate = h @ w["model.early_exit_gate.weight"].T + w["model.early_exit_gate.bias"]
        lambdas.append(torch.sigmoid(gate.squeeze(-1)))
    return OuroOutputs(logits, lambdas)


def ouro_reference_logits(directory: str | Path, input_ids: Tensor, n_loops: int | None = None) -> list[Tensor]:
    """Every loop's logits, (B, T, V) each."""
    return ouro_reference(directory, input_ids, n_loops).logits


def ouro_exit_pdf(lambdas: list[Tensor]) -> Tensor:
    """(B, T, n): the probability of exiting at each loop, as ``OuroForCausalLM.forward`` computes it."""
    remaining = torch.ones_like(lambdas[0])
    pdf = []
    for i, lam in enumerate(lambdas):
        if i < len(lambdas) - 1:
            pdf.append(lam * remaining)
            remaining = remaining * (1.0 - lam)
        else:
            pdf.append(remaining)
    return torch.stack(pdf, dim=2)


def ouro_q_exit(lambdas: list[Tensor], threshold: float) -> Tensor:
    """(B, T): the 0-based loop each token exits at under ``early_exit_threshold``: the first whose cumulative
    exit probability reaches ``threshold``, else the last (``OuroForCausalLM.forward``'s ``exit_threshold``)."""
    reached = torch.cumsum(ouro_exit_pdf(lambdas), dim=2) >= threshold
    steps = torch.argmax(reached.float(), dim=2)
    steps[~reached.any(dim=2)] = len(lambdas) - 1
    return steps


def huginn_reference_logits(
    directory: str | Path,
    input_ids: Tensor,
    num_steps: int,
    dtype: torch.dtype = torch.float32,
    state: Tensor | None = None,
) -> list[Tensor]:
    """The exit logits after each recurrence step, (B, T, V) each: entry k-1 is what ``RavenForCausalLM``'s
    forward gives with ``num_steps=k`` and ``init_scale=0`` (a zero initial state; ``state`` to give another)."""
    config, w = load_checkpoint(directory, dtype)
    huginn = _Huginn(config, w, input_ids.shape[1], dtype)
    e = huginn.prelude(input_ids)
    x = torch.zeros_like(e) if state is None else state.to(dtype)
    out = []
    for _ in range(num_steps):
        x = huginn.step(x, e)
        out.append(huginn.exit(x))
    return out


def huginn_reference_training(
    directory: str | Path, input_ids: Tensor, labels: Tensor, no_grad_steps: int, grad_steps: int
) -> tuple[Tensor, dict[str, Tensor]]:
    """The training forward of ``RavenForCausalLM`` with ``num_steps=(no_grad_steps, grad_steps)`` from a zero
    state (``iterate_forward``: the first steps under ``torch.no_grad()``, the last ones with gradients; the exit
    and the loss, ``cross_entropy(logits, labels, ignore_index=-100)``, after the last step only), and its
    backward: (the loss, each published tensor's gradient; tensors no gradient reached are left out)."""
    config, w = load_checkpoint(directory)
    for tensor in w.values():
        tensor.requires_grad_(tensor.is_floating_point())
    huginn = _Huginn(config, w, input_ids.shape[1], torch.float32)
    e = huginn.prelude(input_ids)
    x = torch.zeros_like(e)
    with torch.no_grad():
        for _ in range(no_grad_steps):
            x = huginn.step(x, e)
    for _ in range(grad_steps):
        x = huginn.step(x, e)
    logits = huginn.exit(x)
    loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1), ignore_index=-100)
    loss.backward()
    return loss.detach(), {name: t.grad for name, t in w.items() if t.grad is not None}


class _Huginn:
    """Huginn's parts over whole sequences of length T, on the published tensors ``w``."""

    def __init__(self, config: dict, w: dict[str, Tensor], T: int, dtype: torch.dtype) -> None:
        if config.get("test_time_noise", 0):
            raise NotImplementedError("test-time noise is random: the reference computes without it")
        self.config, self.w = config, w
        self.d, self.heads, self.eps = config["n_embd"], config["n_heads"], config["norm_eps"]
        self.freqs = huginn_freqs_cis(self.d // self.heads, T, config["rope_base"]).to(dtype)[0, :, 0]  # (T, hd/2, 2)

    def block(self, prefix: str, x: Tensor) -> Tensor:
        w, d, eps, heads = self.w, self.d, self.eps, self.heads
        hd = d // heads
        y = _rms(x, w[prefix + "norm_1.weight"], eps)
        q, k, v = (y @ w[prefix + "attn.Wqkv.weight"].T).split([d, d, d], dim=-1)
        q, k, v = (t.unflatten(-1, (heads, hd)) for t in (q, k, v))  # (B, T, H, hd)
        if self.config["qk_bias"]:
            q, k = q + w[prefix + "attn.qk_bias"][0], k + w[prefix + "attn.qk_bias"][1]
        q, k = _pairs_rotary(q, self.freqs), _pairs_rotary(k, self.freqs)
        a = _causal_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), hd**-0.5)
        x = _rms(x + a @ w[prefix + "attn.proj.weight"].T, w[prefix + "norm_2.weight"], eps)
        gate, up = (_rms(x, w[prefix + "norm_3.weight"], eps) @ w[prefix + "mlp.fc.weight"].T).chunk(2, dim=-1)
        return _rms(x + (F.silu(gate) * up) @ w[prefix + "mlp.proj.weight"].T, w[prefix + "norm_4.weight"], eps)

    def blocks(self, part: str, count: int, x: Tensor) -> Tensor:
        for i in range(count):
            x = self.block(f"transformer.{part}.{i}.", x)
        return x

    def prelude(self, input_ids: Tensor) -> Tensor:
        """``e``: the prelude's output (the embedding scaled by sqrt(n_embd), the model's ``emb_scale``: it is
        ``_init_func(n_embd, ...)["embed_scale"]``, not read from the config)."""
        embedded = self.w["transformer.wte.weight"][input_ids] * math.sqrt(self.d)
        return self.blocks("prelude", self.config["n_layers_in_prelude"], embedded)

    def step(self, x: Tensor, e: Tensor) -> Tensor:
        """One recurrence: ``core_block(adapter(cat([x, e])))``."""
        x = torch.cat([x, e], dim=-1) @ self.w["transformer.adapter.weight"].T
        if "transformer.adapter.bias" in self.w:
            x = x + self.w["transformer.adapter.bias"]
        return self.blocks("core_block", self.config["n_layers_in_recurrent_block"], x)

    def exit(self, x: Tensor) -> Tensor:
        """The logits ``lm_head(ln_f(coda(ln_f(x))))`` (the head tied to the embedding unless written out)."""
        w, eps = self.w, self.eps
        head = w.get("lm_head.weight", w["transformer.wte.weight"])
        y = self.blocks("coda", self.config["n_layers_in_coda"], _rms(x, w["transformer.ln_f.weight"], eps))
        return _rms(y, w["transformer.ln_f.weight"], eps) @ head.T


def huginn_random_state(directory: str | Path, draws: Tensor, init_scale: float = 1.0) -> Tensor:
    """``RavenForCausalLM.initialize_state(e, scale=init_scale)`` with its truncated-normal draws given: ``draws``
    (..., n_embd), standard normals within +-3, scaled to std ``init_values["std"] * init_scale`` (so truncated at
    +-3 std) and multiplied by the embedding scale sqrt(n_embd); the draws themselves are random in the published
    model, so a test passes the ones the platform drew (its reproducible noise) and checks what is made of them."""
    config = json.loads((Path(directory) / "config.json").read_text())
    if draws.abs().max() > 3:
        raise ValueError("initialize_state's draws lie within +-3 standard deviations")
    std = config["init_values"]["std"] * init_scale
    return draws * std * math.sqrt(config["n_embd"])


def huginn_freqs_cis(head_dim: int, end: int, theta: float) -> Tensor:
    """``precompute_freqs_cis``: (1, end, 1, head_dim/2, 2), [..., 0] the cosines and [..., 1] the sines."""
    inv_freqs = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    freqs = torch.outer(torch.arange(end, dtype=torch.float32), inv_freqs)
    return torch.stack([freqs.cos()[None, :, None, :], freqs.sin()[None, :, None, :]], dim=4)


def load_checkpoint(directory: str | Path, dtype: torch.dtype = torch.float32) -> tuple[dict, dict[str, Tensor]]:
    """``config.json`` and every tensor (single file or shards through the index), floats as ``dtype``."""
    directory = Path(directory)
    config = json.loads((directory / "config.json").read_text())
    if (directory / "model.safetensors").is_file():
        files = ["model.safetensors"]
    else:
        files = sorted(set(json.loads((directory / "model.safetensors.index.json").read_text())["weight_map"].values()))
    weights = {}
    for name in files:
        weights |= load_file(str(directory / name))
    return config, {k: v.to(dtype) if v.is_floating_point() else v for k, v in weights.items()}


# ------------------------------------------------------------------------------------------------ pieces


def _rms(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    return weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def _heads(x: Tensor, n: int) -> Tensor:
    """(B, T, n * hd) -> (B, n, T, hd)."""
    return x.unflatten(-1, (n, -1)).transpose(1, 2)


def _causal_attention(q: Tensor, k: Tensor, v: Tensor, scaling: float) -> Tensor:
    """(B, H, T, hd) each -> (B, T, H * hd): softmax(q k^T * scaling, causal) v, the softmax in float32."""
    T = q.shape[2]
    scores = (q @ k.transpose(-1, -2)) * scaling
    scores = scores.masked_fill(torch.ones(T, T, dtype=torch.bool).triu(1), float("-inf"))
    return (scores.float().softmax(-1).to(q.dtype) @ v).transpose(1, 2).flatten(2)


def _halves_rotary(head_dim: int, T: int, theta: float, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """Llama's default rotary embedding: cos and sin (T, head_dim), frequencies repeated over the two halves."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    freqs = torch.arange(T, dtype=torch.float32)[:, None] * inv_freq[None, :]
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def _rotate_half(x: Tensor) -> Tensor:
    half = x.shape[-1] // 2
    return torch.cat([-x[..., half:], x[..., :half]], dim=-1)


def _pairs_rotary(x: Tensor, freqs: Tensor) -> Tensor:
    """Huginn's ``apply_rotary_emb_complex_like`` on (B, T, H, hd) with ``freqs`` (T, hd/2, 2)."""
    pairs = x.unflatten(-1, (-1, 2))
    cos, sin = freqs[None, :, None, :, 0], freqs[None, :, None, :, 1]
    return torch.stack(
        [pairs[..., 0] * cos - pairs[..., 1] * sin, pairs[..., 1] * cos + pairs[..., 0] * sin], dim=-1
    ).flatten(-2)


def _ouro_head_dim(config: dict) -> int:
    return config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]


def _random_tensors(shapes: dict[str, tuple[int, ...]], seed: int, scale: float) -> dict[str, Tensor]:
    """Matrices ~ N(0, scale^2 / fan_in), embeddings ~ N(0, scale^2), norm weights ~ 1 + N(0, 0.1^2), biases
    ~ N(0, (scale / 2)^2): varied enough that every loop's output differs."""
    generator = torch.Generator().manual_seed(seed)
    tensors = {}
    for name, shape in shapes.items():
        noise = torch.randn(shape, generator=generator)
        if "norm" in name or name.endswith("ln_f.weight"):
            tensors[name] = 1.0 + 0.1 * noise
        elif name.endswith("bias"):
            tensors[name] = 0.5 * scale * noise
        elif "wte" in name or "embed_tokens" in name:
            tensors[name] = scale * noise
        else:
            tensors[name] = scale * noise / math.sqrt(shape[-1])
    return tensors


def _write(
    directory: Path,
    config: dict,
    tensors: dict[str, Tensor],
    dtype: torch.dtype,
    shards: int,
    keep: dict[str, Tensor] | None = None,
) -> None:
    """``config.json`` and the tensors (floats as ``dtype``, those in ``keep`` as they are) as one
    ``model.safetensors`` or ``shards`` files ``model-0000i-of-0000n.safetensors`` with the index."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    stored = {name: t.to(dtype).contiguous() for name, t in tensors.items()} | dict(keep or {})
    names = list(stored)
    if shards == 1:
        save_file(stored, str(directory / "model.safetensors"), metadata={"format": "pt"})
        return
    weight_map = {}
    per = math.ceil(len(names) / shards)
    for i in range(shards):
        file = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        part = {name: stored[name] for name in names[i * per : (i + 1) * per]}
        save_file(part, str(directory / file), metadata={"format": "pt"})
        weight_map |= dict.fromkeys(part, file)
    total = sum(t.numel() * t.element_size() for t in stored.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (directory / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")
