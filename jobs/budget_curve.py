"""The budget curve of one training run: every checkpoint evaluated on the same held-out examples.

    .venv/bin/python jobs/budget_curve.py --run runs/finetune --limit 100
    .venv/bin/python jobs/budget_curve.py --run s3://bucket/speed/<run> --steps 100 200 400 --task translate_en_de

Evaluates each complete checkpoint_<step> of --run (or the --steps given) with the same settings, in-process,
one after another (speed.eval.budget), at batch 1: quality with its 95% bootstrap interval, the flip rate per loop,
SPEED's own and (with --oracle, the default) oracle steps per token, every loop's perplexity. Each evaluation
lands in <out>/checkpoint_<step> (one already there with the same settings is reused); <out>/budget.parquet
(speed.eval.budget.BUDGET_SCHEMA) holds one row per budget with each budget's paired-bootstrap difference from
the previous one. --out defaults to <run>/budget/<task>-<split>. A run keeps train.keep_checkpoints
checkpoints: the job names the budgets it lacks. `make analysis` draws the curve (analysis/budget.ipynb).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "platform"))  # this checkout's speed, not an installed one

from speed.cli import JobParser, user_errors
from speed.eval.budget import BUDGET_FILE, budget_curve, choose_budgets
from speed.eval.evaluate import EvalConfig
from speed.models.checkpoint import read_checkpoint_config


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = JobParser(prog="budget_curve.py", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--run", required=True, help="run directory holding checkpoint_<step> folders, a path or a URI")
    p.add_argument("--steps", type=int, nargs="+", default=None, help="budgets to evaluate (default: every one)")
    p.add_argument("--task", default=None, help="task to evaluate (default: the run's training task)")
    p.add_argument("--split", default="test", help="held-out split (default: test)")
    p.add_argument("--limit", type=int, default=None, help="first N records (default: the whole split)")
    p.add_argument("--max-new-tokens", type=int, default=EvalConfig.max_new_tokens)
    p.add_argument("--oracle", action=argparse.BooleanOptionalAction, default=True, help="oracle steps per token")
    check = "also decode sequentially and require identical output (slower; the curve keeps no timing)"
    p.add_argument("--check-sequential", action=argparse.BooleanOptionalAction, default=False, help=check)
    p.add_argument("--bootstrap-samples", type=int, default=1000, help="resamples of every interval")
    p.add_argument("--out", default=None, help="output folder or URI (default: <run>/budget/<task>-<split>)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    """Evaluate the budgets, write budget.parquet; prints a line per budget."""
    args = parse_args(argv)
    with user_errors():  # a run with no checkpoints, a missing budget, bad settings: one line, status 2
        config = EvalConfig(
            task=args.task, split=args.split, limit=args.limit, batch_size=1, max_new_tokens=args.max_new_tokens,
            oracle=args.oracle, check_sequential=args.check_sequential, bootstrap_samples=args.bootstrap_samples,
        )  # fmt: skip
        budgets, _ = choose_budgets(args.run, args.steps)  # the run holds them: else an error, before any work
        job = read_checkpoint_config(budgets[-1].checkpoint).get("job", {})
        task = args.task or job.get("data", {}).get("task")
        if task is None:
            raise ValueError(f"{args.run} records no training task; pass --task")
        out = args.out or f"{args.run.rstrip('/')}/budget/{task}-{args.split}"
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    samples = args.bootstrap_samples or 1000  # the paired differences' resamples even without intervals
    table = budget_curve(args.run, config, out, args.steps, device=args.device, samples=samples)
    print(f"wrote {out.rstrip('/')}/{BUDGET_FILE} ({table.num_rows} budgets)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
