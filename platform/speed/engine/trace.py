"""The per-token flip trace: one row per (sequence, position, loop) of every committed token.

``flipped_prev`` says whether loop i's early-exit prediction differs from loop
i-1's (always false at loop 1); ``flipped_final`` whether it differs from the
committed token (always false at the last loop). How often early loops flip
decides how much speculation pays (the paper's Figure 4).
"""

from __future__ import annotations

import pyarrow as pa
import pyarrow.compute as pc

from speed.losses import flip_cost_weights

TRACE_SCHEMA = pa.schema(
    [
        pa.field("sequence", pa.int32(), nullable=False),  # request id (generate: index in the decoded batch)
        pa.field("position", pa.int32(), nullable=False),  # output token index, 0-based
        pa.field("loop", pa.int16(), nullable=False),  # 1-based loop whose exit made the prediction
        pa.field("prediction", pa.int32(), nullable=False),  # argmax of that loop's early exit
        pa.field("token", pa.int32(), nullable=False),  # committed token (= last loop's prediction)
        pa.field("flipped_prev", pa.bool_(), nullable=False),  # prediction != previous loop's
        pa.field("flipped_final", pa.bool_(), nullable=False),  # prediction != committed token
    ]
)


class TraceBuilder:
    """Collects trace rows column-wise; ``table()`` returns them under ``TRACE_SCHEMA``."""

    def __init__(self) -> None:
        self._cols: dict[str, list] = {f.name: [] for f in TRACE_SCHEMA}

    def add_token(self, sequence: int, position: int, predictions: list[int]) -> None:
        """Record one committed token from its per-loop predictions (the last one is committed)."""
        final = predictions[-1]
        c = self._cols
        for i, pred in enumerate(predictions):
            c["sequence"].append(sequence)
            c["position"].append(position)
            c["loop"].append(i + 1)
            c["prediction"].append(pred)
            c["token"].append(final)
            c["flipped_prev"].append(i > 0 and pred != predictions[i - 1])
            c["flipped_final"].append(pred != final)

    def table(self) -> pa.Table:
        """The rows sorted by (sequence, position, loop), whatever order tokens were committed in."""
        table = pa.Table.from_pydict(self._cols, schema=TRACE_SCHEMA)
        return table.sort_by([("sequence", "ascending"), ("position", "ascending"), ("loop", "ascending")])


def flip_rates(trace: pa.Table) -> pa.Table:
    """Per loop: tokens, share flipped vs the previous loop, share differing from the final token."""
    grouped = trace.group_by("loop").aggregate(
        [("flipped_prev", "mean"), ("flipped_final", "mean"), ("token", "count")]
    )
    grouped = grouped.rename_columns(["loop", "flip_rate_prev", "flip_rate_final", "tokens"])
    return grouped.take(pc.sort_indices(grouped, [("loop", "ascending")])).select(
        ["loop", "tokens", "flip_rate_prev", "flip_rate_final"]
    )


def flip_costs(trace: pa.Table) -> list[float]:
    """Per loop k (1-based): the pipeline steps per committed token that its flips cost SPEED, (k-1) x flip_prev.

    A flip at loop k (the prediction differs from loop k-1's) restarts the
    successor that launched after loop 1 and ran k-1 loops (launch loop 1, no
    branches), so it delays the token after it by about k-1 steps; the sum over
    loops is the expected delay per token. It needs no decoding beyond the
    trace (a teacher-forced pass gives the same flags). Their sum is
    ``speed.losses.flip_cost`` of the trace's flip rates.
    """
    prev = flip_rates(trace).column("flip_rate_prev").to_pylist()  # loops 1..M in order
    return [w * r for w, r in zip(flip_cost_weights(len(prev)).tolist(), prev)]
