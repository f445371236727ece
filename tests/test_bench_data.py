"""The data-at-scale benchmark (``jobs/bench_data.py``, ``speed.benchmarks.data``) run once at a small size: the
68-document pretraining validation split replicated twice, prepared, read by a worker and by the in-memory path,
each in a fresh process."""

from __future__ import annotations

import importlib.util
import json

import pytest

from speed.data import load_records, tokenize_records
from speed.paths import repo_root
from speed.tokenizer import Tokenizer


def _job():
    spec = importlib.util.spec_from_file_location("bench_data_job", repo_root() / "jobs" / "bench_data.py")
    job = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(job)
    return job


@pytest.mark.slow  # three fresh Python processes: ~10-20 s
def test_a_row_counts_the_replicated_corpus_and_each_process_memory(tmp_path, capsys):
    flags = ["--split", "validation", "--scales", "2", "--before", "2", "--steps", "2", "--vocab-size", "300"]
    assert _job().main([*flags, "--max-source-len", "64", "--workdir", str(tmp_path), "--json"]) == 0
    # the last line: a Ray worker's log forwarded to this process (a task of another test on the session's Ray, in
    # the same pytest worker) may land in the captured output before it
    (row,) = json.loads(capsys.readouterr().out.strip().splitlines()[-1])

    records = load_records("pretrain", "validation")
    packed = tokenize_records(records, "pretrain", Tokenizer.load(tmp_path / "spm.model"), 64, 32, pack=True)
    # two copies: twice the records and the examples (each copy packs alone), one shard each
    assert (row["scale"], row["records"], row["examples"], row["shards"]) == (2, 136, 2 * len(packed), 2)
    assert len(records) == 68 and not row["cached"] and row["prepare_s"] > 0
    for process in ("prepare", "worker", "before"):  # each its own, torch loaded
        assert row[f"{process}_peak_mib"] > 100
    assert 0 < row["worker_data_mib"] < row["worker_peak_mib"] and row["worker_anon_mib"] > 0
    assert row["before_s"] > 0
