import torch

from speed.config import preset
from speed.losses import shift_right
from speed.models.t5 import SpeedT5, count_parameters


def test_shapes_and_parameter_sharing():
    cfg = preset("tiny", pattern="2x6")
    shared, shallow, deep = SpeedT5(cfg), SpeedT5(cfg.replace(pattern="2x1")), SpeedT5(cfg.replace(pattern="12x1"))
    assert count_parameters(shared) == count_parameters(shallow) < count_parameters(deep)
    src, labels = torch.randint(3, 128, (3, 5)), torch.randint(3, 128, (3, 4))
    out = shared.eval()(src, shift_right(labels), labels=labels, return_logits=True)
    assert out.loop_losses.shape == (6,) and len(out.loop_logits) == 6
    assert out.loop_logits[0].shape == (3, 4, 128)


def test_first_loop_of_a_shared_decoder_is_the_shallow_decoder():
    torch.manual_seed(0)
    cfg = preset("tiny", pattern="2x6")
    deep = SpeedT5(cfg).eval()
    shallow = SpeedT5(cfg.replace(pattern="2x1")).eval()
    shallow.load_state_dict(deep.state_dict())  # identical parameters: only the loop count differs
    src, labels = torch.randint(3, 128, (2, 6)), torch.randint(3, 128, (2, 5))
    with torch.no_grad():
        a = deep(src, shift_right(labels), return_logits=True).loop_logits
        b = shallow(src, shift_right(labels), return_logits=True).loop_logits
    assert torch.equal(a[0], b[0])
    assert not torch.allclose(a[1], b[0])


def test_padding_does_not_change_outputs():
    torch.manual_seed(1)
    model = SpeedT5(preset("tiny", pattern="2x2")).eval()
    src = torch.randint(3, 128, (1, 4))
    padded = torch.cat([src, torch.zeros(1, 3, dtype=torch.long)], 1)
    mask = torch.tensor([[1, 1, 1, 1, 0, 0, 0]])
    dec = torch.randint(3, 128, (1, 3))
    with torch.no_grad():
        a = model(src, dec, return_logits=True).loop_logits[-1]
        b = model(padded, dec, mask, return_logits=True).loop_logits[-1]
    assert torch.allclose(a, b, atol=1e-5)


def test_training_step_reduces_the_weighted_loss():
    torch.manual_seed(2)
    model = SpeedT5(preset("tiny", pattern="2x3"))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    src, labels = torch.randint(3, 128, (4, 6)), torch.randint(3, 128, (4, 5))
    losses = []
    for _ in range(20):
        out = model(src, shift_right(labels), labels=labels)
        opt.zero_grad()
        out.loss.backward()
        opt.step()
        losses.append(out.loss.item())
    assert losses[-1] < 0.5 * losses[0]
