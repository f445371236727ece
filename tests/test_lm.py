"""The looped LM: an unrolled reference of its own, cached decoding against the forward, the loss, the cache.

The reference (``_unrolled``) shares no code with ``speed.models.looped_lm``: plain torch
ops on the model's weights, laid out as an unrolled stack of N * M layers
whose core weights are tied (plus the prelude before and the coda at each
exit). The models are random but non-degenerate (``_randomize``): weights at
unit-variance scales and norm gains off 1, so every term shows in the logits.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from speed.config import LM_PRESETS, PRESETS, lm_preset
from speed.engine.cache import CacheError, Rows
from speed.losses import PARAMETRIC, SCHEMES, loss_weights
from speed.models.lm_blocks import Block
from speed.models.looped_lm import LoopedLM, next_token_labels
from speed.models.t5 import EncoderLayer, count_parameters

VOCAB = 128  # the tiny preset's
# Each option on in some variant and off in another; GQA: 4 query heads on 2 key/value heads.
GQA = {"n_heads": 4, "n_kv_heads": 2, "head_dim": 8}
VARIANTS = {
    "plain": {"pattern": "2x3"},
    "gqa+prelude+coda+injection+loop_norm": {"pattern": "1+2x3+1", "injection": True, "loop_norm": True, **GQA},
    "sandwich+coda+loop_norm": {"pattern": "2x3+2", "norm": "sandwich", "loop_norm": True, **GQA},
    "sandwich+prelude+injection": {"pattern": "2+1x3", "norm": "sandwich", "injection": True},
    "all+tied": {"pattern": "1+2x2+1", "norm": "sandwich", "injection": True, "tie_embeddings": True, **GQA},
}


def _randomize(model: LoopedLM, seed: int) -> LoopedLM:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.ndim == 1:  # norm gains
                p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=g))
            elif name == "embed_tokens.weight":
                p.copy_(torch.randn(p.shape, generator=g))
            else:
                p.copy_(torch.randn(p.shape, generator=g) * p.shape[1] ** -0.5)
    return model.eval()


def _model(seed: int = 0, **overrides) -> LoopedLM:
    return _randomize(LoopedLM(lm_preset("tiny", **overrides)), seed)


# ----- the independent reference ---------------------------------------------------------------------------


def _unrolled(model: LoopedLM, ids: torch.Tensor) -> list[torch.Tensor]:
    """Each loop's logits M x (B, T, V) of the unrolled stack, recomputed from the weights without a cache."""
    c, s = model.config, model.config.sharing
    W = {k: v.detach() for k, v in model.state_dict().items()}
    B, T = ids.shape
    H, K, D, half = c.n_heads, c.n_kv_heads, c.head_dim, c.head_dim // 2
    angle = torch.arange(T, dtype=torch.float32)[:, None] * c.rope_theta ** (-2 * torch.arange(half) / D)  # (T, D/2)
    cos, sin = angle.cos()[:, None], angle.sin()[:, None]  # (T, 1, D/2)
    kv_head = torch.arange(H) // (H // K)  # the key/value head each query head reads
    causal = torch.ones(T, T, dtype=torch.bool).triu(1)

    def rms(x, name):
        return x / (x.pow(2).mean(-1, keepdim=True) + c.norm_eps).sqrt() * W[name]

    def rope(x):  # (B, T, heads, D): dimension i turns with dimension i + D/2
        a, b = x[..., :half], x[..., half:]
        return torch.cat([a * cos - b * sin, b * cos + a * sin], dim=-1)

    def layer(x, name):
        qkv = rms(x, f"{name}.attn_norm.weight") @ W[f"{name}.attn.qkv.weight"].T
        q = rope(qkv[..., : H * D].reshape(B, T, H, D))
        k = rope(qkv[..., H * D : (H + K) * D].reshape(B, T, K, D))[:, :, kv_head]
        v = qkv[..., (H + K) * D :].reshape(B, T, K, D)[:, :, kv_head]
        scores = torch.einsum("bqhd,bkhd->bhqk", q, k) / D**0.5
        mixed = torch.einsum("bhqk,bkhd->bqhd", scores.masked_fill(causal, -torch.inf).softmax(-1), v)
        attn = mixed.reshape(B, T, H * D) @ W[f"{name}.attn.o.weight"].T
        if c.norm == "sandwich":
            attn = rms(attn, f"{name}.attn_out_norm.weight")
        x = x + attn
        gate, up = (rms(x, f"{name}.mlp_norm.weight") @ W[f"{name}.mlp.wi.weight"].T).split(c.d_ff, dim=-1)
        mlp = (gate * torch.sigmoid(gate) * up) @ W[f"{name}.mlp.wo.weight"].T
        if c.norm == "sandwich":
            mlp = rms(mlp, f"{name}.mlp_out_norm.weight")
        return x + mlp

    head = W["embed_tokens.weight"] if c.tie_embeddings else W["lm_head.weight"]
    e = W["embed_tokens.weight"][ids]
    for p in range(s.prelude):
        e = layer(e, f"prelude.{p}")
    stack = [f"core.{v % s.n_unique}" for v in range(s.depth)]  # N * M layers, each loop the same N weights
    state, logits = (torch.zeros_like(e) if c.injection else e), []
    for v, name in enumerate(stack):
        if v % s.n_unique == 0:  # a loop starts
            h = torch.cat([state, e], dim=-1) @ W["adapter.weight"].T if c.injection else state
        h = layer(h, name)
        if v % s.n_unique == s.n_unique - 1:  # a loop ends: its exit, then the next loop's state
            y = h
            for k in range(s.coda):
                y = layer(y, f"coda.{k}")
            logits.append(rms(y, "norm.weight") @ head.T)
            state = rms(h, "norm.weight") if c.loop_norm else h
    return logits


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_looped_model_equals_the_unrolled_stack_at_every_exit(variant: str) -> None:
    model = _model(1, **VARIANTS[variant])
    ids = torch.randint(0, VOCAB, (2, 9), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        got = model(ids, return_logits=True).loop_logits
    want = _unrolled(model, ids)
    assert len(got) == len(want) == model.n_loops
    for loop, (a, b) in enumerate(zip(got, want)):
        assert b.abs().max() > 1.0, "degenerate logits would hide errors"
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4, msg=lambda m, i=loop: f"loop {i}: {m}")


def _interleaved(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """GPT-J's rotary layout (pairs 2i, 2i+1), not Llama's: a bug the reference must see."""
    pairs = x.unflatten(-1, (-1, 2))
    turned = torch.stack([-pairs[..., 1], pairs[..., 0]], dim=-1).flatten(-2)
    return x * cos + turned * sin


def test_the_reference_sees_a_wrong_model(monkeypatch) -> None:
    """A rotary layout, a sandwich norm or a loop norm out of place moves the logits far beyond the tolerance."""
    model = _model(1, **VARIANTS["sandwich+coda+loop_norm"])
    ids = torch.randint(0, VOCAB, (1, 9), generator=torch.Generator().manual_seed(2))
    want = _unrolled(model, ids)[-1]
    for change in ({"norm": "pre"}, {"loop_norm": False}):
        other = LoopedLM(model.config.replace(**change)).eval()
        other.load_state_dict(model.state_dict(), strict=False)
        with torch.no_grad():
            assert (other(ids, return_logits=True).loop_logits[-1] - want).abs().max() > 1e-2
    monkeypatch.setattr("speed.models.lm_blocks.rotate", _interleaved)
    with torch.no_grad():
        assert (model(ids, return_logits=True).loop_logits[-1] - want).abs().max() > 1e-2


def test_first_loop_of_a_looped_model_is_the_shallow_model() -> None:
    deep = _model(3, pattern="1+2x3+1", injection=True)
    shallow = LoopedLM(deep.config.replace(pattern="1+2x1+1")).eval()
    shallow.load_state_dict(deep.state_dict())  # identical parameters: only the loop count differs
    ids = torch.randint(0, VOCAB, (2, 6), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        a, b = deep(ids, return_logits=True).loop_logits, shallow(ids, return_logits=True).loop_logits
    assert torch.equal(a[0], b[0]) and not torch.allclose(a[1], b[0])


# ----- cached decoding against the forward ---------------------------------------------------------------


def _pipelined(model: LoopedLM, cache, seqs: dict[int, torch.Tensor], prompt: dict[int, int]) -> dict:
    """Decode every slot's sequence as SPEED's pipeline would: prefill its prompt, then one step per tick
    in which the token at position p runs loop ``tick - (p - prompt)``, so rows of every loop, position and
    slot share a step. Returns the exit logits (V,) by (slot, loop, position)."""
    M, got, carry = model.n_loops, {}, {}
    for slot, ids in seqs.items():
        for loop, logits in enumerate(model.prefill(cache, slot, ids[: prompt[slot]])):
            got[slot, loop, prompt[slot] - 1] = logits
    longest = max(len(ids) - prompt[slot] for slot, ids in seqs.items())
    for tick in range(longest + M - 1):
        rows, hidden = [], []
        for slot, ids in seqs.items():
            for pos in range(prompt[slot], len(ids)):
                loop = tick - (pos - prompt[slot])
                if 0 <= loop < M:
                    rows.append((slot, loop, pos))
                    hidden.append(model.embed([int(ids[pos])])[0] if loop == 0 else carry[slot, pos])
        out, logits = model.step(cache, Rows.build(*map(list, zip(*rows))), torch.stack(hidden))
        for r, (slot, loop, pos) in enumerate(rows):
            carry[slot, pos], got[slot, loop, pos] = out[r], logits[r]
    return got


SEQS = {0: 12, 1: 12, 2: 12}  # slot -> length
PROMPTS = {0: 5, 1: 1, 2: 8}  # slot -> prompt length: every step mixes positions, loops and slots (> 8 rows)


def _seqs(seed: int) -> dict[int, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {slot: torch.randint(0, VOCAB, (n,), generator=g) for slot, n in SEQS.items()}


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_cached_decoding_reproduces_the_forward(variant: str) -> None:
    model = _model(4, **VARIANTS[variant])
    seqs = _seqs(5)
    with torch.inference_mode():
        want = model(torch.stack(list(seqs.values())), return_logits=True).loop_logits
        got = _pipelined(model, model.cache(len(seqs), 16), seqs, PROMPTS)
    assert len(got) == sum((n - PROMPTS[s] + 1) * model.n_loops for s, n in SEQS.items())
    for (slot, loop, pos), logits in got.items():
        torch.testing.assert_close(logits, want[loop][slot, pos], atol=1e-4, rtol=1e-4)


def test_a_row_decodes_bit_identically_alone_or_in_company() -> None:
    model = _model(6, **VARIANTS["gqa+prelude+coda+injection+loop_norm"])
    seqs = _seqs(7)
    with torch.inference_mode():
        together = _pipelined(model, model.cache(3, 16), seqs, PROMPTS)
        alone = _pipelined(model, model.cache(3, 16), {0: seqs[0]}, {0: PROMPTS[0]})
    assert alone and all(torch.equal(logits, together[key]) for key, logits in alone.items())


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_a_prompt_prefills_bit_identically_alone_or_in_a_batch(variant: str) -> None:
    """``prefill_batch`` runs several prompts' tokens as rows of one pass (tiles of 64 rows, so prompts of up to
    90 tokens straddle tiles with varying company): each prompt's logits and every key/value it leaves equal
    its prefill alone, whatever the others, their order and its slot."""
    model = _model(8, **VARIANTS[variant])
    g = torch.Generator().manual_seed(9)
    prompts = [torch.randint(0, VOCAB, (n,), generator=g) for n in (1, 90, 37, 64, 2)]
    with torch.inference_mode():
        alone = []
        for p in prompts:
            cache = model.cache(1, 96)
            alone.append((model.prefill(cache, 0, p), cache))
        cache = model.cache(5, 96)
        order = [3, 0, 4, 1, 2]  # prompt order[i] goes to slot i
        together = model.prefill_batch(cache, list(range(5)), [prompts[b] for b in order])
    for slot, b in enumerate(order):
        logits, own = alone[b]
        assert torch.equal(together[slot], logits), (variant, b)
        T = prompts[b].numel()
        for part in ("loops", "prelude"):
            mine, theirs = getattr(own, part), getattr(cache, part)
            if mine is None:
                continue
            assert (theirs.lengths[:, :, slot] == T).all()
            for j in range(len(mine.keys)):  # through each slot's block table: the blocks differ
                for a, c in zip(mine.slot_entries(j, 0, T), theirs.slot_entries(j, slot, T)):
                    assert torch.equal(a, c), (variant, part, j)


def test_prefill_batch_checks_its_input() -> None:
    model = _model(1)
    cache = model.cache(2, 8)
    with pytest.raises(ValueError, match="one slot per prompt"):
        model.prefill_batch(cache, [0, 1], [torch.tensor([3])])
    with pytest.raises(ValueError, match="at least one prompt token"):
        model.prefill_batch(cache, [0, 1], [torch.tensor([3]), torch.tensor([], dtype=torch.long)])


def test_invalidated_positions_decode_again_to_the_same_logits() -> None:
    """Lowering valid lengths drops positions at every virtual layer; with the head skipped (``with_logits``
    False) the coda still writes its keys, so later exits see them."""
    model = _model(8, **VARIANTS["gqa+prelude+coda+injection+loop_norm"])
    ids, M = _seqs(9)[0], model.n_loops
    cache = model.cache(1, 16)

    def decode(start: int, all_exits: bool) -> list[torch.Tensor]:
        final = []
        for pos in range(start, len(ids)):
            hidden = model.embed([int(ids[pos])])
            for loop in range(M):
                hidden, logits = model.step(cache, Rows.build([0], [loop], [pos]), hidden, all_exits or loop == M - 1)
                assert (logits is None) == (not all_exits and loop < M - 1)
            final.append(logits[0])
        return final

    with torch.inference_mode():
        model.prefill(cache, 0, ids[:3])
        first = decode(3, all_exits=True)
        cache.invalidate(0, 6)
        assert cache.loops.lengths.max() == cache.prelude.lengths.max() == 6
        again = decode(6, all_exits=False)
    assert all(torch.equal(a, b) for a, b in zip(first[3:], again, strict=True))


def test_prefill_needs_an_empty_slot() -> None:
    model = _model(0, pattern="1+1x2")
    cache = model.cache(2, 8)
    with torch.inference_mode():
        model.prefill(cache, 1, torch.tensor([3, 4]))
        with pytest.raises(CacheError, match="from position 0, but its valid length is 2"):
            model.prefill(cache, 1, torch.tensor([5]))
        cache.reset(1)
        with pytest.raises(ValueError, match="at least one prompt token"):
            model.prefill(cache, 1, torch.tensor([], dtype=torch.long))
        model.prefill(cache, 1, torch.tensor([5]))
        assert cache.loops.lengths[:, :, 0].sum() == 0  # the other slot untouched


def test_embed_and_cache_shapes() -> None:
    model = _model(0, pattern="2+3x4+1", injection=True, **GQA)
    carry = model.embed([1, 2, 3])
    assert carry.shape == (3, 64) and not carry[:, :32].any()  # [zero state, embedding]
    cache = model.cache(n_slots=5, max_len=20)
    assert cache.loops.keys[0].shape[:3] == (4, 2, 5 + 1)  # loops, key/value heads, a block a slot + the zero one
    assert len(cache.loops.keys) == 3 + 1 and len(cache.prelude.keys) == 2 and cache.prelude.lengths.shape[0] == 1
    assert LoopedLM(lm_preset("tiny")).cache(1, 4).prelude is None


# ----- sizes -----------------------------------------------------------------------------------------------


def test_parameter_sharing_and_presets() -> None:
    def size(**overrides) -> int:
        return count_parameters(LoopedLM(lm_preset("tiny", **overrides)))

    assert size(pattern="2x6") == size(pattern="2x1") < size(pattern="12x1")
    block = count_parameters(Block(lm_preset("tiny")))
    assert size(pattern="1+2x6+1") == size(pattern="2x6") + 2 * block
    assert size(injection=True) == size() + 2 * 32 * 32
    assert size(tie_embeddings=True) == size() - VOCAB * 32
    assert size(norm="sandwich") == size() + 2 * 32 * 2
    # A pre-norm LM block without GQA has the parameters of the same-named T5 preset's encoder block.
    for name in ("tiny", "mini", "small", "base"):
        assert count_parameters(Block(LM_PRESETS[name])) == count_parameters(EncoderLayer(PRESETS[name]))
        assert LM_PRESETS[name].vocab_size == PRESETS[name].vocab_size


# ----- the loss --------------------------------------------------------------------------------------------


def test_weighted_loss_is_the_sum_over_exits_for_every_scheme() -> None:
    model = _model(10, **VARIANTS["gqa+prelude+coda+injection+loop_norm"])
    ids = torch.randint(0, VOCAB, (3, 7), generator=torch.Generator().manual_seed(11))
    labels = next_token_labels(ids)
    labels[1, 2] = -100  # an ignored position anywhere
    schemes = [*SCHEMES, *(f"{family}:0.5" for family in PARAMETRIC)]
    with torch.no_grad():
        out = model(ids, labels=labels, return_logits=True)
        for scheme in schemes:
            w = loss_weights(scheme, model.n_loops)
            loop_losses = [F.cross_entropy(lg.reshape(-1, VOCAB), labels.reshape(-1)) for lg in out.loop_logits]
            expected = sum(wi * li for wi, li in zip(w, loop_losses))
            torch.testing.assert_close(model(ids, labels=labels, weights=w).loss, expected)
    torch.testing.assert_close(out.loss, (loss_weights("linear", 3) * out.loop_losses).sum())  # the default
    with pytest.raises(ValueError, match=r"expected \(3,\) for 3 loops"):
        model(ids, labels=labels, weights=torch.ones(2))


def test_next_token_labels() -> None:
    assert next_token_labels(torch.tensor([[5, 6, 7]])).tolist() == [[6, 7, -100]]


def test_training_step_reduces_the_weighted_loss() -> None:
    torch.manual_seed(12)
    model = LoopedLM(lm_preset("tiny", pattern="1+2x3+1", injection=True, norm="sandwich", **GQA)).train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ids = torch.randint(0, VOCAB, (4, 8))
    losses = []
    for _ in range(20):
        out = model(ids, labels=next_token_labels(ids))
        opt.zero_grad()
        out.loss.backward()
        opt.step()
        losses.append(out.loss.item())
    assert losses[-1] < 0.5 * losses[0]
    assert all(p.grad is not None for p in model.parameters())  # every part learns: adapter, prelude, coda


def test_rows_past_a_tile_run_in_tiles() -> None:
    """More rows than a tile holds: one call equals the rows' calls in tiles (the split is invisible)."""
    model = _model(13, pattern="2x2")
    cache_a, cache_b = model.cache(10, 4), model.cache(10, 4)
    tokens = torch.arange(10) + 3
    rows = Rows.build(list(range(10)), [0] * 10, [0] * 10)
    with torch.inference_mode():
        one, logits_one = model.step(cache_a, rows, model.embed(tokens))
        parts = [
            model.step(cache_b, rows.take(np.arange(a, b)), model.embed(tokens[a:b])) for a, b in ((0, 8), (8, 10))
        ]
    assert torch.equal(one, torch.cat([p[0] for p in parts])) and torch.equal(
        logits_one, torch.cat([p[1] for p in parts])
    )
