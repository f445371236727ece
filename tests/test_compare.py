"""Comparing two evaluation folders: the paired interval, the SPEED cost of each, refusing different examples."""

from __future__ import annotations

import importlib.util
import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from speed.eval.compare import compare_evaluations, format_comparison
from speed.eval.evaluate import PREDICTIONS_FILE, PREDICTIONS_SCHEMA, SUMMARY_FILE
from speed.losses import flip_cost
from speed.paths import repo_root

REFS = ["a man rides a red bike", "two dogs play in the snow", "a woman reads a book", "kids swim in a pool"] * 3


def _evaluation(folder, hypotheses, refs=REFS, steps=30, flips=(0.0, 0.2, 0.1)):
    """What jobs/evaluate.py writes, reduced to what a comparison reads."""
    folder.mkdir(parents=True)
    n = len(refs)
    columns = {"example": list(range(n)), "source": [f"src {i}" for i in range(n)], "reference": refs}
    columns |= {"hypothesis": hypotheses, "output_tokens": [5] * n, "finished": [True] * n}
    pq.write_table(pa.Table.from_pydict(columns, schema=PREDICTIONS_SCHEMA), folder / PREDICTIONS_FILE)
    rates = [{"loop": k + 1, "tokens": 20, "flip_rate_prev": r, "flip_rate_final": 0.0} for k, r in enumerate(flips)]
    summary = {"flip_rates": rates, "decode": {"speed": {"steps": steps, "tokens": 20}}}
    (folder / SUMMARY_FILE).write_text(json.dumps(summary))
    return folder


def test_a_better_system_has_an_interval_above_zero_and_costs_are_read(tmp_path):
    base = _evaluation(tmp_path / "a", ["nothing matches"] * len(REFS), steps=40, flips=(0.0, 0.3, 0.2))
    better = _evaluation(tmp_path / "b", [r.replace("a ", "the ", 1) for r in REFS], steps=30)
    c = compare_evaluations(base, better, samples=200)
    assert c["examples"] == len(REFS)
    for r in c["accuracy"].values():
        assert r["delta"] > 0 and 0 < r["low"] <= r["high"]
    assert c["cost"]["baseline"]["steps_per_token"] == 2.0 and c["cost"]["system"]["steps_per_token"] == 1.5
    assert c["cost"]["baseline"]["flip_cost"] == pytest.approx(flip_cost([0.0, 0.3, 0.2]))  # 0.3 + 2 * 0.2
    same = compare_evaluations(base, base, samples=50)
    assert all(r["delta"] == 0 and r["low"] <= 0 <= r["high"] for r in same["accuracy"].values())
    assert "bleu" in format_comparison(c) and "steps/token" in format_comparison(c)


def test_evaluations_of_other_examples_are_refused(tmp_path):
    base = _evaluation(tmp_path / "a", ["x"] * len(REFS))
    other = _evaluation(tmp_path / "b", ["x"] * len(REFS), refs=list(reversed(REFS)))
    with pytest.raises(ValueError, match="same examples"):
        compare_evaluations(base, other)


def test_the_job_prints_and_writes_the_comparison(tmp_path, capsys):
    spec = importlib.util.spec_from_file_location("compare_job", repo_root() / "jobs" / "compare.py")
    job = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(job)
    base = _evaluation(tmp_path / "a", ["nothing matches"] * len(REFS))
    system = _evaluation(tmp_path / "b", REFS)
    out = tmp_path / "c.json"
    argv = ["--baseline", str(base), "--system", str(system), "--samples", "50", "--out", str(out)]
    assert job.main(argv) == 0
    assert "rougeL" in capsys.readouterr().out and json.loads(out.read_text())["accuracy"]["bleu"]["delta"] > 0
    with pytest.raises(SystemExit) as exit_:
        job.main(["--baseline", str(tmp_path / "missing"), "--system", str(system)])
    assert exit_.value.code == 2
