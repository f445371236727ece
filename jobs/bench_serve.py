"""The serving benchmark (not a test): (a) one request at a time, sequential; (b) continuous batching,
sequential; (c) continuous batching, SPEED; (d) with --branches or --min-confidence, (c) with SPEED's
runner-up branches or confidence gate; closed-loop HTTP load at concurrency 1, 4 and 16.

    python jobs/bench_serve.py --checkpoint runs/demo/<finetune run> [--rounds 2] [--row-budget 48] [--json]
    python jobs/bench_serve.py --checkpoint runs/demo/<finetune run> --temperature 0.8 --seed 7   # sampled
    python jobs/bench_serve.py --checkpoint runs/demo/<finetune run> --branches 6 --row-budget 8  # (d) beside (c)
    python jobs/bench_serve.py --checkpoint runs/demo/<finetune run> --shape ouro-1.4b --agreement 0.7  # replayed

--shape: the replicas serve a random model of that published shape (--shape-dtype, bf16 by default) instead of the
checkpoint's (whose tokenizer and prompts they keep), its early exits replaying a trained model's flips
(speed.benchmarks.replay): --replay-trace (a trace.parquet; --replay-stop-id its model's stop tokens), else loop-1
--agreement on the trained profile. A replica learns each prompt's final tokens from its first answer (variant b's
sequential decoding comes before c's SPEED in every round), so (c) replays and (b) is the model's own; greedy only.
The flip rates by loop of each variant's requests are printed (the replicas' statistics rows hold them per request).

Prompts are Multi30k test sources (task translate_en_de; a looped LM's checkpoint reads them as its
finetuning prompts, docs/serving.md). Starts a private local
Ray (all of this machine's CPUs), deploys the checkpoint twice behind Ray Serve on
a free loopback port, prints a Markdown table and the ratios against the serving
targets (speed.benchmarks.serving.BARS), and writes rows to --out (speed.serve.schemas.BENCH_SERVE_SCHEMA) and every
request to <out stem>_requests.parquet (LOADGEN_SCHEMA).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import pyarrow.parquet as pq
import ray

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "platform"))  # this checkout's speed, not an installed one

from speed.benchmarks.serving import ServeBenchConfig, format_table, replay_serving, run_serve_bench
from speed.cli import config_from_args
from speed.cluster import start_local_ray
from speed.paths import repo_root
from speed.storage import absolute


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    d = ServeBenchConfig(checkpoint="")
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--checkpoint", required=True, help="checkpoint or run, a path or URI (the demo's finetuned 2x6)")
    p.add_argument("--concurrency", type=int, nargs="+", default=list(d.concurrency))
    p.add_argument("--rounds", type=int, default=d.rounds)
    p.add_argument("--requests-per-client", type=int, default=d.requests_per_client)
    p.add_argument("--min-requests", type=int, default=d.min_requests)
    p.add_argument("--max-tokens", type=int, default=d.max_tokens)
    p.add_argument("--max-active", type=int, default=d.max_active, help="engine capacity of (b) and (c)")
    p.add_argument("--row-budget", type=int, default=d.row_budget, help="rows per engine step of (b) and (c)")
    p.add_argument("--launch-loop", type=int, default=d.launch_loop)
    p.add_argument("--branches", type=int, default=d.branches, help="runner-up branches of variant (d)")
    p.add_argument("--branch-depth", type=int, default=d.branch_depth, help="branch lane length of variant (d)")
    p.add_argument("--min-confidence", type=float, default=d.min_confidence, help="confidence gate of (d)")
    p.add_argument("--temperature", type=float, default=d.temperature, help="sample at this temperature (0: greedy)")
    p.add_argument("--seed", type=int, default=d.seed, help="every request's sampling seed")
    p.add_argument("--threads", type=int, default=d.threads, help="torch threads per replica")
    p.add_argument(
        "--no-cost-model", dest="cost_model", action="store_false", help="replicas run every in-flight row"
    )
    p.add_argument("--time-limit-s", type=float, default=d.time_limit_s, help="each load run's limit in seconds")
    p.add_argument("--shape", default=None, help="serve a random model of this published shape, replaying flips")
    p.add_argument("--shape-dtype", default="bfloat16", help="the shape's weights: bfloat16 or float32")
    p.add_argument("--agreement", type=float, default=0.7, help="--shape: loop-1 agreement on the trained profile")
    p.add_argument("--replay-trace", default=None, help="--shape: a trace.parquet whose flips are replayed")
    p.add_argument("--replay-stop-id", type=int, action="append", default=[], help="the traced model's stop ids")
    p.add_argument("--out", default=str(repo_root() / "results" / "bench_serve.parquet"))
    p.add_argument("--json", action="store_true", help="also print the summary and ratios as one JSON object")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark the flags describe; print the table; write the rows."""
    args = parse_args(argv)
    checkpoint = absolute(args.checkpoint)  # the replicas' working folder is not this one
    replay = None
    if args.shape is not None:
        trace = None if args.replay_trace is None else pq.read_table(args.replay_trace)
        length = max(args.max_tokens, 64)  # the replicas' max_target_len
        replay = replay_serving(args.shape, args.shape_dtype, args.agreement, trace, frozenset(args.replay_stop_id),
                                length, args.seed)  # fmt: skip
        print(f"[bench_serve] serving {args.shape} ({args.shape_dtype}) replaying {replay.pattern.source}", flush=True)
    config = config_from_args(
        ServeBenchConfig, args, checkpoint=checkpoint, concurrency=tuple(args.concurrency), replay=replay
    )
    start_local_ray()  # the replicas import this process's speed, whatever the machine's $PYTHONPATH
    try:
        result = run_serve_bench(config)
    finally:
        from ray import serve

        serve.shutdown()
        ray.shutdown()
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(result.runs, out)
    pq.write_table(result.requests, out.with_name(out.stem + "_requests.parquet"))
    print(format_table(result))
    print(f"rows in {out} and {out.with_name(out.stem + '_requests.parquet')}")
    if args.json:
        summary = {f"{v}@{c}": s for (v, c), s in result.summary.items()}
        print(json.dumps({"summary": summary, "ratios": result.ratios, "mismatches": result.mismatches,
                          "unanswered": result.unanswered}))  # fmt: skip
    return 0 if result.mismatches == result.unanswered == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
