import pytest
import torch
import torch.nn.functional as F

from speed.config import preset
from speed.losses import (
    SCHEMES,
    SettleConfig,
    flip_cost,
    flip_cost_weights,
    loss_weights,
    parametric,
    settle_loss,
    settled_loss,
    shift_right,
    teacher_forced_flips,
    weighted_loss,
)
from speed.models.t5 import SpeedT5


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


# ----- flip cost and the settle term ---------------------------------------------------------------------


def test_flip_cost_is_the_delay_flips_cause():
    # The 2x6 rates: a flip at loop k costs k - 1 steps; loop 1 cannot flip.
    rates = [0.0, 0.202, 0.094, 0.068, 0.061, 0.060]
    assert flip_cost(rates) == pytest.approx(0.202 + 0.094 * 2 + 0.068 * 3 + 0.061 * 4 + 0.060 * 5)
    assert flip_cost([0.0]) == 0.0
    assert torch.equal(flip_cost_weights(4), torch.tensor([0.0, 1.0, 2.0, 3.0], dtype=torch.float64))


def test_settle_config_is_strict_and_labels_round_trip():
    for bad, match in [
        ({"kind": "kl"}, "unknown settle kind"),
        ({"kind": "to_last"}, "needs a weight > 0"),
        ({"kind": "none", "weight": 1.0}, "takes no weight"),
        ({"kind": "consecutive", "weight": -1.0}, ">= 0"),
        ({"kind": "consecutive", "weight": 1.0, "warmup_steps": -2}, "warmup_steps"),
    ]:
        with pytest.raises(ValueError, match=match):
            SettleConfig(**bad)
    for settle in [
        SettleConfig(),
        SettleConfig("to_last", 1.0),
        SettleConfig("consecutive", 3.0, warmup_steps=100, flip_cost_weighted=True),
        SettleConfig("consecutive", 0.25),
    ]:
        assert SettleConfig.parse(settle.label) == settle
    assert SettleConfig("consecutive", 3.0, 100, True).label == "consecutive:3:fc:w100"
    with pytest.raises(ValueError, match="neither"):
        SettleConfig.parse("to_last:1:x")


def test_settle_weight_ramps_over_its_warmup():
    s = SettleConfig("to_last", 2.0, warmup_steps=4)
    assert [s.weight_at(k) for k in (1, 2, 4, 9)] == [0.5, 1.0, 2.0, 2.0]
    assert SettleConfig("to_last", 2.0).weight_at(1) == 2.0 and SettleConfig().weight_at(5) == 0.0


def _exits(seed=0, m=4, shape=(2, 5, 11)):
    g = torch.Generator().manual_seed(seed)
    logits = [torch.randn(*shape, generator=g, requires_grad=True) for _ in range(m)]
    labels = torch.randint(0, shape[-1], shape[:2], generator=g)
    labels[1, 2:] = -100
    return logits, labels


def _settle_by_loop(logits, labels, settle):
    """The term one loop and one token at a time (what the vectorised ``settle_loss`` must equal)."""
    m = len(logits)
    weights = [j if settle.flip_cost_weighted else 1.0 for j in range(1, m)]
    total = 0.0
    for j in range(m - 1):
        target = logits[j + 1 if settle.kind == "consecutive" else m - 1].detach()
        kls = [
            F.kl_div(
                F.log_softmax(logits[j][b, t], -1), F.log_softmax(target[b, t], -1), log_target=True, reduction="sum"
            )
            for b in range(labels.shape[0])
            for t in range(labels.shape[1])
            if labels[b, t] != -100
        ]
        total = total + weights[j] / sum(weights) * torch.stack(kls).mean()
    return total


@pytest.mark.parametrize("kind", ["to_last", "consecutive"])
@pytest.mark.parametrize("weighted", [False, True])
def test_settle_loss_equals_a_loop_and_sends_no_gradient_into_its_target(kind, weighted):
    logits, labels = _exits()
    settle = SettleConfig(kind, 1.0, flip_cost_weighted=weighted)
    term = settle_loss(logits, labels, settle)
    torch.testing.assert_close(term, _settle_by_loop(logits, labels, settle))
    term.backward()
    assert logits[-1].grad is None or torch.count_nonzero(logits[-1].grad) == 0  # the last loop is only a target
    assert all(torch.count_nonzero(lg.grad) > 0 for lg in logits[:-1])
    masked = logits[0].grad[1, 2:]
    assert torch.count_nonzero(masked) == 0  # ignored labels contribute nothing
    # Agreeing exits cost nothing.
    same = [logits[0].detach()] * 4
    assert settle_loss(same, labels, settle).item() == pytest.approx(0.0, abs=1e-6)


def test_consecutive_targets_are_the_next_loop():
    # Changing loop 3's logits changes loop 2's consecutive term only through its target, never its gradient path.
    logits, labels = _exits(m=3)
    settle = SettleConfig("consecutive", 1.0)
    settle_loss(logits, labels, settle).backward()
    assert logits[2].grad is None or torch.count_nonzero(logits[2].grad) == 0
    assert torch.count_nonzero(logits[1].grad) > 0  # loop 2 is a student of loop 3 (and a target of loop 1)


def test_lambda_zero_is_todays_loss_exactly():
    torch.manual_seed(0)
    model = SpeedT5(preset("tiny", pattern="2x3")).eval()
    src = torch.randint(3, 128, (2, 7))
    labels = torch.randint(3, 128, (2, 5))
    out = model(src, shift_right(labels), labels=labels, return_logits=True)
    for settle, step in [(SettleConfig(), 10), (SettleConfig("to_last", 3.0, warmup_steps=50), 0)]:
        total, term = settled_loss(out.loss, out.loop_logits, labels, settle, step)
        assert total is out.loss and term is None
    total, term = settled_loss(out.loss, out.loop_logits, labels, SettleConfig("to_last", 3.0, warmup_steps=4), 2)
    torch.testing.assert_close(
        total, out.loss + 1.5 * settle_loss(out.loop_logits, labels, SettleConfig("to_last", 1.0))
    )
    assert term > 0
    with pytest.raises(ValueError, match="return_logits"):
        settled_loss(out.loss, None, labels, SettleConfig("to_last", 1.0), 1)


def test_teacher_forced_flips_count_changes_per_loop():
    # One sequence, three target tokens (one ignored), three loops with hand-set argmaxes.
    preds = torch.tensor([[0, 1, 2, 3], [0, 2, 2, 3], [1, 2, 0, 3]])  # (M, T): the argmax of each loop
    logits = [F.one_hot(p, 5).float()[None] for p in preds]  # M x (1, T, 5)
    labels = torch.tensor([[4, 4, 4, -100]])
    prev, final, tokens = teacher_forced_flips(logits, labels)
    assert tokens == 3
    assert prev.tolist() == [0, 1, 2]  # loop 2 changed position 1; loop 3 changed positions 0 and 2
    assert final.tolist() == [3, 2, 0]  # against loop 3's predictions [1, 2, 0]


def test_a_traces_flip_costs_sum_to_the_flip_cost_of_its_rates():
    from speed.engine.trace import TraceBuilder, flip_costs, flip_rates

    builder = TraceBuilder()
    for position, preds in enumerate([[5, 6, 6], [7, 7, 8], [1, 2, 3], [4, 4, 4]]):
        builder.add_token(0, position, preds)
    trace = builder.table()
    costs = flip_costs(trace)
    assert costs == pytest.approx([0.0, 0.5 * 1, 0.5 * 2])  # loop 2 flips tokens 0 and 2, loop 3 tokens 1 and 2
    assert sum(costs) == pytest.approx(flip_cost(flip_rates(trace).column("flip_rate_prev").to_pylist()))


def test_weighted_loss_defaults_to_linear_and_checks_the_shape():
    losses = torch.tensor([3.0, 2.0, 1.0])
    assert torch.isclose(weighted_loss(losses), (torch.tensor([1.0, 2.0, 3.0]) / 6 * losses).sum())
    assert weighted_loss(losses, loss_weights("last", 3)) == 1.0
    with pytest.raises(ValueError, match=r"shape \(2,\), expected \(3,\) for 3 loops"):
        weighted_loss(losses, torch.ones(2))
