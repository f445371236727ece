"""Fixed-width text tables, as the benchmarks, the sweeps and the analysis print their rows: a header, a rule as
wide, then a line per row, each column a ``Column`` (its title, its width, how a row's cell reads).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

Row = dict[str, Any]


@dataclass(frozen=True)
class Column:
    """One column of a text table: ``title`` over cells ``width`` wide (0: as wide as each is; a cell wider than
    ``width`` is never cut), aligned right or ``left``. A row's cell is its ``value`` (a key of the row, or a
    function of it) formatted by ``spec`` (".2f"), then ``suffix`` inside the width ("x" after a ratio); ``gap``
    goes before the column, title and cells alike."""

    title: str
    width: int
    value: str | Callable[[Row], Any]
    spec: str = ""
    suffix: str = ""
    left: bool = False
    gap: str = ""

    def _fit(self, text: str) -> str:
        return self.gap + (format(text, f"{'<' if self.left else '>'}{self.width}") if self.width else text)

    def head(self) -> str:
        return self._fit(self.title)

    def cell(self, row: Row) -> str:
        value = row[self.value] if isinstance(self.value, str) else self.value(row)
        return self._fit(format(value, self.spec) + self.suffix)


def table_head(columns: Sequence[Column]) -> list[str]:
    """The header line and its rule."""
    head = "".join(c.head() for c in columns)
    return [head, "-" * len(head)]


def table_line(columns: Sequence[Column], row: Row) -> str:
    """One row's line."""
    return "".join(c.cell(row) for c in columns)


def text_table(columns: Sequence[Column], rows: Iterable[Row]) -> str:
    """The header, its rule and a line per row."""
    return "\n".join([*table_head(columns), *(table_line(columns, r) for r in rows)])
