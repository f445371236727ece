"""Decode-latency benchmark: sequential NxM, SPEED NxM (own and oracle speculation), shallow Nx1.

    python jobs/bench_decode.py                       # base dims, 16k vocabulary, 2x6
    python jobs/bench_decode.py --pattern 3x4 --json  # one JSON object on stdout
    python jobs/bench_decode.py --device cuda         # on a GPU (jobs/gpu_check.py times batch 1 and 8 there)
    python jobs/bench_decode.py --family lm --batch 8 # the looped LM: 64-token prompts, TTFT apart
    python jobs/bench_decode.py --shape ouro-1.4b     # a published model's shape, random bf16 weights, batch 1 and 4
    python jobs/bench_decode.py --shape huginn-3.5b --recurrence 8 --json  # with oracle_speedup, sequential_vs_limit
    python jobs/bench_decode.py --shape ouro-1.4b --dtype float32,bfloat16 --batches 1  # both, in the same rounds
    python jobs/bench_decode.py --shape ouro-1.4b --dtype float32 --layout packed,plain   # packed weights or not

Speed-up is the baseline's ms/token divided by the variant's (baseline:
sequential NxM; for ours_deep, transformers' generate of the same random
(N*M)x1 T5, or Llama with --family lm); "vs shallow" is the variant's ms/token
over the shallow Nx1's. The LM's rows time the prefill and first token (TTFT)
apart from the decode time per later token. T5's speed_exits row is SPEED with
fresh exit adapters of --exit-rank (speed.models.exits): the same schedule as plain
SPEED's, so the difference is the adapters' cost.

--shape (speed.benchmarks.shapes): a published model's real shape (ouro-1.4b, ouro-2.6b, huginn-3.5b at
--recurrence loops, default 4 of its published 32; t5-large), random weights as --dtype, checked against the
available memory first; sequential, oracle SPEED and SPEED at each --batches, the weights read per token, the GB/s
that implies, the machine's read bandwidth measured in the same run (the limit) and the peak resident set;
--dtype bfloat16 (the default) is bf16 weights (speed.models.precision), float32 the whole model in float32;
several dtypes (comma-separated) are each a model of their own, timed in the same interleaved rounds, and the
summary's dtype_speedup is the first one's time per token over each other's. --layout packed (the default)
packs the looped LM's native-kernel weights for decoding (pack_for_decoding: several rows a pass at about one row's
cost; T5 packs none), plain keeps them as loaded; packed,plain times both in the same rounds (layout_speedup).

--agreement CHECKPOINT (speed.benchmarks.precision): a trained looped LM's greedy tokens in bf16 weights against
float32's, on --agreement-prompts validation documents' first --prompt-len tokens, --new-tokens each.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path

import pyarrow as pa
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "platform"))  # this checkout's speed, not an installed one

from speed.benchmarks.decode import BenchConfig, format_table, run_benchmark
from speed.benchmarks.decode_lm import LMBenchConfig, run_lm_benchmark
from speed.benchmarks.precision import corpus_prompts, precision_agreement
from speed.benchmarks.shapes import LAYOUTS, SHAPES, ShapeBenchConfig, format_shape_table, run_shape_benchmark
from speed.cli import JobParser, add_report_flags, config_from_args, report_rows, user_errors
from speed.config import lm_preset, preset
from speed.hf_tokenizer import load_tokenizer
from speed.models.precision import DTYPES
from speed.models.pretrained import load_pretrained


def _t5_benchmark(args: argparse.Namespace) -> Callable[[], pa.Table]:
    model = preset(args.preset, pattern=args.pattern, vocab_size=args.vocab_size)
    exit_rank = args.exit_rank or None
    cfg = config_from_args(BenchConfig, args, model=model, compare_hf=not args.no_hf, exit_rank=exit_rank)
    return lambda: run_benchmark(cfg)


def _lm_benchmark(args: argparse.Namespace) -> Callable[[], pa.Table]:
    lm = lm_preset(args.preset, pattern=args.pattern, vocab_size=args.vocab_size)
    cfg = config_from_args(LMBenchConfig, args, model=lm, compare_hf=not args.no_hf)
    return lambda: run_lm_benchmark(cfg)


def _shape_benchmark(args: argparse.Namespace) -> ShapeBenchConfig:
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


def _agreement(args: argparse.Namespace) -> int:
    """``--agreement``: the checkpoint's greedy tokens in bf16 weights against float32 (one line, or JSON)."""
    with user_errors():
        loaded = load_pretrained(args.agreement, exits=False)
        prompts = corpus_prompts(load_tokenizer(loaded.tokenizer_path), args.agreement_prompts, args.prompt_len)
    agreement = precision_agreement(loaded.model, prompts, args.new_tokens)
    print(json.dumps(asdict(agreement)) if args.json else agreement.describe())
    return 0


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
    p.add_argument("--prompt-len", type=int, default=None, help="the LM's prompt tokens (default 64; --shape: 32)")
    p.add_argument("--new-tokens", type=int, default=None, help="default 64; --shape: 8")
    p.add_argument("--reps", type=int, default=None, help="default 5; --shape: 3")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="cpu", help="torch device every variant runs on, e.g. cuda")
    p.add_argument("--no-hf", action="store_true", help="skip the transformers generate comparison")
    p.add_argument("--exit-rank", type=int, default=64, help="T5: also time SPEED with exit adapters (0: not)")
    p.add_argument("--shape", default=None, help=f"a published model's shape: {', '.join(SHAPES)}")
    p.add_argument("--recurrence", type=int, default=None, help="--shape: loops (Ouro's total_ut_steps, Huginn's)")
    p.add_argument("--batches", default="1,4", help="--shape: the batches, comma-separated")
    p.add_argument(
        "--dtype", default="bfloat16", help="--shape: the weights' dtype; several, comma-separated, in the same rounds"
    )
    p.add_argument(
        "--layout",
        default="packed",
        help="--shape: the weights packed for the native kernel (packed, the default: 4-8 rows a pass at about one "
        "row's cost) or as loaded (plain); both, comma-separated, in the same rounds",
    )
    p.add_argument("--bandwidth-mib", type=int, default=1024, help="--shape: the read-bandwidth buffer")
    p.add_argument("--agreement", default=None, help="a looped LM checkpoint: bf16 weights' tokens against float32's")
    p.add_argument("--agreement-prompts", type=int, default=16, help="--agreement: validation documents' prompts")
    add_report_flags(p, None, "default: results/bench_decode[_lm|_shapes].parquet")
    args = p.parse_args(argv)
    shape = args.shape is not None
    defaults = (32, 8, 3) if shape else (64, 64, 5)  # real shapes: short runs, each token takes seconds on a CPU
    for name, value in zip(("prompt_len", "new_tokens", "reps"), defaults):
        if getattr(args, name) is None:
            setattr(args, name, value)
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.agreement is not None:
        return _agreement(args)
    if shape:
        args.out = args.out or Path("results/bench_decode_shapes.parquet")
        with user_errors():  # an unknown shape, or one that does not fit in memory: one line, status 2
            cfg = _shape_benchmark(args)
            table, summary = run_shape_benchmark(cfg)
        report_rows(table, args, format_shape_table, summary)
        return 0
    setup, default_out = BENCHMARKS[args.family]
    if args.out is None:
        args.out = Path(default_out)
    with user_errors():  # an unknown preset, a bad pattern or size: one line, status 2
        benchmark = setup(args)
    report_rows(benchmark(), args, format_table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
