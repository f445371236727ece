"""What a decoded choice leaves behind: the ``speed`` statistics of its answer, its records, and the ``Recorder``
that hands them to the sink and the metrics.

``choice_stats`` is the per-choice part of an answer's ``speed`` object; ``request_record`` the ``REQUEST_SCHEMA``
record and ``trace_records`` the ``SERVE_TRACE_SCHEMA`` records of one choice that left the engine (pure
functions: no Ray, no engine, no clock). The ``Recorder`` is the replica's last stage: the runner hands it every
choice that leaves the engine (finished or cancelled, an ``Ended`` whose meta is its ``ChoiceMeta``) and every
step; it writes the records through a ``StatsSink`` on a writer thread, on the sink's size and time bounds, and
counts each once in the replica's ``ServeCounters`` (which feed ``/v1/stats`` and Prometheus).
"""

from __future__ import annotations

import asyncio
import logging
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import pyarrow as pa

from speed.engine import Finished
from speed.serve.metrics import ServeCounters, spec_decode
from speed.serve.runner import Ended
from speed.serve.settings import decoding
from speed.serve.sink import StatsSink

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ChoiceMeta:
    """What the replica knows about a choice beyond its engine request: who asked, how, and who decoded it."""

    request_id: str  # the answer's id ("cmpl-..." or "chatcmpl-...")
    choice: int  # its index in the answer
    prompt: int  # its prompt's index
    route: str  # "completions" or "chat"
    arrived: Any  # datetime (UTC) the replica received the request
    started: float  # perf_counter then
    stream: bool
    task: str | None
    seed: int  # this choice's seed
    replica: str  # the Serve replica that decodes it
    model: str  # the served model's name
    family: str  # "t5" or "lm"


def choice_stats(finished: Finished) -> dict[str, Any]:
    """The per-choice part of an answer's ``speed`` object."""
    st = finished.stats
    return {
        "tokens": st.tokens,
        "steps": st.steps,
        "rows": st.rows,
        "flushes": st.flushes,
        "wasted_rows": st.wasted_rows,
        "flip_rate": list(st.flip_rate),
        "spec_decode": spec_decode(
            st.drafts, st.draft_tokens, st.accepted_tokens, st.accepted_per_pos, st.draft_tokens_per_pos
        ),
        "queued_ms": st.queued_s * 1e3,
        "ttft_ms": None if st.ttft_s != st.ttft_s else st.ttft_s * 1e3,  # nan: no token committed
        "latency_ms": st.latency_s * 1e3,
        # exit_gate: the loop passes per token its gate asked for (1-based mean exit loop); null for other methods
        "mean_exit_loop": sum(st.exit_loops) / len(st.exit_loops) if st.exit_loops else None,
    }


def finish_reason(finished: Finished, stopped_at: int | None) -> str:
    """``stop`` (a stop token, EOS or the request's, or a stop string), ``length``, or ``cancelled`` (the client
    left)."""
    if stopped_at is not None:
        return "stop"
    if finished.cancelled:
        return "cancelled"
    return "stop" if finished.stopped else "length"


def request_record(end: Ended[ChoiceMeta]) -> dict[str, Any]:
    """The ``REQUEST_SCHEMA`` record of one choice that left the engine."""
    finished, request, meta = end.finished, end.request, end.meta
    st, s = finished.stats, request.sampling
    tokens = len(finished.tokens) if end.stopped_at is None else end.stopped_at
    speed = {k: v for k, v in choice_stats(finished).items() if k not in ("tokens", "spec_decode")}
    return {
        "request_id": meta.request_id,
        "choice": meta.choice,
        "replica": meta.replica,
        "engine_id": finished.id,
        "arrived": meta.arrived,
        "model": meta.model,
        "family": meta.family,
        "task": meta.task,
        **decoding(request, meta.seed),  # method, SPEED's settings, seed, temperature, top_p, top_k
        "route": meta.route,
        "prompt": meta.prompt,
        "presence_penalty": float(s.presence_penalty),
        "frequency_penalty": float(s.frequency_penalty),
        "stream": meta.stream,
        "max_tokens": request.max_new_tokens,
        "prompt_tokens": len(request.input_ids),
        "completion_tokens": tokens,
        "finish_reason": finish_reason(finished, end.stopped_at),
        **speed,
        "drafts": st.drafts,
        "draft_tokens": st.draft_tokens,
        "accepted_tokens": st.accepted_tokens,
        "accepted_per_pos": list(st.accepted_per_pos),
        "draft_tokens_per_pos": list(st.draft_tokens_per_pos),
        "itl_ms": sum(end.gaps) / len(end.gaps) * 1e3 if end.gaps else None,
        "total_ms": (end.left - meta.started) * 1e3,  # from its request's arrival until it left the engine
        "max_active": end.config.max_active,
        "row_budget": end.config.row_budget,
    }


def trace_records(trace: pa.Table | None, meta: ChoiceMeta) -> pa.Table | None:
    """The engine's trace of one choice with the columns that key it in the served statistics."""
    if trace is None or trace.num_rows == 0:
        return None
    n = trace.num_rows
    keys = {
        "request_id": pa.array([meta.request_id] * n, pa.string()),
        "choice": pa.array([meta.choice] * n, pa.int32()),
        "replica": pa.array([meta.replica] * n, pa.string()),
    }
    return pa.table({**keys, **{name: trace.column(name) for name in trace.column_names}})


def _log_write_error(done: Future) -> None:
    if done.exception() is not None:  # the records stay in their write-ahead log on local storage
        log.error("writing request statistics failed: %r", done.exception())


class Recorder:
    """A replica's statistics: every choice that leaves the engine becomes one request record (and its trace
    records) in the sink, written as Parquet on the sink's bounds on a writer thread (so the event loop keeps
    serving), and is counted once in the counters, as is every step."""

    def __init__(self, sink: StatsSink, counters: ServeCounters) -> None:
        self.sink = sink
        self.counters = counters
        self._writer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="speed-stats")  # Parquet, in order
        self._flusher: asyncio.Task | None = None

    def finished(self, end: Ended[ChoiceMeta]) -> None:
        """A choice left the engine (the runner's ``on_finished``): its records to the sink, its counts."""
        record = request_record(end)
        self.sink.add(record, trace_records(end.finished.trace, end.meta))
        self.counters.add_finished(record, end.finished, end.gaps)
        if self.sink.due():
            self._write_soon()

    def step(self, rows: int, active: int, queued: int) -> None:
        """After every engine step (the runner's ``on_step``): rows per step and the engine's load."""
        self.counters.add_step(rows, active, queued)

    def set_bounds(self, max_records: int, max_seconds: float) -> None:
        """The sink's flush bounds (a live setting)."""
        self.sink.max_records, self.sink.max_seconds = max_records, float(max_seconds)

    def start_flusher(self) -> None:
        """Start the time bound's task on the running event loop (once)."""
        if self._flusher is None:
            self._flusher = asyncio.get_running_loop().create_task(self._flush_periodically())

    def drain(self) -> int:
        """Wait for the records being written and write the rest; returns the records written now."""
        if self._flusher is not None:
            self._flusher.cancel()
        self._writer.shutdown(wait=True)
        return self.sink.flush()

    def _write_soon(self) -> None:
        taken = self.sink.take()
        if taken is not None:
            self._writer.submit(self.sink.write, taken).add_done_callback(_log_write_error)

    async def _flush_periodically(self) -> None:
        """The time bound: write buffered records once they are ``max_seconds`` old, even when no request comes."""
        while True:
            await asyncio.sleep(min(1.0, self.sink.max_seconds / 4))
            if self.sink.due():
                self._write_soon()
