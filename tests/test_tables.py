"""The fixed-width text tables every benchmark, sweep and analysis prints (``speed.tables``)."""

from __future__ import annotations

from speed.tables import Column, table_head, table_line, text_table

COLUMNS = (
    Column("name", 6, "name", left=True),
    Column("ms", 7, "ms", ".2f"),
    Column("speed-up", 9, "speedup", ".2f", "x"),
    Column("steps", 6, lambda r: "" if r["steps"] is None else r["steps"], gap=" "),
    Column("ok", 0, "ok", gap="  "),
)


def test_a_table_is_its_head_a_rule_and_a_line_per_row():
    rows = [{"name": "seq", "ms": 3.14159, "speedup": 1.0, "steps": 12, "ok": True},
            {"name": "speed", "ms": 1.5, "speedup": 2.0944, "steps": None, "ok": False}]  # fmt: skip
    assert text_table(COLUMNS, rows).splitlines() == [
        "name       ms speed-up  steps  ok",
        "---------------------------------",
        "seq      3.14    1.00x     12  True",
        "speed    1.50    2.09x         False",
    ]


def test_a_cell_wider_than_its_column_is_never_cut_and_the_rule_follows_the_head():
    head, rule = table_head(COLUMNS)
    assert len(rule) == len(head) and set(rule) == {"-"}
    line = table_line(COLUMNS, {"name": "a-long-name", "ms": 123456.0, "speedup": 1234567.0, "steps": 1, "ok": 1})
    assert line == "a-long-name123456.001234567.00x      1  1"
