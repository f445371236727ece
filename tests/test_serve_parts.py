"""The serving parts without Ray: request validation, body limits, the API key, streaming text, the statistics
sink and its write-ahead logs, the engine runner, the load generator's arrival times and the Serve config file."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pyarrow as pa
import pyarrow.dataset as pads
import pyarrow.parquet as pq
import pytest
import torch
import yaml

from speed import DecodeOptions, SpeedT5, generate, preset
from speed.engine import Engine, EngineConfig, Finished, Request, Speculation, as_stepper
from speed.engine.trace import TRACE_SCHEMA
from speed.loadtest.loadgen import LoadConfig, arrival_times, summarize
from speed.paths import repo_root
from speed.serve import auth
from speed.serve.answers import TextStream
from speed.serve.limits import parse_body, read_body
from speed.serve.metrics import ServeCounters
from speed.serve.protocol import BadRequest, CompletionRequest, validation_message
from speed.serve.readers import read_requests, read_traces
from speed.serve.runner import Ended, EngineRunner
from speed.serve.schemas import DESTINATION_FILE, LOADGEN_SCHEMA, REQUEST_SCHEMA, SERVE_TRACE_SCHEMA, WAL_DIR
from speed.serve.sink import StatsSink, compact_orphans, log_folder, write_ahead_logs
from speed.storage import locate

# ----- request validation ------------------------------------------------------------------------


@pytest.mark.parametrize(
    "body, says",
    [
        ({"prompt": ""}, "prompt is empty"),
        ({"prompt": "  "}, "prompt is empty"),
        ({"prompt": []}, "prompt must be a non-empty string"),
        ({"prompt": 7}, "prompt must be a non-empty string"),
        ({"prompt": ["a", ""]}, "prompt[1] is empty"),
        ({"prompt": [1, "a"]}, "not a mixture"),
        ({"prompt": [[1, 2], []]}, "prompt[1] must be a non-empty list of token ids"),
        ({"prompt": [-3]}, "not a mixture"),
        ({"prompt": "x", "temperature": -0.7}, "temperature: Input should be greater than or equal to 0"),
        ({"prompt": "x", "n": 0}, "n: Input should be greater than or equal to 1"),
        ({"prompt": "x", "max_tokens": 0}, "max_tokens: Input should be greater than or equal to 1"),
        ({"prompt": "x", "max_tokens": "5"}, "max_tokens: Input should be a valid integer"),
        ({"prompt": "x", "stream": "yes"}, "stream: Input should be a valid boolean"),
        ({"prompt": "x", "method": "fast"}, "method: Input should be 'speed', 'sequential' or 'exit_gate'"),
        ({"prompt": "x", "best_of": 3}, "best_of: not supported by this server"),
        ({"prompt": "x", "bestof": 3}, "bestof: unknown field; the fields are: model, max_tokens"),
        ({}, "prompt: Field required"),
    ],
)
def test_bad_requests_say_what_to_fix(body, says):
    with pytest.raises(Exception) as caught:
        CompletionRequest.model_validate(body)
    message, _ = validation_message(caught.value)
    assert says in message


def test_prompt_shapes():
    assert CompletionRequest.model_validate({"prompt": "hi", "temperature": 0}).prompts() == ["hi"]
    assert CompletionRequest.model_validate({"prompt": ["a", "b"]}).prompts() == ["a", "b"]
    assert CompletionRequest.model_validate({"prompt": [5, 6]}).prompts() == [[5, 6]]
    assert CompletionRequest.model_validate({"prompt": [[5], [6, 7]]}).prompts() == [[5], [6, 7]]


_NESTED = b'{"prompt": ' + b"[" * 5000 + b"]" * 5000 + b"}"


@pytest.mark.parametrize(
    "raw, status, says",
    [
        (_NESTED, 400, "nests arrays or objects too deeply"),
        (b'{"a": ' * 5000 + b"1" + b"}" * 5000, 400, "nests arrays or objects too deeply"),
        (b'{"prompt": "caf\\ud800e"}', 400, "prompt holds a lone UTF-16 surrogate"),
        (b'{"prompt": ["ok", "\\udfff"]}', 400, "prompt[1] holds a lone UTF-16 surrogate"),
        (b'{"prompt": "x", "user": {"\\ud83d": 1}}', 400, "user key holds a lone UTF-16 surrogate"),
        (json.dumps({"prompt": ["x"] * 10_000}).encode(), 400, "prompt holds 10000 prompts; this server takes at most"),
        (json.dumps({"prompt": [[5, 6]] * 33}).encode(), 400, "prompt holds 33 prompts"),
        (b'{"prompt": "x", "max_tokens": ' + b"9" * 5000 + b"}", 400, "a number this server cannot read"),
        (b'{"prompt": "\xff\xfe"}', 400, "not valid UTF-8"),
        (b'{"prompt": ', 400, "not valid JSON"),
        (b"", 400, "not valid JSON"),
        (b"[1, 2]", 400, "must be a JSON object"),
    ],
)
def test_hostile_bodies_are_rejected_saying_what_is_wrong(raw, status, says):
    with pytest.raises(BadRequest) as caught:
        parse_body(raw, max_prompts=32)
    assert caught.value.status == status and says in caught.value.message


def test_clean_bodies_pass_the_limits():
    assert parse_body(json.dumps({"prompt": ["x"] * 32}).encode(), 32)["prompt"] == ["x"] * 32
    assert parse_body(b'{"prompt": [5, 6, 7, 8, 9]}', 1)["prompt"] == [5, 6, 7, 8, 9]  # token ids: one prompt
    assert parse_body(b'{"prompt": "\\ud83d\\ude00 ok"}', 1)["prompt"] == "\U0001f600 ok"  # a surrogate pair


def _request(chunks: list[bytes], declared: int | None):
    """A Starlette request whose body arrives in ``chunks``; ``declared`` its Content-Length (None: chunked)."""
    from starlette.requests import Request as StarletteRequest

    headers = [] if declared is None else [(b"content-length", str(declared).encode())]
    messages = [{"type": "http.request", "body": c, "more_body": i < len(chunks) - 1} for i, c in enumerate(chunks)]
    read = []

    async def receive():
        read.append(1)
        return messages[len(read) - 1]

    return StarletteRequest({"type": "http", "method": "POST", "path": "/", "headers": headers}, receive), read


def test_body_size_is_capped_before_it_is_read():
    async def run(chunks, declared):
        request, read = _request(chunks, declared)
        try:
            return await read_body(request, max_bytes=100), len(read)
        except BadRequest as err:
            return err, len(read)

    rejected, chunks_read = asyncio.run(run([b"x" * 60] * 1000, 60_000))
    assert rejected.status == 413 and "larger than this server accepts (100 bytes)" in rejected.message
    assert chunks_read == 0  # the declared size was enough
    rejected, chunks_read = asyncio.run(run([b"x" * 60] * 1000, None))  # no Content-Length: stop at the cap
    assert rejected.status == 413 and chunks_read == 2
    assert asyncio.run(run([b"x" * 50, b"y" * 50], None)) == (b"x" * 50 + b"y" * 50, 2)


# ----- the API key -----------------------------------------------------------------------------------


async def _get(app, path: str, authorization: str | None = None) -> tuple[int, dict]:
    """One GET through ``app`` as an ASGI server would send it: the status and the JSON body."""
    headers = [] if authorization is None else [(b"authorization", authorization.encode())]
    scope = {"type": "http", "method": "GET", "path": path, "raw_path": path.encode(), "root_path": "",
             "query_string": b"", "headers": headers, "scheme": "http", "http_version": "1.1",
             "server": ("127.0.0.1", 8000), "client": ("127.0.0.1", 5000)}  # fmt: skip
    sent = []

    async def receive():
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message):
        sent.append(message)

    await app(scope, receive, send)
    body = b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")
    return sent[0]["status"], json.loads(body)


def test_api_key_guards_every_route_but_healthz():
    from fastapi import FastAPI

    app = FastAPI()
    auth.require_key(app)
    app.get("/healthz")(lambda: {"ok": True})
    app.get("/v1/models")(lambda: {"data": []})

    async def run():
        open_before = await _get(app, "/v1/models")
        app.state.api_key = auth.ApiKey("s3cret-key")
        return open_before, [
            await _get(app, path, header)
            for path, header in [
                ("/v1/models", None),
                ("/v1/models", "Bearer wrong"),
                ("/v1/models", "Bearer s3cret-key"),
                ("/v1/models", "bearer s3cret-key"),
                ("/v1/models", "Basic s3cret-key"),
                ("/v1/models", "Bearer s3cret-key-and-more"),
                ("/docs", None),
                ("/nowhere", None),
                ("/healthz", None),
            ]
        ]

    open_before, answers = asyncio.run(run())
    assert open_before == (200, {"data": []})  # no key set: open
    assert [status for status, _ in answers] == [401, 401, 200, 200, 401, 401, 401, 401, 200]
    error = answers[0][1]["error"]
    assert (error["code"], error["type"], error["param"]) == ("invalid_api_key", "invalid_request_error", None)
    assert all("s3cret" not in json.dumps(body) for _, body in answers)


def test_api_key_resolution_and_secrecy(monkeypatch):
    monkeypatch.delenv(auth.API_KEY_ENV, raising=False)
    assert auth.resolve(None) is None
    monkeypatch.setenv(auth.API_KEY_ENV, "from-env")
    assert auth.resolve(None).accepts("Bearer from-env")
    assert auth.resolve("given").accepts("Bearer given") and not auth.resolve("given").accepts("Bearer from-env")
    monkeypatch.setenv(auth.API_KEY_ENV, "")
    assert auth.resolve(None) is None  # an empty variable is no key
    key = auth.ApiKey("hunter2")
    assert "hunter2" not in repr(key) + str(key) + repr(vars(key))
    with pytest.raises(ValueError, match="non-empty"):
        auth.ApiKey(" padded ")


def test_text_stream_deltas_add_up_to_the_whole_decode(tiny_tokenizer):
    from speed.tokenizer import Tokenizer

    tok = Tokenizer.load(tiny_tokenizer)
    ids = tok.encode("The quick brown fox, don't you know, jumps over 12 lazy dogs.", add_eos=False)
    stream = TextStream(tok.decode)
    text = "".join(stream.push(t) for t in ids) + stream.finish()
    assert text == tok.decode(ids)


# ----- statistics ---------------------------------------------------------------------------------


def _row(i: int, **extra) -> dict:
    row = {f.name: None for f in REQUEST_SCHEMA}
    row.update(
        request_id=f"cmpl-{i}", choice=0, replica="r#1", engine_id=i, arrived=pa.scalar(0, pa.timestamp("us")).as_py(),
        model="m", method="speed", launch_loop=1, invalidation="eager", stream=False, max_tokens=8,
        prompt_tokens=3, completion_tokens=4, finish_reason="length", steps=5, rows=9, flushes=1, wasted_rows=2,
        flip_rate=[0.5, 0.0], queued_ms=0.1, ttft_ms=1.0, latency_ms=2.0, total_ms=3.0, max_active=4,
        route="completions", prompt=0, temperature=0.0, top_p=1.0, top_k=0, seed=0, presence_penalty=0.0,
        frequency_penalty=0.0, drafts=1, draft_tokens=3, accepted_tokens=2, accepted_per_pos=[2],
        draft_tokens_per_pos=[3],
    )  # fmt: skip
    row.update(extra)
    return row


def _trace(request_id: str, n: int) -> pa.Table:
    cols = {"request_id": [request_id] * n, "choice": [0] * n, "replica": ["r#1"] * n}
    cols.update({f.name: [0] * n if f.type != pa.bool_() else [False] * n for f in TRACE_SCHEMA})
    return pa.table(cols)


def test_sink_flushes_on_size_and_time_and_reads_back(tmp_path):
    """On the sink's own clock, which moves only when the test says so: a wall clock made the time bound's
    "not yet" fail whenever the machine stalled the test for its 0.25 s (a loaded machine does)."""
    now = [0.0]  # seconds; steps that are binary fractions, so that the sums are exact
    sink = StatsSink(str(tmp_path), "app#SpeedServer#a b", max_records=3, max_seconds=0.25, clock=lambda: now[0])
    for i in range(2):
        sink.add(_row(i), _trace(f"cmpl-{i}", 2))
    now[0] += 0.125
    assert not sink.due() and not list((tmp_path / "requests").iterdir())  # no Parquet yet ...
    assert read_requests(str(tmp_path)).num_rows == 2  # ... but the rows are readable from their log
    sink.add(_row(2), None)
    assert sink.due()  # the size bound
    assert sink.flush() == 3 and sink.pending == 0
    now[0] += 4
    sink.add(_row(3), _trace("cmpl-3", 1))
    now[0] += 0.125
    assert not sink.due()  # the time bound counts from the buffer's first record
    now[0] += 0.125
    assert sink.due()  # the time bound
    sink.flush()
    requests, traces = read_requests(str(tmp_path)), read_traces(str(tmp_path))
    assert requests.schema == REQUEST_SCHEMA and traces.schema == SERVE_TRACE_SCHEMA
    assert sorted(requests["request_id"].to_pylist()) == [f"cmpl-{i}" for i in range(4)]
    assert traces.num_rows == 5
    assert len(list((tmp_path / "requests").iterdir())) == 2  # one file (row group) per flush
    assert all(" " not in p.name and "#" not in p.name for p in (tmp_path / "requests").iterdir())


def test_statistics_written_before_the_family_column_read_back_with_it_null(tmp_path):
    """Rows of a Parquet file and of a write-ahead log written without ``family`` (older replicas) read as
    REQUEST_SCHEMA's, their family null; compacting the log keeps them."""
    old = pa.schema([f for f in REQUEST_SCHEMA if f.name != "family"])
    (tmp_path / "requests").mkdir()
    pq.write_table(pa.Table.from_pylist([_row(0)], schema=old), tmp_path / "requests" / "old-1.parquet")
    folder = log_folder(str(tmp_path))
    folder.mkdir(parents=True)
    with pa.OSFile(str(folder / "old-2.requests.arrows"), "wb") as f, pa.ipc.new_stream(f, old) as log:
        log.write_table(pa.Table.from_pylist([_row(1)], schema=old))
    for _ in range(2):  # from the log, then from its compacted Parquet file
        rows = read_requests(str(tmp_path))
        assert rows.schema == REQUEST_SCHEMA and rows.num_rows == 2
        assert sorted(rows["request_id"].to_pylist()) == ["cmpl-0", "cmpl-1"] and rows["family"].null_count == 2
        assert compact_orphans(str(tmp_path)) in (0, 1)
    assert not write_ahead_logs(str(tmp_path))


@pytest.fixture(params=["local", "s3"])
def stats_storage(request, tmp_path) -> str:
    """A stats path on local disk, or on the session's S3 server (tests/s3_helpers.py), whose logs are in the
    node's spool (the session's ``$SPEED_SPOOL_DIR``)."""
    return str(tmp_path / "stats") if request.param == "local" else f"{request.getfixturevalue('s3_bucket')}/stats"


def _parquet_only(storage: str, folder: str = "requests") -> pa.Table:
    """The rows in the Parquet files alone (what the notebooks, pandas or another node read), logs left out."""
    where = locate(storage) / folder
    return pads.dataset(where.path, filesystem=where.fs, format="parquet").to_table()


def _log_names(storage: str) -> list[str]:
    return [Path(p).name for p in write_ahead_logs(storage)]


_KILLED_WRITER = """
import os, signal, sys
sys.path.insert(0, {tests!r})
from test_serve_parts import _row, _trace
from speed.serve.sink import StatsSink
sink = StatsSink({storage!r}, "app#SpeedServer#killed", max_records=2, max_seconds=600)
for i in range(5):
    sink.add(_row(i), _trace(f"cmpl-{{i}}", 3))
    if sink.due():
        sink.flush()
os.kill(os.getpid(), signal.SIGKILL)  # as a replica killed hard: no flush, no __del__
"""


def _kill_a_writer(storage: str) -> None:
    """A replica's sink (``max_records=2``) in a child process: five rows answered, two flushes, then SIGKILL."""
    code = _KILLED_WRITER.format(tests=str(repo_root() / "tests"), storage=storage)
    env = {**os.environ, "PYTHONPATH": str(repo_root() / "platform")}  # the S3 endpoint and the spool too
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, timeout=300)
    assert done.returncode == -signal.SIGKILL, done.stderr.decode()


def test_sink_logs_every_row_so_a_replica_killed_hard_loses_none(stats_storage):
    """On any storage: the rows the killed replica had not flushed are in its logs on this node's disk, read at
    once, and the next sink to start here writes them as Parquet (uploads them, on S3)."""
    storage = stats_storage
    _kill_a_writer(storage)
    requests, traces = read_requests(storage), read_traces(storage)
    assert sorted(requests["request_id"].to_pylist()) == [f"cmpl-{i}" for i in range(5)]  # 4 in Parquet, 1 logged
    assert traces.num_rows == 15 and requests.schema == REQUEST_SCHEMA and traces.schema == SERVE_TRACE_SCHEMA
    assert _parquet_only(storage).num_rows == 4
    (log,) = (p for p in write_ahead_logs(storage) if p.endswith(".requests.arrows"))
    with open(log, "ab") as f:
        f.write(b"\xff\xff\xff\xff\x10\x00")  # a record cut short by the kill
    assert read_requests(storage).num_rows == 5
    live = StatsSink(storage, "app#SpeedServer#alive")  # a new replica compacts the dead one's logs ...
    live.add(_row(9), _trace("cmpl-9", 1))
    assert compact_orphans(storage) == 0  # ... never a live one's (it holds their lock)
    assert _log_names(storage) == [
        "app_SpeedServer_alive-000001.requests.arrows",
        "app_SpeedServer_alive-000001.traces.arrows",
    ]
    parquet = _parquet_only(storage)  # what notebooks read
    assert sorted(parquet["request_id"].to_pylist()) == [f"cmpl-{i}" for i in range(5)]
    assert _parquet_only(storage, "traces").num_rows == 15
    assert read_requests(storage).num_rows == 6 and read_traces(storage).num_rows == 16


def test_a_node_gone_with_its_disk_takes_only_the_rows_not_uploaded_yet(s3_bucket):
    """On an object store a row waits in the node's spool only until its flush uploads it: a node that
    disappears with its disk (here: its spool deleted after the kill) takes the replica's unflushed buffer,
    under ``max_records`` records, and nothing already uploaded."""
    storage = f"{s3_bucket}/stats"
    _kill_a_writer(storage)  # max_records=2: records 0-3 uploaded by two flushes, row 4 only in the spool
    spool = log_folder(storage)
    assert (spool / DESTINATION_FILE).read_text() == f"{storage}\n"  # whoever finds the folder: where it goes
    assert len(write_ahead_logs(storage)) == 2 and not locate(f"{storage}/{WAL_DIR}").exists()  # never on S3
    shutil.rmtree(spool)  # the node is gone with its disk
    kept = read_requests(storage)["request_id"].to_pylist()
    assert sorted(kept) == [f"cmpl-{i}" for i in range(4)]
    assert 5 - len(kept) < 2  # lost: only the buffer, under max_records
    assert read_traces(storage).num_rows == 12


_STOPPING_WRITER = """
import os, signal, sys, time
sys.path.insert(0, {tests!r})
from test_serve_parts import _row, _trace
from speed.serve.sink import StatsSink
sink = StatsSink({storage!r}, "app#SpeedServer#stopping", max_records=100, max_seconds=600)
for i in range(4):
    sink.add(_row(i), _trace(f"cmpl-{{i}}", 2))
print("logged", flush=True)
sys.stdin.readline()
time.sleep(0.5)  # a replica still ending when its job compacts
os.kill(os.getpid(), signal.SIGKILL)  # as a signal to the process group stops it: no flush
"""


def test_a_stopping_job_turns_its_replicas_logs_into_parquet_any_reader_sees(stats_storage):
    """What ``jobs/serve.py`` does once its replicas are gone (``compact_orphans`` with ``wait_s``): it waits for a
    writer still holding its logs to end, then writes them as Parquet (uploads them, on S3), which any Parquet
    reader reads; a writer that stays keeps its logs, and the wait is bounded."""
    storage = stats_storage
    code = _STOPPING_WRITER.format(tests=str(repo_root() / "tests"), storage=storage)
    env = {**os.environ, "PYTHONPATH": str(repo_root() / "platform")}
    pipes = {"stdin": subprocess.PIPE, "stdout": subprocess.PIPE, "text": True}
    writer = subprocess.Popen([sys.executable, "-c", code], env=env, **pipes)
    try:
        assert writer.stdout.readline() == "logged\n"
        assert compact_orphans(storage) == 0 and len(write_ahead_logs(storage)) == 2  # alive: its logs are its own
        writer.stdin.write("end\n")
        writer.stdin.flush()
        assert compact_orphans(storage, wait_s=120) == 2  # waited for it to end
    finally:
        writer.kill()
        writer.wait(timeout=60)
    assert write_ahead_logs(storage) == []
    assert sorted(_parquet_only(storage).to_pandas()["request_id"]) == [f"cmpl-{i}" for i in range(4)]
    assert _parquet_only(storage, "traces").num_rows == 8
    live = StatsSink(storage, "app#SpeedServer#alive")
    live.add(_row(9), None)
    started = time.monotonic()
    assert compact_orphans(storage, wait_s=0.5) == 0 and 0.5 <= time.monotonic() - started < 5
    assert len(write_ahead_logs(storage)) == 1


def test_sink_flush_replaces_the_log_and_no_row_is_read_twice(stats_storage):
    storage = stats_storage
    sink = StatsSink(storage, "r#1", max_records=100, max_seconds=600)
    for i in range(3):
        sink.add(_row(i), _trace(f"cmpl-{i}", 2))
    assert _log_names(storage) == ["r_1-000001.requests.arrows", "r_1-000001.traces.arrows"]
    assert read_requests(storage).num_rows == 3 and read_traces(storage).num_rows == 6
    logs = {p: Path(p).read_bytes() for p in write_ahead_logs(storage)}
    assert sink.flush() == 3 and write_ahead_logs(storage) == []
    for path, data in logs.items():  # killed between the Parquet file's write (the upload) and the log's deletion
        Path(path).write_bytes(data)
    assert read_requests(storage).num_rows == 3 and read_traces(storage).num_rows == 6
    assert compact_orphans(storage) == 2 and write_ahead_logs(storage) == []  # stale: their Parquet files stand
    assert read_requests(storage).num_rows == 3 and read_traces(storage).num_rows == 6
    assert _parquet_only(storage).num_rows == 3  # nothing written twice
    sink.add(_row(3), None)
    assert read_requests(storage).num_rows == 4  # the next file's log


def test_a_failed_write_keeps_its_rows_until_a_write_succeeds(stats_storage, monkeypatch):
    """A flush whose Parquet file cannot be written (the object store out of reach) raises and loses no row:
    its logs stay, unlocked, still read; the sink's next write that succeeds writes them as well, and so does
    its next flush with nothing buffered (a replica's last, on shutdown)."""
    storage = stats_storage
    sink = StatsSink(storage, "r#1", max_records=100, max_seconds=600)
    for i in range(3):
        sink.add(_row(i), _trace(f"cmpl-{i}", 2))

    def unreachable(final, table):
        raise OSError(f"{final.uri}: the store is out of reach")

    def fail_a_flush():
        with monkeypatch.context() as m:
            m.setattr("speed.serve.sink._write_parquet", unreachable)
            with pytest.raises(OSError, match="out of reach"):
                sink.flush()
        assert sink.pending == 0 and write_ahead_logs(storage)

    fail_a_flush()
    assert len(write_ahead_logs(storage)) == 2
    assert read_requests(storage).num_rows == 3 and read_traces(storage).num_rows == 6
    sink.add(_row(3), None)
    assert sink.flush() == 1 and write_ahead_logs(storage) == []  # the store is back: the failed file too
    assert sorted(_parquet_only(storage)["request_id"].to_pylist()) == [f"cmpl-{i}" for i in range(4)]
    assert _parquet_only(storage, "traces").num_rows == 6
    sink.add(_row(4), None)
    fail_a_flush()
    assert sink.flush() == 0 and write_ahead_logs(storage) == []  # nothing buffered: the failed file still
    assert sorted(_parquet_only(storage)["request_id"].to_pylist()) == [f"cmpl-{i}" for i in range(5)]


def test_sink_on_a_uri(tmp_path):
    sink = StatsSink(f"file://{tmp_path}/stats", "r")
    sink.add(_row(0), None)
    sink.flush()
    assert read_requests(f"file://{tmp_path}/stats")["request_id"].to_pylist() == ["cmpl-0"]


@pytest.mark.parametrize("where", ["local", "uri"])
def test_a_malformed_row_costs_only_itself(tmp_path, memory_store, caplog, where):
    """A row that does not fit REQUEST_SCHEMA (a wrong type, a null where none may be) or whose trace does not
    fit its schema is logged and set aside under rejected/ with the error; the other rows are written, now and
    in every later flush (on a URI, where rows are not logged, ``take`` used to fail on it from then on)."""
    storage = str(tmp_path / "stats") if where == "local" else memory_store
    sink = StatsSink(storage, "app#SpeedServer#r", max_records=100, max_seconds=600)
    sink.add(_row(0), _trace("cmpl-0", 2))
    with caplog.at_level("ERROR", logger="speed.serve.sink"):
        sink.add(_row(1, steps="five"), _trace("cmpl-1", 3))  # int32 column, a string
        sink.add(_row(2, request_id=None), None)  # not nullable
        sink.add(_row(3), _trace("cmpl-3", 1).drop_columns(["loop"]))  # its trace lacks a column
    sink.add(_row(4), _trace("cmpl-4", 1))
    assert (sink.pending, sink.set_aside) == (2, 3)
    assert sink.flush() == 2
    sink.add(_row(5), None)
    assert sink.flush() == 1  # and later flushes work
    requests, traces = read_requests(storage), read_traces(storage)
    assert sorted(requests["request_id"].to_pylist()) == ["cmpl-0", "cmpl-4", "cmpl-5"]
    assert sorted(set(traces["request_id"].to_pylist())) == ["cmpl-0", "cmpl-4"] and traces.num_rows == 3
    said = [r.getMessage() for r in caplog.records if "set aside" in r.getMessage()]
    assert len(said) == 3 and "cmpl-1" in said[0] and "int32" in said[0] and "request_id: null" in said[1]
    rejected = locate(storage) / "rejected"
    found = [json.loads((rejected / i.base_name).read_text()) for i in rejected.entries()]
    assert [r["request"]["request_id"] for r in found] == ["cmpl-1", None, "cmpl-3"]
    assert "tried to convert to int32" in found[0]["error"] and found[0]["request"]["steps"] == "five"
    assert len(found[0]["trace"]) == 3 and "loop" in found[2]["error"]
    assert found[0]["request"]["arrived"].startswith("1970-01-01")  # what JSON lacks, as text


def _stats(**counts):
    from speed.engine import RequestStats

    return RequestStats(steps=0, rows=0, queued_s=0.0, ttft_s=0.0, latency_s=0.0, **counts)


def _left(stats, prompt_tokens: int, cancelled: bool = False) -> tuple[dict, Finished, list[float]]:
    """``ServeCounters.add_finished``'s arguments for a prompt that left the engine with ``stats``."""
    return {"prompt_tokens": prompt_tokens}, Finished(0, [7] * stats.tokens, stats, None, cancelled), []


def test_counters_weight_flip_rates_by_tokens():
    c = ServeCounters()
    c.add_step(4, 1, 0)
    c.add_step(0, 1, 0)
    c.add_step(8, 1, 0)
    c.add_finished(*_left(_stats(tokens=10, flushes=2, wasted_rows=3, flip_rate=[0.5, 0.1, 0.0]), 5))
    c.add_finished(*_left(_stats(tokens=30, flushes=0, wasted_rows=0, flip_rate=[0.1, 0.0, 0.0]), 7))
    c.add_finished(*_left(_stats(tokens=2, flushes=0, wasted_rows=1, flip_rate=[]), 3, cancelled=True))
    s = c.snapshot(active=1, queued=2)
    assert (s["steps"], s["rows"], s["rows_per_step"], s["max_rows_per_step"]) == (2, 12, 6.0, 8)
    assert (s["finished"], s["cancelled"], s["tokens"], s["flushes"]) == (2, 1, 42, 2)
    assert s["flip_rate"] == pytest.approx([(5 + 3) / 40, 1 / 40, 0.0])
    assert (s["active"], s["queue_depth"], s["prompt_tokens"]) == (1, 2, 15)


# ----- the engine runner ----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_model():
    torch.manual_seed(0)
    return SpeedT5(preset("tiny", pattern="2x3")).eval()


def _runner(
    model, config: EngineConfig, after_step: Callable[[int, int], None] | None = None
) -> tuple[EngineRunner, list[Ended], list[int]]:
    """An ``EngineRunner`` whose hooks keep every request that left the engine (its ``Ended``) and each step's
    rows; ``after_step(n, active)`` runs after its n-th step (1-based), before that step's tokens are handed out."""
    ended: list[Ended] = []
    rows: list[int] = []

    def on_step(step_rows: int, active: int, queued: int) -> None:
        rows.append(step_rows)
        if after_step is not None:
            after_step(len(rows), active)

    return EngineRunner(model, config, ended.append, on_step), ended, rows


def test_runner_answers_equal_sequential_decoding_alone(tiny_model):
    """Concurrent requests joining a running batch, streamed token by token, equal decoding each alone. The
    arrivals come from the runner's step hook, after steps 2, 4 and 6, while the first request decodes."""
    gen = torch.Generator().manual_seed(1)
    inputs = [torch.randint(3, tiny_model.config.vocab_size, (n,), generator=gen).tolist() + [1] for n in (5, 9, 3, 7)]
    methods = ["speed", "sequential", "speed", "speed"]

    def request(i: int) -> Request:
        return Request(inputs[i], 12 + i, methods[i], Speculation(1 + i % 3))

    async def run():
        arriving, active_then = [], []

        def arrive(step: int, active: int) -> None:  # a submit lands on the engine thread before step + 2
            if step in (2, 4, 6):
                i = len(arriving) + 1
                arriving.append(asyncio.get_running_loop().create_task(runner.submit(request(i), i)))
                active_then.append(active)

        config = EngineConfig(max_active=2, max_source_len=16, max_target_len=24, row_budget=5)
        runner, ended, rows = _runner(tiny_model, config, arrive)
        subs = [await runner.submit(request(0), 0)]
        await subs[0].done  # 12 tokens of a 3-loop model: more than 6 steps
        subs += [await task for task in arriving]

        async def collect(s):
            return [c.token async for c in s.stream()]

        streamed = await asyncio.gather(*(collect(s) for s in subs))
        finished = [await s.done for s in subs]
        runner.close()
        return streamed, finished, ended, rows, active_then

    streamed, finished, ended, rows, active_then = asyncio.run(run())
    assert len(active_then) == 3 and all(active_then)  # each arrived while another decoded
    for i, ids in enumerate(inputs):
        alone = generate(
            tiny_model, torch.tensor([ids]), options=DecodeOptions(method="sequential", max_new_tokens=12 + i)
        ).tokens[0]
        assert finished[i].tokens == alone == streamed[i]
    assert sorted(e.meta for e in ended) == [0, 1, 2, 3] and not any(e.finished.cancelled for e in ended)
    assert all(e.finished is f for e, f in zip(sorted(ended, key=lambda e: e.meta), finished))
    assert max(rows) <= 5  # the row budget


def test_runner_submits_all_or_none(tiny_model):
    """One refused request of several: none of them stays in the engine, none leaves a statistics row."""

    async def run():
        runner, left, _ = _runner(tiny_model, EngineConfig(max_active=2, max_source_len=8, max_target_len=8))
        good = Request([5, 6, 1], 4)
        with pytest.raises(ValueError, match=r"^\[2\]: max_new_tokens must be at most 8"):
            await runner.submit_all([good, good, Request([5, 1], 9)], [None, None, None])
        assert (runner.pending, runner.queued, runner.active, left) == (0, 0, 0, [])
        (ok,) = await runner.submit_all([good], [None])
        finished = await ok.done
        runner.close()
        return finished, ok, left

    finished, ok, left = asyncio.run(run())
    assert len(left) == 1 and len(ok.times) == len(finished.tokens) and len(ok.gaps) == len(finished.tokens) - 1


def test_runner_cancel_frees_the_slot_and_reconfigure_rebuilds(tiny_model):
    async def run():
        runner, ended, _ = _runner(tiny_model, EngineConfig(max_active=1, max_source_len=8, max_target_len=64))
        long = await runner.submit(Request([5, 6, 7, 1], 64, "sequential"))
        waiting = await runner.submit(Request([8, 9, 1], 4))
        async for _ in long.stream():
            break  # one token committed: it holds the only slot
        assert runner.active == 1
        await runner.cancel(long.id)
        cancelled = await long.done
        second = await waiting.done  # got the freed slot
        await runner.reconfigure(EngineConfig(max_active=3, max_source_len=8, max_target_len=16, row_budget=2))
        after = await (await runner.submit(Request([8, 9, 1], 4))).done
        runner.close()
        return cancelled, second, after, runner, ended

    cancelled, second, after, runner, ended = asyncio.run(run())
    assert cancelled.cancelled and 1 <= len(cancelled.tokens) < 64
    assert not second.cancelled and second.tokens == after.tokens
    assert runner.config.max_active == 3 and runner.active == 0
    assert [e.finished.cancelled for e in ended] == [True, False, False] and ended[0].config.max_active == 1


class FaultyModel:
    """``model`` whose ``fail_at``-th step raises, and so does every later step of that engine (known by its
    cache): a fault that leaves the engine unusable. An engine built afterwards steps normally."""

    def __init__(self, model: SpeedT5, fail_at: int) -> None:
        self.model, self.fail_at, self.steps, self.broken = as_stepper(model), fail_at, 0, None

    def __getattr__(self, name: str):
        return getattr(self.model, name)

    def step(self, memory, cache, *args, **kwargs):
        self.steps += 1
        if self.steps == self.fail_at:
            self.broken = cache
        if cache is self.broken:
            raise RuntimeError("injected fault")
        return self.model.step(memory, cache, *args, **kwargs)


def test_runner_fails_every_pending_request_on_an_engine_fault_and_answers_the_next(tiny_model):
    """The fifth step raises with two requests decoding and one queued: all three end with the error, their
    streams end, none leaves a statistics row; the engine is rebuilt and a request sent at once is answered."""
    inputs = [[5, 6, 7, 1], [8, 9, 1], [10, 11, 12, 1]]
    alone = [
        generate(tiny_model, torch.tensor([x]), options=DecodeOptions(method="sequential", max_new_tokens=12)).tokens[0]
        for x in inputs
    ]
    assert all(len(t) > 2 for t in alone), "each request must still be decoding when the fault comes"

    async def run():
        config = EngineConfig(max_active=2, max_source_len=8, max_target_len=16)
        runner, left, _ = _runner(FaultyModel(tiny_model, fail_at=5), config)
        methods = ["speed", "sequential", "speed"]
        failed = await runner.submit_all([Request(x, 12, m) for x, m in zip(inputs, methods)], [None] * 3)
        streamed = []
        for s in failed:
            streamed.append([c.token async for c in s.stream()])  # the stream ends
            with pytest.raises(RuntimeError, match="injected fault"):
                await s.done
        after = await (await runner.submit(Request(inputs[0], 6))).done
        state = (runner.pending, runner.active, runner.queued, len(left), sum(not e.finished.cancelled for e in left))
        runner.close()
        return streamed, after, state

    streamed, after, state = asyncio.run(asyncio.wait_for(run(), 30))  # a request left hanging fails it
    assert streamed[0] and streamed[1] and streamed[2] == []  # the two active ones had streamed, the queued not
    assert all(t == a[: len(t)] for t, a in zip(streamed, alone))
    assert after.tokens == alone[0][:6]
    assert state == (0, 0, 0, 1, 1)  # the old engine's requests are gone with it; one answer counted


# ----- load generator and config file --------------------------------------------------------------------


def test_arrival_times_closed_and_poisson():
    assert arrival_times(4, None, 0) == [0.0] * 4
    times = arrival_times(4000, 50.0, 0)
    gaps = [b - a for a, b in zip(times, times[1:])]
    assert times[0] == 0.0 and all(g >= 0 for g in gaps)
    assert sum(gaps) / len(gaps) == pytest.approx(1 / 50, rel=0.1)  # mean gap of a 50/s Poisson process


def test_load_config_checks():
    with pytest.raises(ValueError, match="url"):
        LoadConfig(url="127.0.0.1:8000")
    with pytest.raises(ValueError, match="rate"):
        LoadConfig(rate=0)
    with pytest.raises(ValueError, match="must not set"):
        LoadConfig(body={"prompt": "x"})


def test_summary_counts_only_answered_requests():
    rows = [
        {"run": "t", "request": 0, "prompt": 0, "status": 200, "scheduled_s": 0.0, "start_s": 0.0,
         "latency_ms": 100.0, "ttft_ms": 10.0, "completion_tokens": 10},
        {"run": "t", "request": 1, "prompt": 1, "status": 200, "scheduled_s": 0.0, "start_s": 0.0,
         "latency_ms": 300.0, "ttft_ms": 30.0, "completion_tokens": 30},
        {"run": "t", "request": 2, "prompt": 2, "status": 503, "error": "overloaded", "scheduled_s": 0.0,
         "start_s": 0.0, "latency_ms": 1.0},
    ]  # fmt: skip
    s = summarize(pa.Table.from_pylist(rows, schema=LOADGEN_SCHEMA), seconds=2.0)
    assert (s["requests"], s["errors"], s["tokens"], s["tokens_per_s"]) == (3, 1, 40, 20.0)
    assert s["p50_ms"] == 200.0 and s["ttft_p50_ms"] == 20.0


def test_serve_config_file_is_valid_and_binds_loopback():
    from ray.serve.schema import ServeDeploySchema

    from speed.config import from_dict
    from speed.serve.settings import ServeSettings

    config = ServeDeploySchema.model_validate(yaml.safe_load((repo_root() / "jobs/configs/serve.yaml").read_text()))
    assert config.http_options.host == "127.0.0.1"
    (app,) = config.applications
    assert app.import_path == "speed.serve.app:build_app"
    (deployment,) = app.deployments
    assert deployment.name == "SpeedServer"
    from_dict(ServeSettings, deployment.user_config)  # every key is a setting


def test_serve_settings_reject_unknown_and_bad_values():
    from speed.config import from_dict
    from speed.serve.settings import ServeSettings

    with pytest.raises(ValueError, match="unknown ServeSettings key"):
        from_dict(ServeSettings, {"max_actives": 3})
    with pytest.raises(ValueError, match="row_budget"):
        ServeSettings(row_budget=0)
    with pytest.raises(ValueError, match="exceeds max_target_len"):
        ServeSettings(max_tokens=200, max_target_len=100)
    with pytest.raises(ValueError, match="unknown task"):
        ServeSettings(task="nope")


@pytest.mark.parametrize(
    "field, value, says",
    [
        ("launch_loop", 0, "ServeSettings: launch_loop must be an integer >= 1"),
        ("invalidation", "lazy", "ServeSettings: invalidation must be one of"),
        ("branches", -1, "ServeSettings: branches must be an integer >= 0"),
        ("branches", 1.5, "ServeSettings: branches must be an integer >= 0"),
        ("branch_depth", 0, "ServeSettings: branch_depth must be an integer >= 1"),
        ("branch_below", 0.0, "ServeSettings: branch_below must be a number in \\(0, 1\\]"),
        ("min_confidence", 1.2, "ServeSettings: min_confidence must be a number in \\[0, 1\\]"),
        ("min_confidence", True, "ServeSettings: min_confidence must be a number"),
    ],
)
def test_serve_settings_check_the_levers(field, value, says):
    from speed.serve.settings import ServeSettings

    with pytest.raises(ValueError, match=says):
        ServeSettings(**{field: value})


def test_serve_settings_levers_are_set_and_checked_against_the_model():
    from speed.config import from_dict
    from speed.serve.settings import ServeSettings

    s = from_dict(ServeSettings, {"branches": 6, "branch_depth": 2, "min_confidence": 0.5})
    assert s.speculation == Speculation(branches=6, branch_depth=2, min_confidence=0.5)
    s.check_model(6)
    with pytest.raises(ValueError, match=r"ServeSettings: branches must be in 0\.\.3 \(the model's loops\), got 6"):
        s.check_model(3)
    with pytest.raises(ValueError, match=r"ServeSettings: launch_loop must be in 1\.\.3 \(the model's loops\)"):
        ServeSettings(launch_loop=4).check_model(3)


def test_bench_ratios_and_table_against_the_bars():
    from speed.benchmarks.serving import ServeBenchResult, format_table, ratios

    def s(tps, p50):
        return {"tokens_per_s": tps, "p50_ms": p50, "p99_ms": 2 * p50, "ttft_p50_ms": None, "requests": 8, "errors": 0}

    summary = {("a", 1): s(10, 100), ("b", 1): s(10, 100), ("c", 1): s(20, 50)}
    summary |= {("a", 16): s(10, 1600), ("b", 16): s(100, 160), ("c", 16): s(94, 170)}
    r = ratios(summary)
    assert r == {
        "c_over_a_tokens_per_s_at_16": 9.4,
        "c_over_b_tokens_per_s_at_1": 2.0,
        "c_over_b_tokens_per_s_at_16": 0.94,
        "c_over_b_p50_at_1": 0.5,
    }
    table = format_table(ServeBenchResult(pa.table({}), summary, pa.table({}), 0, ratios=r))
    assert "c_over_b_tokens_per_s_at_16 = 0.94 (bar >= 0.95: NOT met)" in table
    assert "c_over_b_p50_at_1 = 0.50 (bar <= 0.6: met)" in table
    assert "| (c) continuous batching, SPEED | 16 | 94.0 | 170 | 340 |  |  | 8 | 0 |  |  |" in table


def test_bench_variant_d_ratios_and_engine_counts_per_run():
    """Variant (d) is compared with (c) (no bar); steps and rows per token come from the replicas' rows of each
    run's answered requests, joined on the request id."""
    from speed.benchmarks.serving import (
        ServeBenchConfig,
        ServeBenchResult,
        engine_counts,
        format_table,
        per_token,
        ratios,
    )

    assert ServeBenchConfig(checkpoint="x").levers() is None
    assert ServeBenchConfig(checkpoint="x", branches=6).levers() == Speculation(branches=6)
    assert ServeBenchConfig(checkpoint="x", launch_loop=2).plain() == Speculation(launch_loop=2)
    requests = pa.table({"run": ["c-c1-r0", "c-c1-r0", "d-c1-r0", "d-c1-r0"], "request_id": ["1", "2", "3", None]})
    served = pa.table(
        {"request_id": ["3", "1", "2", "9"], "steps": [30, 12, 8, 99], "rows": [90, 40, 20, 999]}
        | {"completion_tokens": [10, 6, 4, 50]}
    )
    counts = engine_counts(requests, served)
    assert counts == {
        "c-c1-r0": {"steps": 20, "rows": 60, "tokens": 10},
        "d-c1-r0": {"steps": 30, "rows": 90, "tokens": 10},
    }
    assert per_token(list(counts.values())) == {"steps_per_token": 2.5, "rows_per_token": 7.5}
    assert per_token([{"steps": 0, "rows": 0, "tokens": 0}]) == {"steps_per_token": None, "rows_per_token": None}

    def s(tps, p50, steps):
        return {"tokens_per_s": tps, "p50_ms": p50, "p99_ms": p50, "ttft_p50_ms": None, "requests": 4, "errors": 0,
                "steps_per_token": steps, "rows_per_token": 2 * steps}  # fmt: skip

    summary = {("a", 1): s(10, 100, 6.0), ("b", 1): s(10, 100, 6.0), ("c", 1): s(20, 50, 2.0), ("d", 1): s(25, 40, 1.5)}
    r = ratios(summary)
    assert r["d_over_c_tokens_per_s_at_1"] == 1.25 and r["d_over_c_p50_at_1"] == 0.8
    table = format_table(ServeBenchResult(pa.table({}), summary, pa.table({}), 0, ratios=r))
    assert "| (d) continuous batching, SPEED with branches | 1 | 25.0 | 40 | 40 |  |  | 4 | 0 | 1.50 | 3.00 |" in table
    assert "- d_over_c_tokens_per_s_at_1 = 1.25\n" in table


def test_unanswered_requests_are_counted_apart_from_differing_answers():
    """A request that timed out is no different answer: the prompts the variants answered are compared, the
    unanswered counted apart and said in the table; a differing answer is still a mismatch."""
    from speed.benchmarks.serving import ServeBenchResult, answer_mismatches, format_table

    texts = {(0, 16, 0): {"a": "x", "b": "x", "c": "x"}, (0, 16, 1): {"a": None, "b": "y", "c": "y"},
             (0, 16, 2): {"a": None, "b": None, "c": "z"}}  # fmt: skip
    assert answer_mismatches(texts) == (0, 3)
    texts[(0, 16, 0)]["c"] = "w"
    assert answer_mismatches(texts) == (1, 3)
    table = format_table(ServeBenchResult(pa.table({}), {}, pa.table({}), 0, unanswered=3))
    assert "- answers identical across variants: yes (0 prompts differ)" in table
    assert "- 3 requests unanswered (the errors column; not compared" in table


def test_soak_config_bodies_and_the_row_check():
    from speed.loadtest.soak import SOAK_KINDS, SOAK_SCHEMA, SoakConfig, SoakResult, request_body

    for bad in ({"url": "localhost:8000"}, {"minutes": 0}, {"concurrency": 0}, {"prompts": ()}):
        with pytest.raises(ValueError):
            SoakConfig(**bad)
    config = SoakConfig(max_tokens=5, abandon_tokens=50, body={"task": "translate_en_de"}, seed=10)
    bodies = {kind: request_body(kind, 3, config) for kind in SOAK_KINDS}
    assert bodies["greedy"] == {"task": "translate_en_de", "prompt": config.prompts[0], "max_tokens": 5}
    assert bodies["sampled"]["seed"] == 13 and bodies["n2"]["n"] == 2 and bodies["stop"]["stop"]
    assert bodies["streamed"]["stream"] and bodies["abandoned"]["max_tokens"] == 50
    with pytest.raises(ValueError, match="unknown soak kind"):
        request_body("huge", 0, config)

    def row(i, kind, status=200, error=None, rid=None, choices=1, minute=0):
        return {"request": i, "kind": kind, "minute": minute, "status": status, "error": error,
                "request_id": rid, "choices": choices, "latency_ms": 10.0 + i}  # fmt: skip

    table = pa.Table.from_pylist(
        [
            row(0, "greedy", rid="a"),
            row(1, "n2", rid="b", choices=2),
            row(2, "abandoned", rid="c", minute=1),
            row(3, "sampled", status=503, error="overloaded", choices=0, minute=1),
            row(4, "streamed", status=0, error="ClientOSError: reset", choices=0, minute=1),
        ],
        SOAK_SCHEMA,
    )
    result = SoakResult(table, 90.0, {"r1": 100}, {"r1": 108}, {0: {"r1": 104}, 1: {"r1": 2**20}})
    assert result.failures == 1 and abs(result.rss_growth - 0.08) < 1e-12
    assert abs(result.rss_growth_after_warmup - (108 / 104 - 1)) < 1e-12  # from the first minute's last read
    assert SoakResult(table, 50.0, {"r1": 100}, {"r1": 108}, {0: {"r1": 104}}).rss_growth_after_warmup is None
    assert result.errors() == {"sampled: HTTP 503 (intended)": 1, "streamed: ClientOSError": 1}
    assert [(m["minute"], m["requests"], m["answered"], m["failures"], m["rss_mib"]) for m in result.per_minute()] == [
        (0, 2, 2, 0, 104 / 2**20),
        (1, 3, 1, 1, 1.0),
    ]
    stats = pa.table({"request_id": ["a", "b", "c", "x"], "finish_reason": ["length", "stop", "cancelled", "stop"]})
    check = result.check_rows(stats)  # b has one row of its two choices; x is other traffic
    assert (check.answered, check.found, check.missing, check.abandoned, check.cancelled_rows) == (4, 3, ("b",), 1, 1)
    assert not check.complete


def test_a_replicas_settings_take_its_devices_defaults_where_user_config_sets_none():
    """Serve: SPEED's settings the user_config leaves out follow the replica's device (speed.engine.defaults:
    runner-up branches with lanes on a GPU, plain SPEED on a CPU); a key the user_config sets wins."""
    from types import SimpleNamespace

    from speed.serve.app import SpeedServer
    from speed.serve.settings import ServeSettings

    settings = SpeedServer.func_or_class._settings
    gpu = SimpleNamespace(device="cuda", model=SimpleNamespace(n_loops=3))
    cpu = SimpleNamespace(device="cpu", model=SimpleNamespace(n_loops=3))
    assert (settings(gpu, {}).branches, settings(gpu, {}).branch_depth) == (3, 3)
    assert (settings(gpu, {"branches": 1}).branches, settings(gpu, {"branches": 1}).branch_depth) == (1, 3)
    assert settings(gpu, {"max_active": 4}).max_active == 4
    assert settings(gpu, {}).allow_branches and not settings(cpu, {}).allow_branches  # side entries where they win
    assert settings(gpu, {"allow_branches": False}).speculation == ServeSettings().speculation  # none of the GPU's
    assert settings(cpu, {"branches": 2}).allow_branches  # a default asking for branches allocates them
    assert settings(cpu, None).speculation == settings(cpu, {}).speculation == ServeSettings().speculation


def test_a_deployment_without_branches_holds_no_side_entries_and_refuses_a_branches_request():
    """``allow_branches`` off (a CPU's default): the engine's memory need has no side entries and a request asking
    for branches is a 400 naming the setting to deploy with; on: side entries, and branches decode the sequential
    tokens bit for bit."""
    from speed.serve.planning import plan_request
    from speed.serve.protocol import BadRequest, CompletionRequest
    from speed.serve.settings import ServeSettings

    torch.manual_seed(0)
    model = SpeedT5(preset("tiny", pattern="2x3", vocab_size=64)).eval()
    size = {"max_active": 2, "max_source_len": 8, "max_target_len": 8, "max_tokens": 8}
    off = ServeSettings.on_device("cpu", 3, size)
    on = ServeSettings.on_device("cpu", 3, {**size, "allow_branches": True})
    stepper = as_stepper(model)
    for settings, allowed in ((off, False), (on, True)):
        c = settings.engine_config()
        assert c.branches is allowed and settings.allow_branches is allowed
        need = stepper.memory_need(c.max_active, c.max_prompt_len, c.max_target_len, c.branches)
        assert (need.side > 0) is allowed
    body = CompletionRequest.model_validate({"prompt": [5, 6, 7, 1], "branches": 2, "branch_depth": 2})
    with pytest.raises(BadRequest) as refused:
        plan_request(body, off, None, "m")
    err = refused.value
    assert (err.status, err.param) == (400, "branches") and "\n" not in err.message
    assert "deploy it with allow_branches: true" in err.message
    sequential = CompletionRequest.model_validate({"prompt": [5, 6, 7, 1], "method": "sequential", "branches": 2})
    assert plan_request(sequential, off, None, "m").requests[0].method == "sequential"  # no branches asked of it
    engine = Engine(model, on.engine_config())
    engine.add(plan_request(body, on, None, "m").requests[0])
    finished = []
    while engine.has_work:
        finished += engine.step().finished
    want = generate(
        model, torch.tensor([[5, 6, 7, 1]]), options=DecodeOptions(method="sequential", max_new_tokens=8)
    ).tokens[0]
    assert finished[0].tokens == want


def test_the_dtype_option_reaches_the_deployment_and_names_only_what_it_can_load():
    """``jobs/serve.py --dtype`` is ``AppConfig.dtype`` by name (float32 unless given); ``AppConfig`` and
    ``build_app`` refuse a dtype other than float32 and bfloat16 before any replica starts."""
    import importlib.util

    from speed.serve.app import build_app
    from speed.serve.settings import AppConfig

    spec = importlib.util.spec_from_file_location("serve_job", repo_root() / "jobs" / "serve.py")
    job = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(job)
    assert job.parse_args(["--checkpoint", "x"]).dtype == "float32" == AppConfig("x").dtype
    assert job.parse_args(["--checkpoint", "x", "--dtype", "bfloat16"]).dtype == "bfloat16"
    with pytest.raises(SystemExit):
        job.parse_args(["--checkpoint", "x", "--dtype", "float16"])
    with pytest.raises(ValueError, match="AppConfig.dtype must be one of"):
        AppConfig("x", dtype="float16")
    # a GPU replica must ask Ray for its GPU (jobs/serve.py's --num-gpus sets device cuda); the engine then runs
    # its passes in row-count buckets there (speed.engine.graphs), with the statistics and metrics of the CPU's
    assert AppConfig("x", device="cuda", num_gpus=1).device == "cuda"
    with pytest.raises(ValueError, match="needs num_gpus > 0"):
        AppConfig("x", device="cuda")
    with pytest.raises(ValueError, match="auto, cpu or cuda"):
        AppConfig("x", device="gpu")
    with pytest.raises(ValueError, match="dtype='half': choose one of"):
        build_app({"checkpoint": "x", "dtype": "half"})


def test_a_served_model_whose_weights_and_engine_do_not_fit_is_refused_before_it_is_read(tmp_path, monkeypatch):
    """``load_served_model`` checks the weights and, on a CPU, the engine the deployment's settings ask for
    (``host_capacity``) against the memory available (faked: ``SPEED_MEMORY_LIMIT``): one line before a tensor is
    read where the weights fit and the engine does not; a GPU replica's engine is not the host's."""
    from imported_helpers import one_line, write_chat_ouro

    from speed.engine.memory import MEMORY_LIMIT_ENV, MemoryBudgetError, size
    from speed.models.form import FORMS
    from speed.models.pretrained import check_load
    from speed.serve.settings import ServeSettings, host_capacity, load_served_model

    directory = str(write_chat_ouro(tmp_path / "Ouro-tiny"))
    user_config = {"max_active": 8, "max_source_len": 200, "max_target_len": 100, "max_tokens": 50}
    capacity = host_capacity("cpu", user_config)
    assert capacity == ServeSettings(**user_config).engine_config() and host_capacity("cuda", user_config) is None
    monkeypatch.setenv(MEMORY_LIMIT_ENV, str(2**40))
    weights, served = check_load(directory), check_load(directory, capacity=capacity)
    assert served.weights == weights.total and served.cache > 0
    monkeypatch.setenv(MEMORY_LIMIT_ENV, str(weights.total + served.allocated // 2))  # the weights fit, not the cache
    with monkeypatch.context() as patch:  # the form's loader fails the test if it is called
        patch.setattr(FORMS["ouro"], "load", lambda *a, **k: pytest.fail("read before the memory check"))
        with pytest.raises(MemoryBudgetError) as error:
            load_served_model(directory, "cpu", user_config=user_config)
    assert one_line(error).startswith(f"Ouro-tiny as float32 needs {size(served.total)} (weights ")
    small = {"max_active": 1, "max_source_len": 16, "max_target_len": 16, "max_tokens": 16}  # one block
    assert load_served_model(directory, "cpu", user_config=small).family.name == "lm"


def test_the_initial_state_seed_reaches_the_deployment_and_is_checked():
    """``jobs/serve.py --initial-state-seed`` is ``AppConfig.initial_state_seed`` by name (None: zero); ``AppConfig``
    and ``build_app`` check it before any replica starts."""
    import importlib.util

    from speed.serve.app import build_app
    from speed.serve.settings import AppConfig

    spec = importlib.util.spec_from_file_location("serve_job", repo_root() / "jobs" / "serve.py")
    job = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(job)
    assert job.parse_args(["--checkpoint", "x"]).initial_state_seed is None is AppConfig("x").initial_state_seed
    assert job.parse_args(["--checkpoint", "x", "--initial-state-seed", "7"]).initial_state_seed == 7
    with pytest.raises(ValueError, match="AppConfig.initial_state_seed must be an integer >= 0 or null, got -1"):
        AppConfig("x", initial_state_seed=-1)
    with pytest.raises(ValueError, match="initial_state_seed"):
        build_app({"checkpoint": "x", "initial_state_seed": "seven"})
