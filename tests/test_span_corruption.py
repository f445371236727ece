"""T5 span corruption: properties over random lengths, densities and span lengths."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from speed.data import CorruptionLengths, corruption_lengths, random_spans_noise_mask, span_corruption
from speed.data.spans import corrupted_sizes, span_counts

TOP = 100_000  # sentinel ids count down from here, far above the token ids


def sentinel(i: int) -> int:
    return TOP - i


def is_sentinel(t: int) -> bool:
    return t > TOP - 1000


def merge(inputs: list[int], targets: list[int]) -> list[int]:
    """Put every target span back in place of its sentinel in the inputs."""
    spans: dict[int, list[int]] = {}
    current = None
    for t in targets:
        if is_sentinel(t):
            current = spans.setdefault(t, [])
        else:
            assert current is not None, "targets must start with a sentinel"
            current.append(t)
    out = []
    for t in inputs:
        out.extend(spans.pop(t) if is_sentinel(t) else [t])
    # T5 keeps a sentinel for the last non-noise span even when the noise after it was cut off (length < 2,
    # density 0); such a target span is empty. Any other leftover would be lost text.
    assert all(not span for span in spans.values()), f"target spans missing from the inputs: {spans}"
    return out


PROPERTY = settings(max_examples=150, deadline=None)
lengths = st.integers(min_value=0, max_value=400)
densities = st.floats(min_value=0.01, max_value=0.9)
span_means = st.floats(min_value=1.0, max_value=12.0)
seeds = st.integers(min_value=0, max_value=2**32 - 1)


@PROPERTY
@given(lengths, densities, span_means, seeds)
def test_inputs_and_targets_merge_back_with_ordered_sentinels(n, density, mean, seed):
    tokens = list(range(10, 10 + n))
    inputs, targets = span_corruption(tokens, density, mean, rng=np.random.default_rng(seed), sentinel_id=sentinel)
    assert merge(inputs, targets) == tokens
    in_sentinels = [t for t in inputs if is_sentinel(t)]
    out_sentinels = [t for t in targets if is_sentinel(t)]
    assert out_sentinels == [sentinel(i) for i in range(len(out_sentinels))]
    assert in_sentinels == out_sentinels[: len(in_sentinels)] and len(out_sentinels) - len(in_sentinels) in (0, 1)
    if n >= 2:
        assert len(in_sentinels) == len(out_sentinels) >= 1
    if n:
        assert not is_sentinel(inputs[0]), "T5 starts every sequence with a non-noise span"
        assert is_sentinel(targets[0])


@PROPERTY
@given(st.integers(min_value=2, max_value=400), densities, span_means, seeds)
def test_noise_density_and_span_count(n, density, mean, seed):
    mask = random_spans_noise_mask(n, density, mean, np.random.default_rng(seed))
    assert mask.shape == (n,) and mask.dtype == bool
    noise = int(mask.sum())
    if 1 <= round(n * density) <= n - 1:  # away from T5's clamps to at least one noise and one kept token
        assert abs(noise / n - density) <= 0.5 / n + 1e-9
    starts = int(np.sum(mask & ~np.concatenate([[False], mask[:-1]])))  # noise spans
    assert (noise, starts) == span_counts(n, density, mean)
    assert not mask[0]


@PROPERTY
@given(lengths, st.sampled_from([0.0, 0.15, 0.5, 0.9]), span_means, seeds)
def test_corrupted_sizes_are_known_before_the_draw(n, density, mean, seed):
    inputs, targets = span_corruption(
        list(range(10, 10 + n)), density, mean, rng=np.random.default_rng(seed), sentinel_id=sentinel
    )
    assert (len(inputs) + 1, len(targets) + 1) == corrupted_sizes(n, density, mean)  # + EOS each


def test_mean_span_length_on_a_long_sequence():
    mask = random_spans_noise_mask(100_000, 0.15, 3.0, np.random.default_rng(0))
    spans = int(np.sum(mask & ~np.concatenate([[False], mask[:-1]])))
    assert mask.mean() == pytest.approx(0.15, abs=1e-4)
    assert mask.sum() / spans == pytest.approx(3.0, abs=0.01)


def test_same_seed_same_corruption_and_zero_density():
    tokens = list(range(50))
    a = span_corruption(tokens, rng=np.random.default_rng(7), sentinel_id=sentinel)
    b = span_corruption(tokens, rng=np.random.default_rng(7), sentinel_id=sentinel)
    c = span_corruption(tokens, rng=np.random.default_rng(8), sentinel_id=sentinel)
    assert a == b and a != c
    assert span_corruption(tokens, 0.0, rng=np.random.default_rng(0), sentinel_id=sentinel) == (tokens, [sentinel(0)])


def test_t5_default_lengths():
    # T5's random_spans_helper: 512 inputs at 15% noise, spans of 3 -> 568 raw tokens and 114 targets.
    assert corruption_lengths(512, 114) == CorruptionLengths(tokens=568, inputs=512, targets=114)
    assert corruption_lengths(512, 1000).tokens == 568  # the inputs bind
    assert corruption_lengths(512, 60).targets <= 60  # the targets bind
    with pytest.raises(ValueError, match="cannot hold even 2 tokens"):
        corruption_lengths(2, 2)


@PROPERTY
@given(st.integers(min_value=4, max_value=300), st.integers(min_value=4, max_value=300), densities, span_means, seeds)
def test_every_run_up_to_the_helper_length_fits(max_inputs, max_targets, density, mean, seed):
    lengths = corruption_lengths(max_inputs, max_targets, density, mean)
    rng = np.random.default_rng(seed)
    for n in {1, 2, lengths.tokens // 2, lengths.tokens}:
        inputs, targets = span_corruption(list(range(10, 10 + n)), density, mean, rng=rng, sentinel_id=sentinel)
        assert len(inputs) + 1 <= max_inputs and len(targets) + 1 <= max_targets  # + EOS
    noise, spans = span_counts(lengths.tokens + 1, density, mean)
    assert lengths.tokens + 1 - noise + spans + 1 > max_inputs or noise + spans + 1 > max_targets  # maximal


def test_rejects_bad_settings():
    rng = np.random.default_rng(0)
    with pytest.raises(ValueError, match="noise_density"):
        span_corruption([1, 2, 3], 1.0, rng=rng, sentinel_id=sentinel)
    with pytest.raises(ValueError, match="mean_span_length"):
        span_corruption([1, 2, 3], 0.15, 0.5, rng=rng, sentinel_id=sentinel)
