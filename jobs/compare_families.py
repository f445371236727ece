"""The two families side by side: train a T5 and a looped LM of equal size on the same examples, evaluate both.

    .venv/bin/python jobs/compare_families.py                                   # Multi30k EN-DE, ~10 min on 2 cores
    .venv/bin/python jobs/compare_families.py --task summarize --max-steps 200  # news headlines, ROUGE-L
    make analysis RESULTS=results/families                                      # analysis/families.ipynb draws it

1. finetunes a T5 (--t5-pattern, jobs/configs/sweep_local.yaml: d_model 128, 2 encoder layers) from scratch,
   training the tokenizer both use (or both use --tokenizer);
2. finetunes a looped LM (--lm-pattern, jobs/configs/sweep_lm_local.yaml) whose FFN width makes its parameter
   count the T5's (speed.models.family.match_parameters), on the same records with the same batch size and steps: the
   same answers, so the same target tokens (each family reads its sources in its own format);
3. evaluates both on the same held-out examples at batch 1 (jobs/evaluate.py's folders: SPEED checked
   identical to sequential decoding, BLEU or ROUGE-L with bootstrap intervals, flip rates, own and oracle steps
   per token, per-loop perplexity of the references);
4. writes <out>/families.parquet (speed.analysis.families.FAMILIES_SCHEMA) and prints both rows and the LM's
   paired difference from the T5.

Runs live in --storage-path under deterministic names: a second run continues them.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "platform"))  # this checkout's speed, not an installed one

import pyarrow as pa
import pyarrow.parquet as pq

from speed.analysis.families import (
    family_row,
    format_families,
    load_families,
    quality_difference,
)
from speed.analysis.results import FAMILIES_FILE, FAMILIES_SCHEMA
from speed.cli import JobParser, user_errors
from speed.data import get_task
from speed.eval.evaluate import EvalConfig, format_summary, run_evaluation
from speed.models.checkpoint import load_model
from speed.models.family import match_parameters, parameter_count
from speed.paths import TRAIN_LOG_FILE, repo_root
from speed.train.config import JobConfig, job_from_layers
from speed.train.launch import check_inputs, run_job

CONFIGS = {"t5": "sweep_local.yaml", "lm": "sweep_lm_local.yaml"}  # the sweeps' CPU-sized base jobs


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = JobParser(prog="compare_families.py", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--task", default="translate_en_de", help="a source/target task (translate_en_de, summarize)")
    p.add_argument("--t5-pattern", default="2x3", help="the T5 decoder's NxM")
    p.add_argument("--lm-pattern", default="1+2x3+1", help="the LM's P+NxM+C")
    p.add_argument("--max-steps", type=int, default=300, help="optimizer steps of each model")
    p.add_argument("--batch-size", type=int, default=32, help="examples per step of each model")
    p.add_argument("--limit", type=int, default=None, help="first N training records (default: all)")
    p.add_argument("--eval-limit", type=int, default=100, help="held-out (test split) examples evaluated")
    p.add_argument("--max-new-tokens", type=int, default=32, help="output tokens per example at most")
    p.add_argument("--tokenizer", default=None, help="a SentencePiece .model both use (default: train one)")
    p.add_argument("--vocab-size", type=int, default=None, help="pieces of the trained tokenizer (default: 4000)")
    p.add_argument("--cpus-per-worker", type=float, default=None, help="CPUs of the training worker")
    p.add_argument("--threads", type=int, default=None, help="torch threads of the evaluation (default: torch's)")
    p.add_argument("--storage-path", default="runs/families", help="where the two training runs go")
    p.add_argument("--no-tracking", action="store_true", help="log nothing to MLflow (default: <storage>/mlruns)")
    p.add_argument("--out", default="results/families", help="where families.parquet and the evaluations go")
    return p.parse_args(argv)


def family_job(args: argparse.Namespace, family: str, pattern: str, extra: dict[str, Any]) -> JobConfig:
    """The finetuning job of one family: its CPU-sized base job with the comparison's task, steps and batch."""
    flags = {
        "data.task": args.task,
        "model.pattern": pattern,
        "train.max_steps": args.max_steps,
        "train.batch_size": args.batch_size,
        "train.checkpoint_every": args.max_steps,
        "run.storage_path": args.storage_path,
        "run.name": f"{family}-{pattern}-{args.task}-{args.max_steps}",
        "eval": None,  # evaluated below, both alike
        **({"tracking": None} if args.no_tracking else {}),
        **({"data.limit": args.limit} if args.limit is not None else {}),
        **({"data.tokenizer": args.tokenizer} if args.tokenizer is not None else {}),
        **({"data.vocab_size": args.vocab_size} if args.vocab_size is not None else {}),
        **({"scale.cpus_per_worker": args.cpus_per_worker} if args.cpus_per_worker is not None else {}),
        **extra,
    }
    return job_from_layers("finetune", repo_root() / "jobs" / "configs" / CONFIGS[family], [], flags)


def main(argv: list[str] | None = None) -> int:
    """Train, evaluate and tabulate both families; returns the exit status."""
    with user_errors():
        args = parse_args(argv)
        if get_task(args.task).is_pretrain:
            raise ValueError(f"task {args.task!r} has no references to compare on: choose a source/target task")
        t5_job = family_job(args, "t5", args.t5_pattern, {})
        lm_job = family_job(args, "lm", args.lm_pattern, {})  # checked now; its width and tokenizer follow the T5's
        for job in (t5_job, lm_job):
            check_inputs(job)
    if args.threads is not None:
        import torch

        torch.set_num_threads(args.threads)
    t5 = run_job(t5_job)
    t5_model = load_model(t5.checkpoint)
    size = parameter_count(t5.job.model)
    lm_model_config = match_parameters(lm_job.model.replace(vocab_size=t5.job.model.vocab_size), size)
    extra = {"data.tokenizer": t5_model.tokenizer_path, "model.d_ff": lm_model_config.d_ff}
    lm = run_job(family_job(args, "lm", args.lm_pattern, extra))

    out = Path(args.out)
    rows = []
    for family, outcome, loaded in (("t5", t5, t5_model), ("lm", lm, load_model(lm.checkpoint))):
        config = EvalConfig(
            args.task,
            "test",
            limit=args.eval_limit,
            batch_size=1,  # the latency SPEED targets
            max_new_tokens=args.max_new_tokens,
            max_source_len=outcome.job.data.max_source_len,
        )
        folder = f"{family}-{outcome.job.model.pattern}"
        summary = run_evaluation(loaded.model.eval(), loaded.tokenizer_path, config, out / folder)
        print(f"\n{family} {outcome.job.model.pattern}:\n{format_summary(summary)}", flush=True)
        rows.append(family_row(family, summary, folder, parameter_count(outcome.job.model), _training(outcome)))
    pq.write_table(pa.Table.from_pylist(rows, schema=FAMILIES_SCHEMA), out / FAMILIES_FILE)
    families = load_families(out)
    print(f"\n{format_families(families.table)}")
    for name, r in quality_difference(families).items():
        print(f"lm - t5 {name}: {r['delta']:+.2f} [{r['low']:+.2f}, {r['high']:+.2f}] (paired bootstrap, 95%)")
    print(f"wrote {out / FAMILIES_FILE}")
    return 0


def _training(outcome: Any) -> dict[str, Any]:
    """Steps, examples, tokens read and seconds of a finished run, from its train log."""
    log = pq.read_table(f"{outcome.checkpoint}/{TRAIN_LOG_FILE}").to_pydict()
    return {
        "train_steps": outcome.step,
        "train_examples": outcome.step * outcome.job.train.batch_size,
        "train_tokens": sum(log["tokens"]),
        "train_seconds": sum(log["step_time_s"]),
    }


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
