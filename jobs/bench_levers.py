"""SPEED's levers on trained checkpoints: batch 1, greedy, side by side with plain SPEED, sequential and shallow.

    python jobs/bench_levers.py --checkpoint runs/demo/<finetune run>/checkpoint_<step> --limit 30 \\
        --levers "b6_rb8=branches:6,row_budget:8;lanes_rb8=branches:6,branch_depth:6,row_budget:8"
    python jobs/bench_levers.py --checkpoint plain=<checkpoint> --checkpoint settle=<checkpoint> ...

Decodes the checkpoint task's held-out test sentences one at a time with every variant of every checkpoint
(sequential; the shallow Nx1, the same weights run one loop; plain SPEED; SPEED with each --levers setting;
where the checkpoint has exit adapters, every SPEED variant also without them, ``<name>_no_exits``), the
variants alternating per sentence in a rotating order. Reports group passes (SPEED at batch 1: its steps)
and rows per token (exact), wall and CPU ms per token and the ratio to the same checkpoint's plain SPEED
(measured side by side), whether every output equals sequential decoding, and each checkpoint's quality on
the references (BLEU or ROUGE-L, with a 95 % bootstrap interval; each later checkpoint's difference from the
first's, with a 95 % paired-bootstrap interval); last, each checkpoint's ``oracle`` row: plain SPEED speculating
the known output. Several checkpoints must share a task and a tokenizer. Writes the rows
(speed.benchmarks.levers.LEVER_BENCH_SCHEMA) to --out; exits 1 if a SPEED variant's output differs.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "platform"))  # this checkout's speed, not an installed one

from speed.benchmarks.heldout import HeldOut, held_out, paired_quality, score_outputs
from speed.benchmarks.levers import format_lever_table, parse_levers, run_lever_benchmark
from speed.cli import JobParser, add_report_flags, report_rows, user_errors

DEFAULT_LEVERS = "b6_rb8=branches:6,row_budget:8;lanes_rb8=branches:6,branch_depth:6,row_budget:8"


def main(argv: list[str] | None = None) -> int:
    p = JobParser(prog="bench_levers.py", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--checkpoint", required=True, action="append", metavar="[NAME=]PATH",
                   help="a finetuned checkpoint or run, or a Hugging Face directory (a local path or a URI); "
                   "repeat, named, to compare")  # fmt: skip
    p.add_argument("--task", default=None, help="the task whose split is decoded (default: the checkpoints' training "
                   "task; a Hugging Face directory has none)")  # fmt: skip
    p.add_argument("--split", default="test")
    p.add_argument("--limit", type=int, default=30, help="sentences decoded")
    p.add_argument("--levers", default=DEFAULT_LEVERS, help="NAME=key:value,...;... (keys: speed.engine.Speculation's "
                   "fields, launch_loop .. min_confidence, and row_budget)")  # fmt: skip
    p.add_argument("--max-new-tokens", type=int, default=64)
    add_report_flags(p, Path("results/bench_levers.parquet"))
    args = p.parse_args(argv)
    with user_errors():  # a missing checkpoint, task or split, a misspelled lever: one line, status 2
        levers = parse_levers(args.levers)
        checkpoints = named(args.checkpoint)
        works = {name: held_out(path, args.split, args.limit, args.task) for name, path in checkpoints.items()}
        work = same_workload(works)
    if args.threads:
        torch.set_num_threads(args.threads)
    print(
        f"lever benchmark: {', '.join(f'{n} {w.model.config.pattern}' for n, w in works.items())}, "
        f"{len(work.inputs)} {work.task} {args.split} sentences, "
        f"batch 1, threads {torch.get_num_threads()}",
        flush=True,
    )
    with torch.inference_mode():
        models = {name: w.model for name, w in works.items()}
        quality, stops = score_outputs(work), work.tokenizer.stop_ids
        run = run_lever_benchmark(models, work.inputs, levers, args.max_new_tokens, quality, stops)
    table = run.table
    report_rows(table, args, format_lever_table)
    if not args.json:
        for line in paired_quality(work, run.outputs):
            print(line)
    speed_rows = [r for r in table.to_pylist() if r["variant"] not in ("sequential", "shallow")]
    return 0 if all(r["identical"] for r in speed_rows) else 1


def named(checkpoints: list[str]) -> dict[str, str]:
    """``["a=PATH", ...]`` -> ``{"a": PATH}``; one unnamed checkpoint is ``model``; names must differ."""
    if len(checkpoints) == 1 and "=" not in checkpoints[0]:
        return {"model": checkpoints[0]}
    out = {}
    for item in checkpoints:
        name, sep, path = item.partition("=")
        if not sep or not name or not path or name in out:
            raise ValueError(f"several checkpoints are NAME=PATH with different names, got {item!r}")
        out[name] = path
    return out


def same_workload(works: dict[str, HeldOut]) -> HeldOut:
    """The one workload several checkpoints are compared on: the same task and the same encoded inputs."""
    first = next(iter(works.values()))
    for name, w in works.items():
        if w.task != first.task or w.inputs != first.inputs:
            raise ValueError(f"checkpoint {name!r} reads other inputs ({w.task}) than the first ({first.task})")
    return first


if __name__ == "__main__":
    sys.exit(main())
