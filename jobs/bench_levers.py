"""SPEED's levers on a trained checkpoint: batch 1, greedy, side by side with plain SPEED, sequential and shallow.

    python jobs/bench_levers.py --checkpoint runs/demo/<finetune run>/checkpoint_<step> --limit 30 \\
        --levers "b6_rb8=branches:6,row_budget:8;lanes_rb8=branches:6,branch_depth:6,row_budget:8"

Decodes the checkpoint task's held-out test sentences one at a time with every variant (sequential; the
shallow Nx1, the same weights run one loop; plain SPEED; SPEED with each --levers setting), the variants
alternating per sentence in a rotating order; reports group passes (SPEED at batch 1: its steps) and rows
per token (exact), ms per token and the ratio to plain SPEED's (measured side by side), and whether every
output equals sequential decoding. Writes
the rows (speed.benchmarks.decode.LEVER_BENCH_SCHEMA) to --out; exits 1 if a SPEED variant's output differs.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "platform"))  # this checkout's speed, not an installed one

from speed.benchmarks.decode import format_lever_table, held_out, parse_levers, run_lever_benchmark
from speed.cli import JobParser, report_rows, user_errors

DEFAULT_LEVERS = "b6_rb8=branches:6,row_budget:8;lanes_rb8=branches:6,branch_depth:6,row_budget:8"


def main(argv: list[str] | None = None) -> int:
    p = JobParser(prog="bench_levers.py", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--checkpoint", required=True, help="a finetuned checkpoint or run (a local path or a URI)")
    p.add_argument("--split", default="test")
    p.add_argument("--limit", type=int, default=30, help="sentences decoded")
    p.add_argument("--levers", default=DEFAULT_LEVERS, help="NAME=key:value,...;... (keys: speed.engine.Speculation's "
                   "fields, launch_loop .. min_confidence, and row_budget)")  # fmt: skip
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    p.add_argument("--out", type=Path, default=Path("results/bench_levers.parquet"))
    p.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    args = p.parse_args(argv)
    with user_errors():  # a missing checkpoint, task or split, a misspelled lever: one line, status 2
        levers = parse_levers(args.levers)
        work = held_out(args.checkpoint, args.split, args.limit)
    if args.threads:
        torch.set_num_threads(args.threads)
    print(
        f"lever benchmark: {work.model.config.pattern}, {len(work.inputs)} {work.task} {args.split} sentences, "
        f"batch 1, threads {torch.get_num_threads()}",
        flush=True,
    )
    with torch.inference_mode():
        table = run_lever_benchmark(work.model, work.inputs, levers, args.max_new_tokens)
    report_rows(table, args, format_lever_table)
    speed_rows = [r for r in table.to_pylist() if r["variant"] not in ("sequential", "shallow")]
    return 0 if all(r["identical"] for r in speed_rows) else 1


if __name__ == "__main__":
    sys.exit(main())
