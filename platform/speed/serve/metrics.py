"""A replica's Prometheus metrics (Ray's export), under vLLM's names with a ``speed_`` prefix, beside SPEED's own.

vLLM's: ``speed_time_to_first_token_seconds``, ``speed_inter_token_latency_seconds``,
``speed_e2e_request_latency_seconds``, ``speed_request_queue_time_seconds``
(histograms, seconds); ``speed_num_requests_running``, ``speed_num_requests_waiting``
(gauges); ``speed_prompt_tokens``, ``speed_generation_tokens`` and the speculative
decoding counters ``speed_spec_decode_num_drafts``, ``speed_spec_decode_num_draft_tokens``,
``speed_spec_decode_num_accepted_tokens``, ``speed_spec_decode_num_accepted_tokens_per_pos``
(tag ``position``, 1..M-1) as ``speed.engine.RequestStats`` defines them, and beside them
``speed_spec_decode_num_draft_tokens_per_pos`` (a flush may relaunch at any position, so the
acceptance rate at a position is accepted over draft tokens there)
(acceptance rate = accepted / draft tokens; mean acceptance length = 1 + accepted / drafts).
SPEED's own: ``speed_requests`` (tags method, finish_reason), ``speed_flushes``,
``speed_flipped_tokens`` (tag ``loop``: committed tokens whose exit there differed;
over ``speed_generation_tokens`` it is the flip rate per loop) and the histogram
``speed_rows_per_step``. Ray's exporter puts its ``ray_`` namespace before every name and
``_total`` after a counter's (``ray_speed_spec_decode_num_drafts_total``).

``ServeCounters`` is where a replica counts each event once: its running totals are ``/v1/stats``, and it hands
the same events to its ``ServeMetrics`` (``export``) for Prometheus.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

from speed.engine import Finished

SECONDS = [0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0]
ITL_SECONDS = [0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 1.0, 2.5]
ROWS = [1, 2, 4, 8, 16, 32, 64, 128, 256, 512]


class ServeMetrics:
    """Counters, histograms and gauges of one replica; ``metrics`` is ``ray.serve.metrics`` (or a stand-in)."""

    def __init__(self, metrics: Any = None) -> None:
        if metrics is None:
            from ray.serve import metrics
        m, by = metrics, ("method",)
        self.requests = m.Counter(
            "speed_requests", "Choices that left the engine", tag_keys=("method", "finish_reason")
        )
        self.prompt_tokens = m.Counter("speed_prompt_tokens", "Prompt (encoder) tokens", tag_keys=by)
        self.generation_tokens = m.Counter("speed_generation_tokens", "Committed tokens", tag_keys=by)
        self.flushes = m.Counter("speed_flushes", "Misprediction flushes", tag_keys=by)
        self.flipped = m.Counter(
            "speed_flipped_tokens", "Committed tokens whose early exit at a loop differed", tag_keys=("method", "loop")
        )
        self.drafts = m.Counter("speed_spec_decode_num_drafts", "Speculative chains started", tag_keys=by)
        self.draft_tokens = m.Counter(
            "speed_spec_decode_num_draft_tokens", "Tokens launched speculatively", tag_keys=by
        )
        self.accepted = m.Counter(
            "speed_spec_decode_num_accepted_tokens", "Speculative tokens committed unchanged", tag_keys=by
        )
        self.accepted_per_pos = m.Counter(
            "speed_spec_decode_num_accepted_tokens_per_pos",
            "Accepted speculative tokens by draft position",
            tag_keys=("method", "position"),
        )
        self.draft_tokens_per_pos = m.Counter(
            "speed_spec_decode_num_draft_tokens_per_pos",
            "Speculative tokens by draft position",
            tag_keys=("method", "position"),
        )
        self.ttft = m.Histogram("speed_time_to_first_token_seconds", "Time to first token", SECONDS, tag_keys=by)
        self.itl = m.Histogram("speed_inter_token_latency_seconds", "Time between tokens", ITL_SECONDS, tag_keys=by)
        self.e2e = m.Histogram("speed_e2e_request_latency_seconds", "Arrival to last token", SECONDS, tag_keys=by)
        self.queue = m.Histogram("speed_request_queue_time_seconds", "Waiting for an engine slot", SECONDS, tag_keys=by)
        self.rows = m.Histogram("speed_rows_per_step", "Rows computed per engine step", ROWS)
        self.running = m.Gauge("speed_num_requests_running", "Requests holding an engine slot")
        self.waiting = m.Gauge("speed_num_requests_waiting", "Requests waiting for an engine slot")

    def step(self, rows: int, active: int, queued: int) -> None:
        """After an engine step."""
        if rows:
            self.rows.observe(rows)
        self.running.set(active)
        self.waiting.set(queued)

    def finished(self, record: dict[str, Any], gaps: list[float]) -> None:
        """A choice left the engine: its ``REQUEST_SCHEMA`` record and its inter-token gaps (seconds)."""
        tags = {"method": record["method"]}
        self.requests.inc(tags={**tags, "finish_reason": record["finish_reason"]})
        for counter, value in (
            (self.prompt_tokens, record["prompt_tokens"]),
            (self.generation_tokens, record["completion_tokens"]),
            (self.flushes, record["flushes"]),
            (self.drafts, record["drafts"]),
            (self.draft_tokens, record["draft_tokens"]),
            (self.accepted, record["accepted_tokens"]),
        ):
            if value:
                counter.inc(value, tags=tags)
        for counter, counts in (
            (self.accepted_per_pos, record["accepted_per_pos"]),
            (self.draft_tokens_per_pos, record["draft_tokens_per_pos"]),
        ):
            for pos, n in enumerate(counts, start=1):
                if n:
                    counter.inc(n, tags={**tags, "position": str(pos)})
        for loop, rate in enumerate(record["flip_rate"], start=1):
            flipped = round(rate * record["completion_tokens"])
            if flipped:
                self.flipped.inc(flipped, tags={**tags, "loop": str(loop)})
        if record["ttft_ms"] is not None:
            self.ttft.observe(record["ttft_ms"] / 1e3, tags=tags)
        for gap in gaps:
            self.itl.observe(gap, tags=tags)
        self.e2e.observe(record["total_ms"] / 1e3, tags=tags)
        self.queue.observe(record["queued_ms"] / 1e3, tags=tags)


def resident_bytes() -> int | None:
    """This process's resident memory (Linux: ``/proc/self/statm``), for ``/v1/stats``; None where unknown."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return None


@dataclass
class ServeCounters:
    """A replica's running totals, served by ``GET /v1/stats``; each event is counted here once, and handed to
    Prometheus (``export``) from here."""

    export: ServeMetrics | None = field(default=None, repr=False, compare=False)  # None: no Prometheus export
    requests: int = 0  # completion requests accepted (each may hold several prompts)
    rejected: int = 0  # requests answered with a 4xx before decoding
    finished: int = 0  # prompts decoded to the end
    cancelled: int = 0  # prompts cancelled (client gone)
    tokens: int = 0  # committed tokens
    flushes: int = 0
    wasted_rows: int = 0
    steps: int = 0  # engine steps that computed rows
    rows: int = 0  # rows over those steps
    max_rows_per_step: int = 0
    flips: list[float] = field(default_factory=list)  # per loop: tokens whose early exit differed from the final
    flip_tokens: int = 0  # committed tokens of requests with known flip rates (the flip-rate denominator)
    prompt_tokens: int = 0  # encoder tokens of the prompts that left the engine
    drafts: int = 0  # speculation, vLLM's counters (speed.engine.RequestStats)
    draft_tokens: int = 0
    accepted_tokens: int = 0
    accepted_per_pos: list[int] = field(default_factory=list)
    draft_tokens_per_pos: list[int] = field(default_factory=list)

    def add_request(self) -> None:
        """Count one completion request accepted for decoding."""
        self.requests += 1

    def add_rejected(self) -> None:
        """Count one request answered with a 4xx before decoding."""
        self.rejected += 1

    def add_step(self, rows: int, active: int, queued: int) -> None:
        """Count one engine step of ``rows`` rows (steps without rows are not counted), after which ``active``
        requests hold a slot and ``queued`` wait."""
        if rows:
            self.steps += 1
            self.rows += rows
            self.max_rows_per_step = max(self.max_rows_per_step, rows)
        if self.export is not None:
            self.export.step(rows, active, queued)

    def add_finished(self, record: dict[str, Any], finished: Finished, gaps: list[float]) -> None:
        """Count one prompt that left the engine: its ``REQUEST_SCHEMA`` record, what the engine gave back, and
        its inter-token gaps (seconds)."""
        stats = finished.stats
        tokens, flip_rate = stats.tokens, stats.flip_rate
        self.prompt_tokens += record["prompt_tokens"]
        self.drafts += stats.drafts
        self.draft_tokens += stats.draft_tokens
        self.accepted_tokens += stats.accepted_tokens
        _add(self.accepted_per_pos, stats.accepted_per_pos)
        _add(self.draft_tokens_per_pos, stats.draft_tokens_per_pos)
        self.cancelled += finished.cancelled
        self.finished += not finished.cancelled
        self.tokens += tokens
        self.flushes += stats.flushes
        self.wasted_rows += stats.wasted_rows
        if flip_rate and tokens:
            if len(self.flips) < len(flip_rate):
                self.flips += [0.0] * (len(flip_rate) - len(self.flips))
            for loop, rate in enumerate(flip_rate):
                self.flips[loop] += rate * tokens
            self.flip_tokens += tokens
        if self.export is not None:
            self.export.finished(record, gaps)

    def snapshot(self, active: int, queued: int) -> dict[str, Any]:
        """The counters as JSON, with derived rates and the engine's current load."""
        return {
            "requests": self.requests,
            "rejected": self.rejected,
            "finished": self.finished,
            "cancelled": self.cancelled,
            "tokens": self.tokens,
            "flushes": self.flushes,
            "wasted_rows": self.wasted_rows,
            "steps": self.steps,
            "rows": self.rows,
            "rows_per_step": self.rows / self.steps if self.steps else 0.0,
            "max_rows_per_step": self.max_rows_per_step,
            "flip_rate": [f / self.flip_tokens for f in self.flips] if self.flip_tokens else [],
            "prompt_tokens": self.prompt_tokens,
            "spec_decode": spec_decode(
                self.drafts, self.draft_tokens, self.accepted_tokens, self.accepted_per_pos, self.draft_tokens_per_pos
            ),
            "active": active,
            "queue_depth": queued,
        }


def spec_decode(
    drafts: int, draft_tokens: int, accepted: int, accepted_per_pos: list[int], draft_tokens_per_pos: list[int]
) -> dict[str, Any]:
    """Speculation in vLLM's terms: its counters, acceptance rate (accepted / draft tokens), mean acceptance
    length (1 + accepted / drafts: tokens per speculative chain, the committed-path token included) and the
    acceptance rate per draft position (accepted / draft tokens there; None where none was launched)."""
    return {
        "num_drafts": drafts,
        "num_draft_tokens": draft_tokens,
        "num_accepted_tokens": accepted,
        "num_accepted_tokens_per_pos": list(accepted_per_pos),
        "num_draft_tokens_per_pos": list(draft_tokens_per_pos),
        "acceptance_rate": accepted / draft_tokens if draft_tokens else None,
        "acceptance_rate_per_pos": [a / d if d else None for a, d in zip(accepted_per_pos, draft_tokens_per_pos)],
        "mean_acceptance_length": 1 + accepted / drafts if drafts else None,
    }


def _add(total: list[int], counts: list[int]) -> None:
    """Add ``counts`` into ``total`` element-wise, growing it as needed."""
    total += [0] * (len(counts) - len(total))
    for i, n in enumerate(counts):
        total[i] += n
