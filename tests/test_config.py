import pytest
from hypothesis import given
from hypothesis import strategies as st

from speed.config import PRESETS, ConfigError, ModelConfig, SharingPattern, from_dict, preset, to_dict


@pytest.mark.parametrize(
    "text, n, m", [("2x6", 2, 6), ("1x12", 1, 12), ("12x1", 12, 1), (" 3 x 4 ", 3, 4), ("2X6", 2, 6)]
)
def test_parse_valid(text, n, m):
    p = SharingPattern.parse(text)
    assert (p.n_unique, p.n_loops, p.depth) == (n, m, n * m)


@pytest.mark.parametrize(
    "text, fragment",
    [
        ("2x0", r"M \(loops\) must be at least 1"),
        ("0x3", r"N \(unique layers\) must be at least 1"),
        ("x6", "missing N"),
        ("2x", "missing M"),
        ("12", "has no 'x'"),
        ("ax6", "positive integers"),
        ("2x-1", "positive integers"),
        ("2.5x2", "positive integers"),
    ],
)
def test_parse_rejects_with_reason(text, fragment):
    with pytest.raises(ValueError, match=fragment):
        SharingPattern.parse(text)


@given(st.integers(1, 12), st.integers(1, 12))
def test_cycle_order_for_every_pattern(n, m):
    p = SharingPattern(n, m)
    layers = [p.physical_layer(v) for v in range(p.depth)]
    loops = [p.loop_of(v) for v in range(p.depth)]
    assert layers == list(range(n)) * m  # CYCLE: 1,2,...,N,1,2,...
    assert loops == [i for i in range(m) for _ in range(n)]
    with pytest.raises(IndexError):
        p.physical_layer(p.depth)


def test_model_config_round_trip_and_unknown_keys():
    cfg = preset("tiny", pattern="3x4")
    assert from_dict(ModelConfig, to_dict(cfg)) == cfg
    with pytest.raises(ValueError, match="unknown ModelConfig key.*'d_modle'"):
        from_dict(ModelConfig, {**to_dict(cfg), "d_modle": 3})
    with pytest.raises(ValueError, match="unknown ModelConfig key"):
        cfg.replace(n_layers=4)


def test_presets():
    base = PRESETS["base"]
    assert (base.d_model, base.n_heads, base.d_ff, base.n_encoder_layers) == (768, 12, 2048, 12)
    assert preset("tiny", pattern="2x3").sharing == SharingPattern(2, 3)
    with pytest.raises(ValueError, match="unknown model preset 'huge'"):
        preset("huge")


@pytest.mark.parametrize("field, value", [("pattern", "2x0"), ("d_model", 0), ("dropout", 1.0), ("eos_id", 10**6)])
def test_model_config_validates(field, value):
    with pytest.raises(ValueError):
        preset("tiny", **{field: value})


def test_from_dict_coerces_by_field_type():
    cfg = from_dict(ModelConfig, {"layer_norm_eps": "1e-5", "d_model": "64", "dropout": 0, "pattern": "3x2"})
    assert (cfg.layer_norm_eps, cfg.d_model, cfg.dropout) == (1e-5, 64, 0.0) and isinstance(cfg.dropout, float)
    with pytest.raises(ConfigError, match="model.d_model: expected an integer, got True"):
        from_dict(ModelConfig, {"d_model": True}, "model")
    with pytest.raises(ConfigError, match="pattern: expected a string, got 26"):
        from_dict(ModelConfig, {"pattern": 26})
