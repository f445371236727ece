"""Tokenisation (parallel ``datasets.map``), span corruption with optional packing, and padding; for the looped
LM (``speed.models.family``), packed next-token rows and prompted examples with the loss on the answer only.

Every example is EOS-terminated and truncated to explicit limits. Span
corruption draws from ``noise_rng(seed, 0, index)`` per example (the noise of
epoch 0 of a prepared corpus, ``speed.data.corpus``), so the result does not
depend on ``num_proc`` or on how the work was split.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from torch import Tensor

from speed.chat import CHAT_TEMPLATE, ChatRenderer, task_prompt
from speed.data.spans import corruption_lengths, noise_rng, span_corruption, span_counts
from speed.data.tasks import Task, get_task
from speed.hf_tokenizer import chat_renderer, prompt_ids
from speed.losses import shift_right
from speed.tokenizer import EOS_ID, LABEL_PAD, TextTokenizer, Tokenizer

if TYPE_CHECKING:
    import datasets

MAP_BATCH = 1000  # records per datasets.map call; packing joins texts within one such batch


def tokenize_records(
    ds: datasets.Dataset | datasets.IterableDataset,
    task: str,
    tokenizer: Tokenizer,
    max_source_len: int,
    max_target_len: int,
    seed: int = 0,
    num_proc: int | None = None,
    pack: bool = False,
    *,
    noise_density: float = 0.15,
    mean_span_length: float = 3.0,
) -> datasets.Dataset | datasets.IterableDataset:
    """Columns ``input_ids`` and ``labels``: EOS-terminated token ids within the length limits.

    Source/target tasks encode both sides. ``pretrain`` cuts each text into
    runs that fit the limits after span corruption (``pack=True`` first joins
    consecutive texts, so runs are full length), then corrupts every run.
    ``num_proc`` worker processes tokenise in parallel (ignored for streams).
    """
    import datasets  # only here and in load_records: decoding, serving and the GPU machine go without it

    features = datasets.Features(
        {"input_ids": datasets.List(datasets.Value("int32")), "labels": datasets.List(datasets.Value("int32"))}
    )
    spec = get_task(task)
    check_encoding(spec, max_source_len, max_target_len, pack)
    needed = list(spec.columns)
    if ds.column_names is not None and not set(needed) <= set(ds.column_names):
        raise ValueError(f"task {task!r} needs columns {needed}, the data set has {ds.column_names}")
    procs = None if isinstance(ds, datasets.IterableDataset) else num_proc
    columns = list(ds.column_names or needed)  # a stream may not know its columns
    if not spec.is_pretrain:
        kwargs = {"tokenizer": tokenizer, "max_source_len": max_source_len, "max_target_len": max_target_len}
        return _map(ds, encode_pairs, kwargs, columns, f"tokenize {task}", procs, features=features)
    run = pretrain_run_length(tokenizer, max_source_len, max_target_len, noise_density, mean_span_length)
    runs = _map(ds, encode_runs, {"tokenizer": tokenizer, "run": run}, columns, "tokenize text", procs)
    if pack:  # one process: joining lists is cheap, and batch boundaries then never depend on num_proc
        runs = _map(runs, pack_runs, {"run": run}, ["tokens"], "pack", None)
    corrupt = {"seed": seed, "noise_density": noise_density, "mean_span_length": mean_span_length}
    kwargs = {**corrupt, "sentinel_id": tokenizer.sentinel_id}
    return _map(runs, _corrupt_runs, kwargs, ["tokens"], "span corruption", procs, with_indices=True, features=features)


def check_encoding(task: Task, max_source_len: int, max_target_len: int, pack: bool) -> None:
    """Whether ``task`` can be encoded within these limits (and packed); a ``ValueError`` says why not."""
    if pack and not task.is_pretrain:
        raise ValueError("pack=True applies to pretraining only: source/target pairs are never joined")
    if max_source_len < 2 or max_target_len < 2:
        raise ValueError(f"length limits must leave room for a token and EOS, got {max_source_len}, {max_target_len}")


def pretrain_run_length(
    tokenizer: Tokenizer, max_source_len: int, max_target_len: int, noise_density: float, mean_span_length: float
) -> int:
    """Raw tokens per pretraining run: the longest whose corruption fits the limits and the tokenizer's sentinels."""
    run = corruption_lengths(max_source_len, max_target_len, noise_density, mean_span_length).tokens
    spans = span_counts(run, noise_density, mean_span_length)[1]
    if spans > tokenizer.num_extra:
        raise ValueError(f"runs of {run} tokens need {spans} sentinels, the tokenizer has {tokenizer.num_extra}")
    return run


def _map(
    ds: datasets.Dataset | datasets.IterableDataset,
    fn: Callable[..., dict[str, list]],
    fn_kwargs: dict[str, Any],
    remove: list[str],
    desc: str,
    num_proc: int | None,
    **kwargs: Any,
) -> datasets.Dataset | datasets.IterableDataset:
    """``ds.map(fn)`` in batches, replacing the ``remove`` columns by ``fn``'s output."""
    import datasets

    common = {"batched": True, "batch_size": MAP_BATCH, "remove_columns": remove, "fn_kwargs": fn_kwargs, **kwargs}
    if isinstance(ds, datasets.IterableDataset):
        return ds.map(fn, **common)
    return ds.map(fn, desc=desc, num_proc=num_proc, **common)


def truncate(ids: list[int], max_len: int, eos_id: int = EOS_ID) -> list[int]:
    """``ids`` cut to ``max_len`` tokens, the last one ``eos_id`` (as T5: trim, then append EOS)."""
    return ids if len(ids) <= max_len else ids[: max_len - 1] + [eos_id]


def encode_pairs(
    batch: dict[str, list], tokenizer: Tokenizer, max_source_len: int, max_target_len: int
) -> dict[str, list]:
    """Columns ``source``/``target`` -> ``input_ids``/``labels``, each truncated with EOS last."""
    sources = tokenizer.encode_batch(batch["source"])
    targets = tokenizer.encode_batch(batch["target"])
    return {
        "input_ids": [truncate(ids, max_source_len) for ids in sources],
        "labels": [truncate(ids, max_target_len) for ids in targets],
    }


def encode_runs(batch: dict[str, list], tokenizer: Tokenizer, run: int) -> dict[str, list]:
    """Each text's tokens (no EOS) cut into runs of at most ``run`` tokens; nothing dropped."""
    runs = []
    for ids in tokenizer.encode_batch(batch["text"], add_eos=False):
        runs.extend(ids[i : i + run] for i in range(0, len(ids), run))
    return {"tokens": runs}


def pack_runs(batch: dict[str, list], run: int) -> dict[str, list]:
    """The batch's runs joined end to end and cut again into runs of exactly ``run`` (the last may be short)."""
    joined = list(itertools.chain.from_iterable(batch["tokens"]))
    return {"tokens": [joined[i : i + run] for i in range(0, len(joined), run)]}


def _corrupt_runs(
    batch: dict[str, list],
    indices: list[int],
    seed: int,
    noise_density: float,
    mean_span_length: float,
    sentinel_id: Callable[[int], int],
) -> dict[str, list]:
    inputs, labels = [], []
    for index, tokens in zip(indices, batch["tokens"]):
        rng = noise_rng(seed, 0, index)
        example = corrupt_run(tokens, rng, sentinel_id, noise_density, mean_span_length)
        inputs.append(example["input_ids"])
        labels.append(example["labels"])
    return {"input_ids": inputs, "labels": labels}


def corrupt_run(
    tokens: Sequence[int],
    rng: np.random.Generator,
    sentinel_id: Callable[[int], int],
    noise_density: float = 0.15,
    mean_span_length: float = 3.0,
) -> dict[str, list[int]]:
    """One pretraining example of a token run: span-corrupted ``input_ids`` and ``labels``, both EOS-terminated."""
    corrupted = span_corruption(tokens, noise_density, mean_span_length, rng=rng, sentinel_id=sentinel_id)
    return {"input_ids": corrupted.inputs + [EOS_ID], "labels": corrupted.targets + [EOS_ID]}


# ----- the looped LM: packed rows, prompted examples ---------------------------------------------------


def pack_rows(
    pending: list[int], documents: Sequence[Sequence[int]], row_len: int
) -> tuple[list[list[int]], list[int]]:
    """``documents`` (each EOS-terminated) joined after ``pending`` and cut into full rows of ``row_len``.

    Returns (the full rows, the tokens left over): nothing is dropped or repeated, and the rows do not
    depend on how the documents were split into calls (the leftover starts the next call's ``pending``).
    """
    joined = pending + list(itertools.chain.from_iterable(documents))
    full = len(joined) // row_len * row_len
    return [joined[i : i + row_len] for i in range(0, full, row_len)], joined[full:]


def cut_rows(documents: Sequence[Sequence[int]], row_len: int) -> list[list[int]]:
    """Each document (EOS-terminated) cut on its own into rows of at most ``row_len`` (unpacked)."""
    return [list(ids[i : i + row_len]) for ids in documents for i in range(0, len(ids), row_len)]


def encode_prompts(
    sources: Sequence[str], tokenizer: TextTokenizer, max_len: int, template: ChatRenderer = CHAT_TEMPLATE
) -> list[list[int]]:
    """Each source text (instruction included) as a chat prompt (``speed.chat.task_prompt`` in ``template``), no
    EOS, at most ``max_len`` tokens: an overlong prompt loses the end of its source, never what the template writes
    after it (the platform's: the answer's cue)."""
    prompts = prompt_ids(tokenizer, [task_prompt("", text, template) for text in sources], template)
    after = task_prompt("", _MARK, template).rsplit(_MARK, 1)[1]  # the template's text after the source
    tail = len(tokenizer.encode(after, add_eos=False))
    if max_len <= tail:
        raise ValueError(f"a prompt of at most {max_len} tokens cannot hold the chat template's cue ({tail})")
    return [ids if len(ids) <= max_len else ids[: max_len - tail] + ids[-tail:] for ids in prompts]


_MARK = "\x00source\x00"  # a source text no template writes itself


def encode_prompted(
    batch: dict[str, list], tokenizer: TextTokenizer, max_source_len: int, max_target_len: int
) -> dict[str, list]:
    """Columns ``source``/``target`` -> ``input_ids`` (the prompt, ``encode_prompts`` in the tokenizer's chat
    template: an imported model's own, as evaluation writes its prompts) and ``labels`` (the answer, the
    tokenizer's EOS last): ``collate_lm`` joins them and puts the loss on the answer only."""
    targets = tokenizer.encode_batch(batch["target"])
    return {
        "input_ids": encode_prompts(batch["source"], tokenizer, max_source_len, chat_renderer(tokenizer)),
        "labels": [truncate(ids, max_target_len, tokenizer.eos_id) for ids in targets],
    }


def collate_lm(columns: Mapping[str, Sequence[Sequence[int]]], pad_id: int = 0) -> dict[str, Tensor]:
    """A looped-LM batch: input_ids (B, T) right-padded, labels (B, T) the next token at each position.

    ``input_ids`` alone (packed rows): every position but the last predicts the next. With ``labels`` (the
    answers of prompted examples): each sequence is prompt + answer, and only the positions that predict an
    answer token carry a label (from the prompt's last token to the answer's second to last). -100 elsewhere.
    """
    prompts = columns["input_ids"]
    if len(prompts) == 0:
        raise ValueError("collate got an empty batch")
    answers = columns.get("labels")
    sequences = [list(p) + list(a) for p, a in zip(prompts, answers)] if answers is not None else prompts
    starts = [max(len(p) - 1, 0) for p in prompts] if answers is not None else [0] * len(prompts)
    input_ids = _pad(sequences, pad_id)  # (B, T)
    labels = torch.full_like(input_ids, LABEL_PAD)  # (B, T)
    for b, (seq, start) in enumerate(zip(sequences, starts)):
        labels[b, start : len(seq) - 1] = torch.as_tensor(seq[start + 1 :], dtype=torch.long)
    return {"input_ids": input_ids, "labels": labels}


# ----- batching --------------------------------------------------------------------------


def collate(examples: Sequence[Mapping[str, Any]] | Mapping[str, Sequence], pad_id: int = 0) -> dict[str, Tensor]:
    """Pad a batch to its longest: input_ids (B,S), attention_mask (B,S), labels (B,T), decoder_input_ids (B,T).

    Takes a list of examples or a dict of columns. Labels are padded with -100
    (ignored by the loss); decoder inputs are the labels shifted right behind
    the start token (= pad, as T5).
    """
    columns = examples if isinstance(examples, Mapping) else _columns(examples)
    missing = [key for key in ("input_ids", "labels") if key not in columns]
    if missing:
        raise KeyError(f"collate needs input_ids and labels; missing {missing} (have {sorted(columns)})")
    if len(columns["input_ids"]) == 0:
        raise ValueError("collate got an empty batch")
    if len(columns["input_ids"]) != len(columns["labels"]):
        raise ValueError(f"{len(columns['input_ids'])} input_ids but {len(columns['labels'])} labels")
    input_ids, attention_mask = pad_inputs(columns["input_ids"], pad_id)  # (B, S), (B, S)
    labels = _pad(columns["labels"], LABEL_PAD)  # (B, T)
    return {
        "input_ids": input_ids,
        "attention_mask": attention_mask,
        "labels": labels,
        "decoder_input_ids": shift_right(labels, start_id=pad_id, pad_id=pad_id),  # (B, T)
    }


def pad_inputs(sequences: Sequence[Sequence[int]], pad_id: int = 0) -> tuple[Tensor, Tensor]:
    """Encoder inputs padded to the longest: input_ids (B,S) and attention_mask (B,S), 1 on real tokens."""
    input_ids = _pad(sequences, pad_id)  # (B, S)
    lengths = torch.tensor([len(ids) for ids in sequences])  # (B,)
    attention_mask = (torch.arange(input_ids.shape[1])[None, :] < lengths[:, None]).long()  # (B, S)
    return input_ids, attention_mask


def _columns(examples: Sequence[Mapping[str, Any]]) -> dict[str, list]:
    if len(examples) == 0:
        raise ValueError("collate got an empty batch")
    return {key: [ex[key] for ex in examples] for key in examples[0]}


def _pad(sequences: Sequence[Sequence[int]], value: int) -> Tensor:
    """(B, L) long tensor of ``sequences`` padded with ``value`` to the longest, L >= 1."""
    rows = [torch.as_tensor(seq, dtype=torch.long).reshape(-1) for seq in sequences]
    out = torch.full((len(rows), max(1, max(len(r) for r in rows))), value, dtype=torch.long)
    for i, row in enumerate(rows):
        out[i, : len(row)] = row
    return out
