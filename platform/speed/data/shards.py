"""The data-preparation stage: tokenize a corpus split once into memory-mappable shards, cached on storage.

``prepare_corpus(spec, tokenizer_path, root)`` returns where the split lies
(``<root>/<task>-<split>-<key>``, laid out as ``speed.data.corpus`` reads it).
The key hashes the corpus (each file's path, size and modification time, or the
hub name), the tokenizer's bytes (``speed.hf_tokenizer.pack_tokenizer``) and every setting that changes the
tokens, so a training job, every worker and every trial of a sweep share one
preparation, and any change prepares anew. A folder without its completion
marker is never trusted: it is rebuilt.

Records stream from the files in chunks of ``MAP_BATCH`` (packing joins texts
within a chunk), so memory stays bounded by one shard. A source of several
local files is prepared file by file, in Ray tasks on this node when Ray is
running (each file becomes its own shards, in file order), else in-process;
either way the shards and their order are the same. The folder is staged under
a temporary name: on local storage it is renamed into place with the marker
inside; on remote storage the files are uploaded, then the marker last.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import socket
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import pyarrow as pa

from speed.data.batching import MAP_BATCH, check_encoding
from speed.data.corpus import COMPLETE_MARKER, FORMAT_VERSION, MANIFEST_FILE, Manifest, Shard, write_shard
from speed.data.encoders import PREPARATIONS, Preparation
from speed.data.records import RecordCount, iter_records
from speed.data.sources import PARQUET_SUFFIX, Source, resolve_source
from speed.data.tasks import Task, get_task
from speed.hf_tokenizer import load_tokenizer, pack_tokenizer
from speed.storage import Location, locate
from speed.tokenizer import TextTokenizer

DOCS_PER_SHARD = 50_000  # source records per shard: a few tens of MB of tokens, cheap to map and to copy
_PROGRESS_EVERY_S = 10.0


@dataclass(frozen=True)
class CorpusSpec:
    """Which split to tokenize and how: everything that changes the stored tokens (the seed does not)."""

    task: str
    split: str = "train"
    source: str | None = None  # as speed.data.load_records: None = the task's local corpus
    limit: int | None = None  # first N usable records
    max_source_len: int = 128
    max_target_len: int = 64
    pack: bool = False  # pretraining: join texts into full-length runs
    noise_density: float = 0.15  # pretraining: span corruption, applied when batches are read
    mean_span_length: float = 3.0
    family: str = "t5"  # how a model family's splits are prepared: a PREPARATIONS name (speed.models.family's)

    def __post_init__(self) -> None:
        check_encoding(get_task(self.task), self.max_source_len, self.max_target_len, self.pack)
        if self.limit is not None and self.limit < 1:
            raise ValueError(f"limit must be positive or None, got {self.limit}")
        if self.family not in PREPARATIONS:
            raise ValueError(f"unknown model family {self.family!r}; choose one of {sorted(PREPARATIONS)}")

    @property
    def preparation(self) -> Preparation:
        """How this family's splits are read and tokenized."""
        return PREPARATIONS[self.family]

    @property
    def encoder(self) -> type:
        """The encoder of this split's records (a pretraining task's texts, or source/target pairs)."""
        p = self.preparation
        return p.texts if get_task(self.task).is_pretrain else p.pairs

    @property
    def kind(self) -> str:
        """What the prepared split stores (``speed.data.corpus.Manifest.kind``)."""
        return self.encoder.kind

    @property
    def reading(self) -> Task:
        """The task as this family reads its records (the LM's instruction instead of T5's prefix)."""
        return self.preparation.read_task(get_task(self.task))


@dataclass(frozen=True)
class PreparedCorpus:
    """A prepared split on storage."""

    uri: str  # the split's folder (local path or URI): pass to speed.data.corpus.open_corpus
    manifest: Manifest
    cached: bool  # True: found complete on storage, nothing was tokenized


def cache_root(storage_path: str) -> str:
    """Where a job's prepared corpora live: ``<storage_path>/data``."""
    return f"{storage_path.rstrip('/')}/data"


def corpus_key(spec: CorpusSpec, tokenizer_bytes: bytes) -> str:
    """The cache key: a hash of the corpus's identity, the tokenizer's model bytes and the settings."""
    src = resolve_source(get_task(spec.task), spec.split, spec.source)
    if src.files:
        corpus: object = [[str(f.resolve()), f.stat().st_size, f.stat().st_mtime_ns] for f in src.files]
    else:
        corpus = str(src)
    spec_fields = asdict(spec)
    if not spec.preparation.keyed:
        spec_fields.pop("family")
    identity = {"format": FORMAT_VERSION, "spec": spec_fields, "corpus": corpus}
    digest = hashlib.sha256(json.dumps(identity, sort_keys=True).encode())
    digest.update(hashlib.sha256(tokenizer_bytes).digest())
    return digest.hexdigest()[:16]


def prepare_corpus(
    spec: CorpusSpec,
    tokenizer_path: str | Path,
    root: str,
    *,
    docs_per_shard: int = DOCS_PER_SHARD,
    use_ray: bool | None = None,
    log: Callable[[str], None] = print,
) -> PreparedCorpus:
    """Tokenize ``spec``'s split into shards under ``root`` (a local folder or a URI), or find it there.

    ``use_ray``: prepare a multi-file source in Ray tasks (None: when Ray is
    initialized). ``log`` receives progress lines.
    """
    if docs_per_shard < 1 or docs_per_shard % MAP_BATCH:
        raise ValueError(f"docs_per_shard must be a positive multiple of {MAP_BATCH}, got {docs_per_shard}")
    tokenizer_bytes = pack_tokenizer(tokenizer_path)  # a SentencePiece model's own bytes: its keys stay as they were
    tokenizer = load_tokenizer(tokenizer_path)
    key = corpus_key(spec, tokenizer_bytes)
    name = f"{spec.task}-{spec.split}-{key}"
    top = locate(root)
    final = top / name
    uri = final.path if final.local else final.uri
    if (final / COMPLETE_MARKER).is_file():
        manifest = Manifest.from_json((final / MANIFEST_FILE).read_text())
        log(f"data: reusing {uri} ({manifest.examples:,} examples of {manifest.records:,} records)")
        return PreparedCorpus(uri, manifest, cached=True)

    if top.local:
        top.makedirs()
        _remove_abandoned(Path(top.path), name)
    staging = Path(
        tempfile.mkdtemp(
            prefix=f".{name}.tmp-{socket.gethostname()}-{os.getpid()}-", dir=top.path if top.local else None
        )
    )
    try:
        manifest = _build(spec, tokenizer, key, staging, docs_per_shard, use_ray, log)
        (staging / MANIFEST_FILE).write_text(manifest.to_json())
        if top.local:
            (staging / COMPLETE_MARKER).write_text("")
            _publish_local(staging, Path(final.path))
        else:
            _publish_remote(staging, final)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    log(
        f"data: prepared {manifest.examples:,} examples of {manifest.records:,} records in {manifest.seconds:.0f}s "
        f"-> {uri}"
    )
    return PreparedCorpus(uri, manifest, cached=False)


def _publish_local(staging: Path, final: Path) -> None:
    """Rename the complete staging folder into place; an unmarked leftover there is replaced."""
    if final.exists() and not (final / COMPLETE_MARKER).is_file():
        shutil.rmtree(final)  # a partial folder (written by hand or by an older crash): never trusted
    try:
        os.replace(staging, final)
    except OSError:
        if not (final / COMPLETE_MARKER).is_file():  # a concurrent preparation finished first: keep its copy
            raise


def _publish_remote(staging: Path, final: Location) -> None:
    """Upload the shards and the manifest, then the marker last (object stores have no atomic rename)."""
    final.delete()
    final.upload(staging)
    (final / COMPLETE_MARKER).write_bytes(b"")


def _remove_abandoned(root: Path, name: str) -> None:
    """Staging folders of this split left by processes of this host that no longer run."""
    host = socket.gethostname()
    for leftover in root.glob(f".{name}.tmp-{host}-*"):
        pid = leftover.name[len(f".{name}.tmp-{host}-") :].split("-", 1)[0]
        if pid.isdigit() and not _running(int(pid)):
            shutil.rmtree(leftover, ignore_errors=True)


def _running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


# ----- building ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Piece:
    """A part of the split prepared as one unit: its shards are numbered ``shard-<index>-<part>``."""

    index: int
    source: str | Sequence[str] | None
    limit: int | None


@dataclass(frozen=True)
class _PieceResult:
    shards: tuple[Shard, ...]
    read: int
    skipped: int


def _build(
    spec: CorpusSpec,
    tokenizer: TextTokenizer,
    key: str,
    out: Path,
    docs_per_shard: int,
    use_ray: bool | None,
    log: Callable[[str], None],
) -> Manifest:
    """Tokenize every piece of the split into ``out``; the manifest of what was written."""
    task = get_task(spec.task)
    pieces = _pieces(spec, resolve_source(task, spec.split, spec.source))
    started = time.perf_counter()
    progress = _Progress(f"{spec.task}/{spec.split}", len(pieces), started, log)
    if len(pieces) > 1 and (use_ray if use_ray is not None else _ray_running()):
        results = _build_with_ray(pieces, spec, tokenizer, out, docs_per_shard, progress)
    else:
        results = []
        for piece in pieces:
            results.append(_prepare_piece(piece, spec, tokenizer, out, docs_per_shard, progress.shard))
            progress.piece()
    for result in results:
        if result.skipped:
            log(f"data: skipped {result.skipped} empty or whitespace-only records of {result.read}")
    return Manifest(
        format=FORMAT_VERSION,
        key=key,
        spec=asdict(spec),
        kind=spec.kind,
        vocab_size=tokenizer.vocab_size,
        noise_density=spec.noise_density,
        mean_span_length=spec.mean_span_length,
        shards=tuple(s for r in results for s in r.shards),
        records=sum(s.records for r in results for s in r.shards),
        skipped=sum(r.skipped for r in results),
        seconds=time.perf_counter() - started,
    )


def _ray_running() -> bool:
    import ray  # only here: preparing without Ray should not pay for importing it

    return ray.is_initialized()


def _pieces(spec: CorpusSpec, src: Source) -> list[_Piece]:
    """One piece per local file (they prepare independently), or the whole split when a limit spans files."""
    streamable = all(f.name.endswith((".jsonl", ".jsonl.gz", PARQUET_SUFFIX)) for f in src.files)
    if src.files and streamable and spec.limit is None:
        return [_Piece(i, [str(f)], None) for i, f in enumerate(src.files)]
    return [_Piece(0, spec.source, spec.limit)]


def _build_with_ray(
    pieces: list[_Piece],
    spec: CorpusSpec,
    tokenizer: TextTokenizer,
    out: Path,
    docs_per_shard: int,
    progress: _Progress,
) -> list[_PieceResult]:
    """One Ray task per piece, on this node (the files and the staging folder are local to it)."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    here = NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=False)
    task = ray.remote(_prepare_piece).options(num_cpus=1, scheduling_strategy=here)
    refs = {task.remote(p, spec, tokenizer, out, docs_per_shard, None): i for i, p in enumerate(pieces)}
    results: list[_PieceResult | None] = [None] * len(pieces)
    pending = list(refs)
    while pending:
        done, pending = ray.wait(pending, num_returns=1)
        result = ray.get(done[0])
        results[refs[done[0]]] = result
        for shard in result.shards:
            progress.shard(shard)
        progress.piece()
    return [r for r in results if r is not None]


def _prepare_piece(
    piece: _Piece,
    spec: CorpusSpec,
    tokenizer: TextTokenizer,
    out: Path,
    docs_per_shard: int,
    on_shard: Callable[[Shard], None] | None,
) -> _PieceResult:
    """Tokenize one piece's records chunk by chunk, writing a shard every ``docs_per_shard`` records."""
    count = RecordCount()
    encoder = spec.encoder(spec, tokenizer)
    kind = spec.kind
    shards: list[Shard] = []
    columns: dict[str, list] = {}
    records = 0

    def add(encoded: dict[str, list]) -> None:
        for name, values in encoded.items():
            columns.setdefault(name, []).extend(values)

    def flush() -> None:
        nonlocal columns, records
        name = f"shard-{piece.index:05d}-{len(shards):05d}.arrow"
        write_shard(out / name, columns, kind)
        shards.append(Shard(name, len(columns["length"]), records))
        if on_shard is not None:
            on_shard(shards[-1])
        columns, records = {}, 0

    chunks: Iterator[pa.Table] = iter_records(spec.reading, spec.split, piece.source, piece.limit, MAP_BATCH, count)
    for chunk in chunks:
        add(encoder.encode(chunk))
        records += chunk.num_rows
        if records >= docs_per_shard and columns:
            flush()
    add(encoder.finish())
    if columns:
        flush()
    return _PieceResult(tuple(shards), count.read, count.skipped)


class _Progress:
    """Progress lines at most every few seconds: pieces done, records, examples, rate."""

    def __init__(self, what: str, pieces: int, started: float, log: Callable[[str], None]) -> None:
        self.what, self.pieces, self.started, self.log = what, pieces, started, log
        self.done = self.records = self.examples = 0
        self.last = started

    def shard(self, shard: Shard) -> None:
        """A shard was written."""
        self.records += shard.records
        self.examples += shard.rows
        self._report()

    def piece(self) -> None:
        """A piece (file) was finished."""
        self.done += 1
        self._report()

    def _report(self) -> None:
        now = time.perf_counter()
        if now - self.last < _PROGRESS_EVERY_S:
            return
        self.last = now
        elapsed = now - self.started
        files = f"{self.done}/{self.pieces} files, " if self.pieces > 1 else ""
        eta = f", ETA {(self.pieces - self.done) * elapsed / self.done:.0f}s" if self.pieces > 1 and self.done else ""
        self.log(
            f"data: {self.what}: {files}{self.records:,} records -> {self.examples:,} examples in {elapsed:.0f}s "
            f"({self.records / elapsed:,.0f} records/s{eta})"
        )
