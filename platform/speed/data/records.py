"""Reading a task split into columns ``source``/``target`` (task prefix applied) or ``text``.

Local files and downloaded hub splits are read as Arrow tables and cut to the
task's fields with Arrow compute; streamed hub splits record by record.
Empty or whitespace-only records are skipped and counted. A record without a
field is a ``RecordError`` naming the field and, for files, the file and line.
"""

from __future__ import annotations

import gzip
import json
import logging
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.json as pj
import pyarrow.parquet as pq

from speed.data.sources import PARQUET_SUFFIX, Source, resolve_source
from speed.data.tasks import Task, get_task

if TYPE_CHECKING:
    import datasets

log = logging.getLogger(__name__)


class RecordError(ValueError):
    """A record that cannot be read: the message names the field and where the record is."""


@dataclass
class Records:
    """The records of one task split and what reading them found."""

    dataset: datasets.Dataset | datasets.IterableDataset  # IterableDataset only for an unbounded hub stream
    source: Source
    read: int | None  # records read (None: an unbounded stream, read lazily)
    skipped: int | None  # empty or whitespace-only records dropped (None: an unbounded stream)


def load_records(
    task: str, split: str, source: str | Sequence[str] | None = None, limit: int | None = None
) -> datasets.Dataset | datasets.IterableDataset:
    """Columns ``source``/``target`` (prefix applied) or ``text`` (pretraining) of a task split.

    The first ``limit`` usable records when given. An unbounded hub stream
    (``pretrain`` from ``allenai/c4`` without ``limit``) returns a lazy
    ``datasets.IterableDataset``.
    """
    return read_records(task, split, source, limit).dataset


def read_records(
    task: str | Task, split: str, source: str | Sequence[str] | None = None, limit: int | None = None
) -> Records:
    """``load_records`` plus where the records came from and how many were read and skipped."""
    import datasets  # only when records are read: decoding, serving and the GPU machine go without it

    task = get_task(task) if isinstance(task, str) else task
    if limit is not None and limit < 1:
        raise ValueError(f"limit must be positive or None, got {limit}")
    src = resolve_source(task, split, source)
    if src.files:
        table, read, skipped = _read_files(src.files, task)
    elif src.streaming:
        stream = datasets.load_dataset(src.hub_path, name=src.hub_config, split=split, streaming=True)
        if limit is None:
            return Records(_lazy_records(stream, task), src, None, None)
        table, read, skipped = _take_stream(stream, task, limit, f"{src} split {split!r}")
    else:
        hub = datasets.load_dataset(src.hub_path, name=src.hub_config, split=split)
        table = hub.with_format("arrow")[:]
        try:
            table, skipped = _extract(table, task)
        except _FieldProblem as p:
            raise RecordError(f"task {task.name!r}: {src} split {split!r}, record {p.row + 1}: {p.reason}") from None
        read = hub.num_rows
    if table.num_rows == 0:
        raise ValueError(
            f"task {task.name!r}: no usable records in {src} split {split!r} "
            f"({read} read, {skipped} empty or whitespace-only)"
        )
    if skipped:
        log.warning(
            "%s/%s: skipped %d empty or whitespace-only records of %d in %s", task.name, split, skipped, read, src
        )
    if limit is not None:
        table = table.slice(0, limit)
    return Records(datasets.Dataset(table), src, read, skipped)


class _FieldProblem(Exception):
    """A record (0-based ``row`` of a table) without a usable text field."""

    def __init__(self, row: int, reason: str) -> None:
        super().__init__(reason)
        self.row, self.reason = row, reason


def _read_files(files: tuple[Path, ...], task: Task) -> tuple[pa.Table, int, int]:
    """The task's columns from local files (empty records dropped), records read, records skipped."""
    import datasets
    from datasets.utils import logging as datasets_logging

    builder = "parquet" if files[0].name.endswith(PARQUET_SUFFIX) else "json"
    shown = datasets_logging.is_progress_bar_enabled()
    datasets_logging.disable_progress_bar()  # its bar reads "Generating train split" whatever the file: no failure
    try:
        loaded = datasets.load_dataset(builder, data_files=[str(f) for f in files], split="train")
        table = loaded.with_format("arrow")[:]
        extracted, skipped = _extract(table, task)
    except Exception as err:  # any failure is diagnosed again, record by record, to name the file and line
        where = _locate_problem(files, task)
        if where is not None:
            raise RecordError(f"task {task.name!r}: {where}") from err
        if builder == "json" and not any(line.strip() for path in files for _, line in _lines(path)):
            raise ValueError(f"task {task.name!r}: no records in {Source(files)}") from err
        if isinstance(err, _FieldProblem):
            raise RecordError(f"task {task.name!r}: {Source(files)}, record {err.row + 1}: {err.reason}") from None
        raise
    finally:
        if shown:
            datasets_logging.enable_progress_bar()
    return extracted, table.num_rows, skipped


def _extract(table: pa.Table, task: Task) -> tuple[pa.Table, int]:
    """The task's output columns, blank records dropped, and how many were blank."""
    if table.num_rows == 0:
        return pa.table({name: pa.array([], pa.string()) for name in task.columns}), 0
    columns = {name: _text_column(table, field) for name, field in task.columns.items()}
    blank = None
    for column in columns.values():
        empty = pc.equal(pc.utf8_length(pc.utf8_trim_whitespace(column)), 0)
        blank = empty if blank is None else pc.or_(blank, empty)
    if task.prefix:
        columns["source"] = pc.binary_join_element_wise(task.prefix, columns["source"], "")
    return pa.table(columns).filter(pc.invert(blank)), pc.sum(blank).as_py() or 0


def _text_column(table: pa.Table, field: str) -> pa.ChunkedArray:
    """The string column at dotted path ``field``; raises ``_FieldProblem`` at the first bad record."""
    head, *rest = field.split(".")
    if head not in table.column_names:
        raise _FieldProblem(0, f"record has no field {field!r} (fields: {table.column_names})")
    column = table.column(head)
    for key in rest:
        if not pa.types.is_struct(column.type) or column.type.get_field_index(key) < 0:
            raise _FieldProblem(0, f"record has no field {field!r}")
        column = pc.struct_field(column, key)
    if not (pa.types.is_string(column.type) or pa.types.is_large_string(column.type)):
        raise _FieldProblem(0, f"field {field!r} holds {column.type}, not text")
    if column.null_count:
        raise _FieldProblem(pc.index(pc.is_null(column), True).as_py(), f"record has no field {field!r}")
    return column


def _locate_problem(files: tuple[Path, ...], task: Task) -> str | None:
    """``"<file>, line <n>: <problem>"`` for the first unreadable record, or None if all are fine."""
    for path in files:
        if path.name.endswith(PARQUET_SUFFIX):
            try:
                _extract(pq.read_table(path), task)
            except _FieldProblem as p:
                return f"{path}, row {p.row + 1}: {p.reason}"
            except pa.ArrowException as err:
                return f"{path}: unreadable Parquet file ({err})"
            continue
        for lineno, line in _lines(path):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as err:
                return f"{path}, line {lineno}: invalid JSON ({err.msg})"
            for field in task.columns.values():
                problem = _record_problem(record, field)
                if problem:
                    return f"{path}, line {lineno}: {problem}"
    return None


def _lines(path: Path) -> Iterator[tuple[int, str]]:
    opener = gzip.open if path.name.endswith(".gz") else open
    with opener(path, "rt", encoding="utf-8") as f:
        yield from enumerate(f, start=1)


def _record_problem(record: Any, field: str) -> str | None:
    value = record
    for key in field.split("."):
        if not isinstance(value, dict) or key not in value:
            return f"record has no field {field!r}"
        value = value[key]
    if value is None:
        return f"record has no field {field!r} (null)"
    if not isinstance(value, str):
        return f"field {field!r} holds {type(value).__name__}, not text"
    return None


def _record_values(record: dict, task: Task, where: str) -> dict[str, str]:
    """One streamed record's output columns, before the prefix."""
    values = {}
    for name, field in task.columns.items():
        problem = _record_problem(record, field)
        if problem:
            raise RecordError(f"task {task.name!r}: {where}: {problem}")
        value = record
        for key in field.split("."):
            value = value[key]
        values[name] = value
    return values


def _usable(values: dict[str, str], task: Task) -> dict[str, str] | None:
    """The values with the task prefix applied, or None for a blank record."""
    if any(not value.strip() for value in values.values()):
        return None
    return {**values, "source": task.prefix + values["source"]} if task.prefix else values


def _take_stream(stream: datasets.IterableDataset, task: Task, limit: int, where: str) -> tuple[pa.Table, int, int]:
    """The first ``limit`` usable records of a stream, records read, records skipped."""
    rows: dict[str, list[str]] = {name: [] for name in task.columns}
    read = skipped = 0
    for read, record in enumerate(stream, start=1):
        values = _usable(_record_values(record, task, f"{where}, record {read}"), task)
        if values is None:
            skipped += 1
            continue
        for name, value in values.items():
            rows[name].append(value)
        if len(rows[next(iter(rows))]) == limit:
            break
    return pa.table({name: pa.array(col, pa.string()) for name, col in rows.items()}), read, skipped


def _lazy_records(stream: datasets.IterableDataset, task: Task) -> datasets.IterableDataset:
    """The task's columns of an unbounded stream, blank records dropped as they stream by."""
    log.info("%s: streaming without a limit; empty records are dropped lazily and not counted", task.name)
    columns = stream.column_names or list(next(iter(stream)).keys())
    return stream.map(_stream_batch, batched=True, with_indices=True, remove_columns=columns, fn_kwargs={"task": task})


def _stream_batch(batch: dict[str, list], indices: list[int], task: Task) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {name: [] for name in task.columns}
    for i, index in enumerate(indices):
        record = {key: column[i] for key, column in batch.items()}
        values = _usable(_record_values(record, task, f"streamed record {index + 1}"), task)
        if values is not None:
            for name, value in values.items():
                out[name].append(value)
    return out


# ----- streaming: the same columns, batch by batch, never the whole split in memory ------------------

_LINE_SUFFIXES = (".jsonl.gz", ".jsonl")  # JSON Lines: pyarrow streams them; .json may hold one array


@dataclass
class RecordCount:
    """Records read and blank records skipped so far by ``iter_records``."""

    read: int = 0
    skipped: int = 0


def iter_records(
    task: str | Task,
    split: str,
    source: str | Sequence[str] | None = None,
    limit: int | None = None,
    batch_size: int = 1000,
    count: RecordCount | None = None,
) -> Iterator[pa.Table]:
    """The columns of ``read_records`` in tables of ``batch_size`` usable records (the last may be short).

    Local JSON Lines and Parquet files stream block by block, so memory does
    not grow with the split; other sources are read as ``read_records`` does.
    Batches are cut at multiples of ``batch_size`` counted from the first
    record, whatever the file blocks. ``count`` (if given) accumulates records
    read and skipped; a split without a usable record is an error.
    """
    task = get_task(task) if isinstance(task, str) else task
    if limit is not None and limit < 1:
        raise ValueError(f"limit must be positive or None, got {limit}")
    count = RecordCount() if count is None else count
    src = resolve_source(task, split, source)
    if src.files and all(f.name.endswith((*_LINE_SUFFIXES, PARQUET_SUFFIX)) for f in src.files):
        tables = (t for path in src.files for t in _stream_file(path, task, count))
    else:
        records = read_records(task, split, source, limit)
        if records.read is None:
            raise ValueError(f"task {task.name!r} from {src} is an unbounded stream: pass a limit to read it")
        count.read, count.skipped = records.read, records.skipped
        tables = iter([records.dataset.with_format("arrow")[:]])
    yielded = 0
    for table in _rebatch(tables, batch_size):
        if limit is not None and yielded + table.num_rows >= limit:
            yield table.slice(0, limit - yielded)
            return
        yielded += table.num_rows
        yield table
    if yielded == 0:
        raise ValueError(f"task {task.name!r}: no usable records in {src} split {split!r} ({count.read} read)")


def _stream_file(path: Path, task: Task, count: RecordCount) -> Iterator[pa.Table]:
    """One file's task columns, blanks dropped, block by block; a bad record names its file and line."""
    try:
        if path.name.endswith(PARQUET_SUFFIX):
            batches: Iterable[pa.RecordBatch] = pq.ParquetFile(path).iter_batches()
        else:
            options = pj.ParseOptions(explicit_schema=_json_schema(task), unexpected_field_behavior="ignore")
            batches = pj.open_json(path, parse_options=options)
        for batch in batches:
            table, skipped = _extract(pa.Table.from_batches([batch]), task)
            count.read += batch.num_rows
            count.skipped += skipped
            yield table
    except (_FieldProblem, pa.ArrowException) as err:
        where = _locate_problem((path,), task)
        raise RecordError(f"task {task.name!r}: {where or f'{path}: {err}'}") from err


def _json_schema(task: Task) -> pa.Schema:
    """The task's fields as string columns (dotted paths become structs): all that is parsed of a record."""
    tree: dict = {}
    for field in task.columns.values():
        node = tree
        *heads, leaf = field.split(".")
        for key in heads:
            node = node.setdefault(key, {})
        node[leaf] = None

    def arrow_type(node: dict | None) -> pa.DataType:
        return pa.string() if node is None else pa.struct([(k, arrow_type(v)) for k, v in node.items()])

    return pa.schema([(key, arrow_type(node)) for key, node in tree.items()])


def _rebatch(tables: Iterable[pa.Table], size: int) -> Iterator[pa.Table]:
    """The rows of ``tables`` in order, re-cut into tables of exactly ``size`` rows (the last may be short)."""
    pending: list[pa.Table] = []
    held = 0
    for table in tables:
        pending.append(table)
        held += table.num_rows
        while held >= size:
            joined = pa.concat_tables(pending)
            yield joined.slice(0, size).combine_chunks()
            pending, held = [joined.slice(size)], held - size
    if held:
        yield pa.concat_tables(pending).combine_chunks()
