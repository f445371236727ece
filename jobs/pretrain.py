"""Pretrain a parameter-shared T5 (NxM looped decoder, early exits) with span corruption, on Ray Train; with
--model lm a decoder-only looped LM (P+NxM+C) on next tokens, documents packed into fixed-length rows.

    python jobs/pretrain.py                      # few-minute local run: mini preset, 2x6, ../shared/data/pretrain_text
    python jobs/pretrain.py --model lm --pattern 1+2x4+1
    python jobs/pretrain.py --config jobs/configs/pretrain_small_gpu.yaml --use-gpu --num-workers 8 \\
        --source allenai/c4 --limit 2000000 --storage-path s3://bucket/speed
    ray job submit --working-dir . -- python jobs/pretrain.py --storage-path s3://bucket/speed

Without $RAY_ADDRESS a local Ray starts in-process. Rerunning the same command
resumes its run from the last checkpoint; --resume PATH continues another one.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "platform"))  # this checkout's speed, not an installed one

from speed.train.launch import job_main


def main(argv: list[str] | None = None) -> int:
    """Parse flags (and --config YAML) into a JobConfig and train (``speed.train.launch.job_main``)."""
    return job_main("pretrain", argv, __doc__)


if __name__ == "__main__":
    sys.exit(main())
