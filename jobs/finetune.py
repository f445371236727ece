"""Finetune a parameter-shared T5 on translate_en_de or summarize with Ray Train, then evaluate it with SPEED.

A looped LM checkpoint (or --model lm) is finetuned on the same tasks as chat prompts (speed.chat), the loss
on the answer only.

    python jobs/finetune.py --init-from runs/pretrain-pretrain-2x6-<hash>      # a pretraining run or checkpoint
    python jobs/finetune.py --init-from hf:google/t5-v1_1-small --pattern 2x4 --task summarize --use-gpu
    python jobs/finetune.py --task translate_en_de                             # from scratch

The final checkpoint is evaluated (speed.eval.evaluate.run_evaluation: SPEED decoding,
optionally against sequential) into <run>/eval_<split>/ (predictions.parquet,
trace.parquet, summary.json). Without $RAY_ADDRESS a local Ray starts in-process.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "platform"))  # this checkout's speed, not an installed one

from speed.train.launch import job_main


def main(argv: list[str] | None = None) -> int:
    """Parse flags (and --config YAML) into a JobConfig and train, then evaluate (``speed.train.launch.job_main``)."""
    return job_main("finetune", argv, __doc__)


if __name__ == "__main__":
    sys.exit(main())
