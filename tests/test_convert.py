"""Hugging Face T5 import: an oracle against ``transformers`` on a random v1.1 model.

The HF model is random but made non-degenerate: an untied LM head (so a
shared/lm_head mix-up shows), stronger residual branches and norm gains (so
greedy outputs vary), and a calibrated EOS row (so some sequences stop early
and others run to the limit).
"""

from __future__ import annotations

import json
import re

import pytest
import torch
from torch import nn
from transformers import T5Config, T5ForConditionalGeneration
from transformers.cache_utils import DynamicCache, EncoderDecoderCache

from speed.config import PRESETS, ModelConfig
from speed.decode.generate import DecodeOptions, generate
from speed.models.convert_t5 import (
    config_from_hf,
    conversion_plan,
    default_layer_map,
    from_hf_model,
    from_hf_state_dict,
    from_pretrained,
    hf_config_from,
)

VOCAB, D_MODEL = 200, 64
EOS = 1
# Encoder and decoder depths differ so a swapped num_layers/num_decoder_layers shows; the other fields are off
# their defaults so each one's mapping is checked (16 buckets put decoder offsets >= 8 in the log-spaced range).
CONFIG = ModelConfig(
    vocab_size=VOCAB,
    d_model=D_MODEL,
    n_heads=4,
    d_kv=16,
    d_ff=128,
    n_encoder_layers=2,
    pattern="3x1",
    dropout=0.05,
    relative_buckets=16,
    relative_max_distance=24,
    layer_norm_eps=1e-3,
)
MAX_NEW = 16


def _random_hf_t5(config: ModelConfig, seed: int = 0) -> T5ForConditionalGeneration:
    torch.manual_seed(seed)
    hf = T5ForConditionalGeneration(hf_config_from(config)).eval()
    with torch.no_grad():
        hf.lm_head.weight = nn.Parameter(torch.randn(config.vocab_size, config.d_model) * 0.5)  # untie from shared
        for name, p in hf.named_parameters():
            if name.endswith(("o.weight", "wo.weight")):
                p.mul_(4.0)  # residual branches outweigh the input embedding: outputs are not just echoes
            elif "layer_norm" in name:
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
        _aim_eos(hf, seed)
    return hf


def _hf_greedy(hf: T5ForConditionalGeneration, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """HF greedy decoding (B, 1 + new tokens), starting with the decoder start token."""
    # transformers 5.24 sizes its default cache by the ENCODER depth; an unsized cache grows as needed.
    cache = EncoderDecoderCache(DynamicCache(), DynamicCache())
    return hf.generate(
        input_ids=ids, attention_mask=mask, do_sample=False, num_beams=1, max_new_tokens=MAX_NEW, cache=cache
    )


def _aim_eos(hf: T5ForConditionalGeneration, seed: int) -> None:
    """Set the EOS row so that about half of some calibration sequences stop before ``MAX_NEW`` tokens.

    Greedy paths do not change before their first EOS, so decode once with a
    zero EOS row, then scale a random EOS direction to the median of the
    per-sequence scales at which EOS first wins somewhere.
    """
    hf.lm_head.weight[EOS] = 0.0
    seen: list[torch.Tensor] = []
    hook = hf.lm_head.register_forward_hook(lambda m, inputs, out: seen.append(inputs[0][:, -1]))
    _hf_greedy(hf, *_batch(seed=99, batch=8))
    hook.remove()
    hidden = torch.stack(seen, 1)  # (B, T, d): the LM head's input at each greedy step
    logits = hf.lm_head(hidden)  # (B, T, V)
    logits[..., EOS] = -torch.inf
    direction = torch.randn(hidden.shape[-1], generator=torch.Generator().manual_seed(seed + 1))  # (d,)
    align = hidden @ direction  # (B, T)
    needed = (logits.max(-1).values / align).masked_fill(align <= 0, torch.inf)  # EOS wins above this scale
    hf.lm_head.weight[EOS] = needed.min(1).values.median() * direction


def _batch(seed: int, batch: int = 4, length: int = 11) -> tuple[torch.Tensor, torch.Tensor]:
    """Random encoder inputs with right padding of varied lengths (one row unpadded)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(2, VOCAB, (batch, length), generator=g)
    lengths = torch.randint(2, length + 1, (batch,), generator=g)
    lengths[0] = length
    mask = (torch.arange(length)[None, :] < lengths[:, None]).long()
    return ids.masked_fill(mask == 0, 0), mask


def _until_eos(tokens: list[int]) -> list[int]:
    return tokens[: tokens.index(EOS) + 1] if EOS in tokens else tokens


@pytest.fixture(scope="module")
def hf_model() -> T5ForConditionalGeneration:
    return _random_hf_t5(CONFIG)


@pytest.fixture(scope="module")
def converted(hf_model: T5ForConditionalGeneration):
    return from_hf_model(hf_model)


def _max_logit_diff(hf_model, model, ids, mask, dec) -> float:
    with torch.no_grad():
        expected = hf_model(input_ids=ids, attention_mask=mask, decoder_input_ids=dec).logits  # (B, T, V)
        (ours,) = model(ids, dec, mask, return_logits=True).loop_logits
    return (expected - ours).abs().max().item()


# ----- the oracle ------------------------------------------------------------------------------------


def test_converted_config_matches_hf(converted) -> None:
    assert converted.config == CONFIG
    assert not converted.training


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_logits_match_hf(hf_model, converted, seed: int) -> None:
    ids, mask = _batch(seed)
    assert (mask == 0).any(), "the batch must exercise encoder padding"
    dec = torch.randint(2, VOCAB, (ids.shape[0], 9), generator=torch.Generator().manual_seed(100 + seed))
    dec[:, 0] = CONFIG.pad_id
    assert _max_logit_diff(hf_model, converted, ids, mask, dec) <= 1e-4


# Plausible conversion bugs, each applied to one converted tensor: the oracle must notice every one.
BUGS = {
    "swap wi_0/wi_1": ("encoder_layers.1.ffn.wi.weight", lambda w: torch.cat(w.chunk(2)[::-1])),
    "swap cross k/v": ("decoder_layers.2.cross_attn.kv.weight", lambda w: torch.cat(w.chunk(2)[::-1])),
    "q/k order": ("decoder_layers.0.self_attn.qkv.weight", lambda w: torch.cat([w.chunk(3)[i] for i in (1, 0, 2)])),
    "one lm_head entry": (
        "lm_head.weight",
        lambda w: w.index_put((torch.tensor([7]), torch.tensor([3])), w[7, 3] + 0.01),
    ),
    "decoder bias": ("decoder_bias.embedding.weight", lambda w: w.flip(0)),
}


@pytest.mark.parametrize("bug", sorted(BUGS))
def test_oracle_catches_a_wrong_weight(hf_model, bug: str) -> None:
    model = from_hf_model(hf_model)
    name, corrupt = BUGS[bug]
    param = dict(model.named_parameters())[name]
    with torch.no_grad():
        param.copy_(corrupt(param.clone()))
    ids, mask = _batch(1)
    dec = torch.randint(2, VOCAB, (ids.shape[0], 9), generator=torch.Generator().manual_seed(101))
    dec[:, 0] = CONFIG.pad_id
    assert _max_logit_diff(hf_model, model, ids, mask, dec) > 1e-4


def test_greedy_tokens_match_hf_generate(hf_model, converted) -> None:
    expected: list[list[int]] = []
    got: dict[str, list[list[int]]] = {"sequential": [], "speed": []}
    for seed in (11, 12, 13):
        ids, mask = _batch(seed)
        out = _hf_greedy(hf_model, ids, mask)
        assert (out[:, 0] == CONFIG.pad_id).all()  # HF's decoder start token
        expected += [_until_eos(row) for row in out[:, 1:].tolist()]  # HF pads after EOS
        for method in got:
            got[method] += generate(
                converted, ids, mask, DecodeOptions(method=method, max_new_tokens=MAX_NEW, trace=False)
            ).tokens
    lengths = [len(t) for t in expected]
    stops = {n for n, t in zip(lengths, expected) if 1 < n < MAX_NEW and t[-1] == EOS}
    assert len(stops) >= 2, f"need sequences that stop mid-batch at different steps, got lengths {lengths}"
    assert MAX_NEW in lengths, "need a sequence that runs to the limit"
    assert len({tuple(t) for t in expected}) >= len(expected) // 2, "greedy outputs should vary with the input"
    assert got["sequential"] == expected
    assert got["speed"] == expected


# ----- NxM initialisation ----------------------------------------------------------------------------


def test_default_layer_map_is_evenly_spaced() -> None:
    assert default_layer_map(2, 12) == [0, 6]
    assert default_layer_map(3, 12) == [0, 4, 8]
    assert default_layer_map(12, 12) == list(range(12))
    assert default_layer_map(1, 5) == [0]


@pytest.mark.parametrize(("pattern", "layer_map", "picked"), [("2x3", None, [0, 1]), ("2x2", [2, 0], [2, 0])])
def test_shared_layers_equal_chosen_hf_layers(hf_model, pattern: str, layer_map, picked: list[int]) -> None:
    model = from_hf_model(hf_model, pattern=pattern, layer_map=layer_map)
    assert model.config.pattern == pattern and len(model.decoder_layers) == 2
    for j, src in enumerate(picked):
        block = hf_model.decoder.block[src].layer
        ours = model.decoder_layers[j]
        hf_self, hf_cross, hf_ffn = block[0].SelfAttention, block[1].EncDecAttention, block[2].DenseReluDense
        pairs = [
            (ours.self_attn.qkv.weight, torch.cat([hf_self.q.weight, hf_self.k.weight, hf_self.v.weight])),
            (ours.self_attn.o.weight, hf_self.o.weight),
            (ours.self_norm.weight, block[0].layer_norm.weight),
            (ours.cross_attn.q.weight, hf_cross.q.weight),
            (ours.cross_attn.kv.weight, torch.cat([hf_cross.k.weight, hf_cross.v.weight])),
            (ours.cross_attn.o.weight, hf_cross.o.weight),
            (ours.cross_norm.weight, block[1].layer_norm.weight),
            (ours.ffn.wi.weight, torch.cat([hf_ffn.wi_0.weight, hf_ffn.wi_1.weight])),
            (ours.ffn.wo.weight, hf_ffn.wo.weight),
            (ours.ffn_norm.weight, block[2].layer_norm.weight),
        ]
        for mine, theirs in pairs:
            assert torch.equal(mine, theirs)
    # The stack-level parts do not depend on the layer choice.
    hf_bias = hf_model.decoder.block[0].layer[0].SelfAttention.relative_attention_bias.weight
    assert torch.equal(model.decoder_bias.embedding.weight, hf_bias)
    assert torch.equal(model.lm_head.weight, hf_model.lm_head.weight)
    assert torch.equal(model.decoder_norm.weight, hf_model.decoder.final_layer_norm.weight)


@pytest.mark.parametrize(
    ("layer_map", "message"),
    [
        ([0], "has 1 entries"),
        ([0, 1, 2], "has 3 entries"),
        ([0, 3], r"layer_map\[1\]=3"),
        ([-1, 0], r"layer_map\[0\]=-1"),
    ],
)
def test_bad_layer_map_is_refused(hf_model, layer_map: list[int], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        from_hf_model(hf_model, pattern="2x3", layer_map=layer_map)


def test_plan_accounts_for_every_hf_tensor(hf_model) -> None:
    plan = conversion_plan(CONFIG.replace(pattern="2x3"), hf_decoder_layers=3, layer_map=[2, 0])
    assert plan.skipped["decoder.block.1.*"].startswith("decoder layer not picked")
    names = set(hf_model.state_dict())
    assert plan.used <= names
    leftover = names - plan.used
    assert leftover == {"encoder.embed_tokens.weight", "decoder.embed_tokens.weight"} | {
        n for n in names if n.startswith("decoder.block.1.")
    }


# ----- strictness ------------------------------------------------------------------------------------


def test_missing_unexpected_and_inconsistent_tensors_are_refused(hf_model) -> None:
    state = dict(hf_model.state_dict())
    missing = {k: v for k, v in state.items() if k != "decoder.block.2.layer.2.DenseReluDense.wi_1.weight"}
    with pytest.raises(KeyError, match="wi_1"):
        from_hf_state_dict(missing, CONFIG, 3)
    with pytest.raises(KeyError, match="decoder.block.3.layer.0.SelfAttention.q.weight"):
        from_hf_state_dict(
            {**state, "decoder.block.3.layer.0.SelfAttention.q.weight": state["shared.weight"]}, CONFIG, 3
        )
    with pytest.raises(ValueError, match="encoder.embed_tokens.weight differs from shared"):
        from_hf_state_dict({**state, "encoder.embed_tokens.weight": state["shared.weight"] + 1}, CONFIG, 3)
    with pytest.raises(ValueError, match=r"encoder_layers.0.ffn.wo.weight expects shape \(64, 128\)"):
        bad = state["encoder.block.0.layer.1.DenseReluDense.wo.weight"][:, :100]
        from_hf_state_dict({**state, "encoder.block.0.layer.1.DenseReluDense.wo.weight": bad}, CONFIG, 3)


def test_old_checkpoint_cross_attention_bias_is_skipped(hf_model, converted) -> None:
    unused = torch.zeros(CONFIG.relative_buckets, CONFIG.n_heads)
    state = {**hf_model.state_dict(), "decoder.block.0.layer.1.EncDecAttention.relative_attention_bias.weight": unused}
    expected = converted.state_dict()
    for name, value in from_hf_state_dict(state, CONFIG, 3).state_dict().items():
        assert torch.equal(value, expected[name]), name


# ----- configs ---------------------------------------------------------------------------------------


def _v11(**changes) -> T5Config:
    """A T5 v1.1 config with some constructor arguments changed."""
    base = dict(vocab_size=VOCAB, d_model=D_MODEL, feed_forward_proj="gated-gelu", tie_word_embeddings=False)
    return T5Config(**{**base, **changes})


@pytest.mark.parametrize(
    ("hf_config", "field"),
    [
        (lambda: _v11(feed_forward_proj="relu"), "feed_forward_proj='relu'"),
        (lambda: _v11(feed_forward_proj="gated-silu"), "feed_forward_proj='gated-silu'"),
        (lambda: T5Config(feed_forward_proj="gated-gelu"), "tie_word_embeddings=True"),  # v1.0 head, v1.1 FFN
        (lambda: T5Config(), "feed_forward_proj='relu'"),  # T5 v1.0 defaults
        (lambda: _v11(decoder_start_token_id=5), "decoder_start_token_id=5"),
    ],
)
def test_other_layouts_are_refused(hf_config, field: str) -> None:
    with pytest.raises(ValueError, match=re.escape(field)):
        config_from_hf(hf_config())


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_config_round_trip(name: str) -> None:
    config = PRESETS[name]
    hf = hf_config_from(config)
    assert hf.num_decoder_layers == config.sharing.depth  # the dense decoder doing the same work per token
    assert config_from_hf(hf, pattern=config.pattern) == config
    dense = config.replace(pattern=f"{config.sharing.n_unique}x1")
    assert config_from_hf(hf_config_from(dense)) == dense


@pytest.mark.parametrize("legacy_config", [False, True])
def test_from_pretrained_local_directory(tmp_path, hf_model, converted, legacy_config: bool) -> None:
    hf_model.save_pretrained(tmp_path)
    if legacy_config:  # how hub T5 v1.1 checkpoints (e.g. google/t5-v1_1-base, flan-t5) spell the untied head
        path = tmp_path / "config.json"
        saved = json.loads(path.read_text())
        saved.pop("scale_decoder_outputs")
        path.write_text(json.dumps({**saved, "tie_word_embeddings": False}))
    model = from_pretrained(str(tmp_path))
    assert model.config == CONFIG
    expected = converted.state_dict()
    for name, value in model.state_dict().items():
        assert torch.equal(value, expected[name]), name
    looped = from_pretrained(str(tmp_path), pattern="1x3", layer_map=[2])
    hf_wo = hf_model.decoder.block[2].layer[2].DenseReluDense.wo.weight
    assert looped.config.pattern == "1x3" and torch.equal(looped.decoder_layers[0].ffn.wo.weight, hf_wo)
