"""SPEED under seeded sampling on a trained checkpoint: batch 1, against sequential sampling, side by side.

    python jobs/bench_sampling.py --checkpoint runs/demo/<finetune run>/checkpoint_<step> --limit 100

Decodes the checkpoint task's held-out test sentences one at a time (sentence i samples with seed i)
sequentially and with SPEED at each temperature (0 is greedy), speculating from the early exit's draw
under the same noise (coupled) or from its argmax; reports group passes per token, ms per token, the
speed-up over sequential sampling at the same temperature (variants interleaved per sentence) and
whether every output equals sequential sampling's. Writes the rows
(speed.benchmarks.sampling.SAMPLING_BENCH_SCHEMA) to --out.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "platform"))  # this checkout's speed, not an installed one

from speed.benchmarks.heldout import add_held_out_flags, held_out
from speed.benchmarks.sampling import format_sampling_table, run_sampling_benchmark
from speed.cli import JobParser, add_report_flags, report_rows, user_errors


def main(argv: list[str] | None = None) -> int:
    p = JobParser(prog="bench_sampling.py", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_held_out_flags(p, limit=100, max_new_tokens=64)
    p.add_argument("--temperatures", default="0,0.7,1.0", help="comma-separated; 0 is greedy")
    add_report_flags(p, Path("results/bench_sampling.parquet"))
    args = p.parse_args(argv)
    with user_errors():  # a missing checkpoint, task or split, a bad temperature: one line, status 2
        temperatures = tuple(float(t) for t in args.temperatures.split(","))
        if any(t < 0 for t in temperatures):
            raise ValueError(f"temperatures must be >= 0, got {args.temperatures}")
        work = held_out(args.checkpoint, args.split, args.limit)
    if args.threads:
        torch.set_num_threads(args.threads)
    print(
        f"sampling benchmark: {work.model.config.pattern}, {len(work.inputs)} {work.task} {args.split} sentences, "
        f"batch 1, temperatures {temperatures}, threads {torch.get_num_threads()}",
        flush=True,
    )
    table = run_sampling_benchmark(work.model, work.inputs, temperatures, args.max_new_tokens)
    report_rows(table, args, format_sampling_table)
    return 0 if all(table.column("identical").to_pylist()) else 1


if __name__ == "__main__":
    sys.exit(main())
