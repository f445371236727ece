import pytest
import torch
import torch.nn.functional as F

from speed.config import preset
from speed.losses import SCHEMES, loss_weights, parametric
from speed.model import SpeedT5, shift_right


@pytest.mark.parametrize("scheme", sorted(SCHEMES))
@pytest.mark.parametrize("m", [1, 2, 5, 12])
def test_weights_are_normalised(scheme, m):
    w = loss_weights(scheme, m)
    assert w.shape == (m,)
    assert (w >= 0).all()
    assert w.sum().item() == pytest.approx(1.0, abs=1e-6)


def test_linear_is_the_papers_default():
    assert torch.allclose(loss_weights("linear", 4), torch.tensor([1, 2, 3, 4]) / 10.0)
    assert torch.equal(loss_weights("last", 3), torch.tensor([0.0, 0.0, 1.0]))
    assert torch.allclose(loss_weights("uniform", 4), torch.full((4,), 0.25))
    g = loss_weights("geometric", 4)
    assert torch.allclose(g[1:] / g[:-1], torch.full((3,), 2.0))


@pytest.mark.parametrize("scheme", ["power:0", "power:2.5", "power:-1", "ratio:0.5", "ratio:1", "ratio:20"])
@pytest.mark.parametrize("m", [1, 2, 5, 12])
def test_parametric_weights_are_normalised(scheme, m):
    w = loss_weights(scheme, m)
    assert w.shape == (m,) and (w >= 0).all()
    assert w.sum().item() == pytest.approx(1.0, abs=1e-6)


def test_parametric_families_contain_the_named_schemes():
    for m in (1, 3, 12):
        assert torch.allclose(loss_weights("power:0", m), loss_weights("uniform", m))
        assert torch.allclose(loss_weights("power:0.5", m), loss_weights("sqrt", m))
        assert torch.allclose(loss_weights("power:1", m), loss_weights("linear", m))
        assert torch.allclose(loss_weights("ratio:1", m), loss_weights("uniform", m))
        assert torch.allclose(loss_weights("ratio:2", m), loss_weights("geometric", m))
    w = loss_weights("ratio:0.5", 4)
    assert torch.allclose(w[1:] / w[:-1], torch.full((3,), 0.5))  # earlier loops weigh more
    p = loss_weights("power:2", 3)
    assert torch.allclose(p, torch.tensor([1.0, 4.0, 9.0]) / 14.0)


def test_parametric_names_and_bad_parameters():
    assert parametric("power", 1.5) == "power:1.5"
    assert parametric("ratio", 1 / 3) == "ratio:0.3333"
    for bad, match in [
        ("power:x", "not a number"),
        ("ratio:0", "must lie in"),
        ("power:100", "must lie in"),
        ("cubic:2", "parametric families are"),
    ]:
        with pytest.raises(ValueError, match=match):
            loss_weights(bad, 3)


def test_unknown_scheme():
    with pytest.raises(ValueError, match="unknown loss-weight scheme 'cubic'.*linear"):
        loss_weights("cubic", 3)


@pytest.mark.parametrize("scheme", ["linear", "geometric", "last"])
def test_weighted_loss_equals_loop_over_exits(scheme):
    torch.manual_seed(0)
    model = SpeedT5(preset("tiny", pattern="2x3")).eval()
    src = torch.randint(3, 128, (2, 7))
    labels = torch.randint(3, 128, (2, 5))
    labels[1, 3:] = -100
    out = model(src, shift_right(labels), labels=labels, weights=loss_weights(scheme, 3), return_logits=True)
    per_loop = [F.cross_entropy(lg.flatten(0, 1), labels.flatten(), ignore_index=-100) for lg in out.loop_logits]
    assert torch.allclose(out.loop_losses, torch.stack(per_loop))
    expected = sum(w * loss for w, loss in zip(loss_weights(scheme, 3), per_loop))
    assert torch.allclose(out.loss, expected)
    with pytest.raises(ValueError, match="expected \\(3,\\)"):
        model(src, shift_right(labels), labels=labels, weights=loss_weights(scheme, 4))
