"""Decode-latency benchmark of one family at a preset's dims: sequential NxM, SPEED NxM (own and oracle
speculation), shallow Nx1, our (N*M)x1 against transformers' generate.

    python jobs/bench_decode.py                       # T5, base dims, 16k vocabulary, 2x6
    python jobs/bench_decode.py --pattern 3x4 --json  # one JSON object on stdout
    python jobs/bench_decode.py --device cuda         # on a GPU (jobs/gpu_check.py times batch 1 and 8 there)
    python jobs/bench_decode.py --family lm --batch 8 # the looped LM: 64-token prompts, TTFT apart

Speed-up is the baseline's ms/token divided by the variant's (baseline:
sequential NxM; for ours_deep, transformers' generate of the same random
(N*M)x1 T5, or Llama with --family lm); "vs shallow" is the variant's ms/token
over the shallow Nx1's. The LM's rows time the prefill and first token (TTFT)
apart from the decode time per later token. T5's speed_exits row is SPEED with
fresh exit adapters of --exit-rank (speed.models.exits): the same schedule as plain
SPEED's, so the difference is the adapters' cost.

A published model's real shape is jobs/bench_shapes.py's; bf16 weights' token agreement, jobs/bench_agreement.py's.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path

import pyarrow as pa
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "platform"))  # this checkout's speed, not an installed one

from speed.benchmarks.decode import BenchConfig, format_table, run_benchmark
from speed.benchmarks.decode_lm import LMBenchConfig, run_lm_benchmark
from speed.cli import JobParser, add_report_flags, config_from_args, report_rows, user_errors
from speed.config import lm_preset, preset


def _t5_benchmark(args: argparse.Namespace) -> Callable[[], pa.Table]:
    model = preset(args.preset, pattern=args.pattern, vocab_size=args.vocab_size)
    exit_rank = args.exit_rank or None
    cfg = config_from_args(BenchConfig, args, model=model, compare_hf=not args.no_hf, exit_rank=exit_rank)
    return lambda: run_benchmark(cfg)


def _lm_benchmark(args: argparse.Namespace) -> Callable[[], pa.Table]:
    lm = lm_preset(args.preset, pattern=args.pattern, vocab_size=args.vocab_size)
    cfg = config_from_args(LMBenchConfig, args, model=lm, compare_hf=not args.no_hf)
    return lambda: run_lm_benchmark(cfg)


# --family -> (the benchmark its flags set up, its default output)
BENCHMARKS: dict[str, tuple[Callable[[argparse.Namespace], Callable[[], pa.Table]], str]] = {
    "t5": (_t5_benchmark, "results/bench_decode.parquet"),
    "lm": (_lm_benchmark, "results/bench_decode_lm.parquet"),
}


def main(argv: list[str] | None = None) -> int:
    p = JobParser(prog="bench_decode.py", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--family", choices=list(BENCHMARKS), default="t5", help="SpeedT5, or the decoder-only LoopedLM")
    p.add_argument("--preset", default="base")
    p.add_argument("--pattern", default="2x6")
    p.add_argument("--vocab-size", type=int, default=16384)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--source-len", type=int, default=32, help="T5's encoder tokens")
    p.add_argument("--prompt-len", type=int, default=64, help="the LM's prompt tokens")
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--reps", type=int, default=5, help="interleaved rounds")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="cpu", help="torch device every variant runs on, e.g. cuda")
    p.add_argument("--no-hf", action="store_true", help="skip the transformers generate comparison")
    p.add_argument("--exit-rank", type=int, default=64, help="T5: also time SPEED with exit adapters (0: not)")
    add_report_flags(p, None, "default: results/bench_decode.parquet, with --family lm results/bench_decode_lm.parquet")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    setup, default_out = BENCHMARKS[args.family]
    if args.out is None:
        args.out = Path(default_out)
    with user_errors():  # an unknown preset, a bad pattern or size: one line, status 2
        benchmark = setup(args)
    report_rows(benchmark(), args, format_table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
