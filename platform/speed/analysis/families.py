"""The two model families side by side: a T5 and a looped LM of equal size, trained on the same examples.

``speed.train.families.compare_families`` trains both, evaluates both on the same held-out examples
(``jobs/evaluate.py``'s folders) and writes ``families.parquet`` (``FAMILIES_SCHEMA``, one row per model). These
functions turn it into what the families notebook draws: every loop's flip rates and perplexity
(``loop_table``), SPEED's own and oracle steps per token and its speed-up (the rows themselves), quality with
bootstrap intervals and the LM's paired difference from the T5 (``quality_difference``), and the
accuracy-latency plane (``latency_plane``).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from speed.analysis.results import Evaluation, load_evaluation
from speed.eval.metrics import paired_bootstrap
from speed.tables import Column, text_table
from speed.train.families import FAMILIES_FILE


@dataclass(frozen=True)
class Families:
    """A comparison's folder: its rows and every row's evaluation."""

    path: Path
    table: pa.Table  # FAMILIES_SCHEMA
    evaluations: dict[str, Evaluation]  # by family

    def label(self, family: str) -> str:
        """``lm 1+2x3+1`` etc.: a row's family and pattern, for legends."""
        row = next(r for r in self.table.to_pylist() if r["family"] == family)
        return f"{family} {row['pattern']}"


def load_families(path: str | Path) -> Families:
    """Read ``families.parquet`` in ``path`` and the evaluation folders its rows name."""
    path = Path(path)
    if not (path / FAMILIES_FILE).is_file():
        raise FileNotFoundError(f"{path} holds no {FAMILIES_FILE}: not a family comparison")
    table = pq.read_table(path / FAMILIES_FILE)
    evaluations = {r["family"]: load_evaluation(path / r["evaluation"]) for r in table.to_pylist()}
    return Families(path, table, evaluations)


LOOPS_SCHEMA = pa.schema(
    [
        pa.field("family", pa.string()),
        pa.field("pattern", pa.string()),
        pa.field("loop", pa.int32()),  # 1..M
        pa.field("fraction", pa.float64()),  # loop / M: where the loop lies in its model's depth
        pa.field("flip_rate_prev", pa.float64()),
        pa.field("flip_rate_final", pa.float64()),
        pa.field("perplexity", pa.float64()),
    ]
)


def loop_table(table: pa.Table) -> pa.Table:
    """One row per (family, loop): the decoded tokens' flip rates and the references' perplexity."""
    rows = []
    for r in table.to_pylist():
        loops = len(r["flip_rate_final"])
        for i in range(loops):
            rows.append(
                {
                    "family": r["family"],
                    "pattern": r["pattern"],
                    "loop": i + 1,
                    "fraction": (i + 1) / loops,
                    "flip_rate_prev": r["flip_rate_prev"][i],
                    "flip_rate_final": r["flip_rate_final"][i],
                    "perplexity": r["perplexity"][i] if r["perplexity"] else None,
                }
            )
    return pa.Table.from_pylist(rows, schema=LOOPS_SCHEMA)


PLANE_SCHEMA = pa.schema(
    [
        pa.field("family", pa.string()),
        pa.field("pattern", pa.string()),
        pa.field("decoder", pa.string()),  # speed | sequential
        pa.field("ms_per_token", pa.float64()),
        pa.field("accuracy", pa.float64()),  # the same for both decoders of a model: their outputs are identical
        pa.field("accuracy_low", pa.float64()),
        pa.field("accuracy_high", pa.float64()),
    ]
)


def latency_plane(table: pa.Table) -> pa.Table:
    """The accuracy-latency plane (the paper's Figure 3): every model decoded with SPEED and sequentially."""
    rows = []
    for r in table.to_pylist():
        for decoder in ("speed", "sequential"):
            rows.append(
                {
                    "family": r["family"],
                    "pattern": r["pattern"],
                    "decoder": decoder,
                    "ms_per_token": r[f"{decoder}_ms_per_token"],
                    **{k: r[k] for k in ("accuracy", "accuracy_low", "accuracy_high")},
                }
            )
    return pa.Table.from_pylist(rows, schema=PLANE_SCHEMA)


def quality_difference(
    families: Families, baseline: str = "t5", system: str = "lm", samples: int = 1000, seed: int = 12345
) -> dict[str, dict[str, float]]:
    """``system``'s BLEU and ROUGE-L minus ``baseline``'s on the same held-out examples, with paired-bootstrap
    intervals (``speed.eval.metrics.paired_bootstrap``); the two read the sources in their own prompt formats, so
    the examples are matched by their references."""
    sides = [families.evaluations[name].predictions.sort_by("example").to_pydict() for name in (baseline, system)]
    if sides[0]["reference"] != sides[1]["reference"]:
        raise ValueError(f"{baseline} and {system} were not evaluated on the same examples (their references differ)")
    return paired_bootstrap(sides[0]["hypothesis"], sides[1]["hypothesis"], sides[0]["reference"], samples, seed)


def _interval(r: dict) -> str:
    return f"[{r['accuracy_low']:.2f}, {r['accuracy_high']:.2f}]" if r["accuracy_low"] is not None else "-"


FAMILY_COLUMNS = (
    Column("family", 8, "family", left=True),
    Column("pattern", 10, "pattern"),
    Column("params", 10, "parameters"),
    Column("tokens", 10, "train_tokens"),
    Column("metric", 8, "accuracy_metric"),
    Column("score", 7, "accuracy", ".2f"),
    Column("95% interval", 16, _interval),
    Column("flip@1", 8, lambda r: r["flip_rate_final"][0], ".3f"),
    Column("steps/tok", 10, "steps_per_token", ".2f"),
    Column("oracle", 8, lambda r: "-" if r["oracle_steps_per_token"] is None else f"{r['oracle_steps_per_token']:.2f}"),
    Column("ms/tok", 8, "speed_ms_per_token", ".2f"),
    Column("seq ms", 8, "sequential_ms_per_token", ".2f"),
    Column("speed-up", 9, "speedup", ".2f", "x"),
)


def format_families(table: pa.Table) -> str:
    """The rows side by side as a fixed-width text table."""
    return text_table(FAMILY_COLUMNS, table.to_pylist())
