"""The looped LM trained as its authors did: activation checkpointing (the same losses and gradients), Huginn's
sampled and truncated recurrence (against the published training forward, tests/looped_refs.py), Ouro's gate
objective (against a hand computation), and the jobs' flags for them."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from looped_refs import huginn_reference_training, write_huginn_checkpoint

from speed.config import LMConfig
from speed.losses import exit_log_distribution, gate_objective, loss_weights
from speed.models.convert_huginn import load_huginn
from speed.models.looped_lm import LoopedLM, TrainRun, next_token_labels
from speed.train.config import job_from_args
from speed.train.recurrence import UNBOUNDED_CAP, sample_recurrence

SHAPES = {
    "ouro": dict(pattern="3x3", norm="sandwich", loop_norm=True, exit_gate=True, n_kv_heads=1),
    "huginn": dict(
        pattern="1+2x3+1", norm="residual", injection=True, coda_norm=True, rope_layout="pairs", qk_bias=True
    ),
    "llama": dict(pattern="1+2x2+1"),
}


def _model(shape: str, seed: int = 0) -> LoopedLM:
    torch.manual_seed(seed)
    sizes = dict(vocab_size=61, d_model=32, n_heads=2, n_kv_heads=2, head_dim=16, d_ff=48)
    config = LMConfig(**(sizes | SHAPES[shape]))
    return LoopedLM(config)


def _batch(vocab: int = 61) -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.randint(2, vocab, (2, 9), generator=torch.Generator().manual_seed(5))
    labels = next_token_labels(ids)
    labels[1, :3] = -100  # a prompt's tokens: no loss there
    return ids, labels


def _step(model: LoopedLM, run: TrainRun) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    model.zero_grad(set_to_none=True)
    ids, labels = _batch()
    out = model(ids, labels, run=run)
    out.loss.backward()
    return out.loop_losses.detach(), {n: p.grad for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("shape", sorted(SHAPES))
@pytest.mark.parametrize("checkpoint", ["block", "loop"])
def test_activation_checkpointing_keeps_the_losses_and_the_gradients(shape, checkpoint):
    model = _model(shape)
    gate = 0.1 if model.exit_gate is not None else None
    plain_losses, plain = _step(model, TrainRun(gate_entropy=gate))
    losses, grads = _step(model, TrainRun(checkpoint=checkpoint, gate_entropy=gate))
    assert torch.equal(losses, plain_losses)
    assert grads.keys() == plain.keys() and len(grads) == len(list(model.parameters()))
    for name, grad in grads.items():
        torch.testing.assert_close(grad, plain[name], rtol=1e-6, atol=1e-7, msg=name)


def test_the_default_run_is_the_plain_forward():
    model = _model("huginn")
    ids, labels = _batch()
    assert torch.equal(model(ids, labels).loop_losses, model(ids, labels, run=TrainRun()).loop_losses)


@pytest.mark.parametrize("checkpoint", ["none", "block", "loop"])
@pytest.mark.parametrize(("no_grad", "grad"), [(0, 3), (3, 2), (5, 1)])
def test_truncated_backprop_equals_huginns_training_forward(tmp_path, no_grad, grad, checkpoint):
    write_huginn_checkpoint(tmp_path, prelude=1, core=2, coda=1, seed=3, bias=True)
    model = load_huginn(tmp_path, n_loops=4)  # the model's own M does not matter: the run says how many loops
    ids, labels = _batch(97)
    out = model(ids, labels, run=TrainRun(loops=no_grad + grad, backprop=grad, checkpoint=checkpoint))
    out.loss.backward()
    loss, grads = huginn_reference_training(tmp_path, ids, labels, no_grad, grad)
    assert out.loop_losses.shape == (1,)  # the last loop's alone
    torch.testing.assert_close(out.loss, loss, rtol=1e-5, atol=1e-6)
    ours = dict(model.named_parameters())
    pairs = {
        "transformer.adapter.weight": "adapter.weight",
        "transformer.adapter.bias": "adapter_bias",
        "transformer.wte.weight": "embed_tokens.weight",  # the tied head's gradient too
        "transformer.ln_f.weight": "norm.weight",
        "transformer.core_block.1.attn.Wqkv.weight": "core.1.attn.qkv.weight",
        "transformer.core_block.0.mlp.fc.weight": "core.0.mlp.wi.weight",
        "transformer.prelude.0.attn.proj.weight": "prelude.0.attn.o.weight",
        "transformer.coda.0.norm_4.weight": "coda.0.mlp_out_norm.weight",
    }
    for theirs, name in pairs.items():
        torch.testing.assert_close(ours[name].grad, grads[theirs], rtol=1e-4, atol=1e-5, msg=name)


def test_a_truncated_recurrence_trains_only_the_last_loops():
    model = _model("huginn")
    ids, labels = _batch()
    # Two loops without gradients then one with: the same loss as three loops, a gradient from the last alone.
    full = model(ids, labels, run=TrainRun(loops=3))
    full.loss.backward()
    through_all = model.adapter.weight.grad.clone()
    model.zero_grad(set_to_none=True)
    truncated = model(ids, labels, run=TrainRun(loops=3, backprop=1))
    assert torch.equal(truncated.loss, full.loss)
    truncated.loss.backward()
    assert not torch.allclose(model.adapter.weight.grad, through_all, rtol=1e-3, atol=1e-6)
    assert model.prelude[0].attn.qkv.weight.grad is not None  # e feeds the trained loop: the prelude still learns


def test_the_sampled_recurrence_is_huginns_log_normal_poisson_and_seeded():
    draws = [sample_recurrence(32, 8, seed=0, step=s) for s in range(1, 4001)]
    loops = torch.tensor([d.loops for d in draws], dtype=torch.float64)
    # p = Poisson(r) + 1, r ~ LogNormal(log 32 - 1/8, 1/2): E[p] = 33, Var[p] = E[r] + Var[r] = 32 + 32^2 (e^(1/4) - 1)
    assert abs(loops.mean().item() - 33) < 0.7
    assert abs(loops.var().item() / (32 + 32**2 * (math.exp(0.25) - 1)) - 1) < 0.1
    assert loops.min() >= 1 and all(d.backprop == min(8, d.loops) for d in draws)
    assert sample_recurrence(32, 8, seed=0, step=17) == draws[16]  # a resumed run draws what it drew
    assert [sample_recurrence(32, 8, seed=1, step=s) for s in range(1, 50)] != draws[:49]
    capped = [sample_recurrence(4, None, seed=0, step=s) for s in range(1, 2000)]
    assert max(d.loops for d in capped) == UNBOUNDED_CAP * 4 and all(d.backprop == d.loops for d in capped)


def test_the_gate_objective_by_hand():
    # lambda = (1/2, 1/4, 3/4): p = (1/2, 1/2 * 1/4, 1/2 * 3/4) = (0.5, 0.125, 0.375) (the last loop takes the rest)
    logits = torch.tensor([[0.0, math.log(1 / 3), math.log(3)]])
    torch.testing.assert_close(exit_log_distribution(logits).exp(), torch.tensor([[0.5, 0.125, 0.375]]))
    losses = torch.tensor([[2.0, 1.0, 3.0]])
    expected = 0.5 * 2 + 0.125 * 1 + 0.375 * 3  # 2.25
    entropy = -(0.5 * math.log(0.5) + 0.125 * math.log(0.125) + 0.375 * math.log(0.375))
    for beta in (0.0, 0.1, 1.0):
        torch.testing.assert_close(gate_objective(losses, logits, beta), torch.tensor(expected - beta * entropy))
    # Two tokens: the mean of theirs; a uniform gate (every p 1/M) pays no KL to the uniform prior beyond log M.
    uniform = torch.tensor([[math.log(1 / 2), math.log(1 / 1), 0.0]])  # lambda (1/3, 1/2, .): p = (1/3, 1/3, 1/3)
    two = gate_objective(torch.cat([losses, losses]), torch.cat([logits, uniform]), 0.1)
    by_hand = (expected - 0.1 * entropy + 2.0 - 0.1 * math.log(3)) / 2
    torch.testing.assert_close(two, torch.tensor(by_hand))


def test_the_lms_gate_objective_is_its_lambdas_and_loop_losses():
    model = _model("ouro")
    ids, labels = _batch()
    out = model(ids, labels, run=TrainRun(gate_entropy=0.05))
    with torch.no_grad():
        lambdas = model.exit_lambdas(ids)  # (B, T, M), the decoding rule's reading of the gate
        plain = model(ids, labels, return_logits=True)
    keep = labels != -100
    p = torch.zeros_like(lambdas)
    survive = torch.ones_like(lambdas[..., 0])
    for k in range(3):
        p[..., k] = lambdas[..., k] * survive if k < 2 else survive
        survive = survive * (1 - lambdas[..., k])
    token_losses = torch.stack(
        [F.cross_entropy(lg.transpose(1, 2), labels.clamp(min=0), reduction="none") for lg in plain.loop_logits], dim=-1
    )  # (B, T, M)
    by_hand = ((p * token_losses).sum(-1) + 0.05 * (p * p.log()).sum(-1))[keep].mean()
    torch.testing.assert_close(out.loss, by_hand, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(out.loop_losses, plain.loop_losses, rtol=1e-6, atol=1e-6)


def test_only_the_gate_objective_trains_the_gate():
    model = _model("ouro")
    ids, labels = _batch()
    model(ids, labels, weights=loss_weights("linear", 3)).loss.backward()
    assert model.exit_gate.weight.grad is None  # a weight scheme never reaches the gate: finetuning would stop it
    model(ids, labels, run=TrainRun(gate_entropy=0.05)).loss.backward()
    assert model.exit_gate.weight.grad.abs().sum() > 0 and model.exit_gate.bias.grad.abs() > 0


def test_the_flags_and_their_refusals(tmp_path):
    base = ["--model", "lm", "--preset", "tiny", "--no-eval", "--storage-path", str(tmp_path)]
    job = job_from_args("finetune", [*base, "--checkpoint-activations", "loop", "--recurrence-sampling",
                                     "--backprop-depth", "8"])  # fmt: skip
    assert job.run_shape == TrainRun(backprop=8, checkpoint="loop")
    assert job.train.recurrence_sampling
    gated = job_from_args("finetune", [*base, "--set", "model.exit_gate=true", "--loss-weights", "gate",
                                       "--gate-entropy", "0.1"])  # fmt: skip
    assert gated.run_shape == TrainRun(gate_entropy=0.1)
    refusals = {
        ("--loss-weights", "gate"): "has none",
        ("--checkpoint-activations", "layer"): "unknown checkpoint_activations",
        ("--backprop-depth", "0"): "backprop_depth must be positive",
        ("--loss-weights", "gate", "--set", "model.exit_gate=true", "--recurrence-sampling"): "every loop",
    }
    for flags, message in refusals.items():
        with pytest.raises(ValueError, match=message):
            job_from_args("finetune", [*base, *flags])
    with pytest.raises(ValueError, match="looped LM"):
        job_from_args("finetune", ["--preset", "tiny", "--no-eval", "--checkpoint-activations", "block"])
