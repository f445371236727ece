"""T5's span corruption: mask random spans, replace each by a sentinel, predict the spans.

Follows ``random_spans_noise_mask`` and ``noise_span_to_unique_sentinel`` of
T5 (``t5/data/preprocessors.py``) in numpy: the number of noise tokens is
``round(length * noise_density)``, cut into ``round(noise / mean_span_length)``
spans, and span lengths come from a random segmentation of both the noise and
the non-noise tokens; the sequence always starts with a non-noise span. One
addition for extreme settings T5 never uses: spans are capped at the number of
noise and non-noise tokens, so that no span is empty.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np


class Corrupted(NamedTuple):
    """Encoder inputs (noise spans replaced by sentinels) and targets (sentinel, span, ...); no EOS."""

    inputs: list[int]
    targets: list[int]


@dataclass(frozen=True)
class CorruptionLengths:
    """Raw tokens per example, and the inputs and targets they become (EOS included)."""

    tokens: int
    inputs: int
    targets: int


def span_counts(length: int, noise_density: float, mean_span_length: float) -> tuple[int, int]:
    """Noise tokens and noise spans for a sequence of ``length`` tokens (``length`` >= 2)."""
    num_noise = min(max(round(length * noise_density), 1), length - 1)
    num_spans = max(round(num_noise / mean_span_length), 1)
    return num_noise, min(num_spans, num_noise, length - num_noise)


def random_spans_noise_mask(
    length: int, noise_density: float, mean_span_length: float, rng: np.random.Generator
) -> np.ndarray:
    """Boolean (length,) mask, True on noise tokens, as T5's ``random_spans_noise_mask``."""
    if noise_density == 0.0:
        return np.zeros(length, dtype=bool)
    orig_length, length = length, max(length, 2)  # T5: avoid degeneracy for 0 or 1 tokens
    num_noise, num_spans = span_counts(length, noise_density, mean_span_length)
    noise_lengths = _random_segmentation(num_noise, num_spans, rng)  # (num_spans,)
    nonnoise_lengths = _random_segmentation(length - num_noise, num_spans, rng)  # (num_spans,)
    interleaved = np.stack([nonnoise_lengths, noise_lengths], axis=1).reshape(-1)  # (2 * num_spans,)
    span_starts = np.cumsum(interleaved)[:-1]
    start_indicator = np.zeros(length, dtype=np.int64)
    start_indicator[span_starts] = 1
    is_noise = np.cumsum(start_indicator) % 2 == 1
    return is_noise[:orig_length]


def _random_segmentation(num_items: int, num_segments: int, rng: np.random.Generator) -> np.ndarray:
    """Lengths of a random partition of ``num_items`` into ``num_segments`` non-empty segments."""
    first_in_segment = rng.permutation(np.arange(num_items - 1) < num_segments - 1)
    segment_id = np.cumsum(np.concatenate([[0], first_in_segment]))  # (num_items,)
    return np.bincount(segment_id, minlength=num_segments)


def span_corruption(
    tokens: Sequence[int],
    noise_density: float = 0.15,
    mean_span_length: float = 3.0,
    *,
    rng: np.random.Generator,
    sentinel_id: Callable[[int], int],
) -> Corrupted:
    """Corrupt ``tokens``: span i becomes ``sentinel_id(i)`` in the inputs and leads span i in the targets."""
    if not 0.0 <= noise_density < 1.0:
        raise ValueError(f"noise_density must be in [0, 1), got {noise_density}")
    if mean_span_length < 1.0:
        raise ValueError(f"mean_span_length must be at least 1, got {mean_span_length}")
    ids = np.asarray(tokens, dtype=np.int64)
    noise = random_spans_noise_mask(len(ids), noise_density, mean_span_length, rng)
    return Corrupted(_spans_to_sentinels(ids, noise, sentinel_id), _spans_to_sentinels(ids, ~noise, sentinel_id))


def _spans_to_sentinels(ids: np.ndarray, mask: np.ndarray, sentinel_id: Callable[[int], int]) -> list[int]:
    """Each masked span collapses to one sentinel, numbered in order (T5's noise_span_to_unique_sentinel)."""
    prev_masked = np.concatenate([[False], mask[:-1]])
    first = mask & ~prev_masked
    out = ids.copy()
    out[first] = [sentinel_id(i) for i in range(int(first.sum()))]
    return out[~(mask & prev_masked)].tolist()


def corruption_lengths(
    max_inputs: int, max_targets: int, noise_density: float = 0.15, mean_span_length: float = 3.0
) -> CorruptionLengths:
    """The longest token run whose inputs and targets (EOS included) fit both limits.

    T5's ``random_spans_helper`` for the inputs (512 inputs -> 568 tokens and
    114 targets at the defaults), also bounded by ``max_targets``.
    """

    def fits(n: int) -> bool:
        inputs, targets = corrupted_sizes(n, noise_density, mean_span_length)
        return inputs <= max_inputs and targets <= max_targets

    if not fits(2):
        raise ValueError(
            f"span corruption needs room for a span, a sentinel and EOS: max_source_len={max_inputs} and "
            f"max_target_len={max_targets} cannot hold even 2 tokens "
            f"(need at least {corrupted_sizes(2, noise_density, mean_span_length)})"
        )
    n = 2
    while fits(n + 1):
        n += 1
    return CorruptionLengths(n, *corrupted_sizes(n, noise_density, mean_span_length))


def corrupted_sizes(length: int, noise_density: float = 0.15, mean_span_length: float = 3.0) -> tuple[int, int]:
    """Lengths of the inputs and targets (EOS included) that ``span_corruption`` makes of ``length`` tokens.

    They do not depend on the random draw, so an example's cost is known before its noise is.
    """
    if length == 0:
        return 1, 1
    if noise_density == 0.0 or length == 1:  # no noise: the whole run is kept, one sentinel is the target
        return length + 1, 2
    noise, spans = span_counts(length, noise_density, mean_span_length)
    return length - noise + spans + 1, noise + spans + 1


def noise_rng(seed: int, epoch: int, index: int) -> np.random.Generator:
    """The noise of example ``index`` in ``epoch``: new every epoch, the same whenever it is replayed."""
    return np.random.default_rng([seed, epoch, index])
