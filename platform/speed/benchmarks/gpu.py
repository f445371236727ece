"""The GPU check (``jobs/gpu_check.py``, ``make gpu-check``): every CUDA path run once, in a few minutes, on a
machine that has torch but no Ray.

The stages (``STAGES``, in order; each timed and caught, so that a failing one still leaves the others' results;
one that would not fit what is left of the budget is skipped, with the reason; the caller rewrites the report
after every stage, so a run stopped early keeps what it measured):

- ``exactness``: ``pytest -m gpu tests/test_gpu_decode.py`` in a subprocess (SPEED's logits bitwise equal to
  sequential decoding's on the device), under a timeout of what is left of the budget (at most
  ``pytest_timeout_s``); first, since exactness is the contract;
- ``launches``: kernels launched per token (``torch.profiler``'s device kernels) and host synchronisations per
  group pass (``torch.cuda.set_sync_debug_mode``) of sequential and oracle SPEED decoding at base dims, batch 1;
- ``shapes``: ``speed.benchmarks.shapes`` at Ouro-1.4B's shape (random bf16 weights), batch 1, 8 and 32, each
  batch while the budget allows: sequential, oracle SPEED and SPEED's own, each against the read bandwidth and a
  device-to-device copy's, both measured in the same run;
- ``llama``: the same shape as a plain 24-layer Llama through ``transformers`` (``LlamaForCausalLM``, random
  weights, its static cache, which on CUDA its ``generate`` compiles with ``torch.compile``: what a GPU user has)
  next to our 24x1 of the same weights, sequential;
- ``timing``: ``speed.benchmarks.decode.run_benchmark`` on the device at base dims, batch 1 and 8 (2x6
  sequential, SPEED with its own and with oracle speculation, the shallow 2x1, our 12x1 and transformers'
  ``generate`` of it): the paper's Fig. 3 latency axis on a GPU;
- ``agreement``: the same random weights decoded on the CPU and on the device, greedy and sampled: how
  many tokens agree (equality is not expected across devices: their kernels round differently);
- ``training``: a few optimizer steps of the model on the device (forward, the weighted early-exit loss,
  backward, clipping, AdamW; bf16 autocast on CUDA, as ``speed.train.loop`` trains), a training checkpoint
  saved and loaded on the CPU, its optimizer state following the parameters back to the device
  (``speed.train.optim.follow_parameters``), then one more step both from the reload and uninterrupted.

A stage is a ``StagePlan`` (its function of the size, the device and the seconds left, its verdict, the seconds it
needs to start); another module adds one by appending to a list of them. No figure is typed in: every time and
ratio is measured in the run, and a time per token is each run's own split (never negative). Every timed decode
of ours runs on an engine kept for its (model, batch, mode) (``speed.benchmarks.decode.decoding``), built and its
CUDA graphs captured in an untimed first run, so no timed run builds an engine or captures a graph; both families'
passes are captured on CUDA (the Triton kernels').
"""

from __future__ import annotations

import copy
import dataclasses
import math
import os
import platform as _platform
import re
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any

import pyarrow as pa
import torch

from speed.benchmarks.decode import BENCH_SCHEMA, BenchConfig, decoding, format_table, random_model, run_benchmark
from speed.benchmarks.decode_lm import LM_BENCH_SCHEMA
from speed.benchmarks.gpu_train import training_check
from speed.benchmarks.shapes import OURO_1_4B, SHAPES, Shape, ShapeBenchConfig, format_shape_table, run_shape_benchmark
from speed.config import ModelConfig, preset
from speed.decode.generate import GenerateResult, generate
from speed.engine.sampling import Sampling
from speed.losses import loss_weights, shift_right
from speed.models.checkpoint import load_model
from speed.models.convert_ouro import config_from_ouro
from speed.models.t5 import SpeedT5
from speed.paths import repo_root
from speed.train.optim import OptimConfig, build_optimizer, build_scheduler, follow_parameters
from speed.train.state import TrainingState, load_training_state, rng_state, save_training_checkpoint, set_rng_state
from speed.train.train_log import TRAIN_LOG_SCHEMA


@dataclass(frozen=True)
class CheckSize:
    """How much each stage does: ``FULL`` fits the 8-minute budget on one GPU, ``TINY`` is a CPU dry run."""

    preset: str = "base"
    vocab_size: int = 16384  # jobs/bench_decode.py's: the CPU table's
    pattern: str = "2x6"
    batches: tuple[int, ...] = (1, 8)
    source_len: int = 32
    new_tokens: int = 64  # per timed decode
    reps: int = 5  # timed rounds per batch size, interleaved
    timing_s: float = 150.0  # a further batch size is timed only while the stage stays under this
    agree_batch: int = 8
    agree_tokens: int = 32
    train_steps: int = 4
    train_batch: int = 8
    train_target_len: int = 32
    pytest_timeout_s: float = 120.0
    shape: str | Shape = "ouro-1.4b"  # the real-shape and Llama stages' (a name of SHAPES, or a Shape)
    shape_batches: tuple[int, ...] = (1, 32, 8)  # the goals read batch 1 and 32: 8 only if time is left
    shape_tokens: int = 16
    shape_reps: int = 3
    shape_s: float = 150.0  # the real-shape stage's budget: a further batch runs only while it fits
    llama_batches: tuple[int, ...] = (1,)  # each batch size is one more compilation of transformers' forward
    llama_tokens: int = 32
    llama_reps: int = 3
    launch_tokens: int = 8  # tokens profiled for the launch counts
    bandwidth_bytes: int = 2**30  # the bandwidth buffers' size

    def model(self) -> ModelConfig:
        """The model every stage builds (random weights)."""
        return preset(self.preset, pattern=self.pattern, vocab_size=self.vocab_size)


FULL = CheckSize()
TINY = CheckSize(
    preset="tiny", vocab_size=128, batches=(1, 2), source_len=6, new_tokens=6, reps=1, agree_batch=2,
    agree_tokens=6, train_steps=2, train_batch=2, train_target_len=5, shape_tokens=4, shape_s=30.0,
    shape_batches=(1, 4), shape_reps=2, llama_batches=(1, 2), llama_tokens=5, llama_reps=1, launch_tokens=3,
    bandwidth_bytes=2**24,
    shape=Shape(
        OURO_1_4B | {"hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2, "num_attention_heads": 4,
                     "num_key_value_heads": 4, "head_dim": 16, "vocab_size": 128},
        config_from_ouro,
    ),  # Ouro's form at tiny size
)  # fmt: skip


@dataclass(frozen=True)
class Machine:
    """Where the check ran."""

    device: str
    name: str  # the GPU's name, or the CPU architecture
    torch: str
    cuda: str | None  # the CUDA version torch was built with
    python: str


@dataclass(frozen=True)
class Stage:
    """One stage's outcome: ``ok`` its verdict, ``result`` what it measured, ``error`` the traceback if it raised."""

    name: str
    ok: bool
    seconds: float
    result: Any = None  # the stage's result dataclass (as a dict in the JSON file)
    error: str | None = None
    skipped: str | None = None  # why the stage did not run (the budget); then ok is False and nothing was measured


@dataclass(frozen=True)
class TrainingRun:
    """A few optimizer steps on the device, a checkpoint round trip, and one step on from it."""

    steps: int
    losses: list[float]  # the weighted loss L_w of each step (the same batch every step)
    ms_per_step: float  # median
    peak_memory_mb: float | None  # CUDA only
    state_on_device: bool  # after loading on the CPU, every moment tensor followed the parameters to the device
    state_restored: bool  # ... and equals, bit for bit, the state that was saved
    continued_loss: float  # the next step's loss, uninterrupted
    resumed_loss: float  # the same step's loss from the reloaded checkpoint
    resume_max_abs_diff: float  # parameters after that step, resumed vs uninterrupted (CUDA atomics: may be > 0)

    @property
    def ok(self) -> bool:
        """Finite losses, and the optimizer state restored onto the device."""
        finite = all(math.isfinite(x) for x in (*self.losses, self.continued_loss, self.resumed_loss))
        return finite and self.state_on_device and self.state_restored


@dataclass(frozen=True)
class Agreement:
    """Tokens of one decoding setting on two devices, the same weights and inputs."""

    sampling: str  # greedy | sampled (temperature 1, one seed)
    sequences: int
    identical: int  # sequences whose tokens are equal on both devices
    positions: int  # output positions compared (each sequence's shorter length)
    agreeing: int  # of them, with equal tokens
    rate: float  # agreeing / positions
    mean_prefix: float  # mean tokens before a sequence's first difference


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
class LlamaRun:
    """A plain Llama of the shape through ``transformers`` (static cache, compiled on CUDA) against our Dx1 of the
    same weights, sequential: ms per token after the first, each run's own split, medians."""

    layers: int
    compiled: bool  # transformers' forward under torch.compile (CUDA only)
    rows: list[dict]  # per batch: ms per token of each, "speedup_vs_hf" (theirs over ours: above 1, ours faster), TTFTs
    agreement: float  # the share of greedy tokens the two chose alike (bf16 kernels differ: not expected equal)


@dataclass(frozen=True)
class PytestRun:
    """``pytest -m gpu`` in a subprocess."""

    command: list[str]
    returncode: int | None  # None: stopped at its timeout
    timeout_s: float
    outcomes: dict[str, int]  # per test: PASSED, FAILED, SKIPPED, ERROR, ...
    failed: list[str]  # the tests that failed or errored
    summary: str  # pytest's last line
    tail: str  # the end of its output


@dataclass(frozen=True)
class GpuCheckReport:
    """Everything the check found; ``jobs/gpu_check.py`` writes it as one JSON file."""

    date: str  # UTC
    machine: Machine
    size: CheckSize
    budget_s: float
    stages: list[Stage]
    seconds: float


def machine(device: str) -> Machine:
    """The device's name, torch's version and its CUDA build."""
    dev = torch.device(device)
    name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else _platform.machine()
    return Machine(str(dev), name, torch.__version__, torch.version.cuda, _platform.python_version())


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# ----- training ---------------------------------------------------------------------------------------------


def training_stage(size: CheckSize, device: str) -> TrainingRun:
    """Train ``size.train_steps`` steps on one random batch, save a training checkpoint, reload it on the CPU
    as a resume does (``speed.train.loop``), follow the parameters to the device, and take one more step from
    there and from the uninterrupted run."""
    dev = torch.device(device)
    config = size.model()
    optim = OptimConfig(warmup_steps=0, schedule="constant")  # the full lr from the first step: the loss moves
    torch.manual_seed(0)
    model = SpeedT5(config).to(dev).train()
    optimizer = build_optimizer(model, optim)
    scheduler = build_scheduler(optimizer, optim, size.train_steps + 1)
    weights = loss_weights("linear", model.n_loops).to(dev)
    generator = torch.Generator().manual_seed(1)
    labels = torch.randint(3, config.vocab_size, (size.train_batch, size.train_target_len), generator=generator)
    inputs = torch.randint(3, config.vocab_size, (size.train_batch, size.source_len), generator=generator)
    batch = {"input_ids": inputs, "attention_mask": torch.ones_like(inputs), "labels": labels}
    batch = {k: v.to(dev) for k, v in (batch | {"decoder_input_ids": shift_right(labels)}).items()}
    autocast = torch.autocast("cuda", dtype=torch.bfloat16) if dev.type == "cuda" else nullcontext()
    if dev.type == "cuda":
        torch.cuda.reset_peak_memory_stats(dev)

    def step(m: SpeedT5, opt: torch.optim.Optimizer, sched: torch.optim.lr_scheduler.LRScheduler) -> float:
        with autocast:  # the forward only, as in training
            out = m(**batch, weights=weights)
        out.loss.backward()
        torch.nn.utils.clip_grad_norm_(m.parameters(), optim.grad_clip)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        return float(out.loss.detach())

    losses, times = [], []
    for _ in range(size.train_steps):
        t0 = time.perf_counter()
        losses.append(step(model, optimizer, scheduler))
        _sync(dev)
        times.append((time.perf_counter() - t0) * 1000)
    peak = torch.cuda.max_memory_allocated(dev) / 2**20 if dev.type == "cuda" else None

    with tempfile.TemporaryDirectory(prefix="speed-gpu-check-") as directory:
        state = TrainingState(
            size.train_steps, optimizer.state_dict(), scheduler.state_dict(), [rng_state()],
            TRAIN_LOG_SCHEMA.empty_table(),
        )  # fmt: skip
        save_training_checkpoint(directory, model, None, {}, state)
        saved = copy.deepcopy(optimizer.state_dict())  # the next step updates the live state in place
        continued_loss = step(model, optimizer, scheduler)
        resumed = load_model(directory).model.train()  # on the CPU, as a resume loads it
        restored = load_training_state(directory)
    resumed_opt = build_optimizer(resumed, optim)
    resumed_opt.load_state_dict(restored.optimizer)
    resumed_sched = build_scheduler(resumed_opt, optim, size.train_steps + 1)
    resumed_sched.load_state_dict(restored.scheduler)
    resumed.to(dev)
    follow_parameters(resumed_opt)
    set_rng_state(restored.rng[0])  # the dropout masks of the step the uninterrupted run took
    moments = [v for s in resumed_opt.state.values() for k, v in s.items() if k != "step" and torch.is_tensor(v)]
    state_restored = _same_state(saved, resumed_opt.state_dict())
    resumed_loss = step(resumed, resumed_opt, resumed_sched)
    diff = max(float((a.detach() - b.detach()).abs().max()) for a, b in zip(model.parameters(), resumed.parameters()))
    return TrainingRun(
        steps=size.train_steps,
        losses=losses,
        ms_per_step=statistics.median(times),
        peak_memory_mb=peak,
        state_on_device=bool(moments) and all(v.device.type == dev.type for v in moments),
        state_restored=state_restored,
        continued_loss=continued_loss,
        resumed_loss=resumed_loss,
        resume_max_abs_diff=diff,
    )


def _same_state(a: dict, b: dict) -> bool:
    """Two optimizer state dicts hold the same tensors, bit for bit (on any devices)."""
    if a["state"].keys() != b["state"].keys():
        return False
    for key, state in a["state"].items():
        other = b["state"][key]
        if state.keys() != other.keys() or not all(torch.equal(state[k].cpu(), other[k].cpu()) for k in state):
            return False
    return True


# ----- agreement --------------------------------------------------------------------------------------------


def agreement(sampling: str, a: list[list[int]], b: list[list[int]]) -> Agreement:
    """How the tokens ``b`` of one setting on one device agree with ``a`` on another, sequence by sequence."""
    positions = agreeing = identical = 0
    prefixes = []
    for x, y in zip(a, b, strict=True):
        same = [p == q for p, q in zip(x, y)]
        positions += len(same)
        agreeing += sum(same)
        identical += x == y
        prefixes.append(same.index(False) if False in same else len(same))
    return Agreement(sampling, len(a), identical, positions, agreeing, agreeing / max(positions, 1),
                     statistics.mean(prefixes))  # fmt: skip


def agreement_stage(size: CheckSize, device: str) -> list[Agreement]:
    """Decode one random batch sequentially on the CPU and on ``device`` with the same weights, greedy and
    sampled (the noise computed on each device, ``device_gumbel``), and compare the tokens."""
    cpu = random_model(size.model(), seed=0)  # EOS disabled: every sequence runs its full length
    other = copy.deepcopy(cpu).to(device)
    shape = (size.agree_batch, size.source_len)
    ids = torch.randint(3, size.vocab_size, shape, generator=torch.Generator().manual_seed(2))
    found = []
    for name, sampling in (("greedy", None), ("sampled", Sampling(temperature=1.0, seed=7))):
        kw = {"method": "sequential", "max_new_tokens": size.agree_tokens, "trace": False, "sampling": sampling}
        found.append(agreement(name, generate(cpu, ids, **kw).tokens, generate(other, ids, **kw).tokens))
    return found


# ----- timing -----------------------------------------------------------------------------------------------


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
                notes.append(f"batch {batch}: {_last_line(err)} with transformers' generate; timed again without it")
                table = run_benchmark(dataclasses.replace(cfg, compare_hf=False))
        except Exception as err:  # e.g. SPEED's tokens differ from sequential's: the next batch size still runs
            errors.append(f"batch {batch}: {_last_line(err)}")
            continue
        batch_rows = table.to_pylist()
        rows += batch_rows
        found.append(ratios(batch, batch_rows))
        last = time.perf_counter() - t0
    return TimingRun(rows, found, notes, errors)


def copy_bandwidth(device: str, n_bytes: int, reps: int = 5) -> float:
    """GB/s of a device-to-device copy of ``n_bytes`` (read and written: 2 x n_bytes moved), the best of ``reps``."""
    dev = torch.device(device)
    src = torch.ones(n_bytes // 4, dtype=torch.float32, device=dev)
    dst = torch.empty_like(src)
    dst.copy_(src)
    best = float("inf")
    for _ in range(reps):
        _sync(dev)
        start = time.perf_counter()
        dst.copy_(src)
        _sync(dev)
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
    reference = generate(model, ids, method="sequential", max_new_tokens=n, trace=False)
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
                _sync(dev)
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


# ----- a plain Llama through transformers ---------------------------------------------------------------------


class _FirstTokenClock:
    """A ``generate`` streamer that notes when the first new tokens were made (its second ``put``: the first is the
    prompt), after the device finished them."""

    def __init__(self, device: torch.device) -> None:
        self.device, self.puts, self.first = device, 0, math.nan

    def put(self, value: torch.Tensor) -> None:
        self.puts += 1
        if self.puts == 2:
            _sync(self.device)
            self.first = time.perf_counter()

    def end(self) -> None:
        pass


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
            clock = _FirstTokenClock(dev)
            start = time.perf_counter()
            with torch.inference_mode():
                out = hf.generate(b_ids, attention_mask=torch.ones_like(b_ids), max_new_tokens=n, min_new_tokens=n,
                                  do_sample=False, num_beams=1, streamer=clock)  # fmt: skip
            _sync(dev)
            end = time.perf_counter()
            return out[:, b_ids.shape[1] :].tolist(), clock.first - start, end - clock.first

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
        per = {k: statistics.median(r * 1000 / (batch * (n - 1)) for _, r in v) for k, v in times.items()}
        ttft = {k: statistics.median(f * 1000 for f, _ in v) for k, v in times.items()}
        rows.append({
            "batch": batch, "ours_ms_per_token": per["ours"], "hf_ms_per_token": per["hf"],
            "speedup_vs_hf": per["hf"] / per["ours"], "ours_ttft_ms": ttft["ours"], "hf_ttft_ms": ttft["hf"],
        })  # fmt: skip
        pairs = [(a, b) for x, y in zip(tokens["ours"], tokens["hf"]) for a, b in zip(x, y)]
        agree, total = agree + sum(a == b for a, b in pairs), total + len(pairs)
    return LlamaRun(layers, compiled, rows, agree / max(total, 1))


def _last_line(err: BaseException) -> str:
    return f"{type(err).__name__}: {str(err).strip().splitlines()[-1] if str(err).strip() else ''}"


# ----- exactness: pytest -m gpu -----------------------------------------------------------------------------

_OUTCOME = re.compile(r"^(\S+::\S+) (PASSED|FAILED|SKIPPED|ERROR|XFAIL|XPASS)\b", re.MULTILINE)


def exactness_stage(timeout_s: float) -> PytestRun:
    """``pytest -m gpu tests/test_gpu_decode.py -v`` with this checkout's ``platform/`` on the path, stopped at
    ``timeout_s``; outcomes are read from its per-test lines, so a stopped run still counts what finished."""
    root = repo_root()
    command = [sys.executable, "-m", "pytest", "-m", "gpu", "tests/test_gpu_decode.py", "-v", "-p", "no:cacheprovider"]
    path = os.pathsep.join(p for p in (str(root / "platform"), os.environ.get("PYTHONPATH")) if p)
    # no plugins: the tests need none, and the ones installed here would only slow the start; unbuffered, so
    # that a run stopped at its timeout has written the lines of the tests it finished
    env = os.environ | {"PYTHONPATH": path, "PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1", "PYTHONUNBUFFERED": "1"}
    try:
        done = subprocess.run(command, cwd=root, env=env, capture_output=True, text=True, timeout=timeout_s)
        returncode, output = done.returncode, done.stdout + done.stderr
    except subprocess.TimeoutExpired as stopped:
        returncode = None
        output = "".join(_text(x) for x in (stopped.stdout, stopped.stderr))
    outcomes: dict[str, int] = {}
    failed = []
    for test, outcome in _OUTCOME.findall(output):
        outcomes[outcome] = outcomes.get(outcome, 0) + 1
        if outcome in ("FAILED", "ERROR"):
            failed.append(test)
    lines = output.strip().splitlines()
    return PytestRun(command, returncode, timeout_s, outcomes, failed, lines[-1] if lines else "",
                     "\n".join(lines[-40:]))  # fmt: skip


def _text(x: str | bytes | None) -> str:
    return x.decode(errors="replace") if isinstance(x, bytes) else (x or "")


# ----- the check --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class StagePlan:
    """One stage of the check: ``run(size, device, seconds left)`` returns its result, ``verdict(result)`` says
    whether it passed, and it starts only with ``needs_s`` seconds (``needs_s(size)``) of the budget left."""

    name: str
    run: Callable[[CheckSize, str, float], Any]
    verdict: Callable[[Any], bool]
    needs_s: Callable[[CheckSize], float] = lambda size: 0.0


def _exactness(size: CheckSize, device: str, left_s: float) -> PytestRun:
    return exactness_stage(min(size.pytest_timeout_s, left_s - 5))  # the report still has to be written


# the order is the priority under a tight budget: exactness (pytest, under its timeout) first, then the figures
STAGES: list[StagePlan] = [
    StagePlan("exactness", _exactness, lambda r: r.returncode == 0, lambda size: 35.0),
    StagePlan("launches", launches_stage, lambda r: bool(r)),
    StagePlan("shapes", shape_stage, lambda r: bool(r.rows), lambda size: size.shape_s / 3 + 30),
    StagePlan("llama", llama_stage, lambda r: bool(r.rows), lambda size: size.shape_s / 2 + 25),
    StagePlan("timing", timing_stage, lambda r: bool(r.rows) and not r.errors, lambda size: 40.0),
    StagePlan("agreement", lambda size, device, left: agreement_stage(size, device), lambda r: True),  # a measure
    StagePlan("training", lambda size, device, left: training_stage(size, device), lambda r: r.ok),
    # FSDP (world size 1) at Ouro-1.4B's shape, bf16, block checkpointing: about a minute on an H100
    StagePlan(
        "sharded training",
        lambda size, device, left: training_check(size is TINY, device),
        lambda r: r.ok,
        lambda size: 10.0 if size is TINY else 60.0,
    ),
]


def run_stage(name: str, fn: Callable[[], Any], verdict: Callable[[Any], bool]) -> Stage:
    """Run one stage; an exception is recorded in the ``Stage``, never raised."""
    print(f"== {name} ==", flush=True)
    t0 = time.perf_counter()
    try:
        result = fn()
    except Exception:
        return Stage(name, False, time.perf_counter() - t0, error=traceback.format_exc())
    return Stage(name, verdict(result), time.perf_counter() - t0, result)


def run_check(
    size: CheckSize,
    device: str,
    budget_s: float,
    on_stage: Callable[[GpuCheckReport], None],
    stages: list[StagePlan] | None = None,
) -> GpuCheckReport:
    """Every stage of ``stages`` (default ``STAGES``) in turn on ``device``; a stage that needs more than is left of
    ``budget_s`` is skipped with the reason; ``on_stage`` sees the report so far after each one."""
    started = time.perf_counter()
    date = datetime.now(timezone.utc).date().isoformat()
    done: list[Stage] = []

    def report() -> GpuCheckReport:
        return GpuCheckReport(date, machine(device), size, budget_s, list(done), time.perf_counter() - started)

    for plan in STAGES if stages is None else stages:
        left = budget_s - (time.perf_counter() - started)
        need = plan.needs_s(size)
        if left < need:
            why = f"{max(left, 0):.0f} s of the budget left, it needs {need:.0f} s"
            print(f"== {plan.name}: skipped ({why}) ==", flush=True)
            done.append(Stage(plan.name, False, 0.0, skipped=why))
        else:
            done.append(run_stage(plan.name, lambda p=plan, x=left: p.run(size, device, x), plan.verdict))
        on_stage(report())
    return report()


def failed(report: GpuCheckReport) -> list[str]:
    """The stages that ran and did not pass (a skipped stage is not one)."""
    return [s.name for s in report.stages if not s.ok and s.skipped is None]


def report_dict(report: GpuCheckReport) -> dict[str, Any]:
    """The report as plain JSON-ready data."""
    return dataclasses.asdict(report)


def format_report(report: GpuCheckReport) -> str:
    """The summary table: one line per stage, then each batch size's decode table and ratios."""
    m = report.machine
    passed = sum(s.ok for s in report.stages)
    skipped = sum(s.skipped is not None for s in report.stages)
    width = max([len("stage"), *(len(s.name) for s in report.stages)]) + 2  # "sharded training" is 16
    lines = [
        f"GPU check {report.date} on {m.name} ({m.device}), torch {m.torch} (CUDA {m.cuda}), python {m.python}: "
        f"{passed}/{len(report.stages)} stages ok ({skipped} skipped) in {report.seconds:.0f} s",
        f"{'stage':<{width}}{'ok':<5}{'seconds':>8}  result",
    ]
    for s in report.stages:
        if s.skipped is not None:
            said, ok = f"skipped: {s.skipped}", "--"
        else:
            said = _describe(s.result) if s.error is None else f"error: {s.error.strip().splitlines()[-1]}"
            ok = "yes" if s.ok else "NO"
        lines.append(f"{s.name:<{width}}{ok:<5}{s.seconds:>8.1f}  {said}")
    for s in report.stages:
        if isinstance(s.result, TimingRun):
            lines += _timing_tables(s.result)
        if isinstance(s.result, ShapeRun):
            table = pa.Table.from_pylist(s.result.rows, schema=LM_BENCH_SCHEMA)
            reps = table.column("reps")[0].as_py() if table.num_rows else 0
            lines += ["", f"real shape (ms/token, medians of {reps} interleaved rounds):", format_shape_table(table)]
            lines.append("vs the copy's limit (" + f"{s.result.copy_gb_per_s:.0f} GB/s): " + ", ".join(
                f"{r['batch']} {r['variant']} {x:.2f}x" for r, x in zip(s.result.rows, s.result.vs_copy_limit)))
        if isinstance(s.result, LlamaRun):
            lines += ["", f"Llama {s.result.layers}x1 (transformers, static cache, "
                      f"{'compiled' if s.result.compiled else 'eager'}) against our {s.result.layers}x1:"]
            lines += [f"  batch {r['batch']}: ours {r['ours_ms_per_token']:.2f} ms/token, transformers "
                      f"{r['hf_ms_per_token']:.2f}: ours {r['speedup_vs_hf']:.2f}x its speed" for r in s.result.rows]
    return "\n".join(lines)


def _describe(result: Any) -> str:
    if isinstance(result, TrainingRun):
        memory = f", peak {result.peak_memory_mb:.0f} MiB" if result.peak_memory_mb is not None else ""
        return (
            f"{result.steps} steps, loss {result.losses[0]:.3f} -> {result.losses[-1]:.3f}, "
            f"{result.ms_per_step:.1f} ms/step{memory}; optimizer state after loading: "
            f"{'on the device' if result.state_on_device else 'NOT on the device'}, "
            f"{'restored bit for bit' if result.state_restored else 'NOT restored'}; one step on, resumed vs "
            f"uninterrupted: loss {result.resumed_loss:.4f} vs {result.continued_loss:.4f}, "
            f"parameters max |diff| {result.resume_max_abs_diff:.2e}"
        )
    if isinstance(result, list) and result and isinstance(result[0], Agreement):
        return "; ".join(
            f"{a.sampling}: {a.identical}/{a.sequences} sequences identical, {a.agreeing}/{a.positions} tokens "
            f"({100 * a.rate:.1f}%), {a.mean_prefix:.1f} tokens before a first difference"
            for a in result
        )
    if isinstance(result, TimingRun):
        timed = ", ".join(str(r.batch) for r in result.ratios)
        return f"batch {timed} timed (tables below)" + "".join(f"; {x}" for x in result.notes + result.errors)
    if isinstance(result, ShapeRun):
        x = result.summary
        batches = ", ".join(str(b) for b in dict.fromkeys(r["batch"] for r in result.rows))
        scale = ", ".join(f"{v} {k:.2f}x" for v, k in result.batch_speedup.items())
        scale = f"; tokens/s, largest batch over batch 1: {scale}" if scale else ""
        return (
            f"{x['shape']}, batch {batches}: oracle speed-up {x['oracle_speedup']:.2f}x, sequential "
            f"{x['sequential_vs_limit']:.2f}x its bandwidth limit at batch 1 ({x['read_gb_per_s']:.0f} GB/s read, "
            f"{result.copy_gb_per_s:.0f} GB/s copied){scale}" + "".join(f"; {n}" for n in result.notes)
        )
    if isinstance(result, LlamaRun):
        return ", ".join(f"batch {r['batch']}: ours {r['speedup_vs_hf']:.2f}x transformers'" for r in result.rows) + (
            f" ({'compiled' if result.compiled else 'eager'} static cache; {100 * result.agreement:.0f}% tokens alike)"
        )
    if isinstance(result, list) and result and isinstance(result[0], LaunchCount):
        return "; ".join(
            f"{c.variant}: "
            + ("no device kernels (CPU)" if c.kernels is None else f"{c.kernels_per_token:.0f} kernels/token")
            + ("" if c.syncs is None else f", {c.syncs_per_pass:.2f} syncs/pass")
            for c in result
        )
    if isinstance(result, PytestRun):
        counts = ", ".join(f"{n} {k.lower()}" for k, n in sorted(result.outcomes.items()))
        stopped = f"stopped at its {result.timeout_s:.0f} s timeout; " if result.returncode is None else ""
        failed = f"; failed: {', '.join(result.failed)}" if result.failed else ""
        return f"{stopped}{counts or 'no test ran'} (pytest: {result.summary.strip('= ')}){failed}"
    return repr(result)


def _timing_tables(run: TimingRun) -> list[str]:
    lines = []
    for r in run.ratios:
        rows = [row for row in run.rows if row["batch"] == r.batch]
        table = pa.Table.from_pylist(rows, schema=BENCH_SCHEMA)
        pattern = {row["variant"]: row["pattern"] for row in rows}
        deep = ""
        if r.deep_over_shallow is not None:
            deep = f", {pattern['ours_deep']} / {pattern['shallow']} {r.deep_over_shallow:.2f}x"
        lines += [
            "",
            f"decode, batch {r.batch} (ms/token, medians of {table.column('reps')[0].as_py()} interleaved rounds):",
            format_table(table),
            f"SPEED / sequential {r.speed_over_sequential:.2f}x, SPEED / shallow {r.speed_over_shallow:.2f}x, "
            f"oracle / sequential {r.oracle_over_sequential:.2f}x, oracle / shallow {r.oracle_over_shallow:.2f}x"
            f"{deep}",
        ]
    return lines
