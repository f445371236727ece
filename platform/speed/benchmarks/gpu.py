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
needs to start); another module adds one by appending to a list of them. This module holds the plan, the run and the
report; the stages are ``speed.benchmarks.gpu_correctness``'s (exactness, agreement, training),
``speed.benchmarks.gpu_timing``'s (launches, shapes, llama, timing) and ``speed.benchmarks.gpu_train``'s (sharded
training), each reading a ``speed.benchmarks.gpu_setup.CheckSize``. No figure is typed in: every time and
ratio is measured in the run, and a time per token is each run's own split (never negative). Every timed decode
of ours runs on an engine kept for its (model, batch, mode) (``speed.benchmarks.decode.decoding``), built and its
CUDA graphs captured in an untimed first run, so no timed run builds an engine or captures a graph; both families'
passes are captured on CUDA (the Triton kernels').
"""

from __future__ import annotations

import dataclasses
import platform as _platform
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any

import pyarrow as pa
import torch

from speed.benchmarks.decode import BENCH_SCHEMA, format_table
from speed.benchmarks.decode_lm import LM_BENCH_SCHEMA
from speed.benchmarks.gpu_correctness import (
    Agreement,
    PytestRun,
    TrainingRun,
    agreement_stage,
    exactness_stage,
    training_stage,
)
from speed.benchmarks.gpu_setup import TINY, CheckSize
from speed.benchmarks.gpu_timing import (
    LaunchCount,
    LlamaRun,
    ShapeRun,
    TimingRun,
    launches_stage,
    llama_stage,
    shape_stage,
    timing_stage,
)
from speed.benchmarks.gpu_train import training_check
from speed.benchmarks.shapes import format_shape_table


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
