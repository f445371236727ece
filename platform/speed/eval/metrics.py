"""Corpus metrics through the reference libraries: sacrebleu BLEU and chrF, rouge-score ROUGE.

Scores are on a 0-100 scale. Each hypothesis has one reference. ``paired_bootstrap``
compares two systems on the same references with one set of resampled indices
for every metric (sacrebleu's paired bootstrap resampling for BLEU); ``bootstrap``
gives one system's scores an interval from the same resamples.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
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


PAIRED_METRICS = ("bleu", "rougeL")


def bootstrap(
    hyps: Sequence[str], refs: Sequence[str], samples: int = 1000, seed: int = 12345, confidence: float = 0.95
) -> dict[str, dict[str, float]]:
    """One system's BLEU and ROUGE-L with a bootstrap interval: the central ``confidence`` share of the scores
    of ``samples`` resamples of the examples (drawn as ``paired_bootstrap`` draws them). Per metric: ``score``
    (on the full set), ``low``, ``high``, ``samples``."""
    hyps, refs = _check(hyps, refs)
    idx = _indices(len(refs), samples, seed, confidence)  # (S, n)
    out = {}
    for name, (full, resampled) in _resampled(hyps, refs, idx).items():
        low, high = _interval(resampled, confidence)
        out[name] = {"score": full, "low": low, "high": high, "samples": samples}
    return out


def paired_bootstrap(
    baseline: Sequence[str],
    system: Sequence[str],
    refs: Sequence[str],
    samples: int = 1000,
    seed: int = 12345,
    confidence: float = 0.95,
) -> dict[str, dict[str, float]]:
    """``system`` minus ``baseline`` with a paired-bootstrap interval, for BLEU and ROUGE-L.

    Each of ``samples`` resamples draws len(refs) example indices with replacement and scores
    both systems on those same examples (the same indices for every metric); the interval is
    the central ``confidence`` share of the resampled differences. BLEU is re-scored from
    sacrebleu's per-sentence sufficient statistics as its ``paired_bs`` test does, ROUGE-L is
    the mean of the resampled examples' F-measures (as ``rouge``). Per metric: ``baseline``,
    ``system``, ``delta`` (on the full set), ``low``, ``high``, ``samples``.
    """
    baseline, refs = _check(baseline, refs)
    system, _ = _check(system, refs)
    idx = _indices(len(refs), samples, seed, confidence)  # (S, n)
    scored = [_resampled(hyps, refs, idx) for hyps in (baseline, system)]
    out = {}
    for name in PAIRED_METRICS:
        (full0, resampled0), (full1, resampled1) = scored[0][name], scored[1][name]
        low, high = _interval(resampled1 - resampled0, confidence)
        out[name] = {
            "baseline": full0,
            "system": full1,
            "delta": full1 - full0,
            "low": low,
            "high": high,
            "samples": samples,
        }
    return out


def _indices(n: int, samples: int, seed: int, confidence: float) -> np.ndarray:
    """(samples, n) example indices drawn with replacement, seeded."""
    if samples < 1 or not 0 < confidence < 1:
        raise ValueError(f"need samples >= 1 and 0 < confidence < 1, got {samples} and {confidence}")
    return np.random.default_rng(seed).choice(n, size=(samples, n), replace=True)


def _resampled(hyps: list[str], refs: list[str], idx: np.ndarray) -> dict[str, tuple[float, np.ndarray]]:
    """Per metric of ``PAIRED_METRICS``: the score on the full set and on each resample of ``idx`` (S,)."""
    metric = BLEU()
    stats = np.array(metric._extract_corpus_statistics(hyps, [refs]), dtype=np.float64)  # (n, statistics)
    bleu_full = metric._compute_score_from_stats(stats.sum(0)).score
    bleu_resampled = np.array([metric._compute_score_from_stats(stats[i].sum(0)).score for i in idx])
    scorer = rouge_scorer.RougeScorer(["rougeL"], use_stemmer=True)
    per = 100.0 * np.array([scorer.score(target=r, prediction=h)["rougeL"].fmeasure for h, r in zip(hyps, refs)])
    return {"bleu": (float(bleu_full), bleu_resampled), "rougeL": (float(per.mean()), per[idx].mean(1))}


def _interval(values: np.ndarray, confidence: float) -> tuple[float, float]:
    """The central ``confidence`` share of ``values``."""
    tail = (1 - confidence) / 2
    low, high = np.quantile(values, [tail, 1 - tail])
    return float(low), float(high)


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
