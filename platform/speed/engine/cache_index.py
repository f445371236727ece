"""The device indices a pass reads a ``KVCache`` through: ``PagedIndex`` (the Triton attention's, per read) and
``StagedIndex`` (a staged pass's, one static buffer the host fills once a step). ``KVCache.paged_index`` and
``KVCache.stage`` build them."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor


@dataclass(frozen=True)
class PagedIndex:
    """Where the Triton attention (``speed.engine.triton_kernels.paged_attend``) finds each of R rows' keys: device
    tensors of shapes fixed by R and the cache (a captured CUDA graph's static buffers have these shapes), but
    the lanes' width."""

    loop: Tensor  # (R,) the row's loop: its virtual layer's place in a layer's pool
    length: Tensor  # (R,) positions it attends, 0..pos (its own, written, the last)
    table: Tensor  # (R, n_positions / ATTN_CHUNK) its slot's block table: chunk c of its positions is that block
    lane_pos: Tensor | None = None  # (R, S) a branch row's lane positions (-1 pads; a chain row's all -1)
    lane_entry: Tensor | None = None  # (R, S) their side entries (slot * n_side + side)

    @property
    def chain(self) -> tuple[Tensor, Tensor, Tensor]:
        return self.loop, self.length, self.table

    @property
    def lanes(self) -> tuple[Tensor | None, Tensor | None]:
        return self.lane_pos, self.lane_entry


@dataclass(frozen=True)
class StagedIndex:
    """A staged pass's index of R rows into one ``KVCache`` (``KVCache.stage``): contiguous views of one static
    device buffer, ``packed``, which the host fills in one copy a step (so a captured graph reads it in place)."""

    packed: Tensor  # (R * (6 + C + 2 S),) every field below, in order; C the table's chunks, S the side entries
    rows: int
    chunks: int
    n_side: int

    FIELDS = ("loop", "pos", "length", "block", "within", "entry")  # (R,) each, then the table and the lanes

    @classmethod
    def allocate(cls, rows: int, chunks: int, n_side: int, device: torch.device) -> StagedIndex:
        packed = torch.zeros(rows * (len(cls.FIELDS) + chunks + 2 * n_side), dtype=torch.long, device=device)
        return cls(packed, rows, chunks, n_side)

    def _part(self, start: int, width: int) -> Tensor:
        return self.packed[start * self.rows : (start + width) * self.rows].view(self.rows, width)

    def _column(self, i: int) -> Tensor:
        return self.packed[i * self.rows : (i + 1) * self.rows]

    # (R,): the row's loop, its position, positions it attends (pos + 1), the pool block and the place in it it
    # writes, the side entry it writes (slot * n_side + side)
    loop = property(lambda self: self._column(0))
    pos = property(lambda self: self._column(1))
    length = property(lambda self: self._column(2))
    block = property(lambda self: self._column(3))
    within = property(lambda self: self._column(4))
    entry = property(lambda self: self._column(5))
    table = property(lambda self: self._part(6, self.chunks))  # (R, C) its slot's block table
    lane_pos = property(lambda self: self._part(6 + self.chunks, self.n_side))  # (R, S) its lane's positions, -1 pads
    lane_entry = property(lambda self: self._part(6 + self.chunks + self.n_side, self.n_side))  # (R, S) their entries

    @staticmethod
    def pack(
        columns: Sequence[np.ndarray], table: np.ndarray, lane_pos: np.ndarray, lane_entry: np.ndarray
    ) -> np.ndarray:
        """The host's values in ``packed``'s layout (each (R, width) part row-major, one after another)."""
        return np.concatenate([*columns, table.ravel(), lane_pos.ravel(), lane_entry.ravel()])
