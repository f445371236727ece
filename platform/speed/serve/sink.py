"""The replica's statistics sink: records buffered, logged to a write-ahead log, written as Parquet; orphans compacted.

The files and their schemas are ``speed.serve.schemas``'s. A flush writes each buffer as one new file (one row
group), so files on object stores are never appended to and every file is readable while the replica runs.
Every record is also appended to a write-ahead log on the local disk of the replica's node (an Arrow IPC stream,
one batch per request, written through to the OS before the answer leaves the replica), so a replica
killed hard (SIGKILL, a signal to its process group, an out-of-memory kill) loses no record it answered, whatever
the storage: the logs' folder (``log_folder``) is ``<storage>/wal`` on local storage and, for a URI, a folder
of the node's spool (``speed.paths.spool_dir``: ``$SPEED_SPOOL_DIR``, else ``~/.cache/speed/spool``) named by
a digest of the URI, whose ``destination`` file names the URI. A flush writes Parquet file ``n`` (on an object
store one upload, which appears whole) and then deletes log ``n``; a new sink turns the logs of dead replicas
on its node into their Parquet files (``compact_orphans``), and so does ``jobs/serve.py`` once its replicas
are gone. What a node takes with it when it disappears with its disk is only what its logs held: on an object
store, each replica's records not uploaded yet (its buffer: under ``max_records`` records, none older than
``max_seconds`` while uploads keep up, plus a flush still uploading). A record that does not fit
``REQUEST_SCHEMA`` (or trace records that do not fit theirs) costs only itself: it is logged and set aside
under ``rejected/`` with the error, and the other records are written.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import logging
import os
import re
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from speed.paths import spool_dir
from speed.serve.schemas import (
    DESTINATION_FILE,
    REJECTED_DIR,
    REQUEST_SCHEMA,
    REQUESTS_DIR,
    SERVE_TRACE_SCHEMA,
    TRACES_DIR,
    WAL_DIR,
)
from speed.storage import Location, locate

log = logging.getLogger(__name__)


def file_tag(replica: str) -> str:
    """A replica id as a file-name prefix (Serve's ids hold characters like ``#``)."""
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", replica) or "replica"


def read_log(path: str, schema: pa.Schema) -> list[pa.RecordBatch]:
    """The complete record batches of a write-ahead log as ``schema``'s (a column it lacks, added since it was
    written, is null); a torn tail (a writer killed mid-record) is dropped."""
    batches: list[pa.RecordBatch] = []
    with pa.OSFile(path) as f:  # FileNotFoundError: compacted since it was listed
        try:
            reader = pa.ipc.open_stream(f)
            while True:
                batches.append(_conform(reader.read_next_batch(), schema))
        except StopIteration:
            pass
        except (pa.ArrowInvalid, OSError):  # the last batch (or the schema) was cut short
            pass
    return batches


def _conform(batch: pa.RecordBatch, schema: pa.Schema) -> pa.RecordBatch:
    """``batch`` with ``schema``'s columns, in order; one it lacks (a nullable column added later) is null."""
    if batch.schema.equals(schema):
        return batch
    have = set(batch.schema.names)
    columns = [batch.column(f.name) if f.name in have else pa.nulls(batch.num_rows, f.type) for f in schema]
    return pa.RecordBatch.from_arrays(columns, schema=schema)


@dataclass(frozen=True)
class Taken:
    """Buffered records swapped out of a sink, to be written as Parquet file ``number``."""

    requests: pa.Table
    traces: pa.Table
    number: int
    logs: list[_Log] = field(default_factory=list)  # theirs, held (locked) until the Parquet files replace them


class _Log:
    """One append-only Arrow IPC stream; every batch goes to the OS as it is written (no user-space buffer).
    Its writer holds an exclusive ``flock`` on it until it is deleted, which the OS releases when the writer
    dies however it dies: an unlocked log belongs to a dead replica (``compact_orphans``)."""

    def __init__(self, path: str, schema: pa.Schema) -> None:
        self.path = path
        self._file = pa.OSFile(path, "wb")
        fcntl.flock(self._file.fileno(), fcntl.LOCK_EX)
        self._writer = pa.ipc.new_stream(self._file, schema)

    def append(self, data: pa.RecordBatch | pa.Table) -> None:
        if isinstance(data, pa.Table):
            self._writer.write_table(data)
        else:
            self._writer.write_batch(data)

    def close_writer(self) -> None:
        """End the stream; the file (and its lock) stays open until ``release``."""
        self._writer.close()

    def release(self) -> None:
        """Delete the log and drop its lock (its records are in Parquet now)."""
        Path(self.path).unlink(missing_ok=True)
        self._file.close()

    def abandon(self) -> None:
        """Drop the lock and keep the log (its Parquet file could not be written): ``compact_orphans`` writes it."""
        self._file.close()


def _checked(data: pa.RecordBatch | pa.Table) -> pa.RecordBatch | pa.Table:
    """``data`` if no column its schema declares non-nullable holds a null (Arrow builds such columns
    without complaint; the Parquet files would then break the schema's promise), else ``ValueError``."""
    for f, column in zip(data.schema, data.columns):
        if not f.nullable and column.null_count:
            raise ValueError(f"{f.name}: null in a column that may not hold one")
    return data


def _write_parquet(final: Location, table: pa.Table) -> None:
    """One Parquet file (one row group) that appears whole: on local storage written under a dot name readers
    skip, then renamed; on an object store one upload (an object appears once its upload completes)."""
    if not final.local:
        pq.write_table(table, final.path, filesystem=final.fs, row_group_size=None)
        return
    with final.atomic() as partial:
        pq.write_table(table, partial, filesystem=final.fs, row_group_size=None)


def log_folder(storage: str) -> Path:
    """Where this node keeps the write-ahead logs of records bound for ``storage``: ``<storage>/wal`` for local
    storage; for a URI, ``<spool>/<digest of the URI>`` in this node's spool (``speed.paths.spool_dir``)."""
    return _log_folder(locate(storage))


def _log_folder(where: Location) -> Path:
    if where.local:
        return Path(where.path) / WAL_DIR
    return spool_dir() / hashlib.sha256(where.uri.rstrip("/").encode()).hexdigest()[:16]


def _make_log_folder(where: Location) -> Path:
    """``_log_folder(where)``, created; a spool folder gets its ``destination`` file (the URI) first."""
    folder = _log_folder(where)
    folder.mkdir(parents=True, exist_ok=True)
    marker = folder / DESTINATION_FILE
    if not where.local and not marker.exists():  # for whoever finds the folder: where its records go
        partial = folder / f".{DESTINATION_FILE}.{os.getpid()}"
        partial.write_text(where.uri.rstrip("/") + "\n")
        partial.replace(marker)  # appears whole: replicas starting together on one node write the same text
    return folder


def write_ahead_logs(storage: str) -> list[str]:
    """The write-ahead logs on this node of records bound for ``storage`` (not in Parquet yet), sorted."""
    return sorted(str(p) for p in log_folder(storage).glob("*.arrows"))


def compact_orphans(storage: str, wait_s: float = 0.0) -> int:
    """Turn the logs on this node of dead replicas (a hard kill, or a failed write, leaves them; no live writer
    holds their lock) into the Parquet files they stand for, on local storage or uploaded to the object store,
    so that readers of the Parquet files alone (the notebooks, pandas, DuckDB, other nodes) see their records too;
    returns the logs compacted. A new replica calls it when it starts, ``jobs/serve.py`` when it stops, with
    ``wait_s``: how long to wait for the writers still holding a log to end (replicas being stopped) before
    leaving their logs as they are."""
    where, deadline = locate(storage), time.monotonic() + wait_s
    compacted, held = _compact(where)
    while held and time.monotonic() < deadline:
        time.sleep(0.1)
        more, held = _compact(where)
        compacted += more
    return compacted


def _compact(where: Location) -> tuple[int, int]:
    """One pass of ``compact_orphans``: (logs compacted, logs a live writer holds)."""
    compacted, held = 0, 0
    for log in sorted(_log_folder(where).glob("*.arrows")):
        stem, folder, _ = log.name.rsplit(".", 2)
        schema = {REQUESTS_DIR: REQUEST_SCHEMA, TRACES_DIR: SERVE_TRACE_SCHEMA}.get(folder)
        if schema is None:
            continue
        try:
            fd = os.open(log, os.O_RDONLY)
        except FileNotFoundError:
            continue  # compacted or written meanwhile
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                held += 1  # its replica is alive
                continue
            final = where / folder / f"{stem}.parquet"
            if not log.exists() or os.stat(log).st_ino != os.fstat(fd).st_ino:
                continue  # replaced by its Parquet file between the listing and the lock
            if not final.exists():  # else its writer died between the Parquet file's write and the log's deletion
                batches = read_log(str(log), schema)
                if batches:
                    _write_parquet(final, pa.Table.from_batches(batches, schema))
            log.unlink()
            compacted += 1
        finally:
            os.close(fd)
    return compacted, held


class StatsSink:
    """Buffers request and trace records of one replica; writes them as Parquet on a size or time bound.

    ``add`` never writes Parquet (it appends the records to the write-ahead log of
    the current file, in ``log_folder``, on this node's disk); the owner calls
    ``flush`` when ``due()`` (and on shutdown), or ``take`` and then ``write``
    from another thread: ``take`` swaps the buffers out first, so records added
    during a write go into the next file.
    """

    def __init__(
        self,
        storage: str,
        replica: str,
        max_records: int = 256,
        max_seconds: float = 30.0,
        clock: Callable[[], float] = time.monotonic,  # seconds, for the time bound (a test's advances by hand)
    ) -> None:
        if max_records < 1 or max_seconds <= 0:
            raise ValueError(f"flush bounds must be positive, got max_records={max_records}, max_seconds={max_seconds}")
        self.storage = locate(storage)
        self.tag = file_tag(replica)
        self.max_records, self.max_seconds = max_records, max_seconds
        self.set_aside = 0  # records that did not fit their schema (written under rejected/)
        self._requests: list[pa.RecordBatch] = []  # one record each, checked against REQUEST_SCHEMA
        self._traces: list[pa.Table] = []
        self._clock = clock
        self._since = clock()
        self._files = 1  # the number of the file the buffered records will be written as
        self._logs: dict[str, _Log] = {}
        self._abandoned = False  # a write failed and left its logs: the next write or flush compacts them
        for folder in (REQUESTS_DIR, TRACES_DIR):
            (self.storage / folder).makedirs()
        self.log_folder = _make_log_folder(self.storage)
        _compact(self.storage)  # compact_orphans: the logs of replicas that died on this node

    @property
    def pending(self) -> int:
        """Request records waiting for the next flush."""
        return len(self._requests)

    def add(self, request: dict[str, Any], trace: pa.Table | None) -> None:
        """Buffer (and log) one request record (``REQUEST_SCHEMA`` keys) and its trace records
        (``SERVE_TRACE_SCHEMA``).

        A record that does not fit its schema (a missing key, a wrong type, a null where none may be) is set
        aside with its trace records: logged and written under ``rejected/`` with the error, never buffered, so
        that the other records are written."""
        try:
            record = _checked(pa.RecordBatch.from_pylist([request], REQUEST_SCHEMA))
            if trace is not None and trace.num_rows:
                trace = _checked(trace.select(SERVE_TRACE_SCHEMA.names).cast(SERVE_TRACE_SCHEMA))
        except Exception as err:  # whatever the record holds: it must not break the writes of the others
            self._set_aside(request, trace, err)
            return
        if not self._requests:
            self._since = self._clock()
        if trace is not None and trace.num_rows:
            self._log(TRACES_DIR, SERVE_TRACE_SCHEMA).append(trace)  # before the request record, which closes it
            self._traces.append(trace)
        self._log(REQUESTS_DIR, REQUEST_SCHEMA).append(record)
        self._requests.append(record)

    def due(self) -> bool:
        """Whether the buffer reached ``max_records`` or holds records older than ``max_seconds``."""
        return bool(self._requests) and (
            len(self._requests) >= self.max_records or self._clock() - self._since >= self.max_seconds
        )

    def take(self) -> Taken | None:
        """Swap the buffers out (and close their logs); None when empty."""
        if not self._requests:
            return None
        requests = pa.Table.from_batches(self._requests, REQUEST_SCHEMA)
        traces = pa.concat_tables(self._traces) if self._traces else SERVE_TRACE_SCHEMA.empty_table()
        for log in self._logs.values():
            log.close_writer()
        taken = Taken(requests, traces, self._files, list(self._logs.values()))
        self._requests, self._traces, self._logs = [], [], {}
        self._files += 1
        return taken

    def write(self, taken: Taken) -> None:
        """Write taken records as one new Parquet file each (a single row group), then delete their logs. A write
        that fails (an object store out of reach) raises and leaves its logs, unlocked: the sink's next write
        or flush that succeeds (the last one on shutdown included), or any ``compact_orphans`` on this node,
        writes them."""
        name = f"{self.tag}-{taken.number:06d}"
        try:
            for folder, table in ((TRACES_DIR, taken.traces), (REQUESTS_DIR, taken.requests)):
                if table.num_rows:
                    _write_parquet(self.storage / folder / f"{name}.parquet", table)
        except BaseException:
            for log in taken.logs:
                log.abandon()
            self._abandoned = True
            raise
        for log in taken.logs:
            log.release()
        self._write_abandoned()

    def flush(self) -> int:
        """Write whatever is buffered now (and the logs of failed writes); returns the request records written."""
        taken = self.take()
        if taken is None:
            self._write_abandoned()
            return 0
        self.write(taken)
        return taken.requests.num_rows

    def _write_abandoned(self) -> None:
        """After a failed write: write its logs (and any other orphans on this node) now."""
        if self._abandoned:
            _compact(self.storage)
            self._abandoned = False

    def _set_aside(self, request: Any, trace: Any, err: Exception) -> None:
        """Log a record that does not fit its schema and write it, with its trace records and the error, to
        ``rejected/<replica>-<k>.json`` (as JSON; what JSON cannot hold as its ``str``)."""
        self.set_aside += 1
        rid = request.get("request_id") if isinstance(request, dict) else None
        where = self.storage / REJECTED_DIR / f"{self.tag}-{self.set_aside:06d}.json"
        log.error("statistics record of %s set aside in %s: %s: %s", rid, where.uri, type(err).__name__, err)
        traces = trace.to_pylist() if isinstance(trace, pa.Table) else trace
        set_aside = {"error": f"{type(err).__name__}: {err}", "request": request, "trace": traces}
        try:
            (self.storage / REJECTED_DIR).makedirs()
            where.write_text(json.dumps(set_aside, default=str))
        except Exception:  # the set-aside file is a courtesy: the answer and the other records come first
            log.exception("could not write %s", where.uri)

    def _log(self, folder: str, schema: pa.Schema) -> _Log:
        if folder not in self._logs:
            path = self.log_folder / f"{self.tag}-{self._files:06d}.{folder}.arrows"
            self._logs[folder] = _Log(str(path), schema)
        return self._logs[folder]
