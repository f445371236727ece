"""Metric wrappers against values computed by hand."""

from __future__ import annotations

import math

import pytest

from speed.eval.metrics import bleu, bootstrap, chrf, paired_bootstrap, rouge


def test_bleu_identical_is_100_and_signature():
    result = bleu(["the cat sat on the mat", "a dog runs"], ["the cat sat on the mat", "a dog runs"])
    assert result["score"] == pytest.approx(100.0)
    assert result["signature"].startswith("nrefs:1|case:mixed|eff:no|tok:13a|smooth:exp|version:")


def test_bleu_by_hand():
    # hyp "the cat sat on the mat" vs ref "the cat sat on a mat", same length (brevity penalty 1):
    # 1-grams 5/6, 2-grams 3/5, 3-grams 2/4, 4-grams 1/3 -> BLEU = (5/6 * 3/5 * 2/4 * 1/3) ** (1/4).
    result = bleu(["the cat sat on the mat"], ["the cat sat on a mat"])
    assert result["score"] == pytest.approx(100 * (5 / 6 * 3 / 5 * 2 / 4 * 1 / 3) ** 0.25)  # 53.73
    assert result["precisions"] == pytest.approx([500 / 6, 60.0, 50.0, 100 / 3])
    assert result["brevity_penalty"] == 1.0 and (result["sys_len"], result["ref_len"]) == (6, 6)
    # a hypothesis half as long as its reference: brevity penalty exp(1 - 6/3)
    short = bleu(["the cat sat"], ["the cat sat on the mat"])
    assert short["brevity_penalty"] == pytest.approx(math.exp(1 - 6 / 3))


def test_chrf():
    same = chrf(["Ein Hund läuft."], ["Ein Hund läuft."])
    assert same["score"] == pytest.approx(100.0) and "nc:6|nw:0" in same["signature"]
    assert chrf(["xyz"], ["abc"])["score"] == 0.0
    assert 0 < chrf(["Ein Hund läuft."], ["Ein Hund rennt."])["score"] < 100


def test_rouge_by_hand_with_stemming():
    # "the cat sat" vs "the cat ran": unigrams 2/3, bigrams 1/2, longest common subsequence 2/3.
    result = rouge(["the cat sat"], ["the cat ran"])
    assert (result["rouge1"], result["rouge2"], result["rougeL"]) == pytest.approx((200 / 3, 50.0, 200 / 3))
    # Porter stemming: "running cats" and "run cat" are the same words.
    assert rouge(["running cats"], ["run cat"])["rouge1"] == pytest.approx(100.0)
    # the corpus score is the mean over examples
    assert rouge(["the cat sat", "a b"], ["the cat ran", "x y"])["rouge1"] == pytest.approx(100 / 3)


def test_bad_input():
    with pytest.raises(ValueError, match="2 hypotheses but 1 references"):
        bleu(["a", "b"], ["a"])
    with pytest.raises(ValueError, match="no hypotheses"):
        rouge([], [])
    with pytest.raises(TypeError, match="reference 0 is NoneType"):
        chrf(["a"], [None])


_REFS = [
    "a man is riding a red bike down the street",
    "two dogs play in the snow",
    "a woman reads a book in the park",
    "children are swimming in a blue pool",
    "the old man sells fruit at the market",
    "a girl in a yellow dress is dancing",
    "people wait for the train at the station",
    "a cat sleeps on a warm window sill",
]


def test_paired_bootstrap_of_identical_systems_is_zero():
    hyps = ["a man rides a bike", "two dogs in snow", "a woman reads", "kids swim", "a man sells fruit",
            "a girl dances", "people wait for a train", "a cat sleeps"]  # fmt: skip
    result = paired_bootstrap(hyps, hyps, _REFS, samples=200)
    assert sorted(result) == ["bleu", "rougeL"]
    for r in result.values():
        assert r["delta"] == 0.0 and r["low"] <= 0.0 <= r["high"] and r["samples"] == 200
    assert result["bleu"]["baseline"] == pytest.approx(bleu(hyps, _REFS)["score"])
    assert result["rougeL"]["baseline"] == pytest.approx(rouge(hyps, _REFS)["rougeL"])


def test_paired_bootstrap_sees_a_clearly_better_system():
    worse = ["nothing here matches at all"] * len(_REFS)
    better = [r.replace(" a ", " the ", 1) for r in _REFS]  # nearly the references
    result = paired_bootstrap(worse, better, _REFS, samples=300, seed=1)
    for r in result.values():
        assert r["delta"] > 0 and 0 < r["low"] <= r["high"]
    flipped = paired_bootstrap(better, worse, _REFS, samples=300, seed=1)
    assert flipped["bleu"]["high"] < 0 and flipped["rougeL"]["delta"] == pytest.approx(-result["rougeL"]["delta"])
    # The same seed draws the same resamples: the interval is reproducible.
    assert paired_bootstrap(worse, better, _REFS, samples=300, seed=1) == result
    with pytest.raises(ValueError, match="8 hypotheses but 7 references"):
        paired_bootstrap(worse, better, _REFS[:-1])


def test_bootstrap_interval_holds_the_score_and_matches_the_paired_resamples():
    better = [r.replace(" a ", " the ", 1) for r in _REFS]
    worse = ["a man", "dogs", "a woman reads a book", "kids", "fruit", "a girl", "people", "a cat"]
    one = bootstrap(better, _REFS, samples=300, seed=1)
    assert sorted(one) == ["bleu", "rougeL"]
    assert one["bleu"]["score"] == pytest.approx(bleu(better, _REFS)["score"])
    assert one["rougeL"]["score"] == pytest.approx(rouge(better, _REFS)["rougeL"])
    for r in one.values():
        assert r["low"] <= r["score"] <= r["high"] and r["low"] < r["high"] and r["samples"] == 300
    paired = paired_bootstrap(worse, better, _REFS, samples=300, seed=1)
    assert paired["rougeL"]["system"] == one["rougeL"]["score"]
    # An exact system has no spread: every resample of identical texts scores 100.
    exact = bootstrap(_REFS, _REFS, samples=50)
    assert all(r["low"] == r["high"] == pytest.approx(100.0) for r in exact.values())
    assert bootstrap(better, _REFS, samples=300, seed=1) == one  # seeded: reproducible
    with pytest.raises(ValueError, match="samples >= 1"):
        bootstrap(better, _REFS, samples=0)
