"""Llama import: an oracle against ``transformers``' ``LlamaForCausalLM`` on tiny random models, and RRT tying.

The HF models are random but non-degenerate: weights at unit-variance scales
and norm gains off 1 (so every weight shows in the logits and greedy tokens
vary), grouped-query attention (4 query heads on 2 key/value heads) and a
rotary base off the default.
"""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from speed.config import SharingPattern
from speed.engine.cache import Rows
from speed.models.convert_llama import (
    config_from_llama,
    conversion_plan,
    from_llama,
    from_llama_state_dict,
    from_pretrained,
    layer_sources,
)
from speed.models.looped_lm import LoopedLM

VOCAB, D_MODEL, LAYERS = 96, 32, 4
EOS = 2


def _llama(layers: int = LAYERS, seed: int = 0, **overrides) -> LlamaForCausalLM:
    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=D_MODEL,
        intermediate_size=48,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        rope_theta=500.0,
        rms_norm_eps=1e-5,
        bos_token_id=1,
        eos_token_id=EOS,
        pad_token_id=0,
        **overrides,
    )
    torch.manual_seed(seed)
    hf = LlamaForCausalLM(config).eval()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if p.ndim == 1:
                p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=g))
            elif name == "model.embed_tokens.weight":
                p.copy_(torch.randn(p.shape, generator=g))
            else:
                p.copy_(torch.randn(p.shape, generator=g) * p.shape[1] ** -0.5)
    return hf


def _ids(seed: int, batch: int = 3, length: int = 10) -> torch.Tensor:
    return torch.randint(3, VOCAB, (batch, length), generator=torch.Generator().manual_seed(seed))


def _hf_logits(hf: LlamaForCausalLM, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return hf(input_ids=ids).logits  # (B, T, V)


@pytest.fixture(scope="module", params=[False, True], ids=["untied", "tied"])
def hf_model(request) -> LlamaForCausalLM:
    return _llama(tie_word_embeddings=request.param)


def test_config_maps_every_field(hf_model) -> None:
    c = config_from_llama(hf_model.config)
    assert (c.vocab_size, c.d_model, c.n_heads, c.n_kv_heads, c.head_dim, c.d_ff) == (VOCAB, D_MODEL, 4, 2, 8, 48)
    assert (c.pattern, c.rope_theta, c.norm_eps, c.eos_id, c.norm) == ("4x1", 500.0, 1e-5, 2, "pre")
    assert c.tie_embeddings == hf_model.config.tie_word_embeddings
    assert config_from_llama(hf_model.config, "2x2").pattern == "2x2"


def test_logits_match_hf(hf_model) -> None:
    model = from_llama(hf_model)
    ids = _ids(1)
    want = _hf_logits(hf_model, ids)
    with torch.no_grad():
        got = model(ids, return_logits=True).loop_logits
    assert len(got) == 1 and want.abs().max() > 1.0
    torch.testing.assert_close(got[0], want, atol=1e-4, rtol=0)


def test_prelude_and_coda_convert_exactly() -> None:
    """``P+Nx1+C`` from P + N + C layers is the same stack, split in three: the same logits."""
    hf = _llama(layers=5, seed=2)
    model = from_llama(hf, "1+3x1+1")
    ids = _ids(3)
    with torch.no_grad():
        torch.testing.assert_close(
            model(ids, return_logits=True).loop_logits[0], _hf_logits(hf, ids), atol=1e-4, rtol=0
        )


def _greedy(model: LoopedLM, prompt: torch.Tensor, n: int) -> list[int]:
    """Greedy tokens (up to EOS) through the cached path: prefill, then one ``step`` per loop per token."""
    cache, pos, tokens = model.cache(1, len(prompt) + n), len(prompt), []
    logits = model.prefill(cache, 0, prompt)[-1]
    for _ in range(n):
        tokens.append(int(logits.argmax()))
        if tokens[-1] == model.eos_id:
            break
        hidden = model.embed(tokens[-1:])
        for loop in range(model.n_loops):
            hidden, exits = model.step(cache, Rows.build([0], [loop], [pos]), hidden)
        logits, pos = exits[0], pos + 1
    return tokens


def test_greedy_tokens_match_hf_generate(hf_model) -> None:
    model, new = from_llama(hf_model), 8
    expected, got = [], []
    for row in _ids(4, batch=4, length=6):
        out = hf_model.generate(row[None], do_sample=False, max_new_tokens=new, use_cache=True)[0, len(row) :].tolist()
        expected.append(out[: out.index(EOS) + 1] if EOS in out else out)  # HF pads after EOS
        with torch.inference_mode():
            got.append(_greedy(model, row, new))
    assert len({tuple(t) for t in expected}) == len(expected), "greedy outputs should vary with the prompt"
    assert got == expected


# A wrong weight must move the logits past the tolerance: the oracle is sharp enough to see each of these.
BUGS = {
    "q-k-heads-swapped": (
        "core.0.attn.qkv.weight",
        lambda w: torch.cat([w[:8], w[32:40], w[16:32], w[8:16], w[40:]]),
    ),
    "rotary-gpt-j-pairs": (
        "core.1.attn.qkv.weight",
        lambda w: w.view(-1, 2, 4, 32).transpose(1, 2).reshape(-1, 32),
    ),
    "gate-up-swapped": ("core.2.mlp.wi.weight", lambda w: w.roll(48, 0)),
    "a-norm-gain": ("core.3.mlp_norm.weight", lambda w: w + 0.01),
    "final-norm-reversed": ("norm.weight", lambda w: w.flip(0)),
}


@pytest.mark.parametrize("bug", sorted(BUGS))
def test_oracle_catches_a_wrong_weight(bug: str) -> None:
    hf = _llama(seed=5)
    model = from_llama(hf)
    name, corrupt = BUGS[bug]
    param = dict(model.named_parameters())[name]
    with torch.no_grad():
        param.copy_(corrupt(param.clone()))
        ids = _ids(6)
        assert (model(ids, return_logits=True).loop_logits[0] - _hf_logits(hf, ids)).abs().max() > 1e-4


# ----- tying a pretrained stack into loops (Relaxed Recursive Transformers) -----------------------------


@pytest.mark.parametrize(
    "pattern, layers, sources",
    [
        ("2x3", 6, {"core.0": (0, 2, 4), "core.1": (1, 3, 5)}),  # L = N * M: loop i stands where layers 2i, 2i+1 stood
        ("2x2", 8, {"core.0": (0, 2, 4, 6), "core.1": (1, 3, 5, 7)}),  # L a multiple of N * M
        ("3x4", 3, {"core.0": (0,), "core.1": (1,), "core.2": (2,)}),  # L = N: each layer looped
        ("1+2x2+1", 6, {"prelude.0": (0,), "core.0": (1, 3), "core.1": (2, 4), "coda.0": (5,)}),
    ],
)
def test_layer_sources(pattern: str, layers: int, sources: dict) -> None:
    assert layer_sources(SharingPattern.parse(pattern), layers) == sources


def test_layer_sources_need_n_to_divide_the_middle_layers() -> None:
    with pytest.raises(ValueError, match="N must divide them"):
        layer_sources(SharingPattern.parse("4x2"), 6)
    with pytest.raises(ValueError, match="N must divide them"):
        layer_sources(SharingPattern.parse("2+2x1+2"), 5)


def test_tied_layers_are_the_averages_of_the_layers_they_stand_for() -> None:
    hf = _llama(layers=6, seed=7)
    model = from_llama(hf, "1+2x2+1")
    sd = hf.state_dict()

    def hf_layer(i: int, names: tuple[str, ...]) -> torch.Tensor:
        return torch.cat([sd[f"model.layers.{i}.{n}.weight"] for n in names])

    ours = dict(model.named_parameters())
    qkv = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")
    for block, layers in {"core.0": (1, 3), "core.1": (2, 4)}.items():
        for name, hf_names in {
            "attn.qkv": qkv,
            "mlp.wi": ("mlp.gate_proj", "mlp.up_proj"),
            "mlp.wo": ("mlp.down_proj",),
            "attn_norm": ("input_layernorm",),
        }.items():
            mean = (hf_layer(layers[0], hf_names) + hf_layer(layers[1], hf_names)) / 2
            torch.testing.assert_close(ours[f"{block}.{name}.weight"], mean, atol=1e-6, rtol=0)
    assert torch.equal(ours["prelude.0.attn.o.weight"], sd["model.layers.0.self_attn.o_proj.weight"])
    assert torch.equal(ours["coda.0.mlp.wo.weight"], sd["model.layers.5.mlp.down_proj.weight"])


def test_looping_an_unaveraged_stack_starts_from_the_plain_model() -> None:
    """L = N: ``NxM`` holds the plain conversion's weights, and its first exit is the HF model's output."""
    hf = _llama(seed=8)
    plain, looped = from_llama(hf), from_llama(hf, "4x3")
    assert all(
        torch.equal(a, b) for a, b in zip(plain.state_dict().values(), looped.state_dict().values(), strict=True)
    )
    ids = _ids(9)
    with torch.no_grad():
        exits = looped(ids, return_logits=True).loop_logits
    torch.testing.assert_close(exits[0], _hf_logits(hf, ids), atol=1e-4, rtol=0)
    assert len(exits) == 3 and (exits[1] - exits[0]).abs().max() > 1e-2  # later loops run the stack again


# ----- strictness ------------------------------------------------------------------------------------------


def test_plan_accounts_for_every_hf_tensor(hf_model) -> None:
    config = config_from_llama(hf_model.config)
    plan = conversion_plan(config, LAYERS)
    assert plan.used | set(plan.skipped) == set(hf_model.state_dict())
    assert set(plan.sources) == set(dict(LoopedLM(config).named_parameters()))


def test_missing_unexpected_and_inconsistent_tensors_are_refused() -> None:
    hf = _llama(tie_word_embeddings=True)
    config, sd = config_from_llama(hf.config), dict(hf.state_dict())
    with pytest.raises(KeyError, match="lacks 1 tensor"):
        from_llama_state_dict({k: v for k, v in sd.items() if k != "model.norm.weight"}, config, LAYERS)
    with pytest.raises(KeyError, match="does not know.*model.layers.4"):
        from_llama_state_dict({**sd, "model.layers.4.mlp.up_proj.weight": torch.zeros(1)}, config, LAYERS)
    with pytest.raises(ValueError, match="lm_head.weight differs"):
        from_llama_state_dict({**sd, "lm_head.weight": sd["lm_head.weight"] + 1}, config, LAYERS)
    old = {**sd, "model.layers.0.self_attn.rotary_emb.inv_freq": torch.ones(4)}  # older transformers saved it
    from_llama_state_dict(old, config, LAYERS)
    with pytest.raises(ValueError, match="pre-norm LoopedLM without injection"):
        from_llama_state_dict(sd, config.replace(injection=True), LAYERS)


@pytest.mark.parametrize(
    "overrides, message",
    [
        ({"attention_bias": True}, "attention_bias=True"),
        ({"mlp_bias": True}, "mlp_bias=True"),
        ({"hidden_act": "gelu"}, "hidden_act='gelu'"),
        ({"rope_parameters": {"rope_type": "linear", "rope_theta": 500.0, "factor": 2.0}}, "rope_type='linear'"),
        ({"eos_token_id": [2, 3]}, "exactly one EOS"),
    ],
)
def test_other_layouts_are_refused(overrides: dict, message: str) -> None:
    base = {"vocab_size": VOCAB, "hidden_size": D_MODEL, "num_attention_heads": 4, "num_hidden_layers": 1}
    with pytest.raises(ValueError, match=message):
        config_from_llama(LlamaConfig(**base, **overrides))


def test_from_pretrained_local_directory(tmp_path) -> None:
    """The hub loader, on a ``save_pretrained`` folder: the same model as converting the loaded one."""
    hf = _llama(seed=10, tie_word_embeddings=True)
    hf.save_pretrained(tmp_path)
    model = from_pretrained(str(tmp_path), pattern="2x2", local_files_only=True)
    assert model.config == config_from_llama(hf.config, "2x2")
    expected = from_llama(hf, "2x2").state_dict()
    assert all(torch.equal(v, expected[k]) for k, v in model.state_dict().items())
