"""The native decode ops: the attention over the paged KV cache (``KVCache.attend`` on
``speed.engine.native.attend``), the RMS norm and SwiGLU's gate of the decode rows (``tile_rms_norm``,
``tile_swiglu``).

A row's result must be bit-identical alone or in any company, in any order, on 1 or 2 threads, whichever blocks
its positions got, and whatever the pool holds past its position; a branch row reading its lane from side entries
must equal a chain row over the same keys; and its values must be attention's (checked against an independent
softmax in float64). The norm and the gate are torch's to float32 rounding and a row's bits do not depend on its
company. The looped LM decodes exactly (SPEED equals sequential) on them and on the torch path.
"""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch
from engine_helpers import speed_runs_match
from test_lm_decoding import random_case, random_model

import speed.engine.kernels as kernels
from speed.engine import native
from speed.engine.cache import KVCache, Rows
from speed.engine.kernels import ATTN_CHUNK

pytestmark = pytest.mark.skipif(
    not native.supports_attention(torch.float32, torch.device("cpu")),
    reason=f"no native kernels here: {native.unavailable_reason()}",
)

LOOPS, LAYERS, SLOTS = 3, 2, 5


def filled_cache(seed: int, heads: int, d: int, lengths: list[int], n_side: int = 0, device: str = "cpu") -> KVCache:
    """A cache whose slots hold ``lengths[s]`` random positions at every virtual layer, blocks taken in a shuffled
    order (so that a slot's chunks are scattered over the pool), random values in the free blocks."""
    torch.manual_seed(seed)
    cache = KVCache(LOOPS, LAYERS, SLOTS, heads, 128, d, n_side=n_side, n_blocks=3 * SLOTS + 4, device=device)
    order = [(s, p) for s in range(SLOTS) for p in range(lengths[s])]
    random.Random(seed).shuffle(order)
    for s, p in sorted(order, key=lambda sp: (sp[1], random.Random(seed + sp[0]).random())):
        for layer in range(LAYERS):
            rows = Rows.build([s] * LOOPS, list(range(LOOPS)), [p] * LOOPS)
            cache.write(layer, rows, torch.randn(LOOPS, heads, d).to(device), torch.randn(LOOPS, heads, d).to(device))
    free = [b for b in range(1, cache.n_blocks + 1) if b not in set(cache.table.reshape(-1).tolist())]
    for t in (*cache.keys, *cache.values):
        t[:, :, free] = torch.randn_like(t[:, :, free]) * 1e3  # garbage a row must never read
    return cache


def reference(cache: KVCache, layer: int, rows: Rows, q: torch.Tensor) -> torch.Tensor:
    """Softmax attention in float64 over each row's positions, read one by one through the table."""
    out = torch.empty(q.shape, dtype=torch.float64)
    group = q.shape[1] // cache.n_heads
    for r in range(len(rows)):
        slot, loop, pos = int(rows.slot[r]), int(rows.loop[r]), int(rows.pos[r])
        blocks = [int(cache.table[slot, p // ATTN_CHUNK]) for p in range(pos + 1)]
        for h in range(q.shape[1]):
            g = h // group
            keys = torch.stack([cache.keys[layer][loop, g, b, p % ATTN_CHUNK] for p, b in enumerate(blocks)])
            values = torch.stack([cache.values[layer][loop, g, b, p % ATTN_CHUNK] for p, b in enumerate(blocks)])
            weights = torch.softmax(keys.double() @ q[r, h].double(), dim=0)
            out[r, h] = weights @ values.double()
    return out


@pytest.mark.parametrize("heads,group,d", [(2, 1, 8), (2, 2, 24), (4, 1, 128), (1, 3, 20)])
def test_a_row_is_the_same_alone_in_any_company_order_and_thread_count(heads, group, d):
    lengths = [70, 33, 1, 96, 32]
    cache = filled_cache(heads * d + group, heads, d, lengths)
    rng = random.Random(d)
    picks = [(s, rng.randrange(LOOPS), rng.randrange(lengths[s])) for s in range(SLOTS) for _ in range(2)]
    rows = Rows.build(*map(list, zip(*picks)))
    q = torch.randn(len(rows), heads * group, d)
    before = torch.get_num_threads()
    try:
        results = []
        for threads in (1, 2):
            torch.set_num_threads(threads)
            full = cache.attend(1, rows, q)
            results.append(full)
            for r in range(len(rows)):  # alone
                assert torch.equal(cache.attend(1, rows.take(np.array([r])), q[r : r + 1])[0], full[r])
            for _ in range(3):  # any subset, any order, a row repeated
                index = np.array([rng.randrange(len(rows)) for _ in range(rng.randint(1, 8))])
                assert torch.equal(cache.attend(1, rows.take(index), q[index]), full[index])
        assert torch.equal(results[0], results[1])
    finally:
        torch.set_num_threads(before)
    torch.testing.assert_close(results[0].double(), reference(cache, 1, rows, q), rtol=1e-5, atol=1e-5)


def test_the_torch_path_attends_the_same_to_float32_rounding():
    lengths = [40, 64, 65, 3, 100]
    cache = filled_cache(7, 2, 16, lengths)
    rows = Rows.build([0, 1, 2, 3, 4], [0, 1, 2, 1, 0], [39, 63, 64, 2, 99])
    q = torch.randn(5, 4, 16)
    fast = cache.attend(0, rows, q)
    cache.native_attention = False
    slow = cache.attend(0, rows, q)
    torch.testing.assert_close(fast, slow, rtol=1e-5, atol=1e-5)


def test_a_branch_row_reading_side_entries_equals_a_chain_row_over_the_same_keys():
    """A lane forking at position 40: its rows read positions < 40 from the slot's blocks and 40.. from side
    entries. Copying those entries into a second slot's chain positions, that slot's chain row gives the
    same bits."""
    heads, d = 2, 16
    cache = filled_cache(11, heads, d, [41, 0, 0, 0, 0], n_side=LOOPS * LOOPS)
    layer, loop = 0, 1
    cache.invalidate(0, 40)
    for p in range(40):  # slot 1's prefix: slot 0's entries
        block = int(cache.table[0, p // ATTN_CHUNK])
        k = cache.keys[layer][:, :, block, p % ATTN_CHUNK].clone()
        v = cache.values[layer][:, :, block, p % ATTN_CHUNK].clone()
        cache.write(layer, Rows.build([1] * LOOPS, list(range(LOOPS)), [p] * LOOPS), k, v)
    lane = [torch.randn(1, heads, d) for _ in range(2)]  # (k, v) at position 40, the lane's first token
    branch = Rows.build([0], [loop], [40], side=[3], up=[()])
    cache.write(layer, branch, lane[0], lane[1])
    chain = Rows.build([1], [loop], [40])
    cache.write(layer, chain, lane[0], lane[1])
    q = torch.randn(1, heads, d)
    assert torch.equal(cache.attend(layer, branch, q), cache.attend(layer, chain, q))
    second = Rows.build([0], [loop], [41], side=[4], up=[((40, 3),)])  # the lane's second token
    more = [torch.randn(1, heads, d) for _ in range(2)]
    cache.write(layer, second, *more)
    cache.write(layer, Rows.build([1], [loop], [41]), *more)
    assert torch.equal(cache.attend(layer, second, q), cache.attend(layer, Rows.build([1], [loop], [41]), q))


@pytest.mark.parametrize("d", [8, 20, 2048])
def test_rms_norm_and_swiglu_are_torchs_and_per_row(d):
    torch.manual_seed(d)
    norm = torch.nn.RMSNorm(d, eps=1e-6)
    with torch.no_grad():
        norm.weight.normal_()
    x, gate_up = torch.randn(8, d) * 3, torch.randn(8, 2 * d) * 4
    with torch.no_grad():
        fast, gated = kernels.tile_rms_norm(norm, x), kernels.tile_swiglu(gate_up)
        torch.testing.assert_close(fast, norm(x), rtol=1e-5, atol=1e-5)
    gate, up = gate_up.chunk(2, dim=-1)
    torch.testing.assert_close(gated, torch.nn.functional.silu(gate) * up, rtol=1e-5, atol=1e-5)
    with torch.no_grad():
        for r in range(8):
            assert torch.equal(kernels.tile_rms_norm(norm, x[r : r + 1])[0], fast[r])
            assert torch.equal(kernels.tile_swiglu(gate_up[r : r + 1])[0], gated[r])
    assert kernels.tile_rms_norm(norm, x).requires_grad  # with a gradient asked for: torch's, differentiable


@pytest.mark.parametrize("pairs", [False, True])
@pytest.mark.parametrize("heads,d", [(1, 2), (3, 8), (16, 128)])
def test_rope_is_torchs_bit_for_bit_on_strided_rows(pairs, heads, d):
    """The rotary positions of q or k inside fused q;k;v rows (strided) on the native kernel: the same bits as the
    model's ``rotate`` / ``rotate_pairs``, for any row count, each row alone."""
    from speed.models.lm_blocks import rotary, rotate, rotate_pairs

    torch.manual_seed(heads * d)
    turn = rotate_pairs if pairs else rotate
    qkv = torch.randn(8, 3 * heads, d) * 5
    x = qkv[:, heads : 2 * heads]  # the k part: rows 3 * heads * d apart
    cos, sin = rotary(torch.tensor([0, 1, 7, 31, 100, 1000, 4095, 70000]), d, 1e6, "pairs" if pairs else "halves")
    if native.library() is None:
        pytest.skip(f"no native kernel here: {native.unavailable_reason()}")
    with torch.no_grad():
        fast = kernels.tile_rope(x, cos, sin, pairs, turn)
        assert torch.equal(native.rope(x, cos, sin, pairs), fast)  # tile_rope took the native kernel
        assert torch.equal(fast, turn(x, cos.unsqueeze(-2), sin.unsqueeze(-2)))
        for r in range(8):
            assert torch.equal(kernels.tile_rope(x[r : r + 1], cos[r : r + 1], sin[r : r + 1], pairs, turn)[0], fast[r])


@pytest.mark.parametrize("ops", ["auto", "torch"])
def test_lm_speed_equals_sequential_on_either_decode_ops(ops, monkeypatch):
    """The looped LM decodes with SPEED bit-identical to sequential decoding on the native ops and on torch's
    (``SPEED_DECODE_OPS=torch``), each on its own."""
    monkeypatch.setattr(kernels, "DECODE_OPS", ops)
    assert random_model(0).cache(1, 8).loops.native_attention == (ops == "auto")
    runs, flushes = speed_runs_match(random_case, range(3))
    assert runs > 0 and flushes > 0
