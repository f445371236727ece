"""``Rows``: which rows a group pass runs, each a token of a request (its slot) at its own loop and output
position, and where a runner-up branch's row keeps its keys. Plain arrays: the cache reads them, the kernels
tile them, the engine builds them.

``to_device`` is how every host array of the decode path reaches the device: on CUDA through pinned memory and a
copy the host does not wait for (a plain ``torch.as_tensor(array, device="cuda")`` copies from pageable memory
and blocks until the device's queue has drained to it)."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch
from torch import Tensor


def to_device(
    values: np.ndarray | list | Tensor, device: torch.device | str, dtype: torch.dtype | None = None
) -> Tensor:
    """``values`` as a tensor on ``device``: on the CPU the array itself (no copy where it can); on CUDA staged in
    pinned memory and copied with ``non_blocking=True``: the host goes on at once, and the copy runs in stream order
    before the kernels that read it. The pinned block comes from torch's caching host allocator, which reuses it
    only once the copy that read it has finished, so the host may change ``values`` right after. ``values`` may be a
    CPU tensor (e.g. bf16, which numpy has not)."""
    host = values.to(dtype) if isinstance(values, Tensor) else torch.as_tensor(np.asarray(values), dtype=dtype)
    device = torch.device(device)
    if device.type != "cuda":
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)


@dataclass(frozen=True)
class Rows:
    """The tokens processed by one pass of the shared layer group, one row each.

    Row r is the token at decoder position ``pos[r]`` of engine slot ``slot[r]``,
    running loop ``loop[r]`` (0-based); ``side[r]`` >= 0 makes it a branch row
    that keeps its own key/value in that side entry of its slot (-1: a chain
    row), and ``up[r]`` lists the (position, side entry) of the branch tokens
    before it in its lane, oldest first (the lane forks at the first).
    ``side`` and ``up`` are None when no row is a branch. The last ``padding`` rows
    fill a row-count bucket (``speed.engine.graphs``): they sit in the engine's
    scratch slot, and no one reads what they compute.
    """

    slot: np.ndarray  # (R,) int64
    loop: np.ndarray  # (R,) int64
    pos: np.ndarray  # (R,) int64
    side: np.ndarray | None = None  # (R,) int64 side entry of a branch row, -1 for a chain row; None: no branches
    up: tuple[tuple[tuple[int, int], ...], ...] | None = None  # per row: its lane's earlier (pos, side entry)s
    padding: int = 0  # the last rows that only fill a bucket
    _tensors: dict = field(default_factory=dict, repr=False, compare=False)  # device -> (slot, loop, pos)

    @classmethod
    def build(
        cls,
        slot: list[int],
        loop: list[int],
        pos: list[int],
        side: list[int] | None = None,
        up: list[tuple[tuple[int, int], ...]] | None = None,
    ) -> Rows:
        """Rows from three equally long lists of ints (and, for branch rows, ``side`` and ``up``)."""
        s, lo, p = (np.asarray(x, dtype=np.int64) for x in (slot, loop, pos))
        if not len(s) == len(lo) == len(p) == (len(p) if side is None else len(side)):
            raise ValueError(f"slot, loop, pos (and side) differ in length: {len(s)}, {len(lo)}, {len(p)}")
        if side is None or all(x < 0 for x in side):
            return cls(s, lo, p)
        return cls(s, lo, p, np.asarray(side, dtype=np.int64), tuple(up) if up is not None else ((),) * len(p))

    def __len__(self) -> int:
        return len(self.slot)

    def take(self, index: np.ndarray) -> Rows:
        """The rows at ``index`` (an index may repeat, e.g. to pad a tile)."""
        if self.side is None or (self.side[index] < 0).all():
            return Rows(self.slot[index], self.loop[index], self.pos[index])
        up = tuple(self.up[i] for i in index.tolist())
        return Rows(self.slot[index], self.loop[index], self.pos[index], self.side[index], up)

    def lane_entries(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Every (row, position, side entry) a branch row reads from side entries: its lane's and its own."""
        if "lane" not in self._tensors:
            r, p, b = [], [], []
            for i in np.flatnonzero(self.side >= 0).tolist():
                for pos, side in (*self.up[i], (int(self.pos[i]), int(self.side[i]))):
                    r.append(i)
                    p.append(pos)
                    b.append(side)
            self._tensors["lane"] = tuple(np.asarray(x, dtype=np.int64) for x in (r, p, b))
        return self._tensors["lane"]

    def forks(self) -> np.ndarray:
        """(B,) the first lane position of each branch row (where its prefix from the chain ends)."""
        return np.asarray([u[0][0] if u else p for u, p, b in zip(self.up, self.pos.tolist(), self.side) if b >= 0])

    def tensors(self, device: torch.device | str) -> tuple[Tensor, Tensor, Tensor]:
        """(slot, loop, pos) as long tensors on ``device``, made once per device."""
        key = str(device)
        if key not in self._tensors:
            self._tensors[key] = tuple(to_device(a, device) for a in (self.slot, self.loop, self.pos))
        return self._tensors[key]
