"""Predict what SPEED earns on a checkpoint at a published model's real shape, from the checkpoint's own flips.

    python jobs/predict_payoff.py --checkpoint runs/demo/<finetune run> --shape ouro-1.4b --threads 2
    python jobs/predict_payoff.py --checkpoint RUN --dtypes bfloat16 --batches 1 4 --rounds 2 --threads 2

Decodes --limit held-out inputs of the checkpoint's task with its own greedy SPEED (one at a time, its tokenizer's
stop ids), keeps the flip trace (--trace-out), and replays it on a random-weight model of --shape
(speed.benchmarks.payoff, speed.benchmarks.replay): the checkpoint's loops mapped onto the shape's by fraction of
depth where they differ. Prints the checkpoint's own steps per token at its own shape, then the prediction: speed-up
over sequential decoding, steps per token and the engine's overhead per dtype, batch and cost model setting. A
prediction, not a measurement of the checkpoint at that size: the flips are the checkpoint's, the costs the shape's.
Writes the rows (PAYOFF_SCHEMA) to --out.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import pyarrow.parquet as pq
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "platform"))  # this checkout's speed, not an installed one

from speed.benchmarks.payoff import add_map_flags, checkpoint_trace, format_payoff_table, map_config, run_payoff_map
from speed.cli import JobParser, add_report_flags, report_rows, user_errors


def main(argv: list[str] | None = None) -> int:
    p = JobParser(prog="predict_payoff.py", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--checkpoint", required=True, help="a finetuned checkpoint or run (a local path or a URI)")
    p.add_argument("--task", default=None, help="the held-out inputs' task (default: the checkpoint's training task)")
    p.add_argument("--split", default="test")
    p.add_argument("--limit", type=int, default=64, help="held-out inputs decoded for the trace")
    p.add_argument("--max-new-tokens", type=int, default=48, help="the trace's decoding length")
    p.add_argument("--trace-out", type=Path, default=None, help="also write the checkpoint's trace here")
    add_map_flags(p)
    add_report_flags(p, Path("results/predict_payoff.parquet"))
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    with user_errors():
        own = checkpoint_trace(args.checkpoint, args.split, args.limit, args.max_new_tokens, args.task)
        cfg = map_config(args, (), (own.pattern,))
    if args.trace_out:
        args.trace_out.parent.mkdir(parents=True, exist_ok=True)
        pq.write_table(own.pattern.trace, args.trace_out)
    print(
        f"{own.pattern.name}: {own.loops} loops, {own.tokens} tokens; its own SPEED {own.steps_per_token:.3f} steps "
        f"a token (oracle {own.oracle_steps_per_token:.3f}) at batch 1; agreement with the last loop by loop "
        + " ".join(f"{a:.3f}" for a in own.agreement),
        flush=True,
    )
    table = run_payoff_map(cfg, progress=lambda line: print(line, flush=True))
    print(f"predicted at {cfg.shape} from {table.column('source')[0]}:")
    report_rows(table, args, format_payoff_table)
    return 0 if all(table.column("identical").to_pylist()) else 1


if __name__ == "__main__":
    sys.exit(main())
