"""How a model family's records become the columns of its prepared shards (``speed.data.shards``): one encoder per
kind of record (T5's token runs, the LM's next-token rows, source/target pairs, chat prompts and answers), and
``PREPARATIONS``, a family's pair of them by the name its ``preparation`` gives (``speed.models.family``).

An encoder takes chunks of records (``encode``) and returns the columns they make (``length`` among them); what it
holds back to pack across chunks it gives at the end (``finish``), so a piece's shards are the same however its
records are chunked.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pyarrow as pa

from speed.data.batching import (
    MAP_BATCH,
    cut_rows,
    encode_pairs,
    encode_prompted,
    encode_runs,
    pack_rows,
    pack_runs,
    pretrain_run_length,
)
from speed.data.spans import corrupted_sizes
from speed.data.tasks import Task, lm_task
from speed.hf_tokenizer import prompt_ids
from speed.tokenizer import TextTokenizer

CorpusSpec = Any  # a ``speed.data.shards.CorpusSpec`` (its lengths, packing and noise), which imports this module


class PairsEncoder:
    """Source/target records -> ``input_ids``, ``labels`` and ``length``."""

    kind = "pairs"
    encode_pairs = staticmethod(encode_pairs)

    def __init__(self, spec: CorpusSpec, tokenizer: TextTokenizer) -> None:
        self.spec, self.tokenizer = spec, tokenizer

    def encode(self, chunk: pa.Table) -> dict[str, list]:
        batch = {"source": chunk.column("source").to_pylist(), "target": chunk.column("target").to_pylist()}
        pairs = self.encode_pairs(batch, self.tokenizer, self.spec.max_source_len, self.spec.max_target_len)
        return {**pairs, "length": [len(i) + len(t) for i, t in zip(pairs["input_ids"], pairs["labels"])]}

    def finish(self) -> dict[str, list]:
        return {}


class PromptedEncoder(PairsEncoder):
    """The LM's source/target records -> chat prompts (``input_ids``), answers (``labels``) and ``length``."""

    kind = "prompted"
    encode_pairs = staticmethod(encode_prompted)


class RowsEncoder:
    """The LM's texts -> next-token rows (``input_ids``) of ``max_source_len`` tokens, and ``length``.

    Every document ends in EOS, and starts as the model's published tokenizer starts a text (Huginn's BOS;
    nothing for SentencePiece). Packed, the documents run on from row to row across chunks, so every row
    but a piece's last is full; unpacked, each document is cut into rows on its own.
    """

    kind = "rows"

    def __init__(self, spec: CorpusSpec, tokenizer: TextTokenizer) -> None:
        self.spec, self.tokenizer = spec, tokenizer
        self.pending: list[int] = []

    def encode(self, chunk: pa.Table) -> dict[str, list]:
        texts = chunk.column("text").to_pylist()  # each a document: the tokenizer's text prefix (a BOS), EOS last
        documents = [ids + [self.tokenizer.eos_id] for ids in prompt_ids(self.tokenizer, texts)]
        if not self.spec.pack:
            return self._columns(cut_rows(documents, self.spec.max_source_len))
        rows, self.pending = pack_rows(self.pending, documents, self.spec.max_source_len)
        return self._columns(rows)

    def finish(self) -> dict[str, list]:
        rows, self.pending = [self.pending] if self.pending else [], []
        return self._columns(rows)

    @staticmethod
    def _columns(rows: list[list[int]]) -> dict[str, list]:
        return {"input_ids": rows, "length": [len(r) for r in rows]}


class RunsEncoder:
    """T5's texts -> token runs (``tokens``) and ``length`` after corruption.

    Packing joins groups of ``MAP_BATCH`` consecutive runs, exactly as
    ``speed.data.tokenize_records`` does, so runs wait here until a group is full.
    """

    kind = "runs"

    def __init__(self, spec: CorpusSpec, tokenizer: TextTokenizer) -> None:
        self.spec, self.tokenizer = spec, tokenizer
        self.run = pretrain_run_length(
            tokenizer, spec.max_source_len, spec.max_target_len, spec.noise_density, spec.mean_span_length
        )
        self.pending: list[list[int]] = []

    def encode(self, chunk: pa.Table) -> dict[str, list]:
        runs = encode_runs({"text": chunk.column("text").to_pylist()}, self.tokenizer, self.run)["tokens"]
        if not self.spec.pack:
            return self._columns(runs)
        self.pending.extend(runs)
        full = len(self.pending) // MAP_BATCH * MAP_BATCH
        groups, self.pending = self.pending[:full], self.pending[full:]
        return self._columns([r for i in range(0, full, MAP_BATCH) for r in self._pack(groups[i : i + MAP_BATCH])])

    def finish(self) -> dict[str, list]:
        runs, self.pending = self._pack(self.pending) if self.pending else [], []
        return self._columns(runs)

    def _pack(self, runs: list[list[int]]) -> list[list[int]]:
        return pack_runs({"tokens": runs}, self.run)["tokens"]

    def _columns(self, runs: list[list[int]]) -> dict[str, list]:
        lengths = [len(r) for r in runs]
        cost = {n: sum(corrupted_sizes(n, self.spec.noise_density, self.spec.mean_span_length)) for n in set(lengths)}
        return {"tokens": runs, "length": [cost[n] for n in lengths]}


@dataclass(frozen=True)
class Preparation:
    """How a model family's splits are prepared: how it reads a task, and the encoders of its records."""

    read_task: Callable[[Task], Task]  # the task as the family reads its records
    texts: type  # the encoder of a pretraining task's texts
    pairs: type  # the encoder of a source/target task's records
    keyed: bool = True  # the family is part of the cache key (T5's is not: its splits keep their pre-LM keys)


def _as_written(task: Task) -> Task:
    return task  # T5's task prefix ("translate English to German: ")


# name (a model family's ``preparation``, speed.models.family; the name of the family that first read data so)
# -> how the split is prepared. data imports no model: a new family names one of these
PREPARATIONS: dict[str, Preparation] = {
    "t5": Preparation(_as_written, RunsEncoder, PairsEncoder, keyed=False),
    "lm": Preparation(lm_task, RowsEncoder, PromptedEncoder),
}
