"""Load a running speed server: closed loop (C in flight) or open loop (Poisson arrivals), bounded in count and time.

    python jobs/loadtest.py --url http://127.0.0.1:8000 --concurrency 16 --requests 200 --json
    python jobs/loadtest.py --concurrency 32 --requests 500 --rate 20 --method sequential

Prompts default to the Multi30k EN-DE test sources, sent with task=translate_en_de
(the server puts the task prefix before them); --prompts FILE sends one prompt per
line instead. Per-request rows (speed.serve.schemas.LOADGEN_SCHEMA) go to --out;
--json prints one JSON object (requests, errors, tokens_per_s, p50_ms, p99_ms, ...).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import pyarrow.parquet as pq

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "platform"))  # this checkout's speed, not an installed one

from speed.cli import config_from_args
from speed.engine import METHODS
from speed.loadtest.loadgen import DEFAULT_URL, LoadConfig, run_load, task_prompts
from speed.paths import repo_root
from speed.serve.auth import API_KEY_ENV


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--url", default=DEFAULT_URL, help="the server's root URL (only this address is contacted)")
    p.add_argument("--concurrency", type=int, default=1, help="requests in flight (open loop: at most)")
    p.add_argument("--requests", type=int, default=32, help="how many requests to send")
    p.add_argument("--rate", type=float, default=None, help="open loop: Poisson arrivals per second")
    p.add_argument(
        "--time-limit",
        dest="time_limit_s",
        type=float,
        default=600.0,
        help="seconds; stop sending and abandon after this",
    )
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--task", default="translate_en_de", help="task of the default prompts, sent with each request")
    p.add_argument("--prompts", default=None, help="a text file, one prompt per line (sent without a task)")
    p.add_argument("--method", choices=METHODS, default=None, help="default: the server's")
    p.add_argument("--launch-loop", type=int, default=None)
    p.add_argument("--no-stream", action="store_true", help="ask for whole answers (no client-side ttft)")
    p.add_argument("--label", default="load", help="the run column of the rows")
    p.add_argument("--out", default=str(repo_root() / "results" / "loadtest.parquet"), help="per-request Parquet")
    p.add_argument("--json", action="store_true", help="print one JSON summary object")
    p.add_argument("--api-key", default=os.environ.get(API_KEY_ENV), help=f"the server's key (default: ${API_KEY_ENV})")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    """Run the load the flags describe, write its rows, print the summary."""
    args = parse_args(argv)
    if args.prompts:
        prompts = [line for line in Path(args.prompts).read_text().splitlines() if line.strip()]
        body = {}
    else:
        prompts = task_prompts(args.task, "test")
        body = {"task": args.task}
    body.update({k: v for k, v in (("method", args.method), ("launch_loop", args.launch_loop)) if v is not None})
    config = config_from_args(LoadConfig, args, stream=not args.no_stream, body=body)
    result = run_load(config, prompts)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(result.table, args.out)
    summary = {**result.summary(), "concurrency": args.concurrency, "rate": args.rate, "out": args.out}
    if args.json:
        print(json.dumps(summary))
    else:
        for key, value in summary.items():
            print(f"{key:>14}: {value:.1f}" if isinstance(value, float) else f"{key:>14}: {value}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
