import pytest
from hypothesis import given
from hypothesis import strategies as st

from speed.config import (
    LM_PRESETS,
    PRESETS,
    ConfigError,
    LMConfig,
    ModelConfig,
    SharingPattern,
    from_dict,
    lm_preset,
    preset,
    to_dict,
)


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


@pytest.mark.parametrize(
    "text, prelude, n, m, coda",
    [("1+2x6+1", 1, 2, 6, 1), ("2+4x3", 2, 4, 3, 0), ("3x2+2", 0, 3, 2, 2), (" 1 + 2 X 6 + 3 ", 1, 2, 6, 3)],
)
def test_parse_prelude_and_coda(text, prelude, n, m, coda):
    p = SharingPattern.parse(text)
    assert (p.prelude, p.n_unique, p.n_loops, p.coda, p.depth) == (prelude, n, m, coda, n * m)
    assert SharingPattern.parse(str(p)) == p and str(p) == text.replace(" ", "").lower()


@pytest.mark.parametrize(
    "text, fragment",
    [
        ("0+2x6", r"P \(prelude layers\) must be at least 1 \(omit it for none\)"),
        ("2x6+0", r"C \(coda layers\) must be at least 1"),
        ("+2x6", r"needs P \(prelude layers\) before the core as a positive integer"),
        ("2x6+", r"needs C \(coda layers\) after the core"),
        ("a+2x6", "needs P"),
        ("1+2x6+1+1", "too many '\\+' parts"),
        ("1+2+2x6", "too many '\\+' parts"),
        ("2x6+2x3", "has 2 looped parts"),
        ("1+12", "has no 'x'"),
        ("1+x6+1", "missing N"),
        ("1+2x0", r"M \(loops\) must be at least 1"),
    ],
)
def test_parse_rejects_prelude_and_coda_with_reason(text, fragment):
    with pytest.raises(ValueError, match=fragment):
        SharingPattern.parse(text)


@pytest.mark.parametrize("text, shallow", [("2x6", "2x1"), ("1x1", "1x1"), ("1+2x6+1", "1+2x1+1"), ("3x2+2", "3x1+2")])
def test_one_loop_keeps_the_layers_and_loops_once(text, shallow):
    assert str(SharingPattern.parse(text).one_loop()) == shallow


def test_two_part_patterns_keep_their_form():
    assert SharingPattern(2, 6) == SharingPattern.parse("2x6") and str(SharingPattern(2, 6, 1, 0)) == "1+2x6"
    with pytest.raises(ValueError, match="P, C >= 0"):
        SharingPattern(2, 6, coda=-1)


def test_t5_refuses_a_prelude_or_coda():
    with pytest.raises(ValueError, match="T5's decoder has no prelude or coda"):
        preset("tiny", pattern="1+2x6")


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


def test_lm_config_round_trip_presets_and_errors():
    cfg = lm_preset("tiny", pattern="1+2x3+1", norm="sandwich", injection=True, n_heads=4, n_kv_heads=2)
    assert from_dict(LMConfig, to_dict(cfg)) == cfg and cfg.sharing == SharingPattern(2, 3, 1, 1)
    assert [LM_PRESETS[n].d_model for n in ("tiny", "mini", "small", "base")] == [32, 256, 512, 768]
    with pytest.raises(ValueError, match="unknown LM preset 'huge'"):
        lm_preset("huge")
    with pytest.raises(ConfigError, match=r"norm: expected one of \['pre', 'sandwich', 'residual'\], got 'post'"):
        from_dict(LMConfig, {"norm": "post"})
    with pytest.raises(ValueError, match="unknown LMConfig key"):
        cfg.replace(n_layers=3)


@pytest.mark.parametrize(
    "field, value, fragment",
    [
        ("n_kv_heads", 5, "not a multiple of n_kv_heads=5"),
        ("head_dim", 15, "must be even"),
        ("norm", "post", "norm must be one of"),
        ("rope_theta", 0.0, "rope_theta must be positive"),
        ("eos_id", 128, "outside the vocabulary"),
        ("pattern", "0+2x2", "P \\(prelude layers\\) must be at least 1"),
        ("d_ff", 0, "d_ff must be positive"),
    ],
)
def test_lm_config_rejects(field, value, fragment):
    with pytest.raises(ValueError, match=fragment):
        LMConfig(**{**to_dict(LM_PRESETS["tiny"]), field: value})
