"""One model directory end to end, as a user meets it: the memory check, the load, 16 greedy tokens by SPEED and by
sequential decoding (equal, or the run fails), then a two-request chat through Serve in bf16 weights, with the
check's figures beside the memory the processes used.

    python -m speed.benchmarks.end_to_end /tmp/fullsize/Huginn-0125 [--dtype bfloat16] [--tokens 16]

A fresh process per directory (its peak resident set is the run's). Prints one JSON ``EndToEnd`` and a table row
for docs/models.md's "Memory at real sizes". The offline model is freed before Serve starts, whose replica loads
the directory again in its own process (``--dtype bfloat16``, as ``jobs/serve.py --dtype bfloat16``); the replica's
resident set is read from its ``/v1/stats``. The memory check is ``speed.models.pretrained.check_load`` at the
capacity both use (``CAPACITY``: two requests of a ``PROMPT_LEN``-token prompt and ``tokens`` outputs).
"""

from __future__ import annotations

import argparse
import gc
import json
import socket
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path

import psutil
import requests
import torch

from speed.benchmarks.loading import peak_rss
from speed.decode.generate import DecodeOptions, generate
from speed.engine.kernels import ATTN_CHUNK
from speed.engine.memory import available_bytes, size
from speed.engine.types import EngineConfig
from speed.hf_files import read_config
from speed.hf_tokenizer import load_tokenizer
from speed.models.form import form_of
from speed.models.precision import DTYPES, dtype_named
from speed.models.pretrained import check_load, from_pretrained

PROMPT = "The capital of Westphalia is"
CHATS = (
    [{"role": "user", "content": "Name three rivers of Germany."}],
    [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "What is 12 + 30?"}],
)
PROMPT_LEN = 128  # the longest prompt (tokens) the capacity holds: the chats' rendered templates fit it
APP, KEY = "speed-end-to-end", "sk-end-to-end"


@dataclass(frozen=True)
class EndToEnd:
    """One directory's run: the check's figures (bytes), the load, the decodings and the chat."""

    directory: str
    form: str
    dtype: str
    checked_bytes: int  # what check_load said the weights and the capacity need
    available_bytes: int  # what it compared them with
    load_seconds: float
    weights_bytes: int
    peak_after_load: int  # this process's peak resident set once loaded
    speed_seconds: float
    sequential_seconds: float
    tokens: list[int]  # the greedy tokens, SPEED's equal to sequential's
    peak_after_decoding: int
    chat_seconds: float
    chat_tokens: list[int]  # each chat answer's completion tokens
    replica_rss: int  # the Serve replica's resident set after the chats


def capacity(tokens: int) -> EngineConfig:
    """The engine capacity the check counts: two requests of ``PROMPT_LEN`` prompt tokens and ``tokens`` outputs,
    both at once (a pool of their blocks: without ``kv_blocks`` the check counts one request's, the engine's floor),
    no runner-up branches (Huginn's side entries alone would be gigabytes a slot)."""
    blocks = 2 * -(-(PROMPT_LEN + tokens + 1) // ATTN_CHUNK)
    return EngineConfig(
        max_active=2, max_prompt_len=PROMPT_LEN, max_target_len=tokens + 1, branches=False, kv_blocks=blocks
    )


def run(directory: str | Path, dtype: torch.dtype = torch.bfloat16, tokens: int = 16) -> EndToEnd:
    """The run (see the module doc); an ``AssertionError`` where SPEED's tokens differ from sequential's."""
    directory = str(Path(directory).resolve())
    name = str(dtype).removeprefix("torch.")
    need = check_load(directory, dtype=dtype, capacity=capacity(tokens))
    available, _ = available_bytes(torch.device("cpu"))
    start = time.perf_counter()
    model = from_pretrained(directory, dtype=dtype)
    load_seconds = time.perf_counter() - start
    weights = sum(p.nbytes for p in model.parameters())
    after_load = peak_rss()
    tokenizer = load_tokenizer(directory)
    form = form_of(read_config(directory))
    ids = torch.tensor([tokenizer.encode(PROMPT, add_eos=form.prompt_eos)])
    model.pack_for_decoding()  # as a Serve replica decodes
    timed = {}
    for method in ("speed", "sequential"):
        start = time.perf_counter()
        timed[method] = generate(model, ids, options=DecodeOptions(method=method, max_new_tokens=tokens)).tokens[0]
        timed[method + "_seconds"] = time.perf_counter() - start
    assert timed["speed"] == timed["sequential"], f"SPEED {timed['speed']} != sequential {timed['sequential']}"
    after_decoding = peak_rss()
    del model
    gc.collect()
    chat_seconds, chat_tokens, replica_rss = _serve_chats(directory, name, tokens)
    return EndToEnd(
        directory, form.name, name, need.total, available, load_seconds, weights, after_load, timed["speed_seconds"],
        timed["sequential_seconds"], timed["speed"], after_decoding, chat_seconds, chat_tokens, replica_rss,
    )  # fmt: skip


def _serve_chats(directory: str, dtype: str, tokens: int) -> tuple[float, list[int], int]:
    """Deploy ``directory`` on a private local Ray (loopback), two chats at once by the official client; their
    seconds, completion tokens and the replica's resident set. Serve and Ray are stopped after."""
    import openai
    import ray

    from speed.cluster import code_runtime_env, local_ray_options
    from speed.serve.app import start_app
    from speed.serve.settings import AppConfig
    from speed.serve.stop import stop_serving

    settings = {"max_active": 2, "max_source_len": PROMPT_LEN, "max_target_len": tokens + 1, "max_tokens": tokens}
    settings["allow_branches"] = False  # as the check counted: Huginn's side entries would be 4-8 GiB a slot
    stats = tempfile.mkdtemp(prefix="speed-end-to-end-")
    context = ray.init(address="local", **local_ray_options(), runtime_env=code_runtime_env(), log_to_driver=False)
    try:
        port = _free_port()
        config = AppConfig(directory, settings=settings, stats_path=stats, device="cpu", dtype=dtype, name=APP,
                           api_key=KEY, port=port)  # fmt: skip
        url = start_app(config)
        client = openai.OpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0, timeout=3600)
        (card,) = client.models.list().data
        start = time.perf_counter()
        with ThreadPoolExecutor(len(CHATS)) as pool:
            answers = list(pool.map(
                lambda chat: client.chat.completions.create(model=card.id, messages=chat, max_tokens=tokens), CHATS
            ))  # fmt: skip
        seconds = time.perf_counter() - start
        headers = {"Authorization": f"Bearer {KEY}"}
        rss = requests.get(url + "/v1/stats", headers=headers, timeout=60).json()["rss_bytes"]
    finally:
        stop_serving(APP, stats, 60, context.address_info["gcs_address"])
    return seconds, [a.usage.completion_tokens for a in answers], rss


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main(argv: list[str]) -> None:
    """``DIR [--dtype D] [--tokens N]``: the run; one JSON line and a table row."""
    parser = argparse.ArgumentParser(prog="python -m speed.benchmarks.end_to_end", description=main.__doc__)
    parser.add_argument("directory")
    parser.add_argument("--dtype", choices=DTYPES, default="bfloat16")
    parser.add_argument("--tokens", type=int, default=16)
    args = parser.parse_args(argv)
    r = run(args.directory, dtype_named(args.dtype), args.tokens)
    print(json.dumps(asdict(r)))
    print("| model | dtype | memory check (weights + 2 requests) / available | load s | weights | peak RSS loaded | "
          "peak RSS decoded | SPEED = sequential (16 tokens) | SPEED s / sequential s | chat s (2 requests) | "
          "replica RSS |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    print(f"| {Path(r.directory).name} | {r.dtype} | {size(r.checked_bytes)} / {size(r.available_bytes)} | "
          f"{r.load_seconds:.1f} | {size(r.weights_bytes)} | {size(r.peak_after_load)} | {size(r.peak_after_decoding)} "
          f"| yes | {r.speed_seconds:.1f} / {r.sequential_seconds:.1f} | {r.chat_seconds:.1f} | "
          f"{size(r.replica_rss)} |")  # fmt: skip
    print(f"(this process's resident set now: {size(psutil.Process().memory_info().rss)})", file=sys.stderr)


if __name__ == "__main__":
    main(sys.argv[1:])
