"""Deterministic data sharding: which examples each worker trains on at each step.

Ray Data's ``get_dataset_shard`` streams in an order that cannot be replayed
from a step number, and exact resume needs exactly that. So the order here is
a pure function of ``(seed, step)``: epoch ``e`` is a permutation of the
examples seeded by ``(seed, e)`` cut into global batches (remainder dropped);
global batch ``s`` is cut into ``world_size`` contiguous shards, one per rank,
and each shard into ``grad_accum`` micro-batches. A run resumed at step ``s``
(with any worker count of the same global batch) sees the same examples.

The permutation is computed position by position (``Permutation``), never
stored, so a plan over a billion examples costs a worker what one over a
thousand does: the memory of one length-grouping window.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import numpy as np

# Length grouping sorts windows of this many global batches, so batches hold similar
# lengths (less padding) while the window keeps the order random across the epoch.
_GROUP_WINDOW = 50
_ROUNDS = 6  # Feistel rounds: enough mixing for a shuffle (this is not cryptography)
_MIX = (np.uint64(0x9E3779B97F4A7C15), np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB))


class Lengths(Protocol):
    """Example lengths, looked up by arrays of indices (a numpy array, or a corpus's mapped column)."""

    def __len__(self) -> int: ...

    def __getitem__(self, indices: np.ndarray) -> np.ndarray: ...


class Permutation:
    """A pseudo-random bijection of ``[0, n)``, evaluated at any positions in O(1) memory.

    A balanced Feistel network on the smallest even number of bits covering
    ``n``, with cycle walking: a value that lands outside ``[0, n)`` is
    encrypted again until it lands inside, which keeps it a bijection of ``[0, n)``.
    """

    def __init__(self, n: int, seed: Sequence[int]) -> None:
        if n < 1:
            raise ValueError(f"a permutation needs at least one element, got {n}")
        self.n = n
        self._half = max(1, (max(n - 1, 1).bit_length() + 1) // 2)
        self._mask = np.uint64((1 << self._half) - 1)
        self._keys = np.random.default_rng(list(seed)).integers(0, 2**63, size=_ROUNDS, dtype=np.uint64)

    def __call__(self, positions: np.ndarray) -> np.ndarray:
        """(k,) int64 elements at ``positions`` (int array in ``[0, n)``)."""
        x = self._encrypt(np.asarray(positions, dtype=np.uint64))
        outside = x >= self.n
        while outside.any():  # at most a few rounds: the domain is under 4n
            x[outside] = self._encrypt(x[outside])
            outside = x >= self.n
        return x.astype(np.int64)

    def _encrypt(self, x: np.ndarray) -> np.ndarray:
        half = np.uint64(self._half)
        left, right = x >> half, x & self._mask
        for key in self._keys:
            left, right = right, left ^ (_mix(right ^ key) & self._mask)
        return (left << half) | right


def _mix(x: np.ndarray) -> np.ndarray:
    """SplitMix64's finaliser: every output bit depends on every input bit."""
    x = x * _MIX[0]
    x = (x ^ (x >> np.uint64(30))) * _MIX[1]
    x = (x ^ (x >> np.uint64(27))) * _MIX[2]
    return x ^ (x >> np.uint64(31))


class BatchPlan:
    """The micro-batches (example indices) of one rank at every step."""

    def __init__(
        self,
        lengths: Sequence[int] | Lengths,
        global_batch: int,
        world_size: int = 1,
        rank: int = 0,
        grad_accum: int = 1,
        seed: int = 0,
        group_by_length: bool = False,
    ) -> None:
        if global_batch % (world_size * grad_accum):
            raise ValueError(
                f"global batch {global_batch} does not split into {world_size} workers x {grad_accum} micro-batches"
            )
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} outside [0, {world_size})")
        if len(lengths) < global_batch:
            raise ValueError(f"{len(lengths)} examples cannot fill one global batch of {global_batch}")
        self.lengths = np.asarray(lengths, dtype=np.int64) if isinstance(lengths, (list, tuple)) else lengths
        self.global_batch = global_batch
        self.world_size = world_size
        self.rank = rank
        self.grad_accum = grad_accum
        self.seed = seed
        self.group_by_length = group_by_length
        self._window: tuple[tuple[int, int], np.ndarray] | None = None  # (epoch, window) -> its sorted examples

    @property
    def steps_per_epoch(self) -> int:
        """Global batches per pass over the data."""
        return len(self.lengths) // self.global_batch

    def epoch_at(self, step: int) -> int:
        """The epoch (0-based) that 0-based ``step`` belongs to."""
        return step // self.steps_per_epoch

    def global_batch_at(self, step: int) -> np.ndarray:
        """(global_batch,) indices trained on by all workers together at 0-based ``step``."""
        epoch, slot = divmod(step, self.steps_per_epoch)
        order = Permutation(len(self.lengths), (self.seed, epoch))
        if not self.group_by_length:
            return order(slot * self.global_batch + np.arange(self.global_batch))  # (G,)
        # Sorted batch j comes from window j // _GROUP_WINDOW; the batches of the epoch are shuffled.
        batch = int(Permutation(self.steps_per_epoch, (self.seed, epoch, 1))(np.array([slot]))[0])
        window, within = divmod(batch, _GROUP_WINDOW)
        return self._sorted_window(order, epoch, window)[within * self.global_batch : (within + 1) * self.global_batch]

    def _sorted_window(self, order: Permutation, epoch: int, window: int) -> np.ndarray:
        """The examples at one window of positions of the epoch's order, longest first (cached)."""
        if self._window is None or self._window[0] != (epoch, window):
            size = self.global_batch * _GROUP_WINDOW
            end = min((window + 1) * size, self.steps_per_epoch * self.global_batch)
            examples = order(np.arange(window * size, end))  # (W,)
            sorted_examples = examples[np.argsort(-np.asarray(self.lengths[examples]), kind="stable")]
            self._window = ((epoch, window), sorted_examples)
        return self._window[1]

    def micro_batches(self, step: int) -> list[np.ndarray]:
        """This rank's ``grad_accum`` micro-batches of indices at 0-based ``step``."""
        per_rank = self.global_batch // self.world_size
        shard = self.global_batch_at(step)[self.rank * per_rank : (self.rank + 1) * per_rank]
        return np.split(shard, self.grad_accum)
