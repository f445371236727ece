"""Serving under load: throughput and latency percentiles per load run, SPEED rows per step per request.

Load-generator rows (one per request sent: ``run``, ``status``, ``scheduled_s``,
``start_s``, ``latency_ms``, ``ttft_ms``, ``completion_tokens``, ``replica``) give
each run's throughput and latency; the concurrency and replica count of a run
are read off its rows (the most requests in flight at once, the replicas that
answered), so they need no label. The replicas' request rows (``arrived``,
``total_ms``, ``steps``, ``rows``, ``method``) give how many rows a request had
computed per pipeline step, against how loaded its replica was when it arrived,
and (``drafts``, ``draft_tokens``, ``accepted_tokens``, ``accepted_per_pos``,
``temperature``) how much of SPEED's speculation was accepted, by draft position
and by temperature, in vLLM's terms (``speed.engine.RequestStats``).
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

LOAD_SUMMARY_SCHEMA = pa.schema(
    [
        pa.field("run", pa.string()),
        pa.field("requests", pa.int64()),
        pa.field("errors", pa.int64()),  # status other than 200
        pa.field("concurrency", pa.int64()),  # most requests in flight at once
        pa.field("replicas", pa.int64()),  # distinct replicas that answered
        pa.field("seconds", pa.float64()),  # first send to last answer
        pa.field("tokens_per_s", pa.float64()),  # completion tokens of answered requests / seconds
        pa.field("requests_per_s", pa.float64()),
        pa.field("p50_ms", pa.float64()),
        pa.field("p90_ms", pa.float64()),
        pa.field("p99_ms", pa.float64()),
        pa.field("ttft_p50_ms", pa.float64()),  # null without streamed requests
        pa.field("ttft_p99_ms", pa.float64()),
    ]
)


def max_in_flight(starts: np.ndarray, ends: np.ndarray) -> int:
    """The most intervals [start, end) open at one time."""
    events = sorted([(e, -1) for e in ends] + [(s, 1) for s in starts])  # an end before a start at the same time
    open_now = best = 0
    for _, delta in events:
        open_now += delta
        best = max(best, open_now)
    return best


def in_flight_at(starts: np.ndarray, ends: np.ndarray) -> np.ndarray:
    """For every interval, how many intervals (itself included) are open at its start."""
    return np.array([int(np.sum((starts <= s) & (ends > s))) for s in starts], dtype=np.int64)


def _percentile(values: np.ndarray, q: float) -> float | None:
    return float(np.percentile(values, q)) if values.size else None


def load_summary(load: pa.Table) -> pa.Table:
    """One row per load run (``LOAD_SUMMARY_SCHEMA``), sorted by replicas, then concurrency."""
    rows = []
    for run in sorted(set(load.column("run").to_pylist())):
        part = load.filter(pc.equal(load["run"], run))
        ok = part.filter(pc.equal(part["status"], 200))
        starts = part["start_s"].to_numpy()
        ends = part["scheduled_s"].to_numpy() + part["latency_ms"].to_numpy() / 1000.0
        seconds = float(ends.max() - starts.min())
        latency = ok["latency_ms"].to_numpy()
        ttft = ok["ttft_ms"].drop_null().to_numpy()
        replicas = {r for r in ok.column("replica").to_pylist() if r} if "replica" in ok.column_names else set()
        rows.append(
            {
                "run": run,
                "requests": part.num_rows,
                "errors": part.num_rows - ok.num_rows,
                "concurrency": max_in_flight(starts, ends),
                "replicas": len(replicas),
                "seconds": seconds,
                "tokens_per_s": pc.sum(ok["completion_tokens"]).as_py() / seconds if ok.num_rows else 0.0,
                "requests_per_s": ok.num_rows / seconds,
                "p50_ms": _percentile(latency, 50),
                "p90_ms": _percentile(latency, 90),
                "p99_ms": _percentile(latency, 99),
                "ttft_p50_ms": _percentile(ttft, 50),
                "ttft_p99_ms": _percentile(ttft, 99),
            }
        )
    table = pa.Table.from_pylist(rows, schema=LOAD_SUMMARY_SCHEMA)
    return table.sort_by([("replicas", "ascending"), ("concurrency", "ascending"), ("run", "ascending")])


def rows_per_step(requests: pa.Table) -> pa.Table:
    """Per request: method, replica, rows per step it was in, and requests in flight on its replica at arrival."""
    arrived = pc.cast(requests["arrived"], pa.int64()).to_numpy() / 1e6  # timestamp[us] -> seconds
    ends = arrived + requests["total_ms"].to_numpy() / 1000.0
    replicas = np.array(requests.column("replica").to_pylist(), dtype=object)
    load = np.zeros(requests.num_rows, dtype=np.int64)
    for replica in set(replicas):
        mine = replicas == replica
        load[mine] = in_flight_at(arrived[mine], ends[mine])
    steps = requests["steps"].to_numpy()
    per_step = np.where(steps > 0, requests["rows"].to_numpy() / np.maximum(steps, 1), np.nan)
    return pa.table(
        {
            "request_id": requests["request_id"],
            "method": requests["method"],
            "replica": requests["replica"],
            "in_flight": pa.array(load),
            "rows_per_step": pa.array(per_step, pa.float64()),
            "flushes": requests["flushes"],
        }
    )


ACCEPTANCE_SCHEMA = pa.schema(
    [
        pa.field("method", pa.string()),
        pa.field("temperature", pa.float64()),
        pa.field("requests", pa.int64()),
        pa.field("tokens", pa.int64()),  # completion tokens
        pa.field("drafts", pa.int64()),
        pa.field("draft_tokens", pa.int64()),
        pa.field("accepted_tokens", pa.int64()),
        pa.field("acceptance_rate", pa.float64()),  # accepted / draft tokens; null without drafts
        pa.field("mean_acceptance_length", pa.float64()),  # 1 + accepted / drafts; null without drafts
    ]
)

ACCEPTANCE_BY_POSITION_SCHEMA = pa.schema(
    [
        pa.field("method", pa.string()),
        pa.field("temperature", pa.float64()),
        pa.field("position", pa.int64()),  # draft position 1..M-1
        pa.field("accepted_tokens", pa.int64()),
        pa.field("draft_tokens", pa.int64()),  # tokens launched at this position
        pa.field("acceptance_rate", pa.float64()),  # accepted / draft tokens at this position
    ]
)


def _groups(requests: pa.Table) -> dict[tuple[str, float], list[dict]]:
    groups: dict[tuple[str, float], list[dict]] = {}
    columns = ["method", "temperature", "completion_tokens", "drafts", "draft_tokens", "accepted_tokens"]
    for r in requests.select([*columns, "accepted_per_pos", "draft_tokens_per_pos"]).to_pylist():
        groups.setdefault((r["method"], r["temperature"]), []).append(r)
    return dict(sorted(groups.items()))


def acceptance(requests: pa.Table) -> pa.Table:
    """Per (method, temperature) of the replicas' request rows: speculation counters and rates
    (``ACCEPTANCE_SCHEMA``)."""
    rows = []
    for (method, temperature), part in _groups(requests).items():
        drafts = sum(r["drafts"] for r in part)
        draft_tokens = sum(r["draft_tokens"] for r in part)
        accepted = sum(r["accepted_tokens"] for r in part)
        rows.append(
            {
                "method": method,
                "temperature": temperature,
                "requests": len(part),
                "tokens": sum(r["completion_tokens"] for r in part),
                "drafts": drafts,
                "draft_tokens": draft_tokens,
                "accepted_tokens": accepted,
                "acceptance_rate": accepted / draft_tokens if draft_tokens else None,
                "mean_acceptance_length": 1 + accepted / drafts if drafts else None,
            }
        )
    return pa.Table.from_pylist(rows, schema=ACCEPTANCE_SCHEMA)


def acceptance_by_position(requests: pa.Table) -> pa.Table:
    """Per (method, temperature, draft position) where tokens were launched: accepted over draft tokens
    (``ACCEPTANCE_BY_POSITION_SCHEMA``); methods without drafts (sequential) have no rows."""
    rows = []
    for (method, temperature), part in _groups(requests).items():
        positions = max(len(r["draft_tokens_per_pos"]) for r in part)
        for pos in range(positions):
            launched = sum(r["draft_tokens_per_pos"][pos] for r in part if pos < len(r["draft_tokens_per_pos"]))
            accepted = sum(r["accepted_per_pos"][pos] for r in part if pos < len(r["accepted_per_pos"]))
            if launched:
                rows.append(
                    {
                        "method": method,
                        "temperature": temperature,
                        "position": pos + 1,
                        "accepted_tokens": accepted,
                        "draft_tokens": launched,
                        "acceptance_rate": accepted / launched,
                    }
                )
    return pa.Table.from_pylist(rows, schema=ACCEPTANCE_BY_POSITION_SCHEMA)
