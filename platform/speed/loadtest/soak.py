"""A soak run: the Serve app under a mix of requests for minutes, watched for errors, memory and lost rows.

``C`` clients in a closed loop send, in turn, the kinds of ``SOAK_KINDS``: greedy, sampled, streamed, two
choices (``n=2``), a stop string, and a streamed request the client abandons after its first token
(the replica must cancel it). Every request's outcome is one ``SOAK_SCHEMA`` row. Around the load, the
replicas' resident memory is read from ``/v1/stats`` (``rss_bytes``); after it, the statistics the
replicas wrote under their ``stats_path`` are read back (``speed.serve.readers.read_requests``) and matched
with what was answered: every 200 must have one row per choice, and every abandoned request one row.

The result (``SoakResult``) gives latency percentiles per minute, errors by kind (an intended 4xx or 503
is counted apart from a failure) and the row check; ``jobs/soak.py`` runs it and prints them.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

import aiohttp
import numpy as np
import pyarrow as pa

from speed.loadtest.loadgen import DEFAULT_URL

SOAK_KINDS = ("greedy", "sampled", "streamed", "n2", "stop", "abandoned")

SOAK_SCHEMA = pa.schema(
    [
        pa.field("request", pa.int64(), nullable=False),  # send order
        pa.field("kind", pa.string(), nullable=False),  # one of SOAK_KINDS
        pa.field("minute", pa.int32(), nullable=False),  # of the run, when it was sent (0-based)
        pa.field("status", pa.int32(), nullable=False),  # HTTP status; 0: no response
        pa.field("error", pa.string()),  # what went wrong; null: answered (or abandoned as planned)
        pa.field("request_id", pa.string()),  # the completion's id, when the server gave one
        pa.field("choices", pa.int32(), nullable=False),  # choices answered (0 when not answered)
        pa.field("latency_ms", pa.float64(), nullable=False),  # send to last byte (abandoned: to the abandon)
    ]
)

# Errors a soak means to provoke or accepts (refusals under overload, limits): not failures.
INTENDED_STATUSES = frozenset({400, 413, 422, 429, 503})


@dataclass(frozen=True)
class SoakConfig:
    """One soak run."""

    url: str = DEFAULT_URL  # the server's root
    minutes: float = 10.0  # how long clients keep sending
    concurrency: int = 16  # clients, each with one request in flight
    max_tokens: int = 32
    abandon_tokens: int = 128  # an abandoned request's max_tokens: long, so that it is still decoding (<= the server's)
    prompts: tuple[str, ...] = ("A man is walking a dog in the park.",)
    body: dict[str, Any] = field(default_factory=dict)  # extra fields of every request (task, method, ...)
    seed: int = 0  # sampled kinds use seed + request number
    request_timeout_s: float = 120.0  # a request not answered by then is a failure ("never a hang")
    api_key: str | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        parts = urlsplit(self.url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"url must be http(s)://host[:port], got {self.url!r}")
        if not self.minutes > 0 or min(self.concurrency, self.max_tokens, self.abandon_tokens) < 1:
            raise ValueError(
                "minutes, concurrency, max_tokens and abandon_tokens must be positive, got "
                f"{self.minutes}, {self.concurrency}, {self.max_tokens}, {self.abandon_tokens}"
            )
        if not self.request_timeout_s > 0:
            raise ValueError(f"request_timeout_s must be positive, got {self.request_timeout_s}")
        if not self.prompts:
            raise ValueError("no prompts to send")


@dataclass(frozen=True)
class RowCheck:
    """The statistics written by the replicas against what the soak was answered."""

    answered: int  # choices answered with a 200 (every abandoned request counts one)
    found: int  # of them, the rows found under the stats path (one per choice)
    missing: tuple[str, ...]  # request ids answered with fewer rows than choices
    abandoned: int  # requests the client abandoned
    cancelled_rows: int  # their rows that say "cancelled" (the others finished before the server noticed)

    @property
    def complete(self) -> bool:
        return self.found == self.answered and not self.missing


@dataclass
class SoakResult:
    """Every request's row, the replicas' memory before and after, and the run's length."""

    table: pa.Table  # SOAK_SCHEMA
    seconds: float
    rss_start: dict[str, int]  # replica id -> resident bytes, read before the load
    rss_end: dict[str, int]  # and after it
    rss_minutes: dict[int, dict[str, int]] = field(default_factory=dict)  # minute -> the last reads in it

    def per_minute(self) -> list[dict[str, Any]]:
        """Per minute of the run: requests sent, answered, failures, latency p50/p99 (ms) of the answered."""
        out = []
        for minute in sorted(set(self.table.column("minute").to_pylist())):
            rows = [r for r in self.table.to_pylist() if r["minute"] == minute]
            ok = [r["latency_ms"] for r in rows if r["error"] is None]
            out.append(
                {
                    "minute": minute,
                    "requests": len(rows),
                    "answered": len(ok),
                    "failures": sum(1 for r in rows if _failure(r)),
                    "p50_ms": float(np.percentile(ok, 50)) if ok else None,
                    "p99_ms": float(np.percentile(ok, 99)) if ok else None,
                    "rss_mib": max(self.rss_minutes[minute].values()) / 2**20 if self.rss_minutes.get(minute) else None,
                }
            )
        return out

    def errors(self) -> dict[str, int]:
        """Requests not answered, by "kind: status or error", intended refusals marked as such."""
        counts: Counter[str] = Counter()
        for r in self.table.to_pylist():
            if r["error"] is None:
                continue
            what = f"HTTP {r['status']}" if r["status"] else r["error"].split(":")[0]
            counts[f"{r['kind']}: {what}{'' if _failure(r) else ' (intended)'}"] += 1
        return dict(sorted(counts.items()))

    @property
    def failures(self) -> int:
        """Requests that ended in an error that is not an intended refusal."""
        return sum(1 for r in self.table.to_pylist() if _failure(r))

    @property
    def rss_growth(self) -> float | None:
        """The largest relative growth of a replica's resident memory seen at both ends; None if none was."""
        return _growth(self.rss_start, self.rss_end)

    @property
    def rss_growth_after_warmup(self) -> float | None:
        """The same from the end of the first minute (the model's first steps allocate what later ones reuse:
        packed weights, caches, the allocators' arenas) to the end; None for a run of a minute or less."""
        later = sorted(m for m in self.rss_minutes if m > 0)
        return _growth(self.rss_minutes[0], self.rss_end) if 0 in self.rss_minutes and later else None

    def check_rows(self, requests: pa.Table) -> RowCheck:
        """Match ``read_requests(stats_path)`` with the answers: one row per answered choice and abandoned
        request (the stats path may hold rows of other traffic; only this run's request ids are counted)."""
        ids = requests.column("request_id")
        have = Counter(ids.to_pylist())
        answered = found = abandoned = 0
        missing = []
        for r in self.table.to_pylist():
            if r["error"] is not None or r["request_id"] is None:
                continue
            want = r["choices"]
            answered += want
            found += min(have[r["request_id"]], want)
            abandoned += r["kind"] == "abandoned"
            if have[r["request_id"]] < want:
                missing.append(r["request_id"])
        gone = {r["request_id"] for r in self.table.to_pylist() if r["kind"] == "abandoned" and r["error"] is None}
        reasons = zip(ids.to_pylist(), requests.column("finish_reason").to_pylist())
        cancelled = sum(1 for rid, why in reasons if rid in gone and why == "cancelled")
        return RowCheck(answered, found, tuple(missing), abandoned, cancelled)


def _growth(start: dict[str, int], end: dict[str, int]) -> float | None:
    both = [rid for rid in start if rid in end]
    return max((end[r] / start[r] - 1 for r in both), default=None)


def _failure(row: dict[str, Any]) -> bool:
    return row["error"] is not None and row["status"] not in INTENDED_STATUSES


def request_body(kind: str, i: int, config: SoakConfig) -> dict[str, Any]:
    """The body of request ``i`` of ``kind`` (``SOAK_KINDS``)."""
    body = {**config.body, "prompt": config.prompts[i % len(config.prompts)], "max_tokens": config.max_tokens}
    if kind == "sampled":
        body |= {"temperature": 0.8, "seed": config.seed + i}
    elif kind == "streamed":
        body |= {"stream": True, "stream_options": {"include_usage": True}}
    elif kind == "n2":
        body |= {"n": 2, "temperature": 0.8, "seed": config.seed + i}
    elif kind == "stop":
        body |= {"stop": ["e", "."]}
    elif kind == "abandoned":
        body |= {"stream": True, "max_tokens": config.abandon_tokens}  # long: abandoned while it decodes
    elif kind != "greedy":
        raise ValueError(f"unknown soak kind {kind!r}; known: {SOAK_KINDS}")
    return body


def run_soak(config: SoakConfig) -> SoakResult:
    """Run the soak the config describes against a running server; see the module doc."""
    return asyncio.run(_run(config))


async def _run(config: SoakConfig) -> SoakResult:
    headers = {"Authorization": f"Bearer {config.api_key}"} if config.api_key else None
    connector = aiohttp.TCPConnector(limit=config.concurrency + 2)
    async with aiohttp.ClientSession(connector=connector, headers=headers) as session:
        root = config.url.rstrip("/")
        rss_start = await _rss(session, root)
        rows: list[dict[str, Any]] = []
        start = time.perf_counter()
        stop_at = start + config.minutes * 60
        counter = iter(range(1 << 62))

        async def client() -> None:
            while time.perf_counter() < stop_at:
                i = next(counter)
                kind = SOAK_KINDS[i % len(SOAK_KINDS)]
                row = await _send(session, root + "/v1/completions", request_body(kind, i, config), kind, config)
                rows.append({"request": i, "kind": kind, "minute": int((row.pop("sent") - start) // 60), **row})

        rss_minutes: dict[int, dict[str, int]] = {}

        async def monitor() -> None:  # the replicas' memory every 15 s, the last reads of each minute kept
            while time.perf_counter() < stop_at:
                await asyncio.sleep(min(15.0, max(0.0, stop_at - time.perf_counter())))
                minute = int(min(time.perf_counter() - start, config.minutes * 60 - 1e-6) // 60)
                rss_minutes.setdefault(minute, {}).update(await _rss(session, root, reads=2))

        await asyncio.gather(monitor(), *(client() for _ in range(config.concurrency)))
        seconds = time.perf_counter() - start
        await asyncio.sleep(1.0)  # abandoned requests: let the replicas notice and finish them
        rss_end = await _rss(session, root)
    rows.sort(key=lambda r: r["request"])
    return SoakResult(pa.Table.from_pylist(rows, schema=SOAK_SCHEMA), seconds, rss_start, rss_end, rss_minutes)


async def _rss(session: aiohttp.ClientSession, root: str, reads: int = 6) -> dict[str, int]:
    """Resident bytes per replica, from a few ``/v1/stats`` reads (each answered by one replica)."""
    seen: dict[str, int] = {}
    for _ in range(reads):
        try:
            async with session.get(root + "/v1/stats", timeout=aiohttp.ClientTimeout(total=30)) as r:
                if r.status == 200:
                    stats = await r.json()
                    if stats.get("rss_bytes"):
                        seen[stats["replica"]] = int(stats["rss_bytes"])
        except (aiohttp.ClientError, asyncio.TimeoutError):
            pass
    return seen


async def _send(
    session: aiohttp.ClientSession, url: str, body: dict[str, Any], kind: str, config: SoakConfig
) -> dict[str, Any]:
    sent = time.perf_counter()
    row: dict[str, Any] = {"sent": sent, "status": 0, "error": None, "request_id": None, "choices": 0}
    try:
        timeout = aiohttp.ClientTimeout(total=config.request_timeout_s)
        async with session.post(url, json=body, timeout=timeout) as response:
            row["status"] = response.status
            if response.status != 200:
                row["error"] = (await response.text())[:300] or f"HTTP {response.status}"
            elif body.get("stream"):
                choices = set()
                async for event in _events(response):
                    if event.get("error"):
                        row["error"] = f"stream error: {event['error'].get('message', '')}"[:300]
                        break
                    row["request_id"] = event.get("id", row["request_id"])
                    choices |= {c.get("index", 0) for c in event.get("choices", ())}
                    if kind == "abandoned" and row["request_id"]:
                        break  # leaving the block closes the connection: the replica must cancel it
                row["choices"] = max(1, len(choices)) if row["error"] is None else 0
            else:
                answer = await response.json()
                row["request_id"], row["choices"] = answer.get("id"), len(answer.get("choices", ()))
    except (aiohttp.ClientError, asyncio.TimeoutError, json.JSONDecodeError) as err:
        row["error"] = f"{type(err).__name__}: {err}"[:300]
    row["latency_ms"] = (time.perf_counter() - sent) * 1e3
    return row


async def _events(response: aiohttp.ClientResponse):
    """The JSON bodies of a server-sent event stream, up to ``data: [DONE]``."""
    async for raw in response.content:
        line = raw.decode("utf-8").strip()
        if line.startswith("data:"):
            data = line[len("data:") :].strip()
            if data == "[DONE]":
                return
            yield json.loads(data)


def format_report(result: SoakResult, rows: RowCheck | None, kinds: Sequence[str] = SOAK_KINDS) -> str:
    """The soak's tables as Markdown: per minute, errors by kind, memory and the row check."""
    lines = ["| minute | requests | answered | failures | p50 ms | p99 ms | RSS MiB |", "|---|---|---|---|---|---|---|"]
    for m in result.per_minute():
        p50, p99, rss = (f"{v:.0f}" if v is not None else "-" for v in (m["p50_ms"], m["p99_ms"], m["rss_mib"]))
        lines.append(f"| {m['minute']} | {m['requests']} | {m['answered']} | {m['failures']} | {p50} | {p99} | {rss} |")
    sent = Counter(result.table.column("kind").to_pylist())
    lines += ["", f"sent by kind: {', '.join(f'{k} {sent[k]}' for k in kinds)}"]
    lines.append(f"errors: {result.errors() or 'none'}; failures (not intended refusals): {result.failures}")
    for rid in sorted(set(result.rss_start) | set(result.rss_end)):
        a, b = result.rss_start.get(rid), result.rss_end.get(rid)
        growth = f"{(b / a - 1) * 100:+.1f} %" if a and b else "-"
        lines.append(f"replica {rid}: RSS {_mib(a)} -> {_mib(b)} MiB ({growth})")
    warm = result.rss_growth_after_warmup
    if warm is not None:
        lines.append(f"RSS growth after the first minute: {warm * 100:+.1f} %")
    if rows is not None:
        lines.append(
            f"rows: {rows.found} found for {rows.answered} answered choices ({rows.abandoned} abandoned requests, "
            f"{rows.cancelled_rows} of them cancelled on the server); missing: {list(rows.missing) or 'none'}"
        )
    return "\n".join(lines)


def _mib(value: int | None) -> str:
    return f"{value / 2**20:.0f}" if value else "-"
