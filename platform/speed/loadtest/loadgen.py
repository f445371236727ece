"""HTTP load against the completions route: closed loop (C in flight) or open loop (Poisson arrivals).

A run is bounded by a request count and a wall-clock limit. Each request is
sent with ``stream=true`` (time to first token is measured on the client)
unless asked otherwise; one ``LOADGEN_SCHEMA`` row per request records what
came back. Only the URL given is contacted: the default is this machine's
loopback.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

import aiohttp
import numpy as np
import pyarrow as pa

from speed.serve.schemas import LOADGEN_SCHEMA

DEFAULT_URL = "http://127.0.0.1:8000"


@dataclass(frozen=True)
class LoadConfig:
    """One load run."""

    url: str = DEFAULT_URL  # the server's root; requests go to <url>/v1/completions
    concurrency: int = 1  # closed loop: requests in flight; open loop: the most in flight at once
    requests: int = 32  # how many to send
    rate: float | None = None  # open loop: Poisson arrivals per second; None: closed loop
    time_limit_s: float = 600.0  # stop sending after this long, and abandon what is still running
    max_tokens: int = 64
    stream: bool = True
    seed: int = 0  # open-loop arrival times
    body: dict[str, Any] = field(default_factory=dict)  # extra request fields (method, task, launch_loop, ...)
    label: str = "load"  # the ``run`` column
    api_key: str | None = field(default=None, repr=False)  # sent as ``Authorization: Bearer <key>``; None: none

    def __post_init__(self) -> None:
        parts = urlsplit(self.url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"url must be http(s)://host[:port], got {self.url!r}")
        if self.concurrency < 1 or self.requests < 1:
            raise ValueError(f"concurrency and requests must be at least 1, got {self.concurrency}, {self.requests}")
        if self.rate is not None and not self.rate > 0:
            raise ValueError(f"rate must be positive (requests per second) or None, got {self.rate}")
        if not self.time_limit_s > 0 or self.max_tokens < 1:
            raise ValueError(
                f"time_limit_s and max_tokens must be positive, got {self.time_limit_s}, {self.max_tokens}"
            )
        reserved = {"prompt", "max_tokens", "stream"} & set(self.body)
        if reserved:
            raise ValueError(f"body must not set {sorted(reserved)}: they are LoadConfig fields")


@dataclass
class LoadResult:
    """Per-request rows (``LOADGEN_SCHEMA``) and the run's wall-clock time."""

    table: pa.Table
    seconds: float  # from the first send to the last answer

    def summary(self) -> dict[str, Any]:
        """requests, errors, tokens, tokens_per_s, latency and time-to-first-token percentiles (ms)."""
        return summarize(self.table, self.seconds)


def summarize(table: pa.Table, seconds: float) -> dict[str, Any]:
    """The run's totals: successful requests' tokens per wall-clock second, latency percentiles in ms."""
    rows = table.to_pylist()
    ok = [r for r in rows if r["status"] == 200 and r["error"] is None]
    tokens = sum(r["completion_tokens"] or 0 for r in ok)
    latency = [r["latency_ms"] for r in ok]
    ttft = [r["ttft_ms"] for r in ok if r["ttft_ms"] is not None]
    return {
        "requests": len(rows),
        "errors": len(rows) - len(ok),
        "tokens": tokens,
        "seconds": seconds,
        "tokens_per_s": tokens / seconds if seconds > 0 else 0.0,
        "requests_per_s": len(ok) / seconds if seconds > 0 else 0.0,
        "p50_ms": _percentile(latency, 50),
        "p99_ms": _percentile(latency, 99),
        "ttft_p50_ms": _percentile(ttft, 50),
        "ttft_p99_ms": _percentile(ttft, 99),
    }


def _percentile(values: list[float], q: float) -> float | None:
    return float(np.percentile(values, q)) if values else None


def arrival_times(n: int, rate: float | None, seed: int) -> list[float]:
    """Planned send times (seconds from the start): all 0 for a closed loop, Poisson arrivals at ``rate``."""
    if rate is None:
        return [0.0] * n
    rng = random.Random(seed)
    times, t = [], 0.0
    for _ in range(n):
        times.append(t)
        t += rng.expovariate(rate)
    return times


def task_prompts(task: str, split: str = "test", limit: int | None = None) -> list[str]:
    """Source texts of a task split without the task prefix (send them with ``task`` so the server adds it)."""
    from speed.data import get_task, load_records

    prefix = get_task(task).prefix
    sources = load_records(task, split, limit=limit)["source"]
    return [s.removeprefix(prefix) for s in sources]


def run_load(config: LoadConfig, prompts: Sequence[str | list[int]]) -> LoadResult:
    """Send ``config.requests`` completions cycling through ``prompts``; returns the rows and wall time."""
    if not prompts:
        raise ValueError("no prompts to send")
    return asyncio.run(_run(config, list(prompts)))


async def _run(config: LoadConfig, prompts: list[str | list[int]]) -> LoadResult:
    planned = arrival_times(config.requests, config.rate, config.seed)
    slots = asyncio.Semaphore(config.concurrency)
    rows: list[dict[str, Any] | None] = [None] * config.requests
    timeout = aiohttp.ClientTimeout(total=config.time_limit_s)
    connector = aiohttp.TCPConnector(limit=config.concurrency)
    url = config.url.rstrip("/") + "/v1/completions"
    headers = {"Authorization": f"Bearer {config.api_key}"} if config.api_key else None
    async with aiohttp.ClientSession(timeout=timeout, connector=connector, headers=headers) as session:
        start = time.perf_counter()
        deadline = start + config.time_limit_s

        async def one(i: int) -> None:
            delay = start + planned[i] - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            async with slots:
                if time.perf_counter() >= deadline:
                    return
                prompt_index = i % len(prompts)
                body = {
                    **config.body,
                    "prompt": prompts[prompt_index],
                    "max_tokens": config.max_tokens,
                    "stream": config.stream,
                }
                if config.stream:
                    body["stream_options"] = {"include_usage": True}  # the token counts come in the last chunk
                scheduled = planned[i] if config.rate is not None else None  # closed loop: from the send
                rows[i] = await _send(session, url, body, start, scheduled, deadline)
                rows[i].update(run=config.label, request=i, prompt=prompt_index)

        tasks = [asyncio.create_task(one(i)) for i in range(config.requests)]
        await asyncio.gather(*tasks)
        seconds = time.perf_counter() - start
    sent = [r for r in rows if r is not None]
    return LoadResult(pa.Table.from_pylist(sent, schema=LOADGEN_SCHEMA), seconds)


async def _send(
    session: aiohttp.ClientSession,
    url: str,
    body: dict[str, Any],
    start: float,
    planned: float | None,
    deadline: float,
) -> dict[str, Any]:
    """One request; its row. Latency counts from the planned arrival (open loop: waiting for a free slot
    shows) or, with ``planned`` None (closed loop), from the send."""
    sent = time.perf_counter()
    planned = sent - start if planned is None else planned
    row: dict[str, Any] = {"status": 0, "error": None, "scheduled_s": planned, "start_s": sent - start}
    first: float | None = None
    try:
        async with session.post(url, json=body, timeout=aiohttp.ClientTimeout(total=deadline - sent)) as response:
            row["status"] = response.status
            if response.status != 200:
                row["error"] = _error_text(await response.text())
            elif body["stream"]:
                async for event in _events(response):
                    if event.get("error"):
                        row["error"] = event["error"].get("message", "stream error")
                        continue
                    if first is None and any(c.get("text") for c in event.get("choices", ())):
                        first = time.perf_counter()
                    _absorb(row, event)
            else:
                _absorb(row, await response.json())
    except (aiohttp.ClientError, asyncio.TimeoutError) as err:
        row["error"] = f"{type(err).__name__}: {err}" if str(err) else type(err).__name__
    end = time.perf_counter()
    row["latency_ms"] = (end - (start + planned)) * 1e3
    row["ttft_ms"] = (first - (start + planned)) * 1e3 if first is not None else None
    return row


async def _events(response: aiohttp.ClientResponse):
    """The JSON bodies of a server-sent event stream, up to ``data: [DONE]``."""
    async for raw in response.content:
        line = raw.decode("utf-8").strip()
        if not line.startswith("data:"):
            continue
        data = line[len("data:") :].strip()
        if data == "[DONE]":
            return
        yield json.loads(data)


def _absorb(row: dict[str, Any], answer: dict[str, Any]) -> None:
    """Fold an answer (or a stream event) into the row: text, finish reason, usage, SPEED statistics."""
    row["request_id"] = answer.get("id", row.get("request_id"))
    for c in answer.get("choices", ()):
        row["text"] = (row.get("text") or "") + c.get("text", "")
        if c.get("finish_reason"):
            row["finish_reason"] = c["finish_reason"]
    if answer.get("usage"):
        row["prompt_tokens"] = answer["usage"]["prompt_tokens"]
        row["completion_tokens"] = answer["usage"]["completion_tokens"]
    if "speed" in answer:
        row["replica"] = answer["speed"].get("replica")
        row["flushes"] = sum(c.get("flushes", 0) for c in answer["speed"].get("choices", ()))


def _error_text(text: str) -> str:
    try:
        return json.loads(text)["error"]["message"]
    except (ValueError, KeyError, TypeError):
        return text[:500] or "no message"
