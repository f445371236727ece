"""Reading serving statistics back: a storage path's Parquet files and the records still in this node's logs.

``read_requests`` / ``read_traces`` read what ``speed.serve.sink`` wrote under a storage path (local or a URI):
the Parquet files, and the write-ahead logs on this node that no Parquet file replaces yet (a log's torn last
batch is dropped).
"""

from __future__ import annotations

from pathlib import Path

import pyarrow as pa
import pyarrow.dataset as pads

from speed.serve.schemas import REQUEST_SCHEMA, REQUESTS_DIR, SERVE_TRACE_SCHEMA, TRACES_DIR
from speed.serve.sink import log_folder, read_log
from speed.storage import locate


def _read(storage: str, folder: str, schema: pa.Schema) -> pa.Table:
    where = locate(storage)
    files, wal, suffix = where / folder, log_folder(storage), f".{folder}.arrows"
    for _ in range(3):
        # Logs listed first: a log compacted after this listing has its Parquet file in the one below.
        logs = sorted(str(p) for p in wal.glob(f"*{suffix}"))
        table, written = schema.empty_table(), set()
        if files.exists():
            dataset = pads.dataset(files.path, schema=schema, format="parquet", filesystem=where.fs)
            table, written = dataset.to_table(), {Path(f).name for f in dataset.files}
        try:
            logged = [
                batch
                for log in logs
                if Path(log).name.removesuffix(suffix) + ".parquet" not in written
                for batch in read_log(log, schema)
            ]
        except FileNotFoundError:  # compacted between the two listings: list again
            continue
        return pa.concat_tables([table, pa.Table.from_batches(logged, schema)]) if logged else table
    raise RuntimeError(f"{storage}: the statistics kept changing while they were read")


def read_requests(storage: str) -> pa.Table:
    """Every request record written under ``storage`` (``REQUEST_SCHEMA``), the records logged on this node
    included;
    empty if none."""
    return _read(storage, REQUESTS_DIR, REQUEST_SCHEMA)


def read_traces(storage: str) -> pa.Table:
    """Every trace record written under ``storage`` (``SERVE_TRACE_SCHEMA``), the records logged on this node
    included;
    empty if none."""
    return _read(storage, TRACES_DIR, SERVE_TRACE_SCHEMA)
