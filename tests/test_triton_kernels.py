"""The Triton decode kernels (``speed.engine.triton_kernels``): a row's bits alone, in any company, at any place
among the rows and at any row count (1..64, the row buckets of a captured step), masked positions adding nothing;
close to a float64 reference; float32 and bf16 weights; attention over the paged cache across chunk boundaries,
branch rows' lanes as chain rows; and a whole tiny looped LM (and a T5) decoding with SPEED bit for bit as
sequential decoding through them.

On the CPU the kernels run under Triton's interpreter (tiny sizes: each launch costs milliseconds there); the same
tests run compiled on CUDA under ``pytest -m gpu``. The interpreter runs every kernel here, within three limits the
kernels are written around: it cannot loop to a bound read at run time (numpy 2.4 refuses ``int()`` of its
one-element arrays: the trip counts are compile-time widths), it cannot call Triton's own ``tl.sum``/``tl.max`` if
Triton was imported before ``TRITON_INTERPRET=1`` (``tests/conftest.py`` sets it first), and each nested
``@triton.jit`` call costs it milliseconds (the kernels inline their helpers). What it does not show is how the GPU
compiler lays a reduction out, which the kernels fix by shape alone (one binary for every row count): the CUDA
cases are the ones that check it.
"""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch
from engine_helpers import random_exits, speed_as_sequential
from test_decoding_exact import random_case as t5_case
from test_lm import _randomize
from test_lm_decoding import GQA, MAX_PROMPT, prompts, random_model
from test_native_ops import LOOPS, SLOTS, filled_cache, reference

tk = pytest.importorskip("speed.engine.triton_kernels")  # before anything imports triton: it sets the interpreter

import speed.engine.kernels as kernels  # noqa: E402
from speed.config import lm_preset  # noqa: E402
from speed.decode.exactness import LogitRecorder  # noqa: E402
from speed.decode.generate import DecodeOptions, generate  # noqa: E402
from speed.engine import Speculation  # noqa: E402
from speed.engine.cache import Rows  # noqa: E402
from speed.engine.sampling import Sampling  # noqa: E402
from speed.models.lm_blocks import rotary, rotate, rotate_pairs  # noqa: E402
from speed.models.looped_lm import LoopedLM  # noqa: E402
from speed.models.precision import bf16_weights  # noqa: E402

BUCKETS = [1, 2, 3, 4, 8, 9, 16, 33, 64]  # the step's row buckets and counts between them


@pytest.fixture(params=["cpu", pytest.param("cuda", marks=pytest.mark.gpu)], ids=["interpreter", "cuda"])
def device(request, monkeypatch):
    """CPU tensors under Triton's interpreter (where no GPU is: with one, Triton compiles for it), or CUDA. Either
    way the decode ops are the Triton kernels (``SPEED_DECODE_OPS=triton``)."""
    if request.param == "cuda" and not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    if request.param == "cpu" and not tk.interpreted():
        pytest.skip("a GPU is here: Triton compiles for it and does not interpret CPU tensors")
    monkeypatch.setattr(kernels, "DECODE_OPS", "triton")
    return torch.device(request.param)


def company(rng: random.Random, x: torch.Tensor, n: int) -> tuple[torch.Tensor, int]:
    """``x`` (in,) at a random place among n - 1 random rows: (rows (n, in), its place)."""
    rows = torch.randn(n, x.shape[0], device=x.device) * 3
    at = rng.randrange(n)
    rows[at] = x
    return rows, at


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("inn,out", [(7, 5), (48, 80), (100, 130)])  # 100 inputs: two BLOCK_K steps, a tail
def test_linear_row_is_the_same_alone_in_any_company_place_and_count(device, dtype, inn, out):
    rng = random.Random(inn * out)
    torch.manual_seed(inn + out)
    weight = torch.randn(out, inn, device=device).to(dtype)
    x = torch.randn(inn, device=device)
    alone = tk.linear(weight, x[None])[0]
    expected = x.double() @ weight.double().T  # the weight as stored (bf16 read exactly)
    torch.testing.assert_close(alone.double(), expected, rtol=1e-5, atol=1e-5)
    for n in BUCKETS:
        rows, at = company(rng, x, n)
        got = tk.linear(weight, rows)
        assert got.shape == (n, out) and got.dtype == torch.float32
        assert torch.equal(got[at], alone), (n, at)


def test_linear_on_the_gpus_tiles_across_row_blocks(device, monkeypatch):
    """The GPU's tiles (8 rows a program: 64 rows are 8 programs per output tile) give each row its bits alone."""
    monkeypatch.setattr(tk, "LINEAR_BLOCKS", (8, 32, 64))
    rng = random.Random(3)
    weight = torch.randn(40, 70, device=device).to(torch.bfloat16)
    x = torch.randn(70, device=device)
    alone = tk.linear(weight, x[None])[0]
    for n in (7, 9, 64):
        rows, at = company(rng, x, n)
        assert torch.equal(tk.linear(weight, rows)[at], alone), n


@pytest.mark.parametrize("gate", ["silu", "gelu"])
def test_gated_linear_is_the_activation_of_gate_times_up_per_row(device, gate):
    rng = random.Random(5)
    weight = torch.randn(2 * 24, 40, device=device)
    x = torch.randn(40, device=device)
    alone = tk.linear(weight, x[None], gate)[0]
    g, u = (x.double() @ weight.double().T).chunk(2)
    act = torch.nn.functional.silu(g) if gate == "silu" else torch.nn.functional.gelu(g, approximate="tanh")
    torch.testing.assert_close(alone.double(), act * u, rtol=1e-4, atol=1e-4)
    for n in (2, 9, 64):
        rows, at = company(rng, x, n)
        assert torch.equal(tk.linear(weight, rows, gate)[at], alone), n


def rms(v: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    v = v.double()
    return v * torch.rsqrt(v.pow(2).mean(-1, keepdim=True) + eps) * w.double()


@pytest.mark.parametrize("norm_sum,has_out", [(False, False), (False, True), (True, True)])  # pre, sandwich, Huginn
def test_residual_step_per_row(device, norm_sum, has_out):
    rng = random.Random(int(norm_sum) + 2 * int(has_out))
    d = 48
    out_w, next_w = torch.randn(d, device=device), torch.randn(d, device=device)
    x, y = torch.randn(d, device=device), torch.randn(d, device=device)
    stream, h = tk.residual(x[None], y[None], out_w if has_out else None, 1e-6, norm_sum, next_w, 1e-5)
    want = rms(x + y, out_w, 1e-6) if norm_sum else x.double() + (rms(y, out_w, 1e-6) if has_out else y.double())
    torch.testing.assert_close(stream[0].double(), want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(h[0].double(), rms(want.float(), next_w, 1e-5), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(tk.rms_norm(x[None], next_w, 1e-5)[0].double(), rms(x, next_w, 1e-5))
    torch.testing.assert_close(tk.rms_norm(x[None], None, 1e-5)[0].double(), rms(x, torch.ones_like(x), 1e-5))
    for n in (3, 17, 64):
        xs, at = company(rng, x, n)
        ys = torch.randn(n, d, device=device)
        ys[at] = y
        s2, h2 = tk.residual(xs, ys, out_w if has_out else None, 1e-6, norm_sum, next_w, 1e-5)
        assert torch.equal(s2[at], stream[0]) and torch.equal(h2[at], h[0]), n


@pytest.mark.parametrize("layout", ["halves", "pairs"])
def test_rope_qkv_rotates_queries_and_keys_as_the_model_does(device, layout):
    H, K, D = 4, 2, 16
    turn = rotate if layout == "halves" else rotate_pairs
    n = 9
    qkv = torch.randn(n, (H + 2 * K) * D, device=device)
    cos, sin = rotary(torch.arange(n, device=device) * 7, D, 10000.0, layout)
    q_bias, k_bias = torch.randn(H, D, device=device), torch.randn(K, D, device=device)
    q, k, v = tk.rope_qkv(qkv, cos, sin, H, K, q_bias, k_bias, layout == "pairs", 0.25)
    rq, rk, rv = qkv.view(n, H + 2 * K, D).split([H, K, K], dim=1)
    torch.testing.assert_close(q, turn(rq + q_bias, cos[:, None], sin[:, None]) * 0.25, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(k, turn(rk + k_bias, cos[:, None], sin[:, None]), rtol=1e-6, atol=1e-6)
    assert torch.equal(v, rv)
    for r in (0, 4, 8):  # a row alone
        one = slice(r, r + 1)
        q1, k1, _ = tk.rope_qkv(qkv[one], cos[one], sin[one], H, K, q_bias, k_bias, layout == "pairs", 0.25)
        assert torch.equal(q1[0], q[r]) and torch.equal(k1[0], k[r])


@pytest.mark.parametrize("heads,group,d", [(2, 1, 8), (2, 2, 24), (1, 3, 20)])
def test_paged_attention_row_is_the_same_alone_in_any_company_and_order(device, heads, group, d):
    """Lengths across chunk boundaries (1, 32, 33, 70, 96), blocks scattered over the pool, garbage in free blocks."""
    lengths = [70, 33, 1, 96, 32]
    cache = filled_cache(heads * d + group, heads, d, lengths, device=str(device))
    cache.triton_attention, cache.native_attention = True, False
    rng = random.Random(d)
    picks = [(s, rng.randrange(LOOPS), rng.randrange(lengths[s])) for s in range(SLOTS) for _ in range(2)]
    picks += [(3, 1, 31), (3, 2, 32), (0, 0, 63), (0, 1, 64)]  # a chunk's last position, the next's first
    rows = Rows.build(*map(list, zip(*picks)))
    q = torch.randn(len(rows), heads * group, d, device=device)
    full = cache.attend(1, rows, q)
    for r in range(len(rows)):
        assert torch.equal(cache.attend(1, rows.take(np.array([r])), q[r : r + 1])[0], full[r]), r
    for _ in range(3):  # any subset, any order, a row repeated
        index = np.array([rng.randrange(len(rows)) for _ in range(rng.randint(2, 9))])
        assert torch.equal(cache.attend(1, rows.take(index), q[index]), full[index])
    torch.testing.assert_close(full.cpu().double(), reference(cache, 1, rows, q.cpu()), rtol=1e-5, atol=1e-5)


def test_paged_attention_with_a_bias_is_the_dense_attention_over_the_gathered_keys(device):
    """T5's self-attention on the Triton path (``paged_attend`` with a score bias per query head and position): a
    row's bits alone as in any company, the bias past its position never read, and what ``attend`` gives over the
    same keys gathered with the same bias (the CPU path's form), to float32 rounding."""
    heads, d, layer = 2, 16, 1
    lengths = [70, 33, 1, 96, 32]
    cache = filled_cache(5, heads, d, lengths, device=str(device))
    cache.triton_attention, cache.native_attention = True, False
    rng = random.Random(3)
    picks = [(s, rng.randrange(LOOPS), rng.randrange(lengths[s])) for s in range(SLOTS) for _ in range(2)]
    rows = Rows.build(*map(list, zip(*picks)))
    q = torch.randn(len(rows), heads, d, device=device)
    bias = torch.randn(len(rows), heads, cache.n_positions, device=device)
    full = cache.attend(layer, rows, q, bias)
    for r in range(len(rows)):
        past = bias[r : r + 1].clone()
        past[..., int(rows.pos[r]) + 1 :] = float("nan")  # never read: the kernel masks by the row's length
        assert torch.equal(cache.attend(layer, rows.take(np.array([r])), q[r : r + 1], past)[0], full[r]), r
    span = kernels.chunk_span(int(rows.pos.max()) + 1)
    keys, values = cache.read(layer, rows, span)
    visible = torch.arange(span, device=device)[None, :] <= torch.as_tensor(rows.pos, device=device)[:, None]
    dense_bias = bias[..., :span].masked_fill(~visible[:, None], torch.finfo(torch.float32).min)[:, :, None]
    torch.testing.assert_close(full, kernels.attend(q, keys, values, dense_bias), rtol=1e-5, atol=1e-5)
    assert not torch.equal(full, cache.attend(layer, rows, q))  # the bias counts


def test_dense_attention_from_a_source_index_reads_each_rows_source(device):
    """``attend`` with ``source`` (T5's cross-attention: each row's slot of the encoder memory picked on the device):
    the bits of the same attention over the rows' own copies (``index_select``), any slot order, a slot repeated."""
    rng = random.Random(2)
    slots, heads, d, length = 4, 2, 16, 70
    keys, values = torch.randn(2, slots, heads, length, d, device=device)
    bias = torch.randn(slots, 1, 1, length, device=device)
    bias[1, ..., 9:] = torch.finfo(torch.float32).min  # a short prompt
    source = torch.tensor([rng.randrange(slots) for _ in range(6)] + [1, 1], device=device)
    q = torch.randn(len(source), heads, d, device=device)
    got = kernels.attend(q, keys, values, bias, source=source)
    copies = (t.index_select(0, source) for t in (keys, values, bias))
    assert torch.equal(got, kernels.attend(q, *copies))


def test_paged_attention_branch_row_equals_a_chain_row_over_the_same_keys(device):
    heads, d, layer, loop = 2, 16, 0, 1
    cache = filled_cache(11, heads, d, [41, 0, 0, 0, 0], n_side=LOOPS * LOOPS, device=str(device))
    cache.triton_attention, cache.native_attention = True, False
    cache.invalidate(0, 40)
    for p in range(40):  # slot 1's prefix: slot 0's entries
        block = int(cache.table[0, p // 32])
        k = cache.keys[layer][:, :, block, p % 32].clone()
        v = cache.values[layer][:, :, block, p % 32].clone()
        cache.write(layer, Rows.build([1] * LOOPS, list(range(LOOPS)), [p] * LOOPS), k, v)
    q = torch.randn(1, heads, d, device=device)
    first, second = (torch.randn(2, 1, heads, d, device=device) for _ in range(2))
    branch = Rows.build([0], [loop], [40], side=[3], up=[()])
    cache.write(layer, branch, *first)
    cache.write(layer, Rows.build([1], [loop], [40]), *first)
    assert torch.equal(cache.attend(layer, branch, q), cache.attend(layer, Rows.build([1], [loop], [40]), q))
    lane = Rows.build([0], [loop], [41], side=[4], up=[((40, 3),)])  # the lane's second token
    cache.write(layer, lane, *second)
    cache.write(layer, Rows.build([1], [loop], [41]), *second)
    chain = Rows.build([1, 1], [loop, loop], [41, 41])  # beside a chain row of its own slot too
    mixed = Rows.build([1, 0], [loop, loop], [41, 41], side=[-1, 4], up=[(), ((40, 3),)])
    assert torch.equal(cache.attend(layer, mixed, q.expand(2, -1, -1)), cache.attend(layer, chain, q.expand(2, -1, -1)))


def test_dense_attention_does_not_depend_on_masked_positions_or_rows(device):
    """T5's attention (``kernels.attend`` on Triton's path): more masked chunks after a row's positions add exact
    zeros, and a row's result is its own in any company."""
    rng = random.Random(1)
    min_value = torch.finfo(torch.float32).min
    for heads, d, length in [(2, 16, 1), (3, 12, 33), (1, 8, 64), (2, 16, 70)]:
        n = rng.randint(1, 5)
        capacity = 2 * length + 40
        q, keys, values = torch.randn(n, heads, d, device=device), *torch.randn(2, n, heads, capacity, d, device=device)
        bias = torch.randn(n, heads, 1, capacity, device=device)
        bias[..., length:] = min_value
        small = kernels.attend(q, keys[:, :, :length], values[:, :, :length], bias[..., :length])
        assert torch.equal(kernels.attend(q, keys, values, bias), small), (heads, d, length)
        assert torch.equal(kernels.attend(q[-1:], keys[-1:], values[-1:], bias[-1:])[0], small[-1])
        kernels.DECODE_OPS = "torch"  # the CPU's attend as the reference
        torch.testing.assert_close(small, kernels.attend(q, keys, values, bias).float(), rtol=1e-5, atol=1e-5)
        kernels.DECODE_OPS = "triton"


def speed_equals_sequential(model, ids, mask, max_new: int, runs: list[Speculation], sampling=None) -> int:
    """Sequential decoding under a ``LogitRecorder``, then SPEED with each of ``runs``, each checked bit for bit
    against it (every loop's logits, the tokens, the trace). Few runs and few tokens: the interpreter pays
    milliseconds a launch. Returns SPEED's flushes."""
    reference = LogitRecorder(model)
    ref = generate(reference, ids, mask, DecodeOptions(method="sequential", max_new_tokens=max_new, sampling=sampling))
    flushes = 0
    for speculation in runs:
        got = speed_as_sequential(
            model, reference, ref, ids, mask, max_new, speculation, speculation=speculation, sampling=sampling
        )
        assert got.trace.equals(ref.trace)
        flushes += got.stats.flushes
    return flushes


@pytest.mark.slow
def test_lm_speed_equals_sequential_through_the_triton_kernels(device):
    """Greedy, batch 3: a prelude, a looped core and a coda, sandwich norms, loop norm, injection, grouped-query
    attention and exit adapters, every decode op on the Triton kernels (one call per op for all the pass's rows)."""
    config = lm_preset("tiny", pattern="1+2x2+1", norm="sandwich", loop_norm=True, injection=True, **GQA)
    model = random_exits(_randomize(LoopedLM(config), 4), 4).to(device)
    assert model.cache(1, 8).loops.triton_attention
    ids, mask = prompts(random.Random(4), 3, model.vocab_size)
    runs = [Speculation(1, "eager"), Speculation(2, "final")]
    assert speed_equals_sequential(model, ids.to(device), mask.to(device), 5, runs) > 0


@pytest.mark.slow
def test_lm_sampled_speed_equals_sequential_with_bf16_weights_through_the_triton_kernels(device):
    """Seeded sampling on bf16 weights (read in place by the linear), Huginn's rotary pairs and q/k biases."""
    config = lm_preset("tiny", pattern="2x3", rope_layout="pairs", qk_bias=True)
    model = bf16_weights(_randomize(LoopedLM(config), 7)).to(device)  # the biases random too (2-D parameters)
    assert model.core[0].attn.q_bias.abs().min() > 0 and model.core[0].attn.qkv.weight.dtype == torch.bfloat16
    ids, mask = prompts(random.Random(7), 2, model.vocab_size)
    sampling = Sampling(temperature=0.9, top_k=5, seed=1234)
    speed_equals_sequential(model, ids.to(device), mask.to(device), 4, [Speculation(1, "eager")], sampling)


@pytest.mark.slow
def test_t5_speed_equals_sequential_through_the_triton_kernels(device):
    """T5's group pass: the linears, norms, gated GELU and both attentions on Triton (the self-attention in place
    through the block table with its position bias, the cross-attention on each row's slot by a device index)."""
    model, ids, mask, _, _ = t5_case(2)
    speed_equals_sequential(model.to(device), ids.to(device), mask.to(device), 4, [Speculation(1, "eager")])


def test_the_cpu_keeps_its_kernels_unless_triton_is_asked_for(monkeypatch):
    """``SPEED_DECODE_OPS`` auto: CPU rows never take the Triton kernels (their bits stay the CPU kernels'); "triton"
    sends every decode op there, the prompt's linears too."""
    x = torch.randn(2, 8)
    assert not kernels.on_triton(x)
    assert not random_model(0).cache(1, MAX_PROMPT).loops.triton_attention
    monkeypatch.setattr(kernels, "DECODE_OPS", "triton")
    assert kernels.on_triton(x) == tk.interpreted()
    with torch.enable_grad():  # no backward: a row asking for a gradient stays on torch's ops
        assert not kernels.on_triton(x.requires_grad_())


def test_the_kernel_benchmark_times_the_triton_linear(device):
    """``jobs/bench_kernels.py --device cuda --kernels triton``'s rows (here at tiny widths): bytes, time and share of
    the read bandwidth at each row count up to a bucket of 64."""
    from speed.benchmarks.kernels import bench_kernels

    rows = bench_kernels(32, 48, layers=1, rows=(1, 64), kernels_=("triton",), dtypes=(torch.bfloat16,), repeats=1,
                         device=str(device))  # fmt: skip
    assert {(r.kernel, r.dtype, r.rows) for r in rows} == {("triton", "bfloat16", 1), ("triton", "bfloat16", 64)}
    for r in rows:
        assert r.weight_bytes == 2 * (32 * 3 * 32 + 32 * 32 + 32 * 2 * 48 + 48 * 32)
        assert r.seconds > 0 and r.of_read == pytest.approx(r.gb_per_s / r.read_gb_per_s)
