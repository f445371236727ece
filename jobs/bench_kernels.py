"""Decode kernels against this machine's read bandwidth at a real model's layer shapes (not a test).

    python jobs/bench_kernels.py                          # Ouro-1.4B's layers (d 2048, FFN 5632), 6 of them
    python jobs/bench_kernels.py --d-model 768 --d-ff 2048 --layers 24 --rows 1,2,3,4,5,6,7,8
    python jobs/bench_kernels.py --json --out kernels.parquet
    python jobs/bench_kernels.py --device cuda --kernels triton,torch --dtypes bfloat16 --rows 1,8,32,64

Each kernel (the native one compiled for this CPU, on the weights as stored and packed in panels, oneDNN's packed
linear, torch's F.linear) at each row count and weight dtype streams the layers' weights once; the read bandwidth
is measured in the same run, interleaved
(``speed.benchmarks.kernels``). Run it alone: two cores shared with anything else make the numbers worthless.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "platform"))  # this checkout's speed, not an installed one

import pyarrow as pa  # noqa: E402
import pyarrow.parquet as pq  # noqa: E402
import torch  # noqa: E402

from speed.benchmarks.kernels import KERNEL_BENCH_SCHEMA, bench_kernels, format_kernel_rows  # noqa: E402
from speed.engine import native  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--d-model", type=int, default=2048)
    p.add_argument("--d-ff", type=int, default=5632)
    p.add_argument("--layers", type=int, default=6, help="distinct layers streamed per pass (more than the caches)")
    p.add_argument("--rows", default="1,2,4,8", help="rows per call, comma-separated (1..8; triton and torch 1..64)")
    p.add_argument(
        "--kernels",
        default="native,packed,onednn,torch",
        help="native (on the weights as stored), packed (native on weights packed in panels), onednn, torch, "
        "triton (the GPU's Triton linear; under Triton's interpreter on the CPU: slow)",
    )
    p.add_argument("--device", default="cpu", help="cpu, or cuda (the kernels triton and torch)")
    p.add_argument("--dtypes", default="float32,bfloat16")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    p.add_argument("--out", default=None, help="write the rows to this Parquet file")
    p.add_argument("--json", action="store_true", help="print the rows as JSON instead of the table")
    args = p.parse_args(argv)
    rows = tuple(int(n) for n in args.rows.split(","))
    most = 64 if set(args.kernels.split(",")) <= {"triton", "torch"} else 8
    if not all(1 <= n <= most for n in rows):
        p.error(f"--rows: each in 1..{most} for --kernels {args.kernels}, got {args.rows}")
    if args.device != "cpu" and not set(args.kernels.split(",")) <= {"triton", "torch"}:
        p.error(f"--device {args.device}: the kernels triton and torch only")
    if args.threads:
        torch.set_num_threads(args.threads)
    if "packed" in args.kernels.split(",") and native.library() is None:
        p.error(f"--kernels packed: no native kernel here ({native.unavailable_reason()})")
    if "native" in args.kernels.split(",") and native.library() is None:
        print(f"note: no native kernel here ({native.unavailable_reason()}); its rows run on oneDNN", file=sys.stderr)
    results = bench_kernels(
        args.d_model,
        args.d_ff,
        args.layers,
        rows,
        tuple(args.kernels.split(",")),
        tuple(getattr(torch, name) for name in args.dtypes.split(",")),
        args.repeats,
        args.device,
    )
    if args.out:
        pq.write_table(pa.Table.from_pylist([asdict(r) for r in results], schema=KERNEL_BENCH_SCHEMA), args.out)
    if args.json:
        print(json.dumps([asdict(r) for r in results], indent=1))
    else:
        print(f"torch threads: {torch.get_num_threads()}")
        print(format_kernel_rows(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
