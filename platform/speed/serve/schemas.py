"""The serving statistics' files: where they live under a storage path and the schemas of their records.

Every replica of the Serve application appends, for each finished request (one record per choice of a completion
request, ``choice`` its index), one ``REQUEST_SCHEMA`` record and its flip-trace records
(``SERVE_TRACE_SCHEMA``)
under a storage path, local or a URI that ``pyarrow.fs`` understands::

    <storage>/requests/<replica>-<n>.parquet    REQUEST_SCHEMA, one file per flushed row group
    <storage>/traces/<replica>-<n>.parquet      SERVE_TRACE_SCHEMA
    <logs>/<replica>-<n>.requests.arrows        the records of file n until it is written (its write-ahead log)
    <logs>/<replica>-<n>.traces.arrows
    <storage>/rejected/<replica>-<k>.json       a record that does not fit its schema, set aside with the error

``speed.serve.sink`` writes them, ``speed.serve.readers`` reads them back. The load generator writes
``LOADGEN_SCHEMA`` records, the serving benchmark ``BENCH_SERVE_SCHEMA`` records.
"""

from __future__ import annotations

import pyarrow as pa

from speed.engine.trace import TRACE_SCHEMA

REQUESTS_DIR = "requests"
TRACES_DIR = "traces"
WAL_DIR = "wal"  # write-ahead logs of the records not yet in Parquet (local storage; a URI's are in the spool)
DESTINATION_FILE = "destination"  # in a spool folder: the URI its logs' records are bound for
REJECTED_DIR = "rejected"  # records that did not fit their schema, one JSON file each with the error

REQUEST_SCHEMA = pa.schema(
    [
        pa.field("request_id", pa.string(), nullable=False),  # the completion's id ("cmpl-...")
        pa.field("choice", pa.int32(), nullable=False),  # its index in the answer (prompt-major)
        pa.field("replica", pa.string(), nullable=False),  # Serve replica id that decoded it
        pa.field("engine_id", pa.int64(), nullable=False),  # the engine's request id (trace ``sequence``)
        pa.field("arrived", pa.timestamp("us", tz="UTC"), nullable=False),  # when the replica received it
        pa.field("model", pa.string(), nullable=False),  # served model name
        pa.field("family", pa.string()),  # its family, "t5" or "lm"; null: a record written before the column
        pa.field("task", pa.string()),  # task whose prefix (an LM: instruction) the prompt was read under; null: none
        pa.field("method", pa.string(), nullable=False),  # "speed", "sequential" or "exit_gate"
        pa.field("launch_loop", pa.int16(), nullable=False),
        pa.field("invalidation", pa.string(), nullable=False),  # "eager" or "final"
        # SPEED's runner-up branches and confidence gate (speed.engine.Speculation); null for sequential decoding
        pa.field("branches", pa.int16()),
        pa.field("branch_depth", pa.int16()),
        pa.field("branch_below", pa.float64()),
        pa.field("min_confidence", pa.float64()),
        # Ouro's exit gate's rule (speed.engine.ExitRule), null but for method exit_gate (threshold, step: their kind's)
        pa.field("exit_kind", pa.string()),
        pa.field("exit_threshold", pa.float64()),
        pa.field("exit_step", pa.int16()),
        pa.field("route", pa.string(), nullable=False),  # "completions" or "chat"
        pa.field("prompt", pa.int32(), nullable=False),  # index of its prompt (a prompt's n choices share it)
        pa.field("temperature", pa.float64(), nullable=False),  # 0: greedy
        pa.field("top_p", pa.float64(), nullable=False),
        pa.field("top_k", pa.int32(), nullable=False),  # 0: off
        pa.field("seed", pa.int64(), nullable=False),  # this choice's seed (speed.engine.sampling.choice_seed)
        pa.field("presence_penalty", pa.float64(), nullable=False),
        pa.field("frequency_penalty", pa.float64(), nullable=False),
        pa.field("stream", pa.bool_(), nullable=False),  # answered as server-sent events
        pa.field("max_tokens", pa.int32(), nullable=False),
        pa.field("prompt_tokens", pa.int32(), nullable=False),  # T5: encoder tokens (prefix, EOS); LM: its context
        pa.field("completion_tokens", pa.int32(), nullable=False),  # decoded tokens, EOS included when produced
        pa.field("finish_reason", pa.string(), nullable=False),  # "stop" (EOS, stop string), "length", "cancelled"
        pa.field("steps", pa.int32(), nullable=False),  # engine steps that computed one of its rows
        pa.field("rows", pa.int64(), nullable=False),  # its rows (token-loops) computed
        pa.field("flushes", pa.int32(), nullable=False),  # misprediction flushes
        pa.field("wasted_rows", pa.int64(), nullable=False),  # rows of flushed, past-EOS or cancelled tokens
        pa.field("flip_rate", pa.list_(pa.float64()), nullable=False),  # per loop, vs the final token; [] if unknown
        # speculation as vLLM counts it (speed.engine.RequestStats): drafts, draft tokens, accepted ones
        pa.field("drafts", pa.int32(), nullable=False),
        pa.field("draft_tokens", pa.int32(), nullable=False),
        pa.field("accepted_tokens", pa.int32(), nullable=False),
        pa.field("accepted_per_pos", pa.list_(pa.int32()), nullable=False),  # by draft position 1..M-1
        pa.field("draft_tokens_per_pos", pa.list_(pa.int32()), nullable=False),
        pa.field("queued_ms", pa.float64(), nullable=False),  # engine queue, until it got a slot
        pa.field("ttft_ms", pa.float64()),  # until its first token was committed; null if none
        pa.field("latency_ms", pa.float64(), nullable=False),  # engine: from add to finish
        pa.field("mean_exit_loop", pa.float64()),  # exit_gate: its tokens' mean exit loop (1-based); else null
        pa.field("itl_ms", pa.float64()),  # mean time between its committed tokens; null under two tokens
        pa.field("total_ms", pa.float64(), nullable=False),  # replica: from arrival to the last byte's hand-off
        pa.field("max_active", pa.int32(), nullable=False),  # the engine's capacity when it ran
        pa.field("row_budget", pa.int32()),  # the engine's rows per step; null: unlimited
    ]
)

# The flip trace of served requests: one record per (request, position, loop); ``sequence`` is ``engine_id``.
SERVE_TRACE_SCHEMA = pa.schema(
    [
        pa.field("request_id", pa.string(), nullable=False),
        pa.field("choice", pa.int32(), nullable=False),
        pa.field("replica", pa.string(), nullable=False),
        *TRACE_SCHEMA,
    ]
)

LOADGEN_SCHEMA = pa.schema(
    [
        pa.field("run", pa.string(), nullable=False),  # label of the load run
        pa.field("request", pa.int32(), nullable=False),  # index in the run, in send order
        pa.field("prompt", pa.int32(), nullable=False),  # index into the prompt list
        pa.field("status", pa.int32(), nullable=False),  # HTTP status; 0 when no answer came
        pa.field("error", pa.string()),  # the server's or client's error message; null when fine
        pa.field("request_id", pa.string()),  # the completion's id (REQUEST_SCHEMA.request_id); null if none
        pa.field("scheduled_s", pa.float64(), nullable=False),  # arrival (open loop: planned; closed: the send)
        pa.field("start_s", pa.float64(), nullable=False),  # actual send time, seconds from the run's start
        pa.field("latency_ms", pa.float64(), nullable=False),  # from the arrival to the last byte
        pa.field("ttft_ms", pa.float64()),  # from the arrival to the first streamed text (streaming only)
        pa.field("prompt_tokens", pa.int32()),
        pa.field("completion_tokens", pa.int32()),
        pa.field("finish_reason", pa.string()),
        pa.field("replica", pa.string()),
        pa.field("flushes", pa.int32()),
        pa.field("text", pa.string()),
    ]
)

BENCH_SERVE_SCHEMA = pa.schema(
    [
        pa.field("variant", pa.string(), nullable=False),  # "a", "b", "c"
        pa.field("description", pa.string(), nullable=False),
        pa.field("method", pa.string(), nullable=False),
        pa.field("max_active", pa.int32(), nullable=False),
        pa.field("row_budget", pa.int32()),
        pa.field("branches", pa.int16()),  # SPEED's levers of the variant's requests; null for sequential
        pa.field("branch_depth", pa.int16()),
        pa.field("min_confidence", pa.float64()),
        pa.field("concurrency", pa.int32(), nullable=False),
        pa.field("round", pa.int32(), nullable=False),
        pa.field("requests", pa.int32(), nullable=False),
        pa.field("errors", pa.int32(), nullable=False),
        pa.field("tokens", pa.int64(), nullable=False),
        pa.field("seconds", pa.float64(), nullable=False),
        pa.field("tokens_per_s", pa.float64(), nullable=False),
        pa.field("p50_ms", pa.float64(), nullable=False),
        pa.field("p99_ms", pa.float64(), nullable=False),
        pa.field("ttft_p50_ms", pa.float64()),
        # the engine's, from the replicas' REQUEST_SCHEMA records of the run's requests; null: none found
        pa.field("steps_per_token", pa.float64()),
        pa.field("rows_per_token", pa.float64()),
        pa.field("temperature", pa.float64(), nullable=False),  # of every request (seeded per prompt)
        pa.field("load_1m", pa.float64(), nullable=False),  # the machine's 1-minute load average after the run
        pa.field("checkpoint", pa.string(), nullable=False),
    ]
)
