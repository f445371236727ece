"""Finetune a parameter-shared T5 on translate_en_de or summarize with Ray Train, then evaluate it with SPEED.

A looped LM checkpoint (or --model lm) is finetuned on the same tasks as chat prompts (speed.chat), the loss
on the answer only.

    python jobs/finetune.py --init-from runs/pretrain-pretrain-2x6-<hash>      # a pretraining run or checkpoint
    python jobs/finetune.py --init-from hf:google/t5-v1_1-small --pattern 2x4 --task summarize --use-gpu
    python jobs/finetune.py --task translate_en_de                             # from scratch

The final checkpoint is evaluated (speed.evaluate.run_evaluation: SPEED decoding,
optionally against sequential) into <run>/eval_<split>/ (predictions.parquet,
trace.parquet, summary.json). Without $RAY_ADDRESS a local Ray starts in-process.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "platform"))  # this checkout's speed, not an installed one

from speed.cli import user_errors
from speed.evaluate import format_summary
from speed.train.config import job_from_args
from speed.train.launch import check_inputs, run_job


def main(argv: list[str] | None = None) -> int:
    """Parse flags (and --config YAML) into a JobConfig, train, evaluate; prints checkpoint and summary."""
    with user_errors():  # a mistake in the flags, the config or the files they name: one line, status 2
        job = job_from_args("finetune", argv, description=__doc__)
        check_inputs(job)
    outcome = run_job(job)
    print(f"finetuned checkpoint: {outcome.checkpoint}")
    if outcome.evaluation is not None:
        print(format_summary(outcome.evaluation))
    return 0


if __name__ == "__main__":
    sys.exit(main())
