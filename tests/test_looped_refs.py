"""tests/looped_refs.py: the Ouro and Huginn references against themselves and a second, per-position formulation.

transformers 5.24 has neither model (no ``ouro``, ``huginn`` or ``raven`` under ``transformers.models``: both
ship as remote code), so there is no library implementation to compare with here.
"""

from __future__ import annotations

import importlib.util
import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from looped_refs import (
    huginn_freqs_cis,
    huginn_reference_logits,
    load_checkpoint,
    ouro_exit_pdf,
    ouro_q_exit,
    ouro_reference,
    ouro_reference_logits,
    write_huginn_checkpoint,
    write_ouro_checkpoint,
)

IDS = torch.tensor([[3, 17, 5, 60, 2, 41, 9], [88, 1, 1, 30, 72, 6, 50]])


@pytest.fixture(scope="module")
def ouro(tmp_path_factory):
    directory = tmp_path_factory.mktemp("ouro")
    write_ouro_checkpoint(directory, total_ut_steps=4, seed=1, scale=2.0)
    return directory


@pytest.fixture(scope="module")
def huginn(tmp_path_factory):
    directory = tmp_path_factory.mktemp("huginn")
    write_huginn_checkpoint(directory, mean_recurrence=4, seed=2, scale=2.0)
    return directory


def test_no_library_implementation_to_compare_with():
    # Looked up without importing transformers (a second): were either model there, it should be compared with.
    (root,) = importlib.util.find_spec("transformers").submodule_search_locations
    names = {path.name for path in (Path(root) / "models").iterdir()}
    assert not names & {"ouro", "huginn", "raven", "huginn_raven"}


def test_ouro_every_loop_exits_and_later_loops_extend_earlier_ones(ouro):
    out = ouro_reference(ouro, IDS)
    assert len(out.logits) == len(out.lambdas) == 4
    assert all(t.shape == (2, 7, 97) for t in out.logits) and all(lam.shape == (2, 7) for lam in out.lambdas)
    assert all(((lam > 0) & (lam < 1)).all() for lam in out.lambdas)
    for a, b in zip(out.logits, out.logits[1:]):
        assert (a - b).abs().max() > 0.1  # every loop changes the prediction
    shorter, longer = ouro_reference_logits(ouro, IDS, n_loops=2), ouro_reference(ouro, IDS, n_loops=6)
    for a, b in zip(shorter + out.logits, out.logits[:2] + longer.logits[:4]):
        assert torch.equal(a, b)


@pytest.mark.parametrize("model", ["ouro", "huginn"])
def test_causal(model, request):
    directory = request.getfixturevalue(model)
    changed = IDS.clone()
    changed[:, 4:] = torch.tensor([7, 8, 11])
    run = ouro_reference_logits if model == "ouro" else lambda d, ids: huginn_reference_logits(d, ids, 3)
    for a, b in zip(run(directory, IDS), run(directory, changed)):
        torch.testing.assert_close(a[:, :4], b[:, :4], rtol=0, atol=1e-6)
        assert (a[:, 4:] - b[:, 4:]).abs().max() > 1e-3


def test_ouro_exit_distribution_and_q_exit(ouro):
    lambdas = ouro_reference(ouro, IDS).lambdas
    pdf = ouro_exit_pdf(lambdas)
    assert pdf.shape == (2, 7, 4)
    torch.testing.assert_close(pdf.sum(-1), torch.ones(2, 7))
    assert torch.equal(ouro_q_exit(lambdas, 0.0), torch.zeros(2, 7, dtype=torch.long))
    assert torch.equal(ouro_q_exit(lambdas, 2.0), torch.full((2, 7), 3))
    for threshold in (0.3, 0.6, 0.9):
        exits = ouro_q_exit(lambdas, threshold)
        for b in range(2):
            for t in range(7):
                remaining, cumulative, first = 1.0, 0.0, 3
                for i, lam in enumerate(float(lam[b, t]) for lam in lambdas):
                    cumulative += lam * remaining if i < 3 else remaining
                    remaining *= 1 - lam
                    if cumulative >= threshold:
                        first = i
                        break
                assert exits[b, t] == first, (threshold, b, t)


def test_ouro_one_loop_matches_a_per_position_computation(tmp_path):
    write_ouro_checkpoint(tmp_path, layers=1, heads=4, kv_heads=2, total_ut_steps=1, seed=3, scale=2.0)
    (logits,) = ouro_reference_logits(tmp_path, IDS[:1])
    config, w = load_checkpoint(tmp_path, torch.float64)
    eps, hd = config["rms_norm_eps"], config["head_dim"]

    def rms(v, name):
        return w[name] * v / torch.sqrt((v * v).mean() + eps)

    def rotate(v, pos):  # halves layout: pair (i, i + hd/2) as one complex number, turned by pos * inv_freq[i]
        z = torch.complex(v[: hd // 2], v[hd // 2 :])
        angle = pos / config["rope_theta"] ** (torch.arange(hd // 2, dtype=torch.float64) * 2 / hd)
        z = z * torch.polar(torch.ones_like(angle), angle)
        return torch.cat([z.real, z.imag])

    h = [w["model.embed_tokens.weight"][i] for i in IDS[0]]
    p = "model.layers.0."
    x = [rms(v, p + "input_layernorm.weight") for v in h]
    q = [(w[p + "self_attn.q_proj.weight"] @ v).view(4, hd) for v in x]
    k = [(w[p + "self_attn.k_proj.weight"] @ v).view(2, hd) for v in x]
    v_ = [(w[p + "self_attn.v_proj.weight"] @ v).view(2, hd) for v in x]
    rows = []
    for t in range(len(h)):
        heads = []
        for head in range(4):
            kv = head // 2  # query heads 0, 1 share key/value head 0
            qt = rotate(q[t][head], t)
            scores = torch.stack([qt @ rotate(k[s][kv], s) / math.sqrt(hd) for s in range(t + 1)])
            weights = torch.softmax(scores, 0)
            heads.append(sum(weights[s] * v_[s][kv] for s in range(t + 1)))
        a = w[p + "self_attn.o_proj.weight"] @ torch.cat(heads)
        ht = h[t] + rms(a, p + "input_layernorm_2.weight")
        m_in = rms(ht, p + "post_attention_layernorm.weight")
        gate, up = w[p + "mlp.gate_proj.weight"] @ m_in, w[p + "mlp.up_proj.weight"] @ m_in
        m = w[p + "mlp.down_proj.weight"] @ (F.silu(gate) * up)
        ht = rms(ht + rms(m, p + "post_attention_layernorm_2.weight"), "model.norm.weight")
        rows.append(w["lm_head.weight"] @ ht)
    torch.testing.assert_close(logits[0], torch.stack(rows).float(), rtol=1e-4, atol=1e-4)


def test_huginn_steps_extend_and_vary(huginn):
    four = huginn_reference_logits(huginn, IDS, 4)
    assert len(four) == 4 and all(t.shape == (2, 7, 97) for t in four)
    for a, b in zip(huginn_reference_logits(huginn, IDS, 2), four[:2]):
        assert torch.equal(a, b)
    for a, b in zip(four, four[1:]):
        assert (a - b).abs().max() > 0.1
    assert huginn_reference_logits(huginn, IDS, 0) == []
    # A zero state is the default; another state changes the first exit.
    config, _ = load_checkpoint(huginn)
    state = torch.randn(2, 7, config["n_embd"], generator=torch.Generator().manual_seed(0))
    assert (huginn_reference_logits(huginn, IDS, 1, state=state)[0] - four[0]).abs().max() > 1e-3


def test_huginn_one_step_matches_a_per_position_computation(tmp_path):
    write_huginn_checkpoint(tmp_path, prelude=1, core=1, coda=1, heads=2, seed=4, scale=2.0, bias=True)
    (logits,) = huginn_reference_logits(tmp_path, IDS[:1], 1)
    config, w = load_checkpoint(tmp_path, torch.float64)
    d, eps, heads = config["n_embd"], config["norm_eps"], config["n_heads"]
    hd = d // heads

    def rms(v, name):
        return w[name] * v / torch.sqrt((v * v).mean() + eps)

    def rotate(v, pos):  # adjacent pairs (2i, 2i + 1) as one complex number, turned by pos * inv_freq[i]
        z = torch.view_as_complex(v.reshape(hd // 2, 2).contiguous())
        angle = pos / config["rope_base"] ** (torch.arange(hd // 2, dtype=torch.float64) * 2 / hd)
        return torch.view_as_real(z * torch.polar(torch.ones_like(angle), angle)).flatten()

    def block(prefix, xs):
        n1 = [rms(x, prefix + "norm_1.weight") for x in xs]
        qkv = [(w[prefix + "attn.Wqkv.weight"] @ x).view(3, heads, hd) for x in n1]
        bias = w[prefix + "attn.qk_bias"]
        out = []
        for t in range(len(xs)):
            per_head = []
            for h in range(heads):
                qt = rotate(qkv[t][0, h] + bias[0, 0, h], t)
                scores = torch.stack(
                    [qt @ rotate(qkv[s][1, h] + bias[1, 0, h], s) / math.sqrt(hd) for s in range(t + 1)]
                )
                weights = torch.softmax(scores, 0)
                per_head.append(sum(weights[s] * qkv[s][2, h] for s in range(t + 1)))
            x = rms(xs[t] + w[prefix + "attn.proj.weight"] @ torch.cat(per_head), prefix + "norm_2.weight")
            a, b = (w[prefix + "mlp.fc.weight"] @ rms(x, prefix + "norm_3.weight")).chunk(2)
            out.append(rms(x + w[prefix + "mlp.proj.weight"] @ (F.silu(a) * b), prefix + "norm_4.weight"))
        return out

    e = block("transformer.prelude.0.", [w["transformer.wte.weight"][i] * math.sqrt(d) for i in IDS[0]])
    adapter = [w["transformer.adapter.weight"] @ torch.cat([torch.zeros(d, dtype=torch.float64), v]) for v in e]
    x = block("transformer.core_block.0.", [v + w["transformer.adapter.bias"] for v in adapter])
    y = block("transformer.coda.0.", [rms(v, "transformer.ln_f.weight") for v in x])
    rows = [w["transformer.wte.weight"] @ rms(v, "transformer.ln_f.weight") for v in y]  # the tied head
    torch.testing.assert_close(logits[0], torch.stack(rows).float(), rtol=1e-4, atol=1e-4)


def test_huginn_freqs_cis_is_the_polar_form():
    freqs = huginn_freqs_cis(8, 5, 50000.0)
    assert freqs.shape == (1, 5, 1, 4, 2) and freqs.dtype == torch.float32
    angles = torch.outer(torch.arange(5.0), 1.0 / 50000.0 ** (torch.arange(0, 8, 2).float() / 8))
    polar = torch.polar(torch.ones_like(angles), angles)
    torch.testing.assert_close(freqs[0, :, 0], torch.stack([polar.real, polar.imag], dim=-1))


@pytest.mark.parametrize("model", ["ouro", "huginn"])
def test_layout_and_precision_do_not_change_the_reference(tmp_path, model):
    # The same bf16 weights, in one file or three shards (and Huginn's tied head written out or not): same logits.
    if model == "ouro":
        write_ouro_checkpoint(tmp_path / "a", seed=5, dtype=torch.bfloat16)
        write_ouro_checkpoint(tmp_path / "b", seed=5, dtype=torch.bfloat16, shards=3)
        run = ouro_reference_logits
    else:
        write_huginn_checkpoint(tmp_path / "a", seed=5, dtype=torch.bfloat16)
        write_huginn_checkpoint(tmp_path / "b", seed=5, dtype=torch.bfloat16, shards=3, lm_head=True)
        run = lambda d, ids: huginn_reference_logits(d, ids, 2)  # noqa: E731
    assert not (tmp_path / "a" / "model.safetensors.index.json").exists()
    assert (tmp_path / "b" / "model.safetensors.index.json").exists()
    for a, b in zip(run(tmp_path / "a", IDS), run(tmp_path / "b", IDS)):
        assert torch.equal(a, b)
