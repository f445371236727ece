"""Tasks, sources (local files and the hub, monkeypatched), tokenisation, packing and batching."""

from __future__ import annotations

import gzip
import json
import logging
from pathlib import Path

import datasets
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from speed.data import (
    TASKS,
    RecordError,
    collate,
    corruption_lengths,
    get_task,
    load_records,
    read_records,
    tokenize_records,
)
from speed.data.records import RecordCount, iter_records
from speed.losses import shift_right
from speed.paths import DATA_DIR_ENV
from speed.tokenizer import Tokenizer, train_tokenizer

EN_DE = "translate English to German: "


def write_jsonl(path: Path, records: list) -> Path:
    """Records (dicts, or raw strings written as they are) one per line; gzipped for a .gz name."""
    text = "".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in records)
    if path.name.endswith(".gz"):
        with gzip.open(path, "wt", encoding="utf-8") as f:
            f.write(text)
    else:
        path.write_text(text, encoding="utf-8")
    return path


def pair(en: str, de: str) -> dict:
    return {"translation": {"en": en, "de": de}}


@pytest.fixture(scope="module")
def tok(tmp_path_factory) -> Tokenizer:
    ds = load_records("translate_en_de", "validation", limit=400)
    texts = [t for row in ds for t in (row["source"], row["target"])] + list(
        load_records("pretrain", "validation")["text"]
    )
    return train_tokenizer(texts, tmp_path_factory.mktemp("tok") / "spm.model", vocab_size=500, num_extra=100)


# ----- tasks and local corpora -------------------------------------------------------------


def test_registry():
    assert set(TASKS) == {"pretrain", "translate_en_de", "summarize", "summarize_cnn_dailymail"}
    assert get_task("summarize").columns == {"source": "document", "target": "summary"}
    assert get_task("summarize_cnn_dailymail").columns == {"source": "article", "target": "highlights"}
    assert get_task("pretrain").columns == {"text": "text"}
    with pytest.raises(ValueError, match=r"unknown task 'translate'.*'summarize'"):
        get_task("translate")


@pytest.mark.parametrize(
    ("task", "split", "columns", "prefix"),
    [
        ("translate_en_de", "test", ["source", "target"], EN_DE),
        ("summarize", "validation", ["source", "target"], "summarize: "),
        ("pretrain", "validation", ["text"], ""),
    ],
)
def test_local_corpora(task, split, columns, prefix):
    records = read_records(task, split, limit=5)
    assert records.dataset.column_names == columns and records.dataset.num_rows == 5
    assert records.skipped == 0 and records.read >= 5
    first = records.dataset[0]
    assert first[columns[0]].startswith(prefix) and len(first[columns[0]]) > len(prefix) + 10


def test_whole_split_and_data_dir_override(tmp_path, monkeypatch):
    assert load_records("translate_en_de", "validation").num_rows == 1014  # the README's count
    (tmp_path / "multi30k_en_de").mkdir()
    write_jsonl(tmp_path / "multi30k_en_de" / "validation.jsonl", [pair("a", "b")])
    monkeypatch.setenv(DATA_DIR_ENV, str(tmp_path))
    assert load_records("translate_en_de", "validation")[:] == {"source": [EN_DE + "a"], "target": ["b"]}


def test_blank_records_are_skipped_counted_and_logged(tmp_path, caplog):
    path = write_jsonl(
        tmp_path / "train.jsonl.gz",
        [pair("one", "eins"), pair("  ", "zwei"), pair("three", "\n"), pair("four", "vier"), ""],
    )
    with caplog.at_level(logging.WARNING, logger="speed.data"):
        records = read_records("translate_en_de", "train", str(path))
    assert records.dataset["target"][:] == ["eins", "vier"]
    assert (records.read, records.skipped) == (4, 2)
    assert "skipped 2 empty or whitespace-only records of 4" in caplog.text


def test_reading_a_split_prints_no_progress_bar(tmp_path, capfd):
    """datasets' first read of a file shows "Generating train split: N examples" whatever split the file holds (a
    test split too), which a user reads as a failure: records are read quietly, and its bars stay as they were."""
    from datasets.utils import logging as datasets_logging

    path = write_jsonl(tmp_path / "test.jsonl.gz", [pair(f"a{i}", f"b{i}") for i in range(30)])
    before = datasets_logging.is_progress_bar_enabled()  # a process-wide switch: the data benchmark turns it off
    datasets_logging.enable_progress_bar()
    try:
        assert read_records("translate_en_de", "test", str(path)).read == 30
        printed = capfd.readouterr()
        assert "Generating" not in printed.err + printed.out and "split" not in printed.err
        assert datasets_logging.is_progress_bar_enabled()
    finally:
        (datasets_logging.enable_progress_bar if before else datasets_logging.disable_progress_bar)()


def test_missing_field_names_the_field_file_and_line(tmp_path):
    path = write_jsonl(tmp_path / "train.jsonl.gz", [pair("a", "b"), pair("c", "d"), {"translation": {"en": "e"}}])
    with pytest.raises(RecordError, match=rf"{path}, line 3: record has no field 'translation.de'"):
        load_records("translate_en_de", "train", str(path))
    write_jsonl(tmp_path / "validation.jsonl", [{"document": "text", "summary": 3}])
    with pytest.raises(RecordError, match=r"validation.jsonl, line 1: field 'summary' holds int, not text"):
        load_records("summarize", "validation", str(tmp_path))
    write_jsonl(tmp_path / "test.jsonl", [pair("a", "b"), '{"translation": {"en": '])
    with pytest.raises(RecordError, match=r"test.jsonl, line 2: invalid JSON"):
        load_records("translate_en_de", "test", str(tmp_path))


def test_missing_split_file_and_empty_corpus(tmp_path):
    write_jsonl(tmp_path / "train.jsonl", [pair("a", "b")])
    write_jsonl(tmp_path / "validation.jsonl", [pair(" ", "b")])
    (tmp_path / "empty.jsonl").write_text("")
    with pytest.raises(
        FileNotFoundError, match=r"no 'test' split in .*splits there: \['empty', 'train', 'validation'\]"
    ):
        load_records("translate_en_de", "test", str(tmp_path))
    with pytest.raises(FileNotFoundError, match="no such data file"):
        load_records("translate_en_de", "train", str(tmp_path / "nope.jsonl"))
    with pytest.raises(FileNotFoundError, match="no files match"):
        load_records("translate_en_de", "train", str(tmp_path / "*.parquet"))
    with pytest.raises(ValueError, match="no records in"):
        load_records("translate_en_de", "empty", str(tmp_path))
    with pytest.raises(ValueError, match=r"no usable records .*\(1 read, 1 empty or whitespace-only\)"):
        load_records("translate_en_de", "validation", str(tmp_path))
    with pytest.raises(ValueError, match="has no local corpus .*source='hub'"):
        load_records("summarize_cnn_dailymail", "test")


def test_parquet_glob_and_file_lists(tmp_path):
    rows = [{"id": str(i), "document": f"doc {i}", "summary": f"sum {i}"} for i in range(6)]
    for shard in range(2):
        pq.write_table(pa.Table.from_pylist(rows[3 * shard : 3 * shard + 3]), tmp_path / f"train-{shard:05d}.parquet")
    ds = load_records("summarize", "train", str(tmp_path))  # a folder of split shards
    assert ds["target"][:] == [f"sum {i}" for i in range(6)] and ds[0]["source"] == "summarize: doc 0"
    assert load_records("summarize", "x", str(tmp_path / "train-*.parquet"), limit=4).num_rows == 4
    one = [str(tmp_path / "train-00001.parquet")]
    assert load_records("summarize", "x", one)["target"][:] == ["sum 3", "sum 4", "sum 5"]
    pq.write_table(pa.Table.from_pylist([{"document": "d"}]), tmp_path / "bad.parquet")
    with pytest.raises(RecordError, match=r"bad.parquet, row 1: record has no field 'summary'"):
        load_records("summarize", "x", str(tmp_path / "bad.parquet"))


def test_streamed_batches_equal_the_whole_split(tmp_path):
    count = RecordCount()
    batches = list(iter_records("pretrain", "train", batch_size=1000, count=count))
    assert [b.num_rows for b in batches] == [1000, 1000, 1000, 314] and (count.read, count.skipped) == (3314, 0)
    assert [t for b in batches for t in b.column("text").to_pylist()] == load_records("pretrain", "train")["text"][:]
    pairs = list(iter_records("translate_en_de", "validation", limit=700, batch_size=300))
    assert [b.num_rows for b in pairs] == [300, 300, 100]
    assert pa.concat_tables(pairs).to_pydict() == load_records("translate_en_de", "validation", limit=700)[:]
    path = write_jsonl(tmp_path / "train.jsonl.gz", [pair("one", "eins"), pair(" ", "zwei"), pair("three", "drei")])
    count = RecordCount()
    assert pa.concat_tables(iter_records("translate_en_de", "train", str(path), count=count))["target"].to_pylist() == [
        "eins",
        "drei",
    ]
    assert (count.read, count.skipped) == (3, 1)
    write_jsonl(tmp_path / "test.jsonl", [pair("a", "b"), {"translation": {"en": "c"}}])
    with pytest.raises(RecordError, match=r"test.jsonl, line 2: record has no field 'translation.de'"):
        list(iter_records("translate_en_de", "test", str(tmp_path)))


# ----- the hub (no network here: datasets.load_dataset is replaced, its arguments asserted) --------


@pytest.fixture
def hub(monkeypatch):
    """Replace datasets.load_dataset; records its calls and serves the given records."""
    calls: list[tuple[tuple, dict]] = []
    served: dict[str, list[dict]] = {}

    def fake(*args, **kwargs):
        calls.append((args, kwargs))
        records = served["records"]
        if kwargs.get("streaming"):
            return datasets.IterableDataset.from_generator(lambda: iter(records))
        return datasets.Dataset.from_list(records)

    monkeypatch.setattr(datasets, "load_dataset", fake)
    return calls, served


def test_hub_finetuning_sets(hub):
    calls, served = hub
    served["records"] = [pair("hello", "hallo"), pair("", "leer")]
    records = read_records("translate_en_de", "validation", "hub")
    assert calls[-1] == (("wmt/wmt16",), {"name": "de-en", "split": "validation"})
    assert records.dataset[:] == {"source": [EN_DE + "hello"], "target": ["hallo"]} and records.skipped == 1
    served["records"] = [{"id": "1", "document": "long text", "summary": "short"}]
    assert load_records("summarize", "train", "hub")[0] == {"source": "summarize: long text", "target": "short"}
    assert calls[-1] == (("EdinburghNLP/xsum",), {"name": None, "split": "train"})
    served["records"] = [{"article": "story", "highlights": "gist", "id": "x"}]
    assert load_records("summarize_cnn_dailymail", "test", "abisee/cnn_dailymail")[0]["target"] == "gist"
    assert calls[-1] == (("abisee/cnn_dailymail",), {"name": "3.0.0", "split": "test"})
    served["records"] = [pair("a", "b")]
    load_records("translate_en_de", "train", "wmt/wmt14:de-en")
    assert calls[-1] == (("wmt/wmt14",), {"name": "de-en", "split": "train"})
    served["records"] = [{"translation": {"en": "a"}}]
    with pytest.raises(RecordError, match=r"hub:wmt/wmt16:de-en split 'train', record 1: .*'translation.de'"):
        load_records("translate_en_de", "train", "hub")


def test_hub_c4_streams(hub, tok):
    calls, served = hub
    served["records"] = [{"text": f"Document number {i}.", "url": "u"} for i in range(5)]
    served["records"][1]["text"] = " "
    records = read_records("pretrain", "train", "hub", limit=3)
    assert calls[-1] == (("allenai/c4",), {"name": "en", "split": "train", "streaming": True})
    assert records.dataset["text"][:] == ["Document number 0.", "Document number 2.", "Document number 3."]
    assert (records.read, records.skipped) == (4, 1)  # stopped reading once 3 were usable

    stream = load_records("pretrain", "train", "hub")  # no limit: a lazy stream
    assert isinstance(stream, datasets.IterableDataset)
    assert [r["text"] for r in stream] == [r["text"] for r in served["records"] if r["text"].strip()]
    examples = list(tokenize_records(stream, "pretrain", tok, max_source_len=16, max_target_len=16))
    assert len(examples) >= 4 and all(ex["input_ids"][-1] == tok.eos_id for ex in examples)


# ----- tokenisation ------------------------------------------------------------------------


def test_tokenize_pairs_truncates_with_eos(tok):
    ds = load_records("translate_en_de", "validation", limit=64)
    out = tokenize_records(ds, "translate_en_de", tok, max_source_len=24, max_target_len=64)
    assert out.column_names == ["input_ids", "labels"] and out.num_rows == 64

    def cut(ids: list[int], limit: int) -> list[int]:
        return ids if len(ids) <= limit else ids[: limit - 1] + [tok.eos_id]

    for row, ex in zip(ds, out):
        assert ex["input_ids"] == cut(tok.encode(row["source"]), 24)
        assert ex["labels"] == cut(tok.encode(row["target"]), 64)
    lengths = [len(ex["input_ids"]) for ex in out]
    assert max(lengths) == 24 and min(lengths) < 24  # some cut, some not
    with pytest.raises(ValueError, match="pretraining only"):
        tokenize_records(ds, "translate_en_de", tok, 12, 12, pack=True)
    with pytest.raises(ValueError, match=r"needs columns \['text'\]"):
        tokenize_records(ds, "pretrain", tok, 12, 12)


def _merge(inputs: list[int], labels: list[int], tok: Tokenizer) -> list[int]:
    """Inputs with each sentinel replaced by its target span (EOS dropped): the original run."""
    is_sentinel = lambda t: t >= tok.num_pieces  # noqa: E731
    spans, current = {}, None
    for t in labels[:-1]:
        if is_sentinel(t):
            current = spans.setdefault(t, [])
        else:
            current.append(t)
    return [x for t in inputs[:-1] for x in (spans[t] if is_sentinel(t) else [t])]


@pytest.mark.parametrize("pack", [False, True])
def test_pretraining_examples_fit_and_merge_back(tok, pack):
    texts = load_records("pretrain", "validation", limit=12)
    out = tokenize_records(texts, "pretrain", tok, max_source_len=64, max_target_len=24, seed=3, pack=pack)
    run = corruption_lengths(64, 24).tokens
    runs = [_merge(ex["input_ids"], ex["labels"], tok) for ex in out]
    assert all(len(ex["input_ids"]) <= 64 and len(ex["labels"]) <= 24 for ex in out)
    assert all(ex["input_ids"][-1] == ex["labels"][-1] == tok.eos_id for ex in out)
    docs = [tok.encode(t, add_eos=False) for t in texts["text"]]
    assert [t for r in runs for t in r] == [t for d in docs for t in d]  # every token kept, in order
    if pack:
        assert all(len(r) == run for r in runs[:-1])  # full-length runs across text boundaries
    else:
        expected = [min(run, len(d) - i) for d in docs for i in range(0, len(d), run)]
        assert [len(r) for r in runs] == expected  # each text cut on its own


def test_pretraining_is_deterministic_across_processes(tok):
    texts = load_records("pretrain", "validation", limit=8)
    one = tokenize_records(texts, "pretrain", tok, 48, 48, seed=1)
    two = tokenize_records(texts, "pretrain", tok, 48, 48, seed=1, num_proc=2)
    other = tokenize_records(texts, "pretrain", tok, 48, 48, seed=2)
    assert one[:] == two[:] and one["labels"][:] != other["labels"][:]


# ----- batching ---------------------------------------------------------------------------


def test_collate_pads_dynamically():
    examples = [{"input_ids": [5, 6, 1], "labels": [7, 1]}, {"input_ids": [8, 1], "labels": [9, 10, 11, 1]}]
    batch = collate(examples)
    assert batch["input_ids"].tolist() == [[5, 6, 1], [8, 1, 0]]
    assert batch["attention_mask"].tolist() == [[1, 1, 1], [1, 1, 0]]
    assert batch["labels"].tolist() == [[7, 1, -100, -100], [9, 10, 11, 1]]
    assert batch["decoder_input_ids"].tolist() == [[0, 7, 1, 0], [0, 9, 10, 11]]
    assert torch.equal(batch["decoder_input_ids"], shift_right(batch["labels"]))
    assert all(t.dtype == torch.long for t in batch.values())
    columns = {"input_ids": [e["input_ids"] for e in examples], "labels": [e["labels"] for e in examples]}
    assert all(torch.equal(collate(columns)[k], v) for k, v in batch.items())
    with pytest.raises(ValueError, match="empty batch"):
        collate([])
    with pytest.raises(KeyError, match="missing \\['labels'\\]"):
        collate([{"input_ids": [1]}])


def test_collate_a_tokenized_dataset(tok):
    ds = tokenize_records(load_records("summarize", "validation", limit=4), "summarize", tok, 32, 16)
    batch = collate(ds[:4])
    assert batch["input_ids"].shape == (4, 32) and batch["labels"].shape[1] == max(len(x) for x in ds["labels"])
    assert (batch["attention_mask"].sum(1) == torch.tensor([len(x) for x in ds["input_ids"]])).all()
