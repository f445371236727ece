"""Deterministic data sharding: which examples each worker trains on at each step.

Ray Data's ``get_dataset_shard`` streams in an order that cannot be replayed
from a step number, and exact resume needs exactly that. So the order here is
a pure function of ``(seed, step)``: epoch ``e`` is a permutation of the
examples seeded by ``(seed, e)`` cut into global batches (remainder dropped);
global batch ``s`` is cut into ``world_size`` contiguous shards, one per rank,
and each shard into ``grad_accum`` micro-batches. A run resumed at step ``s``
(with any worker count of the same global batch) sees the same examples.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

# Length grouping sorts windows of this many global batches, so batches hold similar
# lengths (less padding) while the window keeps the order random across the epoch.
_GROUP_WINDOW = 50


class BatchPlan:
    """The micro-batches (example indices) of one rank at every step."""

    def __init__(
        self,
        lengths: Sequence[int],
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
        self.lengths = np.asarray(lengths, dtype=np.int64)
        self.global_batch = global_batch
        self.world_size = world_size
        self.rank = rank
        self.grad_accum = grad_accum
        self.seed = seed
        self.group_by_length = group_by_length
        self._cached: tuple[int, np.ndarray] | None = None

    @property
    def steps_per_epoch(self) -> int:
        """Global batches per pass over the data."""
        return len(self.lengths) // self.global_batch

    def epoch_batches(self, epoch: int) -> np.ndarray:
        """(steps_per_epoch, global_batch) example indices of one epoch, in step order."""
        if self._cached is not None and self._cached[0] == epoch:
            return self._cached[1]
        rng = np.random.default_rng([self.seed, epoch])
        order = rng.permutation(len(self.lengths))
        usable = self.steps_per_epoch * self.global_batch
        if self.group_by_length:
            window = self.global_batch * _GROUP_WINDOW
            chunks = [order[i : i + window] for i in range(0, len(order), window)]
            order = np.concatenate([c[np.argsort(-self.lengths[c], kind="stable")] for c in chunks])
            batches = order[:usable].reshape(self.steps_per_epoch, self.global_batch)
            batches = batches[rng.permutation(self.steps_per_epoch)]  # (steps, G)
        else:
            batches = order[:usable].reshape(self.steps_per_epoch, self.global_batch)  # (steps, G)
        self._cached = (epoch, batches)
        return batches

    def epoch_at(self, step: int) -> int:
        """The epoch (0-based) that 0-based ``step`` belongs to."""
        return step // self.steps_per_epoch

    def global_batch_at(self, step: int) -> np.ndarray:
        """(global_batch,) indices trained on by all workers together at 0-based ``step``."""
        epoch, index = divmod(step, self.steps_per_epoch)
        return self.epoch_batches(epoch)[index]

    def micro_batches(self, step: int) -> list[np.ndarray]:
        """This rank's ``grad_accum`` micro-batches of indices at 0-based ``step``."""
        per_rank = self.global_batch // self.world_size
        shard = self.global_batch_at(step)[self.rank * per_rank : (self.rank + 1) * per_rank]
        return np.split(shard, self.grad_accum)
