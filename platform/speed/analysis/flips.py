"""Flip statistics of the early exits (the paper's Figure 4), per loop and by output position."""

from __future__ import annotations

import pyarrow as pa
import pyarrow.compute as pc

from speed.engine.trace import flip_rates

__all__ = ["flip_rates", "flip_rates_by_position"]


def flip_rates_by_position(trace: pa.Table, bucket: int = 1) -> pa.Table:
    """Per (position bucket, loop): tokens, flip rate vs the previous loop and vs the final token.

    ``position`` is the first output position of its bucket (``bucket`` positions wide),
    so late, sparsely populated positions can be pooled; ``tokens`` says how many
    committed tokens each rate rests on. Rows sorted by position, then loop.
    """
    if bucket < 1:
        raise ValueError(f"bucket must be at least 1, got {bucket}")
    start = pc.multiply(pc.divide(trace["position"], pa.scalar(bucket, pa.int32())), pa.scalar(bucket, pa.int32()))
    table = pa.table(
        {
            "position": start,
            "loop": trace["loop"],
            "flipped_prev": trace["flipped_prev"],
            "flipped_final": trace["flipped_final"],
        }
    )
    grouped = table.group_by(["position", "loop"]).aggregate(
        [("flipped_prev", "count"), ("flipped_prev", "mean"), ("flipped_final", "mean")]
    )
    grouped = grouped.rename_columns(["position", "loop", "tokens", "flip_rate_prev", "flip_rate_final"])
    return grouped.sort_by([("position", "ascending"), ("loop", "ascending")])
