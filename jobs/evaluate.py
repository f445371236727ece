"""Evaluate a checkpoint: decode a task split with SPEED, score it, write predictions, trace and summary.

    .venv/bin/python jobs/evaluate.py --checkpoint runs/finetune/checkpoint --task translate_en_de \
        --split test --limit 200 --check-sequential

Writes predictions.parquet, trace.parquet and summary.json to --out (default
<checkpoint>/eval/<task>-<split>) and prints the metrics with their signatures.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "platform"))  # this checkout's speed, not an installed one

from speed.checkpoint import load_model
from speed.data import TASKS
from speed.evaluate import EvalConfig, format_summary, run_evaluation
from speed.tokenizer import Tokenizer


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    defaults = EvalConfig()
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--checkpoint", required=True, help="checkpoint directory (model.pt, config.json, spm.model)")
    p.add_argument("--task", default=defaults.task, choices=sorted(n for n, t in TASKS.items() if not t.is_pretrain))
    p.add_argument("--split", default=defaults.split)
    p.add_argument("--source", default=None, help="'hub', a hub name[:config], or files/glob (default: local corpus)")
    p.add_argument("--limit", type=int, default=None, help="first N records (default: the whole split)")
    p.add_argument("--batch-size", type=int, default=defaults.batch_size)
    p.add_argument("--max-new-tokens", type=int, default=defaults.max_new_tokens)
    p.add_argument("--max-source-len", type=int, default=defaults.max_source_len)
    p.add_argument("--launch-loop", type=int, default=defaults.launch_loop)
    p.add_argument("--invalidation", choices=("eager", "final"), default=defaults.invalidation)
    p.add_argument("--check-sequential", action="store_true", help="also decode sequentially; outputs must match")
    p.add_argument("--tokenizer", default=None, help="SentencePiece model (default: the checkpoint's spm.model)")
    p.add_argument("--out", default=None, help="output folder (default: <checkpoint>/eval/<task>-<split>)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Run the evaluation the flags describe; returns its summary."""
    args = parse_args(argv)
    config = EvalConfig(**{f.name: getattr(args, f.name) for f in dataclasses.fields(EvalConfig)})
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    loaded = load_model(args.checkpoint, map_location=args.device)
    tokenizer_path = args.tokenizer or loaded.tokenizer_path
    if tokenizer_path is None:
        raise SystemExit(f"checkpoint {args.checkpoint} holds no spm.model; pass --tokenizer")
    out = Path(args.out) if args.out else Path(args.checkpoint) / "eval" / f"{config.task}-{config.split}"
    params = dataclasses.asdict(config)
    task, split = params.pop("task"), params.pop("split")
    summary = run_evaluation(loaded.model, Tokenizer.load(tokenizer_path), task, split, out, **params)
    print(format_summary(summary))
    print(f"wrote {', '.join(summary['files'].values())}")
    return summary


if __name__ == "__main__":
    main(sys.argv[1:])
