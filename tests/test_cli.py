"""Job entry points: a user's mistake is one `error: ...` line and exit status 2; real faults keep tracebacks."""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import re
import subprocess
import sys

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from speed.cli import config_from_args, report_rows
from speed.paths import repo_root


def _job(name: str):
    spec = importlib.util.spec_from_file_location(f"{name}_job", repo_root() / "jobs" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _error_line(capsys, job: str, argv: list[str]) -> str:
    with pytest.raises(SystemExit) as exit_:
        _job(job).main(argv)
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: "), err  # one line, no traceback
    return err.strip()


@pytest.mark.parametrize(
    "job, argv, message",
    [
        ("pretrain", ["--preset", "huge"], "error: unknown model preset 'huge'"),
        ("pretrain", ["--pattern", "2x0"], r"error: sharing pattern '2x0': M \(loops\) must be at least 1"),
        ("pretrain", ["--set", "train.bf16=maybe"], "error: train.bf16: expected true or false, got 'maybe'"),
        ("pretrain", ["--set", "optim.lr"], "error: --set expects KEY=VALUE, got 'optim.lr'"),
        ("pretrain", ["--config", "/nonexistent/job.yaml"], "error: no config file at /nonexistent/job.yaml"),
        ("pretrain", ["--tokenizer", "/nonexistent/spm.model"], "error: no tokenizer file at /nonexistent/spm.model"),
        ("pretrain", ["--source", "/nonexistent/corpus.jsonl"], "error: no such data file: /nonexistent/corpus.jsonl"),
        ("pretrain", ["--max-step", "3"], r"error: unrecognized arguments: --max-step 3 \(see pretrain.py --help\)"),
        ("pretrain", ["--lr", "fast"], "error: argument --lr: invalid float value: 'fast'"),
        ("finetune", ["--init-from", "/nonexistent/run"], "error: no checkpoint or run directory at /nonexistent/run"),
        ("finetune", ["--eval-split", "dev"], "error: no 'dev' split in .*multi30k_en_de; splits there: "),
        ("finetune", ["--task", "pretrain"], "error: task 'pretrain' has no references to score"),
        ("evaluate", ["--checkpoint", "/nonexistent/ckpt"], "error: no checkpoint or run directory at /nonexistent/"),
        ("evaluate", ["--checkpoint", "x", "--invalidation", "lazy"], r"error: invalidation: expected one of \["),
        ("evaluate", ["--checkpoint", "x", "--limit", "ten"], "error: limit: expected an integer, got 'ten'"),
        ("bench_decode", ["--pattern", "ax6"], "error: sharing pattern 'ax6' is not of the form NxM"),
        ("bench_decode", ["--shape", "ouro-1.4b"], r"error: unrecognized arguments: --shape ouro-1.4b \(see bench_"),
        ("bench_shapes", ["--shape", "ouro-9b"], "error: --shape 'ouro-9b': known shapes are ouro-1.4b, "),
        ("bench_shapes", ["--shape", "ouro-1.4b", "--family", "lm"], "error: unrecognized arguments: --family lm"),
        ("bench_agreement", ["--checkpoint", "/nonexistent/ckpt"], "error: no checkpoint or run directory at /non"),
        ("evaluate", ["--checkpoint", "x", "--top-p", "2"], r"error: EvalConfig: top_p must be in \(0, 1\], got 2"),
        ("bench_sampling", ["--checkpoint", "/nonexistent/ckpt"], "error: no checkpoint or run directory at /nonexi"),
        ("bench_sampling", ["--checkpoint", "x", "--temperatures", "0,-1"], "error: temperatures must be >= 0"),
        ("serve", ["--checkpoint", "x", "--set", "max_active"], "error: --set expects KEY=VALUE, got 'max_active'"),
        ("serve", ["--checkpoint", "x", "--set", "task=[a"], r"error: --set task=\[a: not valid YAML \("),
    ],
)
def test_a_mistake_is_one_line_and_status_2(capsys, job, argv, message):
    assert re.match(message, _error_line(capsys, job, argv))


def test_a_real_fault_keeps_its_traceback(monkeypatch):
    job = _job("pretrain")

    def broken(_job):
        raise RuntimeError("a worker died")

    monkeypatch.setattr("speed.train.launch.run_job", broken)
    with pytest.raises(RuntimeError, match="a worker died"):
        job.main(["--preset", "tiny"])


def test_the_exit_status_of_the_process():
    done = subprocess.run(
        [sys.executable, str(repo_root() / "jobs" / "pretrain.py"), "--preset", "huge"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2
    assert done.stderr.startswith("error: unknown model preset 'huge'") and done.stderr.count("\n") == 1


def test_config_from_args_takes_the_flags_named_like_fields_and_the_given_values_over_them():
    @dataclasses.dataclass(frozen=True)
    class Settings:
        a: int
        b: int = 2
        c: int = 3

    args = argparse.Namespace(a=1, c=5, out="elsewhere")  # `out` names no field: left alone
    assert config_from_args(Settings, args) == Settings(a=1, b=2, c=5)
    assert config_from_args(Settings, args, c=7) == Settings(a=1, b=2, c=7)


@pytest.mark.parametrize("as_json", [True, False])
def test_report_rows_writes_the_rows_then_prints_them(tmp_path, capsys, as_json):
    out = tmp_path / "results" / "bench.parquet"
    table = pa.table({"variant": ["speed"], "ms_per_token": [1.5]})
    report_rows(table, argparse.Namespace(out=out, json=as_json), lambda t: f"TABLE of {t.num_rows}")
    assert pq.read_table(out).equals(table)
    printed = capsys.readouterr().out
    if as_json:
        assert json.loads(printed) == {"config": {"out": str(out), "json": True}, "rows": table.to_pylist()}
    else:
        assert printed == f"TABLE of 1\nrows written to {out}\n"
