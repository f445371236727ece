"""The GPU check (`make gpu-check`): the CUDA paths run once, within 8 minutes with the machine's start, on a
machine without Ray.

    python3 jobs/gpu_check.py                          # on a GPU machine: its own python3 and torch
    python3 jobs/gpu_check.py --device cpu --tiny      # a dry run of every stage at tiny size on the CPU
    python3 jobs/gpu_check.py --stages shapes,llama    # some stages only (a second run for what the first skipped)

Stages (speed.benchmarks.gpu.STAGES, in this order): exactness (pytest -m gpu tests/test_gpu_decode.py),
launches (kernels per token, synchronisations per pass), shapes (Ouro-1.4B's shape, bf16, batch 1, 8 and 32,
against the read and copy bandwidths measured there), llama (the same shape as a 24-layer Llama through
transformers, static cache, compiled, against our 24x1), timing (decode at base dims, batch 1 and 8, against
transformers' generate), agreement (CUDA tokens against the CPU's for the same weights) and training (a few steps
on the device, a checkpoint saved and loaded, the optimizer state back on the device). A failing stage is
recorded and the next one runs; one that would not fit what is left of --budget-s is skipped, with the reason.
Writes one JSON file (--out; default $OUT/gpu_check.json when $OUT is set, else results/gpu_check.json),
rewritten after every stage, and prints a summary table. Without a CUDA device it says so in one line
and exits 2 before doing anything; it exits 1 when a stage that ran failed.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "platform"))  # this checkout's speed, not an installed one

from speed.benchmarks.gpu import STAGES, failed, format_report, report_dict, run_check
from speed.benchmarks.gpu_setup import FULL, TINY
from speed.cli import JobParser


def default_out() -> Path:
    """``$OUT/gpu_check.json`` where a runner collects files from ``$OUT``, else under results/."""
    return Path(os.environ["OUT"]) / "gpu_check.json" if os.environ.get("OUT") else Path("results/gpu_check.json")


def main(argv: list[str] | None = None) -> int:
    p = JobParser(prog="gpu_check.py", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda", help="torch device to check (default: cuda)")
    p.add_argument("--tiny", action="store_true", help="tiny sizes: a dry run of every stage in seconds")
    p.add_argument(
        "--budget-s", type=float, default=360.0,
        help="wall-clock budget (default 360: 6 minutes of work in an 8-minute run); a stage that would not fit "
        "what is left is skipped",
    )  # fmt: skip
    p.add_argument("--out", type=Path, default=None, help="the JSON report (default: see above)")
    p.add_argument("--stages", default=None, help=f"a comma-separated subset of {','.join(s.name for s in STAGES)}")
    args = p.parse_args(argv)
    stages = STAGES
    if args.stages is not None:
        names = args.stages.split(",")
        unknown = [n for n in names if n not in {s.name for s in STAGES}]
        if unknown:
            p.error(f"--stages: unknown {', '.join(unknown)}; the stages are {', '.join(s.name for s in STAGES)}")
        stages = [s for s in STAGES if s.name in names]
    if torch.device(args.device).type == "cuda" and not torch.cuda.is_available():
        print(
            f"error: no CUDA device here (torch {torch.__version__}, CUDA build {torch.version.cuda}): nothing was "
            "checked; --device cpu --tiny is a dry run",
            file=sys.stderr,
        )
        return 2
    out = args.out or default_out()
    out.parent.mkdir(parents=True, exist_ok=True)

    def write(report) -> None:
        out.write_text(json.dumps(report_dict(report), indent=2, default=str))

    report = run_check(TINY if args.tiny else FULL, args.device, args.budget_s, write, stages)
    print()
    print(format_report(report))
    print(f"report written to {out}")
    return 1 if failed(report) else 0


if __name__ == "__main__":
    sys.exit(main())
