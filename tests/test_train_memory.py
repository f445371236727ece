"""The memory plan (``speed.train.memory_plan``): within 20 % of a step's measured peak on the CPU, with and without
activation checkpointing, under DDP and under FSDP on two gloo workers (``speed.benchmarks.train_memory``, in its
own process); what sharding, checkpointing and
truncation change in it; a job that would not fit refused in one line before any worker starts."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from speed.benchmarks.train_memory import bench_job
from speed.models.looped_lm import CHECKPOINTING
from speed.train.config import job_from_dict
from speed.train.memory_plan import PlanRefused, block_floats, check_fits, plan_memory

ROOT = Path(__file__).resolve().parents[1]


def _run(*args: str, **env: str) -> subprocess.CompletedProcess:
    environment = {**os.environ, "PYTHONPATH": str(ROOT / "platform"), "OMP_NUM_THREADS": "1", **env}
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, env=environment, timeout=300)


@pytest.mark.slow
def test_the_plan_is_within_20_percent_of_the_measured_peak():
    done = _run("-m", "speed.benchmarks.train_memory", "--json")
    assert done.returncode == 0, done.stderr
    rows = {(row["strategy"], row["checkpointing"]): row for row in map(json.loads, done.stdout.splitlines())}
    assert set(rows) == {(strategy, mode) for strategy in ("ddp", "fsdp") for mode in CHECKPOINTING}
    for key, row in rows.items():
        assert 0.8 <= row["planned"] / row["measured"] <= 1.2, (key, row)
    for strategy in ("ddp", "fsdp"):
        # Checkpointing keeps a block's (or a loop's) input instead of its activations: a third of the peak or less.
        assert rows[strategy, "block"]["measured"] < rows[strategy, "none"]["measured"] / 3
        assert rows[strategy, "loop"]["measured"] < rows[strategy, "none"]["measured"] / 2
    for mode in CHECKPOINTING:  # the same micro-batch per worker, half the states
        assert rows["fsdp", mode]["world"] == 2 and rows["fsdp", mode]["measured"] < rows["ddp", mode]["measured"]


def _job(**train) -> dict:
    return {
        "kind": "finetune",
        "model": {"family": "lm", "preset": "mini", "pattern": "2+4x8+2"},
        "data": {"task": "translate_en_de", "max_source_len": 128, "max_target_len": 128},
        "train": {"batch_size": 8, **train},
        "eval": None,
    }


def test_fsdp_shares_the_states_and_ddp_does_not():
    job = _job()
    ddp = plan_memory(job_from_dict(job | {"scale": {"num_workers": 4}}))
    fsdp = plan_memory(job_from_dict(job | {"scale": {"num_workers": 4, "strategy": "fsdp"}}))
    assert ddp.optimizer == 2 * ddp.gradients == 2 * 4 * ddp.parameter_count
    assert fsdp.optimizer == pytest.approx(ddp.optimizer / 4, abs=8)
    assert ddp.buckets == ddp.gradients and fsdp.buckets == 0  # DDP's second copy of the gradients
    # A quarter, plus the gathered root (embedding, head: whole while the step runs) and two gathered blocks.
    assert ddp.parameters / 4 < fsdp.parameters < ddp.parameters
    assert fsdp.activations == ddp.activations  # the same micro-batch per worker


def test_checkpointing_and_truncation_shrink_the_activations():
    plain = plan_memory(job_from_dict(_job()))
    block = plan_memory(job_from_dict(_job(checkpoint_activations="block")))
    truncated = plan_memory(job_from_dict(_job(backprop_depth=2)))
    sampled = plan_memory(job_from_dict(_job(recurrence_sampling=True)))  # no depth: the draw's cap, 3 x 8 loops
    assert block.activations < plain.activations / 3 and block.recompute == plain.per_layer
    assert truncated.loops == 2 and truncated.activations < plain.activations / 3
    assert sampled.loops == 24 and sampled.activations > 2 * plain.activations
    mini = job_from_dict(_job()).model
    assert plain.per_layer == block_floats(mini) * 8 * 256 * 4  # micro-batch x tokens x float32


def test_a_job_that_does_not_fit_is_refused_in_one_line(tmp_path):
    plan = plan_memory(bench_job("none"))
    check_fits(plan, int(plan.total * 1.2))  # fits, with the margin
    with pytest.raises(PlanRefused, match="a worker needs .* GiB .* but its device holds"):
        check_fits(plan, plan.total)
    flags = ["--model", "lm", "--preset", "tiny", "--max-steps", "2", "--storage-path", str(tmp_path)]
    done = _run(str(ROOT / "jobs" / "pretrain.py"), *flags, "--device-memory-gb", "0.0001", "--no-tracking")
    assert done.returncode == 2
    assert done.stderr.strip().count("\n") == 0 and done.stderr.startswith("error: a worker needs")
    assert "memory plan per worker (ddp, 1 worker(s)" in done.stdout
    assert not any((tmp_path / name).exists() for name in ("data", "mlruns"))  # nothing prepared, nothing started
