"""The engine's cost model on a trained checkpoint: sequential, SPEED on every in-flight row, SPEED under the
cost model, side by side at batch 1, 4 and 8 (greedy) and batch 4 sampled with runner-up branches.

    python jobs/bench_cost.py --checkpoint runs/demo/<finetune run>/checkpoint_<step> --limit 48 --threads 1

Decodes the checkpoint task's held-out test sentences in batches of each case's size, every batch by the three
variants in a rotating order; reports group passes and rows per token (exact), the steps the cost model ran as
sequential decoding, ms per token and the ratio to sequential decoding measured side by side (on the wall clock, and
on the process's CPU time, which another process's load on a shared machine does not inflate), and whether every
output equals sequential decoding's. The cost model's curve is measured once before the timing (its time printed).
Writes the rows (speed.benchmarks.cost.COST_BENCH_SCHEMA) to --out; exits 1 if an output differs.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "platform"))  # this checkout's speed, not an installed one

from speed.benchmarks.cost import CostCase, format_cost_table, run_cost_benchmark
from speed.benchmarks.heldout import add_held_out_flags, held_out
from speed.cli import JobParser, add_report_flags, report_rows, user_errors
from speed.engine import Speculation
from speed.engine.cost import row_cost
from speed.engine.sampling import Sampling


def main(argv: list[str] | None = None) -> int:
    p = JobParser(prog="bench_cost.py", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_held_out_flags(p, limit=48, max_new_tokens=48)
    p.add_argument("--branches", type=int, default=2, help="the sampled case's runner-up branches")
    add_report_flags(p, Path("results/bench_cost.parquet"))
    args = p.parse_args(argv)
    with user_errors():
        work = held_out(args.checkpoint, args.split, args.limit)
    if args.threads:
        torch.set_num_threads(args.threads)
    model = work.model
    sampled = Sampling(temperature=0.8, seed=7)
    cases = [CostCase(f"b{b} greedy", b) for b in (1, 4, 8)]
    cases.append(CostCase(f"b4 sampled branches={args.branches}", 4, sampled, Speculation(branches=args.branches)))
    with torch.inference_mode():
        cost = row_cost(model.stepper())
        print(f"cost model: {cost.key}, measured in {cost.measure_s:.2f} s; ms by rows: "
              + ", ".join(f"{r}: {s * 1e3:.2f}" for r, s in enumerate(cost.seconds, start=1)), flush=True)  # fmt: skip
        pad = getattr(model.config, "pad_id", 0)
        table = run_cost_benchmark(model, work.inputs, cases, args.max_new_tokens, pad, work.tokenizer.stop_ids)
    report_rows(table, args, format_cost_table)
    return 0 if all(table.column("identical").to_pylist()) else 1


if __name__ == "__main__":
    sys.exit(main())
