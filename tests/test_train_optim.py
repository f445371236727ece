"""Learning-rate schedule values, both optimizers, scheduler state round trip, the state following its parameters."""

import math

import pytest
import torch

from speed.config import preset
from speed.models.t5 import SpeedT5
from speed.train.optim import OptimConfig, build_optimizer, build_scheduler, follow_parameters, lr_factor


def test_warmup_then_cosine_to_the_floor():
    c = OptimConfig(warmup_steps=4, schedule="cosine", min_lr_ratio=0.1)
    assert [lr_factor(s, c, 14) for s in range(4)] == [0.25, 0.5, 0.75, 1.0]
    assert lr_factor(4, c, 14) == pytest.approx(1.0)
    assert lr_factor(9, c, 14) == pytest.approx(0.55)  # half way: floor + (1 - floor) / 2
    assert lr_factor(14, c, 14) == pytest.approx(0.1)
    assert lr_factor(100, c, 14) == pytest.approx(0.1)


@pytest.mark.parametrize(
    "schedule, step, expected",
    [("linear", 9, 0.55), ("constant", 13, 1.0), ("rsqrt", 15, math.sqrt(4 / 16))],
)
def test_other_schedules(schedule, step, expected):
    c = OptimConfig(warmup_steps=4, schedule=schedule, min_lr_ratio=0.1)
    assert lr_factor(step, c, 14) == pytest.approx(expected)


@pytest.mark.parametrize("name, kind", [("adamw", torch.optim.AdamW), ("adafactor", torch.optim.Adafactor)])
def test_optimizers_train_and_skip_decay_on_norms(name, kind):
    torch.manual_seed(0)
    model = SpeedT5(preset("tiny", pattern="1x2"))
    opt = build_optimizer(model, OptimConfig(name=name, lr=1e-2, weight_decay=0.1))
    assert isinstance(opt, kind)
    decayed, plain = opt.param_groups
    assert all(p.dim() >= 2 for p in decayed["params"]) and all(p.dim() == 1 for p in plain["params"])
    assert plain["weight_decay"] == 0.0 and decayed["weight_decay"] == 0.1
    x = torch.randint(3, 100, (4, 6))
    losses = []
    for _ in range(5):
        out = model(x, x, labels=x)
        out.loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(out.loss.item())
    assert losses[-1] < losses[0]


def test_scheduler_state_round_trip_continues_the_schedule():
    c = OptimConfig(lr=0.1, warmup_steps=3)
    model = torch.nn.Linear(2, 2)
    opt = build_optimizer(model, c)
    sched = build_scheduler(opt, c, max_steps=10)
    for _ in range(5):
        opt.step()
        sched.step()
    state = sched.state_dict()
    opt2 = build_optimizer(model, c)
    sched2 = build_scheduler(opt2, c, max_steps=10)
    sched2.load_state_dict(state)
    opt2.load_state_dict(opt.state_dict())
    sched.step()
    sched2.step()
    assert opt2.param_groups[0]["lr"] == pytest.approx(opt.param_groups[0]["lr"])
    assert opt.param_groups[0]["lr"] == pytest.approx(0.1 * lr_factor(6, c, 10))


def test_restored_state_follows_the_parameters():
    """A state restored beside float32 parameters follows them to float64 (on a GPU: to the device), unchanged."""
    model = torch.nn.Linear(3, 2)
    opt = build_optimizer(model, OptimConfig())
    model(torch.randn(4, 3)).sum().backward()
    opt.step()
    saved = {k: v.clone() for k, v in opt.state[model.weight].items()}
    restored = build_optimizer(model, OptimConfig())
    restored.load_state_dict(opt.state_dict())
    model.double()
    follow_parameters(restored)
    state = restored.state[model.weight]
    assert state["exp_avg"].dtype == state["exp_avg_sq"].dtype == torch.float64
    assert all(torch.equal(state[k].float(), saved[k]) for k in ("exp_avg", "exp_avg_sq", "step"))
    model(torch.randn(4, 3, dtype=torch.float64)).sum().backward()
    restored.step()  # float64 parameters with float32 moments would raise here
