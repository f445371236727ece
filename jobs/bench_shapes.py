"""Decode at a published model's real shape (speed.benchmarks.shapes): random weights, sequential, oracle SPEED and
SPEED's own at each batch, against the machine's read bandwidth.

    python jobs/bench_shapes.py --shape ouro-1.4b     # random bf16 weights, batch 1 and 4, 8 new tokens
    python jobs/bench_shapes.py --shape huginn-3.5b --recurrence 8 --json  # with oracle_speedup, sequential_vs_limit
    python jobs/bench_shapes.py --shape ouro-1.4b --dtype float32,bfloat16 --batches 1  # both, in the same rounds
    python jobs/bench_shapes.py --shape ouro-1.4b --dtype float32 --layout packed,plain   # packed weights or not

--shape: ouro-1.4b, ouro-2.6b, huginn-3.5b at --recurrence loops (default 4 of its published 32), t5-large; random
weights as --dtype, checked against the available memory first; sequential, oracle SPEED and SPEED at each
--batches, the weights read per token, the GB/s that implies, the machine's read bandwidth measured in the same run
(the limit) and the peak resident set. --dtype bfloat16 (the default) is bf16 weights (speed.models.precision),
float32 the whole model in float32; several dtypes (comma-separated) are each a model of their own, timed in the
same interleaved rounds, and the summary's dtype_speedup is the first one's time per token over each other's.
--layout packed (the default) packs the looped LM's native-kernel weights for decoding (pack_for_decoding: several
rows a pass at about one row's cost; T5 packs none), plain keeps them as loaded; packed,plain times both in the same
rounds (layout_speedup).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "platform"))  # this checkout's speed, not an installed one

from speed.benchmarks.shapes import LAYOUTS, SHAPES, ShapeBenchConfig, format_shape_table, run_shape_benchmark
from speed.cli import JobParser, add_report_flags, config_from_args, report_rows, user_errors
from speed.models.precision import DTYPES


def _config(args: argparse.Namespace) -> ShapeBenchConfig:
    if args.shape not in SHAPES:
        raise ValueError(f"--shape {args.shape!r}: known shapes are {', '.join(SHAPES)}")
    model = SHAPES[args.shape].resolve(args.recurrence)
    batches = tuple(int(b) for b in args.batches.split(","))
    dtypes = tuple(args.dtype.split(","))
    for name in dtypes:
        if name not in DTYPES:
            raise ValueError(f"--dtype {name!r}: choose from {', '.join(DTYPES)} (several: comma-separated)")
    layouts = tuple(args.layout.split(","))
    for name in layouts:
        if name not in LAYOUTS:
            raise ValueError(f"--layout {name!r}: choose from {', '.join(LAYOUTS)} (both: comma-separated)")
    return config_from_args(
        ShapeBenchConfig,
        args,
        model=model,
        batches=batches,
        dtypes=dtypes,
        layouts=layouts,
        bandwidth_bytes=args.bandwidth_mib * 2**20,
    )


def main(argv: list[str] | None = None) -> int:
    p = JobParser(prog="bench_shapes.py", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", required=True, help=f"a published model's shape: {', '.join(SHAPES)}")
    p.add_argument("--recurrence", type=int, default=None, help="loops (Ouro's total_ut_steps, Huginn's)")
    p.add_argument("--batches", default="1,4", help="the batches, comma-separated")
    p.add_argument(
        "--dtype", default="bfloat16", help="the weights' dtype; several, comma-separated, in the same rounds"
    )
    p.add_argument(
        "--layout",
        default="packed",
        help="the weights packed for the native kernel (packed, the default: 4-8 rows a pass at about one row's "
        "cost) or as loaded (plain); both, comma-separated, in the same rounds",
    )
    p.add_argument("--prompt-len", type=int, default=32, help="the LM's prompt tokens, T5's encoder tokens")
    p.add_argument("--new-tokens", type=int, default=8, help="short runs: each token takes seconds on a CPU")
    p.add_argument("--reps", type=int, default=3, help="interleaved rounds after a warm-up")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="cpu", help="torch device every variant runs on, e.g. cuda")
    p.add_argument("--bandwidth-mib", type=int, default=1024, help="the read-bandwidth buffer")
    add_report_flags(p, Path("results/bench_decode_shapes.parquet"))
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    with user_errors():  # an unknown shape, or one that does not fit in memory: one line, status 2
        table, summary = run_shape_benchmark(_config(args))
    report_rows(table, args, format_shape_table, summary)
    return 0


if __name__ == "__main__":
    sys.exit(main())
