"""The data-preparation stage and memory-mapped reading: cache keys, atomic publication, same batches as before."""

from __future__ import annotations

import gzip
import json
import os
from pathlib import Path

import datasets
import numpy as np
import pyarrow as pa
import pytest

from speed.data import collate, load_records, tokenize_records
from speed.data.corpus import COMPLETE_MARKER, MANIFEST_FILE, local_copy, open_corpus
from speed.data.shards import CorpusSpec, prepare_corpus
from speed.storage import locate
from speed.tokenizer import Tokenizer, train_tokenizer
from speed.train.batches import BatchPlan

datasets.disable_progress_bars()
PRETRAIN = CorpusSpec("pretrain", limit=60, max_source_len=48, max_target_len=16)


@pytest.fixture(scope="module")
def other_tokenizer(tmp_path_factory) -> Path:
    """A second tokenizer (another vocabulary size) for cache-key tests."""
    path = tmp_path_factory.mktemp("other") / "spm.model"
    train_tokenizer(load_records("pretrain", "train", limit=40)["text"], path, vocab_size=280)
    return path


def _quiet(line: str) -> None:
    """Progress lines are not under test here."""


def _prepare(spec, tokenizer, root, **kwargs):
    return prepare_corpus(spec, tokenizer, str(root), log=_quiet, **kwargs)


def _tokenized_before(spec: CorpusSpec, tokenizer: Path, seed: int) -> datasets.Dataset:
    """What training used before the stage existed: the whole split tokenized in memory by datasets.map."""
    records = load_records(spec.task, spec.split, spec.source, spec.limit)
    tok = Tokenizer.load(tokenizer)
    return tokenize_records(
        records, spec.task, tok, spec.max_source_len, spec.max_target_len, seed=seed, pack=spec.pack
    )


def test_cache_hits_and_misses_by_corpus_tokenizer_and_settings(tiny_tokenizer, other_tokenizer, tmp_path):
    first = _prepare(PRETRAIN, tiny_tokenizer, tmp_path)
    assert not first.cached and first.manifest.examples > PRETRAIN.limit
    again = _prepare(PRETRAIN, tiny_tokenizer, tmp_path)
    assert again.cached and again.uri == first.uri and again.manifest == first.manifest
    changes = [
        (PRETRAIN, other_tokenizer),
        (CorpusSpec("pretrain", limit=60, max_source_len=40, max_target_len=16), tiny_tokenizer),
        (CorpusSpec("pretrain", limit=60, max_source_len=48, max_target_len=16, pack=True), tiny_tokenizer),
        (CorpusSpec("pretrain", limit=60, max_source_len=48, max_target_len=16, noise_density=0.3), tiny_tokenizer),
        (CorpusSpec("pretrain", limit=61, max_source_len=48, max_target_len=16), tiny_tokenizer),
    ]
    uris = {first.uri}
    for spec, tokenizer in changes:
        prepared = _prepare(spec, tokenizer, tmp_path)
        assert not prepared.cached, spec
        uris.add(prepared.uri)
    assert len(uris) == len(changes) + 1
    assert (
        open_corpus(first.uri).manifest.vocab_size
        != open_corpus(_prepare(*changes[0], tmp_path).uri).manifest.vocab_size
    )


def test_a_changed_corpus_file_is_a_miss(tiny_tokenizer, tmp_path):
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    path = corpus / "train.jsonl"
    path.write_text("".join(json.dumps({"text": f"Document {i} says something."}) + "\n" for i in range(5)))
    spec = CorpusSpec("pretrain", source=str(corpus), max_source_len=16, max_target_len=8)
    first = _prepare(spec, tiny_tokenizer, tmp_path / "store")
    assert _prepare(spec, tiny_tokenizer, tmp_path / "store").cached
    path.write_text(path.read_text() + json.dumps({"text": "One more document."}) + "\n")
    changed = _prepare(spec, tiny_tokenizer, tmp_path / "store")
    assert not changed.cached and changed.uri != first.uri and changed.manifest.records == 6


def test_a_folder_without_its_marker_is_rebuilt_and_abandoned_staging_removed(tiny_tokenizer, tmp_path):
    first = _prepare(PRETRAIN, tiny_tokenizer, tmp_path)
    folder = Path(first.uri)
    shard = folder / first.manifest.shards[0].file
    (folder / COMPLETE_MARKER).unlink()
    shard.write_bytes(shard.read_bytes()[:100])  # as if the writer died mid-shard
    with pytest.raises(FileNotFoundError, match="not a complete prepared corpus"):
        open_corpus(first.uri)
    dead = tmp_path / f".{folder.name}.tmp-{os.uname().nodename}-999999999-abc"  # no such pid
    dead.mkdir()
    rebuilt = _prepare(PRETRAIN, tiny_tokenizer, tmp_path)
    assert not rebuilt.cached and rebuilt.uri == first.uri and not dead.exists()
    assert len(open_corpus(rebuilt.uri)) == first.manifest.examples
    assert sorted(p.name for p in tmp_path.iterdir()) == [folder.name]  # no staging folder left behind


@pytest.mark.parametrize(
    "spec",
    [
        CorpusSpec("pretrain", limit=120, max_source_len=64, max_target_len=24, pack=True),  # > 2 packing groups
        CorpusSpec("pretrain", limit=50, max_source_len=48, max_target_len=16),
        CorpusSpec("translate_en_de", split="validation", max_source_len=24, max_target_len=32),
    ],
    ids=["pretrain-packed", "pretrain", "pairs"],
)
def test_memory_mapped_batches_equal_the_in_memory_ones(spec, tiny_tokenizer, tmp_path):
    prepared = _prepare(spec, tiny_tokenizer, tmp_path, docs_per_shard=1000)
    allocated = pa.total_allocated_bytes()
    corpus = open_corpus(prepared.uri)
    assert pa.total_allocated_bytes() - allocated < 10_000  # the shards are mapped, not read into memory
    assert _resident_kib(corpus.directory) == 0
    before = _tokenized_before(spec, tiny_tokenizer, seed=3)  # its noise is epoch 0's
    examples = [{"input_ids": i, "labels": t} for i, t in zip(before["input_ids"], before["labels"])]
    assert len(corpus) == len(examples)
    assert np.asarray(corpus.lengths).tolist() == [len(e["input_ids"]) + len(e["labels"]) for e in examples]
    plan = BatchPlan(corpus.lengths, 8, world_size=2, rank=1, grad_accum=2, seed=3, group_by_length=True)
    for step in (0, 1, plan.steps_per_epoch - 1):
        for indices in plan.micro_batches(step):
            mapped = collate(corpus.examples(indices, epoch=0, seed=3))
            expected = collate([examples[i] for i in indices])
            assert all(mapped[k].equal(expected[k]) for k in expected)
    assert _resident_kib(corpus.directory) == 0  # reads leave no mapped pages behind in the worker


def _resident_kib(directory: Path) -> int:
    """KiB of this process's mappings of files in ``directory`` that are resident (from /proc/self/smaps)."""
    total, inside = 0, False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        if line[:1] in "0123456789abcdef" and "-" in line.split()[0]:  # a mapping's header line
            inside = str(directory) in line
        elif inside and line.startswith("Rss:"):
            total += int(line.split()[1])
    return total


def _merge(inputs: list[int], labels: list[int], first_sentinel: int) -> list[int]:
    """The run a corrupted example came from: each sentinel in the inputs replaced by its target span."""
    spans: dict[int, list[int]] = {}
    current: list[int] = []
    for t in labels[:-1]:
        if t >= first_sentinel:
            current = spans.setdefault(t, [])
        else:
            current.append(t)
    return [x for t in inputs[:-1] for x in (spans[t] if t >= first_sentinel else [t])]


def test_span_corruption_noise_is_drawn_per_epoch_and_replays(tiny_tokenizer, tmp_path):
    corpus = open_corpus(_prepare(PRETRAIN, tiny_tokenizer, tmp_path).uri)
    indices = list(range(0, len(corpus), 7))
    epoch0, epoch1 = corpus.examples(indices, 0, seed=1), corpus.examples(indices, 1, seed=1)
    changed = sum(a != b for a, b in zip(epoch0["labels"], epoch1["labels"]))
    assert changed > 0.8 * len(indices)  # new noise (a run of a few tokens may draw the same by chance)
    assert corpus.examples(indices, 1, seed=1) == open_corpus(str(corpus.directory)).examples(indices, 1, seed=1)
    assert corpus.examples(indices, 0, seed=2) != epoch0
    first_sentinel = Tokenizer.load(tiny_tokenizer).num_pieces
    for e in (epoch0, epoch1):  # the same runs under either noise, at the lengths the plan was given
        runs = [_merge(i, t, first_sentinel) for i, t in zip(e["input_ids"], e["labels"])]
        assert runs == [_merge(i, t, first_sentinel) for i, t in zip(epoch0["input_ids"], epoch0["labels"])]
        assert [len(i) + len(t) for i, t in zip(e["input_ids"], e["labels"])] == corpus.lengths[indices].tolist()
    with pytest.raises(IndexError, match="outside the corpus"):
        corpus.examples([len(corpus)], 0, seed=1)


def _write_files(folder: Path, files: int, per_file: int) -> None:
    folder.mkdir()
    for f in range(files):
        with gzip.open(folder / f"train-{f:05d}.jsonl.gz", "wt") as out:
            for i in range(per_file):
                out.write(json.dumps({"text": f"File {f} holds document {i}: " + "words and more words. " * (i % 5)}))
                out.write("\n")


def _rows(uri: str) -> list:
    corpus = open_corpus(uri)
    return [corpus.manifest.shards, corpus.examples(range(len(corpus)), 2, seed=0), np.asarray(corpus.lengths).tolist()]


def test_files_prepare_as_pieces_into_shards_in_file_order(tiny_tokenizer, tmp_path):
    _write_files(tmp_path / "corpus", files=3, per_file=2500)
    spec = CorpusSpec("pretrain", source=str(tmp_path / "corpus"), max_source_len=32, max_target_len=16)
    prepared = _prepare(spec, tiny_tokenizer, tmp_path / "store", docs_per_shard=1000, use_ray=False)
    shards = prepared.manifest.shards
    assert [s.file for s in shards][:4] == [f"shard-00000-0000{i}.arrow" for i in range(3)] + [
        "shard-00001-00000.arrow"
    ]
    assert [s.records for s in shards] == [1000, 1000, 500] * 3 and prepared.manifest.records == 7500
    with pytest.raises(ValueError, match="multiple of 1000"):
        _prepare(spec, tiny_tokenizer, tmp_path / "other", docs_per_shard=1500)


@pytest.mark.ray
def test_ray_tasks_prepare_the_same_shards(ray_session, tiny_tokenizer, tmp_path):
    _write_files(tmp_path / "corpus", files=3, per_file=1200)
    spec = CorpusSpec("pretrain", source=str(tmp_path / "corpus"), max_source_len=32, max_target_len=16, pack=True)
    local = _prepare(spec, tiny_tokenizer, tmp_path / "local", docs_per_shard=1000, use_ray=False)
    remote = _prepare(spec, tiny_tokenizer, tmp_path / "ray", docs_per_shard=1000, use_ray=True)
    assert _rows(local.uri) == _rows(remote.uri)


def test_remote_storage_marker_last_and_a_local_copy_per_node(memory_store, tiny_tokenizer, tmp_path):
    prepared = _prepare(PRETRAIN, tiny_tokenizer, memory_store)
    split = locate(prepared.uri)
    assert not split.local and prepared.uri.startswith(memory_store)
    names = {info.base_name for info in split.entries()}
    assert {COMPLETE_MARKER, MANIFEST_FILE} <= names and len(names) == 2 + len(prepared.manifest.shards)
    assert _prepare(PRETRAIN, tiny_tokenizer, memory_store).cached
    copy = local_copy(split, tmp_path / "cache")
    assert copy == tmp_path / "cache" / Path(split.path).name and local_copy(split, tmp_path / "cache") == copy
    local = _prepare(PRETRAIN, tiny_tokenizer, tmp_path / "store")
    assert _rows(str(copy)) == _rows(local.uri)
    (split / COMPLETE_MARKER).delete()  # an upload that died before its marker
    with pytest.raises(FileNotFoundError, match="not a complete prepared corpus"):
        local_copy(split, tmp_path / "cache2")
    assert not _prepare(PRETRAIN, tiny_tokenizer, memory_store).cached


def test_invalid_specs_are_refused(tiny_tokenizer, tmp_path):
    with pytest.raises(ValueError, match="pretraining only"):
        CorpusSpec("translate_en_de", pack=True)
    with pytest.raises(ValueError, match="unknown task"):
        CorpusSpec("translate")
    with pytest.raises(ValueError, match="room for a token"):
        CorpusSpec("pretrain", max_source_len=1)
    tight = CorpusSpec("pretrain", limit=5, max_source_len=512, max_target_len=512, noise_density=0.5)
    with pytest.raises(ValueError, match="sentinels, the tokenizer has"):
        _prepare(tight, tiny_tokenizer, tmp_path)
    assert not any(tmp_path.iterdir())  # a failed preparation leaves nothing
