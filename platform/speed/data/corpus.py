"""A tokenized corpus on storage: its folder layout, and memory-mapped reading by example index.

One prepared split (``speed.data.shards``) is one folder::

    shard-00000-00000.arrow ...   Arrow IPC files, uncompressed, so they map without a copy
    manifest.json                 what the folder holds (``Manifest``)
    _COMPLETE                     written last: a folder without it is never read

Source/target tasks store ``input_ids`` and ``labels`` (for the looped LM, kind ``prompted``: the chat prompt
and the answer). The LM's pretraining stores next-token rows (kind ``rows``: ``input_ids``, documents packed
end to end with EOS between them). T5's pretraining stores the
token runs (``tokens``) and span-corrupts them as a batch is read, with noise
drawn from ``(seed, epoch, example index)``: new each epoch, replayed exactly on
resume. Every row has ``length``, the tokens the example costs (inputs plus
targets, EOS included), known before any noise: the batch plan groups by it.
Workers memory-map the shards, so a worker's memory holds the batches it
trains on, not the corpus. The pages a read maps are unmapped again after it
(``MADV_DONTNEED``): the kernel maps generously around each fault, and a long
run would otherwise accumulate most of the corpus in the worker's resident
set; the page cache, shared by the workers of a node, still serves re-reads.
"""

from __future__ import annotations

import json
import mmap
import os
import shutil
import tempfile
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa

from speed.data.batching import corrupt_run
from speed.data.spans import noise_rng
from speed.storage import Location, locate

# Bump when the layout or the meaning of a column changes: old caches are then missed (2: an LM's texts and prompts
# start with the tokenizer's text prefix, an imported Huginn's BOS)
FORMAT_VERSION = 2
MANIFEST_FILE = "manifest.json"
COMPLETE_MARKER = "_COMPLETE"
TOKEN_LIST = pa.list_(pa.int32())
PAIRS_SCHEMA = pa.schema([("input_ids", TOKEN_LIST), ("labels", TOKEN_LIST), ("length", pa.int32())])
RUNS_SCHEMA = pa.schema([("tokens", TOKEN_LIST), ("length", pa.int32())])
ROWS_SCHEMA = pa.schema([("input_ids", TOKEN_LIST), ("length", pa.int32())])
SCHEMAS = {"pairs": PAIRS_SCHEMA, "prompted": PAIRS_SCHEMA, "runs": RUNS_SCHEMA, "rows": ROWS_SCHEMA}  # by kind


@dataclass(frozen=True)
class Shard:
    """One Arrow IPC file of a prepared split."""

    file: str  # name inside the split's folder
    rows: int  # examples
    records: int  # source records they came from


@dataclass(frozen=True)
class Manifest:
    """What a prepared split holds and how it was made (``manifest.json``)."""

    format: int
    key: str  # the cache key: corpus files, tokenizer bytes and settings
    spec: dict[str, Any]  # the CorpusSpec it was prepared with
    kind: str  # "pairs"/"prompted" (input_ids, labels), "runs" (T5 pretraining runs) or "rows" (LM input_ids)
    vocab_size: int  # the tokenizer's, sentinels included: sentinel i is vocab_size - 1 - i
    noise_density: float
    mean_span_length: float
    shards: tuple[Shard, ...]
    records: int  # usable records tokenized
    skipped: int  # blank records dropped
    seconds: float  # preparation wall time

    @property
    def examples(self) -> int:
        """Examples over all shards."""
        return sum(s.rows for s in self.shards)

    def to_json(self) -> str:
        """The manifest as JSON text."""
        return json.dumps(asdict(self), indent=1)

    @classmethod
    def from_json(cls, text: str) -> Manifest:
        """Parse ``manifest.json``."""
        data = json.loads(text)
        return cls(**{**data, "shards": tuple(Shard(**s) for s in data["shards"])})


def write_shard(path: Path, columns: dict[str, list], kind: str) -> None:
    """Write one shard (a single record batch) as an uncompressed Arrow IPC file."""
    schema = SCHEMAS[kind]
    table = pa.table({name: pa.array(columns[name], type=schema.field(name).type) for name in schema.names})
    with pa.OSFile(str(path), "wb") as sink, pa.ipc.new_file(sink, schema) as writer:
        writer.write_table(table.combine_chunks(), max_chunksize=max(1, table.num_rows))


@dataclass(frozen=True)
class _Segment:
    """One record batch of a mapped shard: list columns as (offsets, values) views over the file."""

    start: int  # global index of its first example
    lists: dict[str, tuple[np.ndarray, np.ndarray]]
    lengths: np.ndarray
    mapping: mmap.mmap  # the shard file's mapping, which these views point into


class TokenizedCorpus:
    """A prepared split, memory-mapped: example lengths for the batch plan, and examples by index."""

    def __init__(self, directory: str | Path) -> None:
        directory = Path(directory)
        if not (directory / COMPLETE_MARKER).is_file():
            raise FileNotFoundError(f"{directory} is not a complete prepared corpus (no {COMPLETE_MARKER})")
        self.directory = directory
        self.manifest = Manifest.from_json((directory / MANIFEST_FILE).read_text())
        self._segments: list[_Segment] = []
        start = 0
        for shard in self.manifest.shards:
            with open(directory / shard.file, "rb") as f:
                mapping = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
            table = pa.ipc.open_file(pa.py_buffer(mapping)).read_all()  # zero-copy: buffers point into the map
            for batch in table.to_batches():
                lists = {name: _list_views(batch.column(name)) for name in batch.schema.names if name != "length"}
                lengths = batch.column("length").to_numpy(zero_copy_only=True)
                self._segments.append(_Segment(start, lists, lengths, mapping))
                start += batch.num_rows
            mapping.madvise(mmap.MADV_DONTNEED)  # the footer and metadata pages reading it mapped
        self._starts = np.array([s.start for s in self._segments], dtype=np.int64)
        self._size = start

    def __len__(self) -> int:
        return self._size

    @property
    def lengths(self) -> MappedLengths:
        """Tokens each example costs (inputs + targets), indexable by arrays, as the batch plan needs."""
        return MappedLengths(self)

    def examples(self, indices: Sequence[int], epoch: int, seed: int) -> dict[str, list[list[int]]]:
        """Columns ``input_ids`` and ``labels`` of the examples at ``indices``; runs are corrupted for ``epoch``.

        Next-token rows (kind ``rows``) have ``input_ids`` only: their labels are their own next tokens.
        """
        m = self.manifest
        out: dict[str, list[list[int]]] = {"input_ids": []} if m.kind == "rows" else {"input_ids": [], "labels": []}
        indices = np.asarray(indices, dtype=np.int64)
        for index, segment_index, row in zip(indices.tolist(), *self._locate(indices)):
            segment = self._segments[segment_index]
            if m.kind == "runs":
                example = corrupt_run(
                    _row(segment, "tokens", row),
                    noise_rng(seed, epoch, index),
                    lambda i: m.vocab_size - 1 - i,
                    m.noise_density,
                    m.mean_span_length,
                )
            else:
                example = {name: _row(segment, name, row) for name in out}
            for name in out:
                out[name].append(example[name])
        self._unmap(indices)
        return out

    def _unmap(self, indices: np.ndarray) -> None:
        """Drop the pages that reading ``indices`` mapped (the values were copied out)."""
        segments, _ = self._locate(indices)
        for mapping in {id(m): m for m in (self._segments[i].mapping for i in np.unique(segments))}.values():
            mapping.madvise(mmap.MADV_DONTNEED)

    def _locate(self, indices: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(segment, row within it) of each global example index."""
        if indices.size and (indices.min() < 0 or indices.max() >= self._size):
            bad = indices[(indices < 0) | (indices >= self._size)][0]
            raise IndexError(f"example {bad} outside the corpus's {self._size}")
        segments = np.searchsorted(self._starts, indices, side="right") - 1
        return segments, indices - self._starts[segments]


class MappedLengths:
    """A corpus's example lengths, read from the mapped shards by index; never joined into one array."""

    def __init__(self, corpus: TokenizedCorpus) -> None:
        self._corpus = corpus

    def __len__(self) -> int:
        return len(self._corpus)

    def __getitem__(self, indices: Sequence[int] | np.ndarray) -> np.ndarray:
        """(k,) int32 lengths of the examples at ``indices``."""
        indices = np.asarray(indices, dtype=np.int64)
        segments, rows = self._corpus._locate(indices)
        out = np.empty(indices.shape, dtype=np.int32)
        for segment in np.unique(segments):
            chosen = segments == segment
            out[chosen] = self._corpus._segments[segment].lengths[rows[chosen]]
        self._corpus._unmap(indices)
        return out

    def __array__(self, dtype: np.dtype | None = None, copy: bool | None = None) -> np.ndarray:
        """All lengths as one array (a copy: for small corpora and checks)."""
        return np.concatenate([s.lengths for s in self._corpus._segments]).astype(dtype or np.int32)


def _list_views(column: pa.Array) -> tuple[np.ndarray, np.ndarray]:
    """(offsets, values) of a list<int32> column, zero-copy views of the mapped buffers."""
    return column.offsets.to_numpy(zero_copy_only=True), column.values.to_numpy(zero_copy_only=True)


def _row(segment: _Segment, name: str, row: int) -> list[int]:
    offsets, values = segment.lists[name]
    return values[offsets[row] : offsets[row + 1]].tolist()


def open_corpus(uri: str) -> TokenizedCorpus:
    """The prepared split at a local path or a URI (a remote one is first copied to this node's cache)."""
    where = locate(uri)
    if where.local:
        return TokenizedCorpus(where.path)
    return TokenizedCorpus(local_copy(where, Path(tempfile.gettempdir()) / "speed-data"))


def local_copy(split: Location, cache: Path) -> Path:
    """A complete local copy of the prepared split at ``split`` (remote storage), shared by the workers of a node.

    The folder's name holds its cache key, so a copy made once serves every
    later run; it is fetched under a temporary name and renamed when complete.
    """
    target = cache / split.path.rstrip("/").rsplit("/", 1)[-1]
    if (target / COMPLETE_MARKER).is_file():
        return target
    if not (split / COMPLETE_MARKER).is_file():
        raise FileNotFoundError(f"{split.path} is not a complete prepared corpus (no {COMPLETE_MARKER})")
    cache.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=cache))
    try:
        split.download(staging)
        os.replace(staging, target)  # fails if another worker got there first: its copy is as good
    except OSError:
        if not (target / COMPLETE_MARKER).is_file():
            raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target
