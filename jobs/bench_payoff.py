"""The payoff map (not a test): SPEED at a published model's real shape (random weights) replaying a trained model's
flips, against sequential decoding, by dtype, batch, loop-1 agreement or trace, the cost model off and on.

    python jobs/bench_payoff.py --shape ouro-1.4b --threads 2                      # the whole map (hours: see docs)
    python jobs/bench_payoff.py --dtypes bfloat16 --batches 1 --agreements 0.7 --rounds 3 --threads 2
    python jobs/bench_payoff.py --agreements --trace t5=runs/eval-t5/trace.parquet --trace-stop-id 1

Each loop-1 agreement's later loops follow the trained demo T5's profile by depth
(speed.benchmarks.replay.agreement_profile); a --trace (an evaluation's trace.parquet, a replica's traces folder) is
replayed as recorded, mapped by fraction of depth when its loop count differs (the source column says so). Prints a
progress line per batch with an estimate of the time left, then the Markdown table and the cells that miss the cost
model's goals (at least 1.0x sequential; at least 90 % of plain SPEED's gain where it pays). Writes the rows
(speed.benchmarks.payoff.PAYOFF_SCHEMA) to --out; exits 1 if an output differs from sequential decoding's.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import pyarrow.parquet as pq
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "platform"))  # this checkout's speed, not an installed one

from speed.benchmarks.payoff import (
    AGREEMENTS,
    TracePattern,
    add_map_flags,
    format_payoff_table,
    map_config,
    never_slower,
    run_payoff_map,
)
from speed.cli import JobParser, add_report_flags, report_rows, user_errors


def main(argv: list[str] | None = None) -> int:
    p = JobParser(prog="bench_payoff.py", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_map_flags(p)
    p.add_argument("--agreements", type=float, nargs="*", default=list(AGREEMENTS), help="loop-1 agreements")
    p.add_argument("--trace", action="append", default=[], metavar="NAME=PATH", help="a trace to replay (repeat)")
    p.add_argument("--trace-stop-id", type=int, action="append", default=[], help="the traced model's stop tokens")
    add_report_flags(p, Path("results/bench_payoff.parquet"))
    args = p.parse_args(argv)
    with user_errors():
        traces = []
        for item in args.trace:
            name, sep, path = item.partition("=")
            if not sep or not name or not path:
                raise ValueError(f"--trace expects NAME=PATH, got {item!r}")
            traces.append(TracePattern(name, pq.read_table(path), frozenset(args.trace_stop_id)))
        cfg = map_config(args, args.agreements, traces)
    if args.threads:
        torch.set_num_threads(args.threads)
    print(f"payoff map: {cfg.cells()} cells, {cfg.rounds} timed rounds and one untimed each", flush=True)
    table = run_payoff_map(cfg, progress=lambda line: print(line, flush=True))
    report_rows(table, args, format_payoff_table)
    misses = never_slower(table)
    print("cost model goals: " + ("met in every cell" if not misses else "missed in\n  " + "\n  ".join(misses)))
    return 0 if all(table.column("identical").to_pylist()) else 1


if __name__ == "__main__":
    sys.exit(main())
