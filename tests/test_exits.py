"""Exit adapters (``speed.models.exits``): the module, its place in both families' exits, and its checkpoint files.

The decoding contract with adapters (the output bitwise unchanged, the drafts changed) is proven where the
engine's exactness is: ``test_decoding_exact``, ``test_lm_decoding``, ``test_exact_trained``.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from engine_helpers import random_exits

from speed.config import lm_preset, preset
from speed.losses import shift_right
from speed.models.checkpoint import MODEL_FILE, load_model, save_model
from speed.models.exits import (
    EXITS_CONFIG_FILE,
    EXITS_FILE,
    ExitAdapters,
    ExitConfig,
    attach,
    count_exit_parameters,
    exits_for,
)
from speed.models.looped_lm import LoopedLM
from speed.models.t5 import SpeedT5


def t5(pattern: str = "2x3") -> SpeedT5:
    torch.manual_seed(0)
    return SpeedT5(preset("tiny", pattern=pattern)).eval()


def lm(pattern: str = "1+2x3+1") -> LoopedLM:
    torch.manual_seed(0)
    return LoopedLM(lm_preset("tiny", pattern=pattern)).eval()


def t5_logits(model: SpeedT5) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    ids, labels = torch.randint(3, 100, (2, 6), generator=g), torch.randint(3, 100, (2, 5), generator=g)
    with torch.no_grad():
        return model(ids, shift_right(labels), return_logits=True).loop_logits


def lm_logits(model: LoopedLM) -> list[torch.Tensor]:
    ids = torch.randint(3, 100, (2, 7), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        return model(ids, return_logits=True).loop_logits


def test_config_adapts_every_early_loop_by_default_and_never_the_last():
    assert ExitConfig(n_loops=4, d_model=8).loops == (1, 2, 3)
    assert ExitConfig(n_loops=4, d_model=8, loops=(3, 1)).loops == (1, 3)
    assert ExitConfig(n_loops=1, d_model=8).loops == ()
    for loops in [(4,), (0,), (1, 1)]:
        with pytest.raises(ValueError, match="never adapted"):
            ExitConfig(n_loops=4, d_model=8, loops=loops)


def test_parameters_per_loop():
    """Rank r on width d: 2 d r per adapted loop (the issue's 5 loops at d 128, rank 64: 81,920)."""
    model = SpeedT5(preset("tiny", pattern="2x6", d_model=128, n_heads=2, d_kv=64))
    attach(model, exits_for(model, rank=64))
    assert count_exit_parameters(model) == 5 * 2 * 128 * 64
    assert count_exit_parameters(t5()) == 0


@pytest.mark.parametrize("make, logits", [(t5, t5_logits), (lm, lm_logits)])
def test_fresh_adapters_are_the_identity(make, logits):
    """Zero-initialised ``up``: a fresh adapter leaves every loop's logits as they were, bit for bit."""
    model = make()
    before = logits(model)
    attach(model, exits_for(model))
    assert all(torch.equal(a, b) for a, b in zip(before, logits(model)))


@pytest.mark.parametrize("make, logits", [(t5, t5_logits), (lm, lm_logits)])
def test_trained_adapters_change_early_exits_only(make, logits):
    model = make()
    before = logits(model)
    after = logits(random_exits(model, seed=3))
    assert torch.equal(before[-1], after[-1])  # the last loop's exit is never adapted
    assert all(not torch.equal(a, b) for a, b in zip(before[:-1], after[:-1]))


def test_only_the_listed_loops_are_adapted():
    model = t5("2x3")
    before = t5_logits(model)
    adapters = exits_for(model, rank=4, loops=[2])
    with torch.no_grad():
        adapters.heads["2"].up.weight.normal_()
    after = t5_logits(attach(model, adapters))
    assert (
        torch.equal(before[0], after[0]) and not torch.equal(before[1], after[1]) and torch.equal(before[2], after[2])
    )


def test_rows_are_row_invariant_and_match_the_plain_forward():
    """``adapt_rows``: a row's result is the same alone or among rows at other loops; rows at unadapted loops come
    back bit for bit; the decode kernels agree with the training forward to rounding."""
    adapters = ExitAdapters(ExitConfig(n_loops=4, d_model=32, rank=8))
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in adapters.parameters():
            p.copy_(torch.randn(p.shape, generator=g))
    h = torch.randn(7, 32, generator=g)
    loops = np.array([0, 3, 1, 2, 0, 3, 1])
    together = adapters.adapt_rows(h, loops)
    for r in range(7):
        alone = adapters.adapt_rows(h[r : r + 1], loops[r : r + 1])
        assert torch.equal(alone[0], together[r]), r
        assert torch.allclose(together[r], adapters.adapt(h[r], int(loops[r])), atol=1e-5)
    assert torch.equal(together[loops == 3], h[loops == 3])
    assert not torch.equal(together[loops == 0], h[loops == 0])


def test_attach_refuses_adapters_of_another_model():
    with pytest.raises(ValueError, match="do not fit"):
        attach(t5("2x3"), exits_for(t5("2x6")))


@pytest.mark.parametrize("make", [t5, lm])
def test_checkpoint_keeps_adapters_beside_the_model(tmp_path, make):
    """model.pt holds the backbone alone (an old reader loads it); exits.pt and exits.json hold the adapters and
    say which loops are adapted; ``load_model`` attaches them unless told not to."""
    model = random_exits(make(), seed=1)
    save_model(tmp_path / "ckpt", model)
    weights = torch.load(tmp_path / "ckpt" / MODEL_FILE, weights_only=True)
    assert not any(k.startswith("exit_adapters") for k in weights)
    plain = make()
    plain.load_state_dict(weights)  # strict: the backbone's keys, no more
    stored = json.loads((tmp_path / "ckpt" / EXITS_CONFIG_FILE).read_text())["exits"]
    assert stored["loops"] == list(range(1, model.n_loops)) and stored["rank"] == 8
    loaded = load_model(tmp_path / "ckpt").model
    assert loaded.exit_adapters is not None and loaded.exit_adapters.config == model.exit_adapters.config
    for (ka, a), (kb, b) in zip(loaded.exit_adapters.state_dict().items(), model.exit_adapters.state_dict().items()):
        assert ka == kb and torch.equal(a, b)
    assert load_model(tmp_path / "ckpt", exits=False).model.exit_adapters is None
    (tmp_path / "ckpt" / EXITS_CONFIG_FILE).unlink()  # exits.pt alone is no adapter: exits.json marks them complete
    assert (tmp_path / "ckpt" / EXITS_FILE).is_file() and load_model(tmp_path / "ckpt").model.exit_adapters is None


def test_serve_loads_the_adapters_unless_told_not_to(tmp_path, tiny_tokenizer):
    from speed.serve.app import build_app
    from speed.serve.settings import load_served_model
    from speed.tokenizer import Tokenizer

    torch.manual_seed(0)
    model = SpeedT5(preset("tiny", pattern="2x3", vocab_size=Tokenizer.load(tiny_tokenizer).vocab_size)).eval()
    save_model(tmp_path / "ckpt", random_exits(model, seed=2), tiny_tokenizer)
    served = load_served_model(str(tmp_path / "ckpt"), "cpu")
    assert served.model.exit_adapters is not None and served.model.exit_adapters.config.loops == (1, 2)
    assert load_served_model(str(tmp_path / "ckpt"), "cpu", exits=False).model.exit_adapters is None
    with pytest.raises(ValueError, match="exit_adapters"):  # `serve run ... exit_adapters=maybe`
        build_app({"checkpoint": str(tmp_path / "ckpt"), "exit_adapters": "maybe"})
