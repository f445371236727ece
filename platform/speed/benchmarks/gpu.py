"""The GPU check (``jobs/gpu_check.py``, ``make gpu-check``): every CUDA path run once, in a few minutes, on a
machine that has torch but no Ray.

Five stages, each timed and caught, so that a failing one still leaves the others' results; the caller
rewrites the report after every stage, so a run stopped early keeps what it measured:

- ``training``: a few optimizer steps of the model on the device (forward, the weighted early-exit loss,
  backward, clipping, AdamW; bf16 autocast on CUDA, as ``speed.train.loop`` trains), a training checkpoint
  saved and loaded on the CPU, its optimizer state following the parameters back to the device
  (``speed.train.optim.follow_parameters``), then one more step both from the reload and uninterrupted;
- ``agreement``: the same random weights decoded on the CPU and on the device, greedy and sampled: how
  many tokens agree (equality is not expected across devices: their kernels round differently);
- ``timing``: ``speed.benchmarks.decode.run_benchmark`` on the device at base dims, batch 1 and 8 (2x6
  sequential, SPEED with its own and with oracle speculation, the shallow 2x1, our 12x1 and transformers'
  ``generate`` of it): the paper's Fig. 3 latency axis on a GPU;
- ``shapes``: ``speed.benchmarks.shapes`` at the smallest real shape (Ouro-1.4B, random bf16 weights, batch 1
  and 4): sequential, oracle SPEED and SPEED against the device's read bandwidth measured in the same run (the
  CPU's real-shape table, on the GPU); run only while enough of the budget is left;
- ``exactness``: ``pytest -m gpu tests/test_gpu_decode.py`` in a subprocess (SPEED's logits bitwise equal to
  sequential decoding's on the device), within what is left of the budget.

The in-process stages come first: their work is bounded, while pytest runs under a timeout.
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

from speed.benchmarks.decode import BENCH_SCHEMA, BenchConfig, format_table, random_model, run_benchmark
from speed.benchmarks.decode_lm import LM_BENCH_SCHEMA
from speed.benchmarks.gpu_train import training_check
from speed.benchmarks.shapes import OURO_1_4B, SHAPES, Shape, ShapeBenchConfig, format_shape_table, run_shape_benchmark
from speed.config import ModelConfig, preset
from speed.decode.generate import generate
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
    pytest_timeout_s: float = 200.0
    shape: str | Shape = "ouro-1.4b"  # the real-shape stage's (a name of SHAPES, or a Shape)
    shape_tokens: int = 16
    shape_s: float = 120.0  # the real-shape stage runs only while this much of the budget (and pytest's 30 s) is left

    def model(self) -> ModelConfig:
        """The model every stage builds (random weights)."""
        return preset(self.preset, pattern=self.pattern, vocab_size=self.vocab_size)


FULL = CheckSize()
TINY = CheckSize(
    preset="tiny", vocab_size=128, batches=(1, 2), source_len=6, new_tokens=6, reps=1, agree_batch=2,
    agree_tokens=6, train_steps=2, train_batch=2, train_target_len=5, shape_tokens=4, shape_s=30.0,
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
    """The real-shape benchmark's rows (``LM_BENCH_SCHEMA``) and summary on the device."""

    rows: list[dict]
    summary: dict[str, Any]


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
    sampled (the noise is drawn on the CPU for every device), and compare the tokens."""
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


def timing_stage(size: CheckSize, device: str) -> TimingRun:
    """``run_benchmark`` on ``device`` at each batch size while the stage stays within ``size.timing_s``."""
    rows, found, notes, errors = [], [], [], []
    started, last = time.perf_counter(), 0.0
    for batch in size.batches:
        if rows and time.perf_counter() - started + last > size.timing_s:
            notes.append(f"batch {batch} not timed: it would take the stage past {size.timing_s:.0f} s")
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


def shape_stage(size: CheckSize, device: str) -> ShapeRun:
    """``run_shape_benchmark`` at ``size.shape`` on ``device``: batch 1 and 4, 3 interleaved rounds, 1 GiB read for
    the bandwidth."""
    shape = SHAPES[size.shape] if isinstance(size.shape, str) else size.shape
    name = size.shape if isinstance(size.shape, str) else "tiny"
    cfg = ShapeBenchConfig(
        name, shape.resolve(), new_tokens=size.shape_tokens, reps=3, device=device,
        bandwidth_bytes=2**30 if isinstance(size.shape, str) else 2**24,
    )  # fmt: skip
    table, summary = run_shape_benchmark(cfg)
    return ShapeRun(table.to_pylist(), summary)


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
    size: CheckSize, device: str, budget_s: float, on_stage: Callable[[GpuCheckReport], None]
) -> GpuCheckReport:
    """Every stage in turn on ``device``; ``on_stage`` sees the report so far after each one. pytest's timeout is
    what is left of ``budget_s`` (at most ``size.pytest_timeout_s``)."""
    started = time.perf_counter()
    date = datetime.now(timezone.utc).date().isoformat()
    stages: list[Stage] = []

    def report() -> GpuCheckReport:
        return GpuCheckReport(date, machine(device), size, budget_s, list(stages), time.perf_counter() - started)

    plan = [
        ("training", lambda: training_stage(size, device), lambda r: r.ok),
        ("agreement", lambda: agreement_stage(size, device), lambda r: True),  # a measurement: no verdict
        ("timing", lambda: timing_stage(size, device), lambda r: bool(r.rows) and not r.errors),
        ("sharded training", lambda: training_check(size is TINY, device), lambda r: r.ok),  # FSDP, Ouro-1.4B
    ]
    for name, fn, verdict in plan:
        stages.append(run_stage(name, fn, verdict))
        on_stage(report())
    left = budget_s - (time.perf_counter() - started)
    if left < size.shape_s + 30:
        stages.append(Stage("shapes", False, 0.0, error=f"not run: {max(left, 0):.0f} s of the budget left"))
    else:
        stages.append(run_stage("shapes", lambda: shape_stage(size, device), lambda r: bool(r.rows)))
    on_stage(report())
    left = budget_s - (time.perf_counter() - started) - 5  # the report still has to be written
    timeout = min(size.pytest_timeout_s, left)
    if timeout < 30:
        stages.append(Stage("exactness", False, 0.0, error=f"not run: {max(left, 0):.0f} s of the budget left"))
    else:
        stages.append(run_stage("exactness", lambda: exactness_stage(timeout), lambda r: r.returncode == 0))
    on_stage(report())
    return report()


def report_dict(report: GpuCheckReport) -> dict[str, Any]:
    """The report as plain JSON-ready data."""
    return dataclasses.asdict(report)


def format_report(report: GpuCheckReport) -> str:
    """The summary table: one line per stage, then each batch size's decode table and ratios."""
    m = report.machine
    passed = sum(s.ok for s in report.stages)
    lines = [
        f"GPU check {report.date} on {m.name} ({m.device}), torch {m.torch} (CUDA {m.cuda}), python {m.python}: "
        f"{passed}/{len(report.stages)} stages ok in {report.seconds:.0f} s",
        f"{'stage':<11}{'ok':<5}{'seconds':>8}  result",
    ]
    for s in report.stages:
        said = _describe(s.result) if s.error is None else f"error: {s.error.strip().splitlines()[-1]}"
        lines.append(f"{s.name:<11}{'yes' if s.ok else 'NO':<5}{s.seconds:>8.1f}  {said}")
    for s in report.stages:
        if isinstance(s.result, TimingRun):
            lines += _timing_tables(s.result)
        if isinstance(s.result, ShapeRun):
            table = pa.Table.from_pylist(s.result.rows, schema=LM_BENCH_SCHEMA)
            lines += ["", "real shape (ms/token, medians of 3 interleaved rounds):", format_shape_table(table)]
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
    if isinstance(result, list):  # agreements
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
        return (
            f"{x['shape']}: oracle speed-up {x['oracle_speedup']:.2f}x, sequential {x['sequential_vs_limit']:.2f}x "
            f"its bandwidth limit ({x['read_gb_per_s']:.0f} GB/s read; table below)"
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
