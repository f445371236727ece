"""The benchmarks' workload of a trained checkpoint: its task's held-out inputs as its family reads them
(``held_out``), and its outputs scored against the references (``score_outputs``, ``paired_quality``).
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from speed.models.looped_lm import LoopedLM
from speed.models.t5 import SpeedT5
from speed.tokenizer import TextTokenizer


@dataclass(frozen=True)
class HeldOut:
    """A model and a task's held-out sentences as its family reads them (the benchmarks' workload)."""

    model: SpeedT5 | LoopedLM
    task: str
    inputs: list[list[int]]  # T5's encoder inputs, an LM's chat prompts
    references: list[str]  # the records' targets
    tokenizer: TextTokenizer  # the model's: decodes its outputs, says where they end (``stop_ids``)


def add_held_out_flags(parser: argparse.ArgumentParser, limit: int, max_new_tokens: int) -> None:
    """A benchmark's flags for ``held_out`` and its decoding: ``--checkpoint``, ``--split``, ``--limit`` (sentences
    decoded, default ``limit``) and ``--max-new-tokens`` (default ``max_new_tokens``)."""
    parser.add_argument("--checkpoint", required=True, help="a finetuned checkpoint or run (a local path or a URI)")
    parser.add_argument("--split", default="test")
    parser.add_argument("--limit", type=int, default=limit, help="sentences decoded")
    parser.add_argument("--max-new-tokens", type=int, default=max_new_tokens)


def held_out(checkpoint: str, split: str, limit: int | None, task: str | None = None) -> HeldOut:
    """Load ``checkpoint`` (a platform checkpoint or a Hugging Face directory: ``load_pretrained``) and encode the
    first ``limit`` records of ``task``'s ``split`` (by default the checkpoint's training task) as its family reads
    them (T5's encoder inputs, an LM's prompts in its tokenizer's chat template), truncated as in training; a
    checkpoint without tokenizer or task is a one-line error."""
    from speed.data import get_task, read_records
    from speed.hf_tokenizer import chat_renderer, load_tokenizer
    from speed.models.family import family_of
    from speed.models.pretrained import load_pretrained

    loaded = load_pretrained(checkpoint)
    if loaded.tokenizer_path is None:
        raise FileNotFoundError(f"checkpoint {checkpoint} holds no spm.model nor tokenizer.json")
    data = loaded.config.get("job", {}).get("data", {})
    task = task or data.get("task")
    if not task:
        raise ValueError(f"checkpoint {checkpoint} records no training task; pass --task")
    family = family_of(loaded.model)
    records = read_records(family.read_task(get_task(task)), split, data.get("source"), limit)
    columns = records.dataset.to_dict()
    tok = load_tokenizer(loaded.tokenizer_path)
    inputs = family.encode_sources(columns["source"], tok, data.get("max_source_len") or 512, chat_renderer(tok))
    return HeldOut(loaded.model, task, inputs, columns["target"], tok)


@dataclass(frozen=True)
class Quality:
    """A model's output scored against the references, with a 95 % bootstrap interval."""

    metric: str  # bleu | rougeL
    score: float
    low: float
    high: float


def _scoring(held: HeldOut) -> tuple[Any, str]:
    """The tokenizer that detokenizes ``held``'s outputs, and its task's metric (BLEU for translation, else ROUGE-L)."""
    from speed.data import get_task

    return held.tokenizer, "bleu" if "bleu" in get_task(held.task).metrics else "rougeL"


def score_outputs(held: HeldOut, samples: int = 1000) -> Callable[[list[list[int]]], Quality]:
    """A ``quality`` for ``run_lever_benchmark``: a model's outputs detokenized and scored against ``held``'s
    references with the task's metric (BLEU for translation, else ROUGE-L) and its bootstrap interval."""
    from speed.eval import metrics

    tok, metric = _scoring(held)

    def quality(outputs: list[list[int]]) -> Quality:
        scored = metrics.bootstrap(tok.decode_batch(outputs), held.references[: len(outputs)], samples)[metric]
        return Quality(metric, scored["score"], scored["low"], scored["high"])

    return quality


def paired_quality(held: HeldOut, outputs: dict[str, list[list[int]]], samples: int = 1000) -> list[str]:
    """Each checkpoint's output against the first's on the same references: the task's metric's difference with
    its 95 % paired-bootstrap interval (``speed.eval.metrics.paired_bootstrap``), one line per checkpoint."""
    from speed.eval import metrics

    tok, metric = _scoring(held)
    (first, baseline), *others = outputs.items()
    refs, lines = held.references[: len(baseline)], []
    for name, output in others:
        d = metrics.paired_bootstrap(tok.decode_batch(baseline), tok.decode_batch(output), refs, samples)[metric]
        lines.append(
            f"{name} vs {first}: {metric} {d['system']:.2f} vs {d['baseline']:.2f}, difference {d['delta']:+.2f} "
            f"[{d['low']:+.2f}, {d['high']:+.2f}] (95 % paired bootstrap, {samples} resamples)"
        )
    return lines
