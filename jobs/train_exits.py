"""Train exit adapters on a frozen checkpoint with Ray Train, and save them beside it (speed.models.exits).

One small residual adapter per early loop k < M before the shared classifier, trained with KL(loop M || loop k)
while the model stays frozen: the early exits agree more with the last loop (fewer flushes for SPEED), and the
output cannot change (loop M's exit is never adapted). Evaluation, Serve and the sweep use them when present.

    python jobs/train_exits.py --checkpoint runs/finetune-translate_en_de-2x6-<hash>   # a run's newest checkpoint
    python jobs/train_exits.py --checkpoint <ckpt> --rank 64 --steps 600 --targets decoded
    python jobs/evaluate.py --checkpoint <ckpt> --oracle                               # with them
    python jobs/evaluate.py --checkpoint <ckpt> --oracle --no-exit-adapters            # without
    python jobs/train_exits.py --checkpoint ~/models/Ouro-1.4B --task translate_en_de  # a Hugging Face directory

The run (checkpoints of the adapters and the optimizer) lives in <storage-path>/exits-<ckpt>-r<rank>-<hash>; the
same command again resumes it. A Hugging Face directory (Ouro, Huginn, Llama, T5 v1.1) records no training split:
--task names it, and the run first writes the directory as a platform checkpoint into <run>/model (the converted
model, the directory's tokenizer, a job naming the split), trains the adapters beside it and prints where: name
that checkpoint to evaluate.py or serve.py to decode with them. Without $RAY_ADDRESS a local Ray starts in-process.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "platform"))  # this checkout's speed, not an installed one

from speed.cli import JobParser, config_from_args, user_errors
from speed.train.config import TrackingConfig
from speed.train.exits import TARGETS, ExitTrainConfig, check_inputs, run_exits


def parse(argv: list[str] | None = None) -> ExitTrainConfig:
    """The flags as an ``ExitTrainConfig``."""
    d = ExitTrainConfig
    parser = JobParser(prog="train_exits.py", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--checkpoint",
        required=True,
        help="the frozen model: a checkpoint, a run's newest, or a Hugging Face directory",
    )
    parser.add_argument("--rank", type=int, default=d.rank, help="the adapters' bottleneck width")
    parser.add_argument("--loops", type=int, nargs="+", default=[], help="adapted loops (1-based, < M); default all")
    parser.add_argument(
        "--targets",
        choices=TARGETS,
        default=d.targets,
        help="teacher-force the split's targets, or the model's own greedy outputs (T5)",
    )
    parser.add_argument("--steps", type=int, default=d.steps)
    parser.add_argument("--batch-size", type=int, default=d.batch_size)
    parser.add_argument("--lr", type=float, default=d.lr)
    parser.add_argument("--warmup-steps", type=int, default=d.warmup_steps)
    parser.add_argument("--seed", type=int, default=d.seed)
    parser.add_argument("--limit", type=int, default=None, help="first N training records")
    parser.add_argument(
        "--task",
        default=None,
        help="the training split's task (default: the checkpoint's; a Hugging Face directory needs it)",
    )
    parser.add_argument("--max-source-len", type=int, default=None, help="prompt tokens (default: the job's)")
    parser.add_argument("--max-target-len", type=int, default=None, help="answer tokens (default: the job's)")
    parser.add_argument("--log-every", type=int, default=d.log_every)
    parser.add_argument("--checkpoint-every", type=int, default=d.checkpoint_every)
    parser.add_argument("--stop-at-step", type=int, default=None, help="stop cleanly here; the same command resumes")
    parser.add_argument("--num-workers", type=int, default=d.num_workers)
    parser.add_argument("--cpus-per-worker", type=float, default=d.cpus_per_worker)
    parser.add_argument("--use-gpu", action="store_true")
    parser.add_argument("--storage-path", default=d.storage_path)
    parser.add_argument("--name", default=None, help="the run's name (default: from the settings)")
    parser.add_argument("--max-failures", type=int, default=d.max_failures)
    parser.add_argument("--tracking-uri", default=None, help="MLflow server or store (default <storage>/mlruns)")
    parser.add_argument("--no-tracking", action="store_true")
    args = parser.parse_args(argv)
    tracking = None if args.no_tracking else TrackingConfig(uri=args.tracking_uri)
    return config_from_args(ExitTrainConfig, args, loops=tuple(args.loops), tracking=tracking)


def main(argv: list[str] | None = None) -> int:
    """Parse, check, train; prints where the adapters went."""
    with user_errors():
        config = parse(argv)
        check_inputs(config)
    outcome = run_exits(config)
    print(f"exit adapters: {outcome.checkpoint} (step {outcome.step}, run {outcome.run_dir})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
