"""Corpus metrics through the reference libraries: sacrebleu BLEU and chrF, rouge-score ROUGE.

Scores are on a 0-100 scale. Each hypothesis has one reference.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from rouge_score import rouge_scorer
from sacrebleu.metrics import BLEU, CHRF

ROUGE_TYPES = ("rouge1", "rouge2", "rougeL")


def bleu(hyps: Sequence[str], refs: Sequence[str]) -> dict[str, Any]:
    """sacrebleu corpus BLEU (its defaults: 13a tokenisation, exp smoothing) with its signature."""
    hyps, refs = _check(hyps, refs)
    metric = BLEU()
    result = metric.corpus_score(hyps, [refs])
    return {
        "score": result.score,
        "signature": str(metric.get_signature()),
        "precisions": list(result.precisions),  # 1- to 4-gram precisions, in %
        "brevity_penalty": result.bp,
        "sys_len": result.sys_len,
        "ref_len": result.ref_len,
    }


def chrf(hyps: Sequence[str], refs: Sequence[str]) -> dict[str, Any]:
    """sacrebleu corpus chrF (chrF2: character 6-grams, beta 2) with its signature."""
    hyps, refs = _check(hyps, refs)
    metric = CHRF()
    result = metric.corpus_score(hyps, [refs])
    return {"score": result.score, "signature": str(metric.get_signature())}


def rouge(hyps: Sequence[str], refs: Sequence[str]) -> dict[str, Any]:
    """rouge-score ROUGE-1/2/L F-measures with Porter stemming, averaged over the examples."""
    hyps, refs = _check(hyps, refs)
    scorer = rouge_scorer.RougeScorer(list(ROUGE_TYPES), use_stemmer=True)
    totals = dict.fromkeys(ROUGE_TYPES, 0.0)
    for hyp, ref in zip(hyps, refs):
        scores = scorer.score(target=ref, prediction=hyp)
        for name in ROUGE_TYPES:
            totals[name] += scores[name].fmeasure
    return {
        **{name: 100.0 * total / len(hyps) for name, total in totals.items()},
        "signature": "rouge-score|fmeasure|stemmer:porter|mean",
    }


def _check(hyps: Sequence[str], refs: Sequence[str]) -> tuple[list[str], list[str]]:
    hyps, refs = list(hyps), list(refs)
    if len(hyps) != len(refs):
        raise ValueError(f"{len(hyps)} hypotheses but {len(refs)} references")
    if not hyps:
        raise ValueError("no hypotheses to score")
    for name, texts in (("hypothesis", hyps), ("reference", refs)):
        bad = next((i for i, t in enumerate(texts) if not isinstance(t, str)), None)
        if bad is not None:
            raise TypeError(f"{name} {bad} is {type(texts[bad]).__name__}, not a string")
    return hyps, refs
