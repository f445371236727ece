"""The GPU check's stages that time decoding on the device (``speed.benchmarks.gpu`` runs them): ``launches``
(kernels per token, synchronisations per group pass), ``shapes`` (``speed.benchmarks.shapes`` at a published
model's shape, against the read bandwidth and a device-to-device copy's), ``llama`` (that shape's unique layers as
a plain Llama through ``transformers`` against our Dx1 of the same weights) and ``timing``
(``speed.benchmarks.decode.run_benchmark`` at base dims). Each returns a named result; a time per token is each
run's own split, and every timed decode of ours runs on an engine kept for it (``decoding``), built and its CUDA
graphs captured in an untimed first run.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from speed.benchmarks.decode import BenchConfig, decoding, random_model, run_benchmark
from speed.benchmarks.decode_lm import FirstTokenClock, split_medians
from speed.benchmarks.gpu_setup import CheckSize, sync
from speed.benchmarks.shapes import SHAPES, Shape, ShapeBenchConfig, run_shape_benchmark
from speed.decode.generate import DecodeOptions, GenerateResult, generate


@dataclass(frozen=True)
class LaunchCount:
    """One decode's kernels and synchronisations on the device (None on the CPU: no kernels to count)."""

    variant: str
    tokens: int  # new tokens decoded (batch 1)
    passes: int  # group passes of the engine
    kernels: int | None  # device kernels launched (torch.profiler), admission included
    kernels_per_token: float | None
    syncs: int | None  # synchronising calls (torch.cuda.set_sync_debug_mode) in the passes after admission
    syncs_per_pass: float | None


@dataclass(frozen=True)
class ShapeRun:
    """The real-shape benchmark's rows (``LM_BENCH_SCHEMA``) of each batch timed, each batch's summary, and the
    device-to-device copy's bandwidth measured beside them (``vs_copy_limit``: each row's time per token over the
    time that bandwidth needs to read its weights once per loop pass)."""

    rows: list[dict]
    summary: dict[str, Any]  # the first batch's (``run_shape_benchmark``'s)
    copy_gb_per_s: float  # bytes read and written by a device-to-device copy, over its time (best of several)
    vs_copy_limit: list[float]  # per row
    batch_speedup: dict[str, float] = field(default_factory=dict)  # per variant: tokens/s at the largest batch / at 1
    notes: list[str] = field(default_factory=list)  # batches left out, and why


@dataclass(frozen=True)
class LlamaRun:
    """A plain Llama of the shape through ``transformers`` (static cache, compiled on CUDA) against our Dx1 of the
    same weights, sequential: ms per token after the first, each run's own split, medians."""

    layers: int
    compiled: bool  # transformers' forward under torch.compile (CUDA only)
    rows: list[dict]  # per batch: ms per token of each, "speedup_vs_hf" (theirs over ours: above 1, ours faster), TTFTs
    agreement: float  # the share of greedy tokens the two chose alike (bf16 kernels differ: not expected equal)


@dataclass(frozen=True)
class Ratios:
    """One batch size's medians set against each other: ms per token over ms per token."""

    batch: int
    speed_over_sequential: float  # 2x6 SPEED, own speculation / 2x6 sequential
    speed_over_shallow: float  # ... / 2x1
    oracle_over_sequential: float  # 2x6 SPEED, oracle speculation / 2x6 sequential
    oracle_over_shallow: float
    deep_over_shallow: float | None  # our 12x1 / 2x1; None when transformers' comparison was dropped



@dataclass(frozen=True)
class TimingRun:
    """The decode benchmark's rows (``BENCH_SCHEMA``) for each batch size timed, and their ratios."""

    rows: list[dict]
    ratios: list[Ratios]
    notes: list[str] = field(default_factory=list)  # batch sizes left out, comparisons dropped, and why
    errors: list[str] = field(default_factory=list)  # a batch size that failed: the error's last line



# ----- launches and synchronisations ------------------------------------------------------------------------


def count_syncs(fn: Callable[[], Any], device: str) -> int | None:
    """How many synchronising CUDA calls ``fn()`` makes (``torch.cuda.set_sync_debug_mode("warn")``, one warning
    each); None off CUDA."""
    if torch.device(device).type != "cuda":
        fn()
        return None
    import warnings

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            fn()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return sum("synchroniz" in str(w.message) for w in caught)


def launches_stage(size: CheckSize, device: str, left_s: float = math.inf) -> list[LaunchCount]:
    """Sequential and oracle SPEED decoding of one random base-dims sequence for ``size.launch_tokens`` tokens:
    device kernels per token (a profiled decode) and synchronising calls per group pass after admission, each on
    an engine that decoded the sequence once before (its buckets' CUDA graphs captured then, never counted)."""
    from torch.profiler import ProfilerActivity, profile

    from speed.engine import Engine, EngineConfig, Request

    dev = torch.device(device)
    model = random_model(size.model(), seed=0).to(dev)
    ids = torch.randint(3, size.vocab_size, (1, size.source_len), generator=torch.Generator().manual_seed(3))
    n = size.launch_tokens
    reference = generate(model, ids, options=DecodeOptions(method="sequential", max_new_tokens=n, trace=False))
    found = []
    for variant, kw in (("sequential", {"method": "sequential"}), ("speed_oracle", {"method": "speed"})):
        oracle = reference.tokens[0] if variant == "speed_oracle" else None
        options = kw | ({} if oracle is None else {"oracle": [oracle]})

        run = decoding(model, ids, n, trace=False, **options)
        run()  # warm: kernels compiled, the engine built, its graphs captured
        kernels = None
        if dev.type == "cuda":
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                run()
                sync(dev)
            kernels = sum(1 for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA)
        config = EngineConfig(max_active=1, max_prompt_len=size.source_len, max_target_len=n, trace=False)
        engine = Engine(model, config)
        with torch.inference_mode():
            engine.add(Request(ids[0].tolist(), n, kw["method"], oracle=oracle))
            while engine.has_work:  # warm: the engine's graphs captured (a capture waits on the device)
                engine.step()
            engine.add(Request(ids[0].tolist(), n, kw["method"], oracle=oracle))
            engine.step()  # admission: the prompt encoded or prefilled
            first = engine.stats.group_passes

            def rest(e: Engine = engine) -> None:
                while e.has_work:
                    e.step()

            syncs = count_syncs(rest, device)
        passes = engine.stats.group_passes - first
        found.append(LaunchCount(
            variant, n, passes, kernels, None if kernels is None else kernels / n, syncs,
            None if syncs is None or not passes else syncs / passes,
        ))  # fmt: skip
    return found



# ----- the real shape ---------------------------------------------------------------------------------------


def copy_bandwidth(device: str, n_bytes: int, reps: int = 5) -> float:
    """GB/s of a device-to-device copy of ``n_bytes`` (read and written: 2 x n_bytes moved), the best of ``reps``."""
    dev = torch.device(device)
    src = torch.ones(n_bytes // 4, dtype=torch.float32, device=dev)
    dst = torch.empty_like(src)
    dst.copy_(src)
    best = float("inf")
    for _ in range(reps):
        sync(dev)
        start = time.perf_counter()
        dst.copy_(src)
        sync(dev)
        best = min(best, time.perf_counter() - start)
    return 2 * n_bytes / best / 1e9


def _shape(size: CheckSize) -> tuple[str, Shape]:
    if isinstance(size.shape, str):
        return size.shape, SHAPES[size.shape]
    return "tiny", size.shape


def shape_stage(size: CheckSize, device: str, left_s: float = math.inf) -> ShapeRun:
    """``run_shape_benchmark`` at ``size.shape`` on ``device``, one batch of ``size.shape_batches`` at a time (in
    that order) while the next one (estimated from the last, scaled by the square root of the batches' ratio: a
    pass of more rows costs less than as many passes) fits ``size.shape_s`` and ``left_s``; the copy bandwidth
    measured beside them. The rows come back ordered by batch."""
    name, shape = _shape(size)
    rows, notes, summary = [], [], {}
    copy = copy_bandwidth(device, size.bandwidth_bytes)
    started, last = time.perf_counter(), 0.0
    for batch in size.shape_batches:
        spent = time.perf_counter() - started
        guess = last * max(batch / rows[-1]["batch"], 1.0) ** 0.5 if rows else 0.0
        if rows and spent + guess > min(size.shape_s, left_s):
            notes.append(f"batch {batch} not run: about {guess:.0f} s more would pass the stage's budget")
            continue
        t0 = time.perf_counter()
        cfg = ShapeBenchConfig(
            name, shape.resolve(), batches=(batch,), new_tokens=size.shape_tokens, reps=size.shape_reps,
            device=device, bandwidth_bytes=size.bandwidth_bytes,
        )  # fmt: skip
        table, batch_summary = run_shape_benchmark(cfg)
        rows += table.to_pylist()
        summary = summary or batch_summary
        last = time.perf_counter() - t0
    rows.sort(key=lambda r: r["batch"])  # stable: each batch's variants in their order
    vs_copy = [r["ms_per_token"] / (r["weight_bytes_per_token"] / (copy * 1e9) * 1000) for r in rows]
    return ShapeRun(rows, summary, copy, vs_copy, batch_speedup(rows), notes)


def batch_speedup(rows: list[dict]) -> dict[str, float]:
    """Per variant: tokens per second at the largest batch timed over those at batch 1 (ms per token is per token of
    all sequences, so the ratio of batch 1's ms per token to the largest's); empty with one batch."""
    batches = sorted({r["batch"] for r in rows})
    if len(batches) < 2 or batches[0] != 1:
        return {}
    ms = {(r["batch"], r["variant"]): r["ms_per_token"] for r in rows}
    return {v: ms[1, v] / ms[batches[-1], v] for b, v in ms if b == 1 and (batches[-1], v) in ms}



# ----- a plain Llama through transformers ---------------------------------------------------------------------


def llama_stage(size: CheckSize, device: str, left_s: float = math.inf) -> LlamaRun:
    """The shape's dimensions as a plain Llama of its unique layers, run once each (random
    bf16 weights; ``transformers``' static cache, its forward compiled on CUDA) and our Dx1 of the same weights
    (``from_llama``, bf16 weights), sequential greedy decoding of ``size.llama_tokens`` tokens at each batch of
    ``size.llama_batches``, interleaved; ms per token after the first, from each run's own split."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from speed.models.convert_llama import from_llama
    from speed.models.precision import with_dtype

    dev = torch.device(device)
    _, shape = _shape(size)
    c = shape.resolve()
    layers = c.sharing.n_unique  # Ouro-1.4B's 24 (it loops them 4 times): the plain model a user would compare
    hf_config = LlamaConfig(
        vocab_size=c.vocab_size, hidden_size=c.d_model, intermediate_size=c.d_ff, num_hidden_layers=layers,
        num_attention_heads=c.n_heads, num_key_value_heads=c.n_kv_heads, head_dim=c.head_dim, rms_norm_eps=c.norm_eps,
        rope_theta=c.rope_theta, tie_word_embeddings=False, eos_token_id=c.eos_id, pad_token_id=c.eos_id,
        bos_token_id=None,
    )  # fmt: skip
    torch.manual_seed(0)
    with torch.device(dev):
        hf = LlamaForCausalLM(hf_config).to(torch.bfloat16).eval()
    with torch.no_grad():
        hf.lm_head.weight[c.eos_id].zero_()  # never stops early
    ours = with_dtype(from_llama(hf).to(dev), torch.bfloat16).eval()
    # with a static cache on CUDA, transformers' generate compiles the forward itself (its auto-compilation:
    # torch.compile, mode "reduce-overhead", CUDA graphs); a second torch.compile around it would nest the two
    hf.generation_config.cache_implementation = "static"
    compiled = dev.type == "cuda"
    n, rows, agree, total = size.llama_tokens, [], 0, 0
    for batch in size.llama_batches:
        ids = torch.randint(3, c.vocab_size, (batch, 32), generator=torch.Generator().manual_seed(batch)).to(dev)

        def run_hf(b_ids: torch.Tensor = ids) -> tuple[list[list[int]], float, float]:
            clock = FirstTokenClock(dev)
            with torch.inference_mode():
                out = hf.generate(b_ids, attention_mask=torch.ones_like(b_ids), max_new_tokens=n, min_new_tokens=n,
                                  do_sample=False, num_beams=1, streamer=clock)  # fmt: skip
            first, rest = clock.split()
            return out[:, b_ids.shape[1] :].tolist(), first, rest

        decode = decoding(ours, ids.cpu(), n, method="sequential", trace=False)  # one engine, captured once

        def run_ours(run: Callable[[], GenerateResult] = decode) -> tuple[list[list[int]], float, float]:
            result = run()
            return result.tokens, result.first_token_s, result.decode_s

        times: dict[str, list[tuple[float, float]]] = {"hf": [], "ours": []}
        tokens = {}
        for rep in range(size.llama_reps + 1):  # the first round warms up (compiles, captures): untimed
            for name, fn in (("hf", run_hf), ("ours", run_ours)) if rep % 2 else (("ours", run_ours), ("hf", run_hf)):
                tokens[name], first, rest = fn()
                if rep:
                    times[name].append((first, rest))
        ttft, per = split_medians(times, batch * (n - 1))
        rows.append({
            "batch": batch, "ours_ms_per_token": per["ours"], "hf_ms_per_token": per["hf"],
            "speedup_vs_hf": per["hf"] / per["ours"], "ours_ttft_ms": ttft["ours"], "hf_ttft_ms": ttft["hf"],
        })  # fmt: skip
        pairs = [(a, b) for x, y in zip(tokens["ours"], tokens["hf"]) for a, b in zip(x, y)]
        agree, total = agree + sum(a == b for a, b in pairs), total + len(pairs)
    return LlamaRun(layers, compiled, rows, agree / max(total, 1))


# ----- timing at base dims ----------------------------------------------------------------------------------


def ratios(batch: int, rows: list[dict]) -> Ratios:
    """The side-by-side ratios of one batch size's benchmark rows."""
    ms = {r["variant"]: r["ms_per_token"] for r in rows}
    return Ratios(
        batch=batch,
        speed_over_sequential=ms["speed"] / ms["sequential"],
        speed_over_shallow=ms["speed"] / ms["shallow"],
        oracle_over_sequential=ms["speed_oracle"] / ms["sequential"],
        oracle_over_shallow=ms["speed_oracle"] / ms["shallow"],
        deep_over_shallow=ms["ours_deep"] / ms["shallow"] if "ours_deep" in ms else None,
    )


def timing_stage(size: CheckSize, device: str, left_s: float = math.inf) -> TimingRun:
    """``run_benchmark`` on ``device`` at each batch size while the stage stays within ``size.timing_s`` (and
    ``left_s``)."""
    rows, found, notes, errors = [], [], [], []
    started, last, limit = time.perf_counter(), 0.0, min(size.timing_s, left_s)
    for batch in size.batches:
        if rows and time.perf_counter() - started + last > limit:
            notes.append(f"batch {batch} not timed: it would take the stage past {limit:.0f} s")
            continue
        t0 = time.perf_counter()
        cfg = BenchConfig(
            size.model(), batch=batch, source_len=size.source_len, new_tokens=size.new_tokens, reps=size.reps,
            device=device, exit_rank=None,  # sized for its budget without the exit adapters' variant
        )  # fmt: skip
        try:
            try:
                table = run_benchmark(cfg)
            except Exception as err:  # transformers' side, say (another version there): ours is timed without it
                notes.append(f"batch {batch}: {last_line(err)} with transformers' generate; timed again without it")
                table = run_benchmark(dataclasses.replace(cfg, compare_hf=False))
        except Exception as err:  # e.g. SPEED's tokens differ from sequential's: the next batch size still runs
            errors.append(f"batch {batch}: {last_line(err)}")
            continue
        batch_rows = table.to_pylist()
        rows += batch_rows
        found.append(ratios(batch, batch_rows))
        last = time.perf_counter() - t0
    return TimingRun(rows, found, notes, errors)



def last_line(err: BaseException) -> str:
    return f"{type(err).__name__}: {str(err).strip().splitlines()[-1] if str(err).strip() else ''}"

