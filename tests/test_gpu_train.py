"""The GPU check's sharded-training stage (``speed.benchmarks.gpu_train``) as a dry run on the CPU: FSDP over one
gloo worker at Ouro's form, tiny, in a process that cannot import Ray; the plan of the real shape it would run."""

from __future__ import annotations

import json
import subprocess
import sys

from test_gpu_check import without_absent

from speed.benchmarks.gpu_train import FULL_TRAIN
from speed.paths import repo_root
from speed.train.memory_plan import StepShape, plan_step

SCRIPT = """
import dataclasses, json
from speed.benchmarks.gpu_train import describe, training_check
run = training_check(True, "cpu")
print(describe(run))
print(json.dumps(dataclasses.asdict(run) | {"ok": run.ok}))
"""


def test_the_tiny_stage_trains_sharded_without_ray(tmp_path):
    out = subprocess.run(
        [sys.executable, "-c", SCRIPT], cwd=repo_root(), env=without_absent(tmp_path), capture_output=True,
        text=True, timeout=120,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    line, result = out.stdout.splitlines()[-2:]
    run = json.loads(result)
    assert run["ok"] and len(run["losses"]) == 4 and run["losses"][-1] < run["losses"][0]
    assert run["tokens_per_s"] > 0 and run["peak_memory_mb"] is None and run["planned_mb"] > 0
    assert line.startswith("FSDP x1") and "tokens/s" in line


def test_the_real_shape_fits_one_h100_by_the_plan():
    shape = StepShape(FULL_TRAIN.model, FULL_TRAIN.batch, FULL_TRAIN.seq_len, 0, strategy="fsdp",
                      checkpointing="block", gpu_bf16=True)  # fmt: skip
    plan = plan_step(shape)
    assert 1.3e9 < plan.parameter_count < 1.5e9  # Ouro-1.4B
    assert plan.total < 40 * 2**30  # well inside an H100's 80 GB: the stage never refuses there
