"""Serve a checkpoint over HTTP with Ray Serve: OpenAI-style completions decoded by SPEED.

    python jobs/serve.py --checkpoint runs/demo/<finetune run>/checkpoint_000400 --port 8000 --replicas 2
    curl -s 127.0.0.1:8000/v1/completions -H 'content-type: application/json' \\
        -d '{"prompt": "A man rides a bike.", "task": "translate_en_de", "max_tokens": 48}'

Starts on the local Ray (or joins $RAY_ADDRESS) and blocks until interrupted (Ctrl-C),
then shuts Serve down, which writes every replica's remaining statistics. Binds
127.0.0.1 unless --host says otherwise. --set KEY=VALUE fills the replicas'
user_config (speed.serve.app.ServeSettings: max_active, row_budget, method,
launch_loop, task, ...). For `serve run` / `serve deploy` use jobs/configs/serve.yaml.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time
from pathlib import Path

import ray
import yaml
from ray import serve

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "platform"))  # this checkout's speed, not an installed one

from speed.serve.app import DEFAULT_STATS_PATH, start_app


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--checkpoint", required=True, help="checkpoint or run directory, a local path or a URI")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--host", default="127.0.0.1", help="address the HTTP proxy binds (default: loopback only)")
    p.add_argument("--replicas", type=int, default=1)
    p.add_argument("--num-cpus", type=float, default=1, help="CPUs reserved per replica")
    p.add_argument("--num-gpus", type=float, default=0, help="GPUs per replica (the model then decodes on CUDA)")
    p.add_argument("--stats-path", default=DEFAULT_STATS_PATH, help="where replicas write request statistics")
    p.add_argument("--model-name", default=None, help="name in /v1/models (default: the checkpoint's folder name)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="a ServeSettings field")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    """Deploy, print the URL, block until interrupted."""
    args = parse_args(argv)
    settings = {}
    for item in args.set:
        key, sep, value = item.partition("=")
        if not sep:
            raise SystemExit(f"error: --set expects KEY=VALUE, got {item!r}")
        settings[key] = yaml.safe_load(value)
    ray.init(address=os.environ.get("RAY_ADDRESS") or "local", log_to_driver=True)
    url = start_app(
        args.checkpoint,
        port=args.port,
        host=args.host,
        replicas=args.replicas,
        settings=settings,
        stats_path=args.stats_path,
        model_name=args.model_name,
        device="cuda" if args.num_gpus > 0 else "cpu",
        num_cpus=args.num_cpus,
        num_gpus=args.num_gpus,
    )
    print(f"serving {args.checkpoint} at {url} (Ctrl-C stops); statistics in {args.stats_path}", flush=True)
    signal.signal(signal.SIGTERM, signal.default_int_handler)  # `kill` stops as cleanly as Ctrl-C
    try:
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        print("stopping: draining replicas and writing their statistics", flush=True)
    finally:
        serve.shutdown()
        ray.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
