"""What a decoded choice leaves behind: the ``speed`` statistics of an answer and its records (pure functions).

``choice_stats`` is the per-choice part of an answer's ``speed`` object;
``request_record`` the ``REQUEST_SCHEMA`` record and ``trace_records`` the
``SERVE_TRACE_SCHEMA`` records of one choice that left the engine. Nothing here
touches Ray, the engine or the clock.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import pyarrow as pa

from speed.engine import Finished, Request
from speed.serve.metrics import spec_decode
from speed.serve.planning import levers


@dataclass(frozen=True)
class ChoiceMeta:
    """What the replica knows about a choice beyond its engine request: who asked, how, and where it ended."""

    request_id: str  # the answer's id ("cmpl-..." or "chatcmpl-...")
    choice: int  # its index in the answer
    prompt: int  # its prompt's index
    route: str  # "completions" or "chat"
    arrived: Any  # datetime (UTC) the replica received the request
    started: float  # perf_counter then
    stream: bool
    task: str | None
    seed: int  # this choice's seed


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
    }


def finish_reason(finished: Finished, eos_id: int, stopped_at: int | None) -> str:
    """``stop`` (EOS or a stop string), ``length``, or ``cancelled`` (the client left)."""
    if stopped_at is not None:
        return "stop"
    if finished.cancelled:
        return "cancelled"
    return "stop" if finished.tokens and finished.tokens[-1] == eos_id else "length"


def request_record(
    meta: ChoiceMeta,
    request: Request,
    finished: Finished,
    *,
    replica: str,
    model: str,
    family: str,
    eos_id: int,
    stopped_at: int | None,
    gaps: list[float],
    total_s: float,
    max_active: int,
    row_budget: int | None,
) -> dict[str, Any]:
    """The ``REQUEST_SCHEMA`` record of one choice (``stopped_at``: tokens it kept when a stop string ended it)."""
    st, s = finished.stats, request.sampling
    tokens = len(finished.tokens) if stopped_at is None else stopped_at
    speed = {k: v for k, v in choice_stats(finished).items() if k not in ("tokens", "spec_decode")}
    return {
        "request_id": meta.request_id,
        "choice": meta.choice,
        "replica": replica,
        "engine_id": finished.id,
        "arrived": meta.arrived,
        "model": model,
        "family": family,
        "task": meta.task,
        "method": request.method,
        **levers(request),
        "route": meta.route,
        "prompt": meta.prompt,
        "temperature": float(s.temperature),
        "top_p": float(s.top_p),
        "top_k": s.top_k,
        "seed": meta.seed,
        "presence_penalty": float(s.presence_penalty),
        "frequency_penalty": float(s.frequency_penalty),
        "stream": meta.stream,
        "max_tokens": request.max_new_tokens,
        "prompt_tokens": len(request.input_ids),
        "completion_tokens": tokens,
        "finish_reason": finish_reason(finished, eos_id, stopped_at),
        **speed,
        "drafts": st.drafts,
        "draft_tokens": st.draft_tokens,
        "accepted_tokens": st.accepted_tokens,
        "accepted_per_pos": list(st.accepted_per_pos),
        "draft_tokens_per_pos": list(st.draft_tokens_per_pos),
        "itl_ms": sum(gaps) / len(gaps) * 1e3 if gaps else None,
        "total_ms": total_s * 1e3,
        "max_active": max_active,
        "row_budget": row_budget,
    }


def trace_records(trace: pa.Table | None, request_id: str, choice: int, replica: str) -> pa.Table | None:
    """The engine's trace of one request with the columns that key it in the served statistics."""
    if trace is None or trace.num_rows == 0:
        return None
    n = trace.num_rows
    keys = {
        "request_id": pa.array([request_id] * n, pa.string()),
        "choice": pa.array([choice] * n, pa.int32()),
        "replica": pa.array([replica] * n, pa.string()),
    }
    return pa.table({**keys, **{name: trace.column(name) for name in trace.column_names}})
