"""Data-at-scale benchmark (not a test): preparation time and per-worker peak memory for 1x, 10x, 100x a corpus.

    python jobs/bench_data.py                          # the local pretraining corpus, 1x 10x 100x
    python jobs/bench_data.py --scales 1,10 --before 1 # also the pre-stage in-memory path at 1x
    python jobs/bench_data.py --split validation --scales 1,2 --steps 2 --vocab-size 300  # in seconds

The corpus is replicated by symbolic links in a temporary folder (never in the
project), prepared once per scale with the pretraining job's default settings,
then read by a fresh worker-like process (``speed.benchmarks.data``).
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
from dataclasses import asdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "platform"))  # this checkout's speed, not an installed one

from speed.benchmarks.data import as_row, format_rows, in_subprocess, replicate
from speed.data import get_task, load_records
from speed.data.shards import DOCS_PER_SHARD, CorpusSpec
from speed.paths import data_dir
from speed.tokenizer import train_tokenizer


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--split", default="train", help="the pretraining corpus's split to replicate")
    p.add_argument("--scales", default="1,10,100", help="copies of the corpus, comma-separated")
    p.add_argument("--before", default="", help="scales at which to also measure the in-memory path, e.g. 1,10")
    p.add_argument("--steps", type=int, default=200, help="batches each worker collates")
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--max-source-len", type=int, default=128)
    p.add_argument("--max-target-len", type=int, default=32)
    p.add_argument("--vocab-size", type=int, default=8000)
    p.add_argument("--docs-per-shard", type=int, default=DOCS_PER_SHARD)
    p.add_argument("--ray", action="store_true", help="prepare in Ray tasks (one per file) on a local Ray")
    p.add_argument("--workdir", type=Path, default=None, help="keep corpora, tokenizer and shards here (reused)")
    p.add_argument("--json", action="store_true", help="print the rows as JSON instead of the table")
    args = p.parse_args(argv)

    work = args.workdir or Path(tempfile.mkdtemp(prefix="speed-bench-data-"))
    work.mkdir(parents=True, exist_ok=True)
    try:
        corpus_dir = data_dir() / get_task("pretrain").local_dir
        tokenizer = work / "spm.model"
        if not tokenizer.is_file():
            train_tokenizer(load_records("pretrain", args.split)["text"], tokenizer, vocab_size=args.vocab_size)
        rows = []
        for scale in (int(s) for s in args.scales.split(",")):
            source = replicate(corpus_dir, args.split, scale, work / f"corpus-{scale}x")
            spec = CorpusSpec("pretrain", args.split, str(source), None, args.max_source_len, args.max_target_len, True)
            spec_json = json.dumps(asdict(spec))
            prep = in_subprocess(
                "measure_prepare", spec_json, str(tokenizer), str(work / "data"), args.docs_per_shard, args.ray
            )
            worker = in_subprocess("measure_worker", prep["uri"], args.batch_size, args.steps)
            before = None
            if str(scale) in args.before.split(","):
                before = in_subprocess("measure_in_memory", spec_json, str(tokenizer), args.batch_size, args.steps)
            rows.append(as_row(scale, prep, worker, before))
            print(f"{scale}x: {rows[-1]}", file=sys.stderr, flush=True)
        print(json.dumps(rows) if args.json else format_rows(rows))
    finally:
        if args.workdir is None:
            shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
