"""Serve a checkpoint over HTTP with Ray Serve: OpenAI-style completions decoded by SPEED.

    python jobs/serve.py --checkpoint runs/demo/<finetune run>/checkpoint_000400 --port 8000 --replicas 2
    python jobs/serve.py --checkpoint ~/models/Ouro-1.4B-Thinking  # a Hugging Face directory: its own tokenizer,
                                                                   # chat template and stop tokens
    python jobs/serve.py --checkpoint ~/models/Ouro-1.4B --dtype bfloat16  # bf16 weights: half the bytes a token reads
    curl -s 127.0.0.1:8000/v1/completions -H 'content-type: application/json' \\
        -d '{"prompt": "A man rides a bike.", "task": "translate_en_de", "max_tokens": 48}'

Starts on the local Ray (or joins $RAY_ADDRESS) and blocks until interrupted (Ctrl-C or
SIGTERM, what `kill`, systemd and Kubernetes send), then stops within --stop-timeout-s
(speed.serve.stop.stop_serving): it deletes the application (Serve drains every replica, which writes its remaining
statistics), then shuts Serve and Ray down, and writes the write-ahead logs of replicas
that could not drain (a signal to the whole process group stops them at once) as their
Parquet files, so that any Parquet reader sees every answered row. Binds 127.0.0.1
unless --host says otherwise. With --api-key (or $SPEED_API_KEY, which `ps` does not show) every route
but /healthz needs `Authorization: Bearer <key>`. --set KEY=VALUE fills the replicas'
user_config (speed.serve.settings.ServeSettings: max_active, row_budget, method,
launch_loop, branches, min_confidence, task, max_prompts, ...). For `serve run` / `serve deploy`
use jobs/configs/serve.yaml.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time
from dataclasses import fields
from pathlib import Path

import ray

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "platform"))  # this checkout's speed, not an installed one

from speed.cli import add_weight_flags, parse_set, user_errors
from speed.cluster import code_runtime_env, local_ray_options
from speed.models.form import get_form
from speed.models.precision import DTYPES, dtype_named
from speed.models.pretrained import check_load, model_source
from speed.serve.app import start_app
from speed.serve.auth import API_KEY_ENV
from speed.serve.settings import DEFAULT_STATS_PATH, AppConfig, host_capacity
from speed.serve.stop import stop_serving
from speed.storage import absolute, locate

APP = "speed"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The flags; each one that deploys is named as its ``speed.serve.settings.AppConfig`` field."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--checkpoint",
        required=True,
        help="checkpoint, run or Hugging Face model directory (Ouro, Huginn, Llama, T5 v1.1), a local path or a URI",
    )
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--host", default="127.0.0.1", help="address the HTTP proxy binds (default: loopback only)")
    p.add_argument("--replicas", type=int, default=1)
    p.add_argument("--num-cpus", type=float, default=1, help="CPUs reserved per replica")
    p.add_argument("--max-replicas-per-node", type=int, default=None, help="1: each replica on a node of its own")
    p.add_argument(
        "--proxy-location",
        default="EveryNode",
        help="Serve's HTTP proxies: EveryNode, HeadOnly (nodes sharing a machine)",
    )
    p.add_argument("--num-gpus", type=float, default=0, help="GPUs per replica (the model then decodes on CUDA)")
    p.add_argument("--stats-path", default=DEFAULT_STATS_PATH, help="where replicas write request statistics")
    p.add_argument("--model-name", default=None, help="name in /v1/models (default: the checkpoint's folder name)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="a ServeSettings field")
    p.add_argument(
        "--exit-adapters",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="draft with the checkpoint's exit adapters when it has them (speed.models.exits; answers unchanged); "
        "default: on a GPU yes, on a CPU no (speed.engine.defaults)",
    )
    add_weight_flags(p, DTYPES)
    p.add_argument(
        "--api-key", default=None, help=f"require 'Authorization: Bearer KEY' (default: ${API_KEY_ENV}; none: open)"
    )
    p.add_argument(
        "--stop-timeout-s", type=float, default=25.0, help="longest stop after a signal (Kubernetes grants 30 s)"
    )
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    """Deploy, print the URL, block until interrupted."""
    args = parse_args(argv)
    address = os.environ.get("RAY_ADDRESS")
    device = "cuda" if args.num_gpus > 0 else "cpu"
    # Checked before Ray starts (a replica's failure would be neither one line nor quick): a --set without '=' or with
    # invalid YAML, a directory it cannot read, a model and engine the memory cannot hold: one line, status 2
    with user_errors():
        settings = dict(map(parse_set, args.set))
        source = model_source(args.checkpoint)
        if args.initial_state_seed is not None and (source == "platform" or not get_form(source).seeded_state):
            raise ValueError(f"--initial-state-seed: {args.checkpoint} is a {source} model; only Huginn's has one")
        if not address and (source == "platform" or locate(args.checkpoint).local):  # the replicas run here
            check_load(args.checkpoint, dtype=dtype_named(args.dtype), capacity=host_capacity(device, settings))
    api_key = args.api_key if args.api_key is not None else os.environ.get(API_KEY_ENV) or None
    stats_path = absolute(args.stats_path)  # the replicas' working folder is not this one
    # The replicas import this process's speed (speed.cluster), whatever the machine's $PYTHONPATH.
    where = {"address": address} if address else {"address": "local", **local_ray_options()}  # loopback unless opened
    context = ray.init(**where, log_to_driver=True, runtime_env=code_runtime_env())
    own_gcs = None if address else context.address_info["gcs_address"]  # a joined cluster outlives this job
    signal.signal(signal.SIGTERM, signal.default_int_handler)  # `kill` stops as cleanly as Ctrl-C, even mid-start
    try:
        flags = {f.name: getattr(args, f.name) for f in fields(AppConfig) if hasattr(args, f.name)}  # same names
        given = {"settings": settings, "stats_path": stats_path, "api_key": api_key, "device": device, "name": APP}
        url = start_app(AppConfig(**flags | given))
        key = "; an API key is required" if api_key else ""
        print(f"serving {args.checkpoint} at {url} (Ctrl-C stops){key}; statistics in {stats_path}", flush=True)
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        print("stopping: draining replicas and writing their statistics", flush=True)
    finally:
        for sig in (signal.SIGINT, signal.SIGTERM):  # a second signal must not cut the bounded stop short
            signal.signal(sig, signal.SIG_IGN)
        stop_serving(APP, stats_path, args.stop_timeout_s, own_gcs)
    return 0


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # everything is stopped and written: skip native teardown (seconds, on a stop with a deadline)
