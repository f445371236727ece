"""Sweep sharing patterns and loss-weight schemes with Ray Tune; print the results and the Pareto frontier.

    python jobs/sweep.py                                   # the local default (jobs/configs/sweep_local.yaml)
    python jobs/sweep.py --patterns depth=12 2x1 --schemes linear uniform --config jobs/configs/sweep_multi30k.yaml
    python jobs/sweep.py --patterns 2x6 --loss-family power --loss-range 0 2 --search random --samples 8
    python jobs/sweep.py --patterns 2x6 --settle none to_last:1 consecutive:3:fc   # agreement terms (speed.losses)
    python jobs/sweep.py --patterns 2x6 --branches 0 6 --min-confidence 0 0.5      # SPEED's levers in the costs
    python jobs/sweep.py --model lm --patterns 1+depth=4+1 2x2                      # looped LMs (sweep_lm_local.yaml)

Every trial finetunes the base job (``--config`` YAML, job flags, ``--set``)
with one pattern, one loss-weight scheme and one settle term, reports every loop's
validation loss and teacher-forced flip cost at each checkpoint (ASHA stops
laggards on the last loop's loss, or with ``--metric val_flip_cost`` on the flip cost), and is then
measured on the validation split: BLEU or ROUGE, flip rate per loop, SPEED
steps per token for every launch loop and both invalidation policies (and every
--branches x --branch-depth x --min-confidence setting, rows per token beside). Results:
<storage>/<sweep>/results.parquet, frontier.parquet, latency.parquet. Rerunning
the same command resumes the sweep (finished trials are kept).
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "platform"))  # this checkout's speed, not an installed one

from speed.cli import user_errors
from speed.sweep import SweepConfig, run_sweep
from speed.sweep.space import check_job
from speed.train.config import JobConfig, build_parser, job_from_layers
from speed.train.launch import check_inputs

# the base job without --config, per model family (--model)
DEFAULT_CONFIGS = {"t5": Path(__file__).parent / "configs" / "sweep_local.yaml"}
DEFAULT_CONFIGS["lm"] = DEFAULT_CONFIGS["t5"].with_name("sweep_lm_local.yaml")

# flag -> (SweepConfig field, type, nargs, help)
SWEEP_FLAGS = {
    "--patterns": ("patterns", str, "+", "NxM patterns or families: depth=D (all N*M = D), unique=N (Nx1 .. NxM)"),
    "--schemes": ("loss_weights", str, "+", "loss-weight schemes (speed.losses), e.g. linear uniform power:1.5"),
    "--loss-family": ("loss_family", str, None, "sample a parametric scheme instead: power (i^P) or ratio (R^i)"),
    "--loss-range": ("loss_range", float, 2, "LOW HIGH of the family's parameter"),
    "--settle": ("settle", str, "+", "settle terms (SettleConfig labels): none to_last:1 consecutive:3:fc"),
    "--metric": ("metric", str, None, "what the scheduler minimises: val_loss_last (default) or val_flip_cost"),
    "--max-depth": ("max_depth", int, None, "bound of the unique=N family"),
    "--search": ("search", str, None, "grid (every combination) or random (--samples draws)"),
    "--samples": ("samples", int, None, "Tune num_samples"),
    "--scheduler": ("scheduler", str, None, "asha (default) or fifo"),
    "--grace-steps": ("grace_steps", int, None, "ASHA: steps before a trial may be stopped"),
    "--reduction-factor": ("reduction_factor", int, None, "ASHA reduction factor"),
    "--measure-limit": ("measure_limit", int, None, "validation examples measured per finished trial"),
    "--cost-limit": ("cost_limit", int, None, "of those, the first whose SPEED steps are counted per launch loop"),
    "--val-limit": ("val_limit", int, None, "validation examples of the periodic validation loss"),
    "--max-new-tokens": ("max_new_tokens", int, None, "decoding length limit"),
    "--latency-limit": ("latency_limit", int, None, "inputs the latency stage decodes per variant (0: no stage)"),
    "--latency-reps": ("latency_reps", int, None, "interleaved rounds of the latency stage"),
    "--branches": ("branches", int, "+", "runner-up branches each trial's SPEED costs are also measured with"),
    "--branch-depth": ("branch_depth", int, "+", "branch lane lengths of those measurements"),
    "--min-confidence": ("min_confidence", float, "+", "confidence gates of those measurements (0: none)"),
    "--fail-pattern": ("fail_pattern", str, None, "fault drill: this pattern's trials fail in training"),
}


def parse(argv: list[str] | None = None) -> tuple[SweepConfig, JobConfig]:
    """The sweep (sweep flags) and its base finetuning job (``--config`` YAML, job flags, ``--set``)."""
    parser = build_parser("finetune", __doc__)
    parser.prog = "sweep.py"
    group = parser.add_argument_group("sweep")
    for flag, (field, type_, nargs, help_) in SWEEP_FLAGS.items():
        group.add_argument(flag, dest=f"sweep.{field}", type=type_, nargs=nargs, help=help_)
    args = vars(parser.parse_args(argv))
    for swept in ("model.pattern", "train.loss_weights"):
        if swept in args:
            parser.error(f"the sweep sets {swept} per trial: use --patterns and --schemes")
    if any(item.startswith("train.settle") for item in args.get("set") or []) and "sweep.settle" in args:
        parser.error("--settle sets train.settle per trial: drop --set train.settle...")
    sweep = SweepConfig(**{k.removeprefix("sweep."): v for k, v in args.items() if k.startswith("sweep.")})
    flags = {k: v for k, v in args.items() if not k.startswith("sweep.") and k not in ("config", "set")}
    config = args.get("config") or DEFAULT_CONFIGS.get(args.get("model.family", "t5"), DEFAULT_CONFIGS["t5"])
    return sweep, job_from_layers("finetune", config, args.get("set") or [], flags)


def main(argv: list[str] | None = None) -> int:
    """Run or resume the sweep; the tables are printed and written."""
    with user_errors():  # a mistake in the flags, the config or the files they name: one line, status 2
        sweep, job = parse(argv)
        check_inputs(job)
        check_job(sweep, job)  # scheduler settings against the job's steps and reports (run_sweep prints its notes)
    run_sweep(sweep, job)
    return 0


if __name__ == "__main__":
    sys.exit(main())
