"""Soak the Serve app (not a test): a mix of greedy, sampled, streamed, n=2, stop-string and abandoned requests
from C clients for some minutes; memory, latency per minute, errors by kind, and rows on disk against answers.

    python jobs/soak.py --checkpoint runs/demo/<finetune run> --minutes 10 --concurrency 16
    python jobs/soak.py --url http://127.0.0.1:8000 --stats runs/serve-stats --minutes 10   # a running server

With --checkpoint it starts a private local Ray and deploys the app on a free loopback port, its statistics
under --stats (default: a fresh folder in results/); with --url it loads a running server whose --stats path
it reads the rows from (skip the row check without --stats). Prints Markdown tables
(``speed.loadtest.soak.format_report``) and the goals (no failures but intended 4xx/503, replica RSS growth under
10 %, one row per answered choice); writes every request to --out (``speed.loadtest.soak.SOAK_SCHEMA``).
Exits 1 when a request failed or an answered row is missing.
"""

from __future__ import annotations

import argparse
import os
import socket
import sys
import tempfile
from pathlib import Path

import pyarrow.parquet as pq

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "platform"))  # this checkout's speed, not an installed one

from speed.loadtest.soak import SoakConfig, format_report, run_soak
from speed.paths import repo_root
from speed.serve.auth import API_KEY_ENV
from speed.storage import absolute


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    d = SoakConfig()
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    where = p.add_mutually_exclusive_group(required=True)
    where.add_argument("--checkpoint", help="deploy this checkpoint or run (a path or URI) on a private local Ray")
    where.add_argument("--url", help="soak a running server instead")
    p.add_argument("--stats", default=None, help="the server's stats_path (with --checkpoint: where to put it)")
    p.add_argument("--minutes", type=float, default=d.minutes)
    p.add_argument("--concurrency", type=int, default=d.concurrency)
    p.add_argument("--max-tokens", type=int, default=d.max_tokens)
    p.add_argument("--task", default="translate_en_de", help="task of the prompts (Multi30k test sources)")
    p.add_argument("--replicas", type=int, default=1, help="with --checkpoint")
    p.add_argument("--out", default=str(repo_root() / "results" / "soak.parquet"))
    p.add_argument("--api-key", default=os.environ.get(API_KEY_ENV), help=f"the server's key (default: ${API_KEY_ENV})")
    return p.parse_args(argv)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main(argv: list[str] | None = None) -> int:
    """Run the soak the flags describe; print its report; write its rows."""
    args = parse_args(argv)
    from speed.loadtest.loadgen import task_prompts

    prompts = tuple(task_prompts(args.task, "test", limit=200))
    stats = args.stats
    started = None
    if args.checkpoint:
        folder = Path(args.out).parent
        folder.mkdir(parents=True, exist_ok=True)
        stats = stats or tempfile.mkdtemp(prefix="soak-stats-", dir=folder)
        started = _start(absolute(args.checkpoint), absolute(stats), args.replicas, args.concurrency)
    config = SoakConfig(
        url=args.url or started,
        minutes=args.minutes,
        concurrency=args.concurrency,
        max_tokens=args.max_tokens,
        prompts=prompts,
        body={"task": args.task},
        api_key=args.api_key,
    )
    print(f"soak: {config.concurrency} clients for {config.minutes:g} min against {config.url}", flush=True)
    try:
        result = run_soak(config)
    finally:
        if started:
            _stop()
    rows = None
    if stats:
        from speed.serve.readers import read_requests

        rows = result.check_rows(read_requests(stats))
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(result.table, out)
    print(format_report(result, rows))
    growth, warm = result.rss_growth, result.rss_growth_after_warmup
    print(
        f"goals: failures {result.failures} (0), RSS growth {'-' if growth is None else f'{growth * 100:.1f} %'}"
        f" ({'-' if warm is None else f'{warm * 100:.1f} %'} after the first minute) (< 10 %), rows "
        f"{'not checked' if rows is None else f'{rows.found}/{rows.answered}'} (all)"
    )
    print(f"requests in {out}; statistics under {stats}")
    return 0 if result.failures == 0 and (rows is None or rows.complete) else 1


def _start(checkpoint: str, stats: str, replicas: int, concurrency: int) -> str:
    from speed.cluster import start_local_ray
    from speed.serve.app import start_app
    from speed.serve.settings import AppConfig

    start_local_ray()
    return start_app(
        AppConfig(
            checkpoint,
            port=_free_port(),
            replicas=replicas,
            stats_path=stats,
            device="cpu",
            num_cpus=0,
            max_ongoing_requests=concurrency + 4,
            max_queued_requests=4 * concurrency,
        )
    )


def _stop() -> None:
    import ray
    from ray import serve

    serve.shutdown()  # drains the replicas: their buffered rows are written
    ray.shutdown()


if __name__ == "__main__":
    sys.exit(main())
