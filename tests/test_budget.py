"""jobs/budget_curve.py on tiny runs of kept training checkpoints (T5 on a local path, a looped LM on a URI):
budget.parquet's rows are each checkpoint's own evaluation, the paired differences speed.eval.compare's."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from budget_helpers import STEPS, TOKENS_PER_STEP, make_run

from speed import SpeedT5, preset
from speed.analysis import budget_loops, discover, format_budget, load_budget
from speed.config import lm_preset
from speed.eval.budget import BUDGET_FILE, BUDGET_SCHEMA, checkpoint_steps
from speed.eval.compare import compare_evaluations
from speed.eval.evaluate import SUMMARY_FILE
from speed.models.looped_lm import LoopedLM
from speed.paths import repo_root
from speed.storage import locate
from speed.train.state import checkpoint_name

EVAL_FLAGS = ["--limit", "3", "--max-new-tokens", "6", "--bootstrap-samples", "20", "--threads", "1"]


@pytest.fixture(autouse=True)
def restore_threads():
    """The job takes one torch thread (--threads 1: tiny models decode fastest so); give the rest back after."""
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


def _t5(vocab_size: int, step: int) -> SpeedT5:
    torch.manual_seed(step)  # another model at every budget: what training changes, the curve must follow
    return SpeedT5(preset("tiny", vocab_size=vocab_size, pattern="2x3")).eval()


def _lm(vocab_size: int, step: int) -> LoopedLM:
    torch.manual_seed(step)
    return LoopedLM(lm_preset("tiny", vocab_size=vocab_size, pattern="1+2x2+1")).eval()


def _job():
    spec = importlib.util.spec_from_file_location("budget_curve_job", repo_root() / "jobs" / "budget_curve.py")
    job = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(job)
    return job


def _check_rows(table: pa.Table, out, run: str, family: str) -> None:
    """Every row is its checkpoint's own summary.json; every difference speed.eval.compare's against the previous."""
    assert table.schema.equals(BUDGET_SCHEMA)
    rows = table.to_pylist()
    assert [r["step"] for r in rows] == list(STEPS)
    assert [r["train_tokens"] for r in rows] == [s * TOKENS_PER_STEP for s in STEPS]
    for i, r in enumerate(rows):
        folder = locate(out) / r["evaluation"]
        summary = json.loads((folder / SUMMARY_FILE).read_text())
        assert (r["run"], r["family"], r["pattern"], r["examples"]) == (run, family, summary["model"]["pattern"], 3)
        assert r["evaluation"] == checkpoint_name(r["step"]) and summary["config"]["batch_size"] == 1
        score = summary["metrics"]["bleu"]["score"] if r["metric"] == "bleu" else summary["metrics"]["rouge"]["rougeL"]
        assert r["score"] == score
        assert (r["score_low"], r["score_high"]) == tuple(summary["intervals"][r["metric"]][k] for k in ("low", "high"))
        flips = sorted(summary["flip_rates"], key=lambda f: f["loop"])
        assert r["flip_rate_final"] == [f["flip_rate_final"] for f in flips]
        assert r["flip_rate_prev"] == [f["flip_rate_prev"] for f in flips]
        assert r["steps_per_token"] == summary["decode"]["steps_per_token"]
        assert r["oracle_steps_per_token"] == summary["decode"]["oracle_steps_per_token"]
        assert r["perplexity"] == summary["perplexity"]["perplexity"]
        if i == 0:
            assert r["delta"] is None
            continue
        previous = (locate(out) / rows[i - 1]["evaluation"]).uri
        paired = compare_evaluations(previous, folder.uri, samples=20)["accuracy"][r["metric"]]
        assert (r["delta"], r["delta_low"], r["delta_high"]) == (paired["delta"], paired["low"], paired["high"])


def test_t5_budget_curve_then_reused(tmp_path, tiny_tokenizer, capsys):
    """A T5 translation run: every kept checkpoint evaluated; a second run reads the evaluations back."""
    from speed.tokenizer import Tokenizer

    vocab = Tokenizer.load(tiny_tokenizer).vocab_size
    run = str(make_run(tmp_path / "run", lambda s: _t5(vocab, s), tiny_tokenizer, "translate_en_de"))
    assert _job().main(["--run", run, "--split", "validation", *EVAL_FLAGS]) == 0
    out = f"{run}/budget/translate_en_de-validation"
    table = pq.read_table(f"{out}/{BUDGET_FILE}")
    _check_rows(table, out, run, "t5")
    assert table["metric"].to_pylist() == ["bleu"] * 3
    printed = capsys.readouterr().out
    assert "budget 3/3: step 6 (evaluated)" in printed and f"wrote {out}/{BUDGET_FILE} (3 budgets)" in printed

    assert _job().main(["--run", run, "--split", "validation", "--steps", "6", "2", *EVAL_FLAGS]) == 0
    printed = capsys.readouterr().out
    assert "budget 1/2: step 2 (reused)" in printed and "budget 2/2: step 6 (reused)" in printed
    reread = load_budget(out)
    assert reread["step"].to_pylist() == [2, 6] and reread["score"].to_pylist() == table["score"].to_pylist()[::2]
    assert discover(tmp_path).budgets == [Path(out)]
    loops = budget_loops(reread).to_pylist()
    assert [(r["step"], r["loop"]) for r in loops] == [(s, loop) for s in (2, 6) for loop in (1, 2, 3)]
    assert "bleu" in format_budget(reread)


def test_lm_budget_curve_on_object_storage(tmp_path, tiny_tokenizer, memory_store, capsys):
    """A looped LM's summarization run kept on a URI (two budgets of three were not kept): named, then drawn."""
    from speed.tokenizer import Tokenizer

    vocab = Tokenizer.load(tiny_tokenizer).vocab_size
    local = make_run(tmp_path / "run", lambda s: _lm(vocab, s), tiny_tokenizer, "summarize", every=1)
    run = f"{memory_store}/run"
    locate(run).upload(local)
    assert [b.step for b in checkpoint_steps(run)] == list(STEPS)
    out = f"{memory_store}/curve"
    assert _job().main(["--run", run, "--out", out, "--split", "validation", *EVAL_FLAGS]) == 0
    table = load_budget_uri(out)
    _check_rows(table, out, run, "lm")
    assert table["metric"].to_pylist() == ["rougeL"] * 3
    printed = capsys.readouterr().out
    assert "lacks the checkpoint(s) of step(s) 1, 3, 5" in printed


def load_budget_uri(out: str) -> pa.Table:
    file = locate(out) / BUDGET_FILE
    return pq.read_table(file.path, filesystem=file.fs)


def test_clear_errors(tmp_path, tiny_tokenizer, capsys):
    """A run without checkpoints, and a budget the run did not keep: one line each, status 2, nothing written."""
    (tmp_path / "empty").mkdir()
    with pytest.raises(SystemExit) as exit_:
        _job().main(["--run", str(tmp_path / "empty")])
    assert exit_.value.code == 2 and "error: " in capsys.readouterr().err
    from speed.tokenizer import Tokenizer

    vocab = Tokenizer.load(tiny_tokenizer).vocab_size
    run = make_run(tmp_path / "run", lambda s: _t5(vocab, s), tiny_tokenizer, "translate_en_de", steps=(2,))
    with pytest.raises(SystemExit) as exit_:
        _job().main(["--run", str(run), "--steps", "2", "4", *EVAL_FLAGS])
    err = capsys.readouterr().err
    assert exit_.value.code == 2
    assert "error: " in err and "no complete checkpoint at step(s) 4 (train.keep_checkpoints=3); it holds 2" in err
    assert not (run / "budget").exists()
