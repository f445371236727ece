"""MLflow tracking without Ray: the ``tracking`` section and its flags, the default store, the check at start.

The tracked Train runs themselves are read back in ``test_train_ray.py`` (one run per Train run, metric
histories per logged step, params) and ``test_sweep.py`` (one run per trial).
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from speed.paths import repo_root
from speed.train.config import TrackingConfig, job_from_args, job_from_dict, job_to_dict, run_name
from speed.train.tracking import TrackingError, check, experiment_name, flatten, step_metrics, tracking_uri
from speed.train.train_log import StepRecord


def test_tracking_flags_and_section(tmp_path):
    job = job_from_args("pretrain", ["--storage-path", str(tmp_path), "--tracking-uri", "http://127.0.0.1:5000"])
    assert job.tracking == TrackingConfig(uri="http://127.0.0.1:5000") and tracking_uri(job) == "http://127.0.0.1:5000"
    assert job_from_args("pretrain", ["--no-tracking"]).tracking is None
    assert tracking_uri(job_from_args("pretrain", ["--no-tracking"])) is None
    cfg = tmp_path / "job.yaml"
    cfg.write_text("tracking: {experiment: loops}\n")
    named = job_from_args("finetune", ["--config", str(cfg)])
    assert experiment_name(named) == "loops" and experiment_name(job_from_args("finetune", [])) == "finetune"
    assert job_from_dict(job_to_dict(named)) == named  # recorded in checkpoints like every section
    cfg.write_text("tracking: {url: http://x}\n")
    with pytest.raises(ValueError, match=r"unknown TrackingConfig key\(s\) \['url'\]"):
        job_from_args("pretrain", ["--config", str(cfg)])
    with pytest.raises(ValueError, match="TrackingConfig.experiment must be a non-empty string"):
        TrackingConfig(experiment=" ")
    # Where and whether a run is watched does not change what it computes: the same run name.
    assert run_name(job) == run_name(job_from_args("pretrain", ["--no-tracking"]))


def test_the_default_store_sits_under_local_storage_only(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert TrackingConfig().store_uri("runs") == (tmp_path / "runs" / "mlruns").as_uri()  # absolute, file://
    assert TrackingConfig().store_uri(str(tmp_path / "s")) == f"file://{tmp_path}/s/mlruns"
    assert TrackingConfig().store_uri("s3://bucket/speed") is None  # no local default for remote storage
    assert TrackingConfig(uri="http://127.0.0.1:5000").store_uri("s3://bucket/speed") == "http://127.0.0.1:5000"
    assert TrackingConfig(uri="track").store_uri("s3://bucket/speed") == (tmp_path / "track").as_uri()


def test_an_unreachable_server_fails_the_job_at_its_start(monkeypatch):
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    job = job_from_args("pretrain", ["--tracking-uri", f"http://127.0.0.1:{port}"])
    message = rf"MLflow tracking at http://127.0.0.1:{port} cannot be used .*--no-tracking"
    with pytest.raises(TrackingError, match=message):
        check(job)
    assert issubclass(TrackingError, ValueError)  # speed.cli.user_errors: one line, status 2
    check(job_from_args("pretrain", ["--no-tracking"]))  # nothing to reach


def test_a_file_store_writes_only_under_the_storage_path(tmp_path):
    """A fresh process (first import of MLflow) with an empty HOME: the store is created, nothing else is written."""
    home, cwd, storage = tmp_path / "home", tmp_path / "cwd", tmp_path / "runs"
    home.mkdir()
    cwd.mkdir()
    script = (
        "import json, sys\n"
        "from speed.train import tracking\n"
        "from speed.train.config import job_from_args\n"
        "job = job_from_args('pretrain', ['--storage-path', sys.argv[1]])\n"
        "tracking.check(job)\n"
        "mlflow = tracking.import_mlflow()\n"
        "mlflow.set_tracking_uri(tracking.tracking_uri(job))\n"
        "with mlflow.start_run(experiment_id=mlflow.create_experiment('pretrain')):\n"
        "    mlflow.log_metrics({'loss': 1.0}, step=1)\n"
        "print(json.dumps(mlflow.search_runs(experiment_names=['pretrain'], output_format='list')[0].data.metrics))\n"
    )
    keep = ("PATH", "LANG", "OMP_NUM_THREADS")  # no CI or pytest markers: MLflow's own telemetry switches stay off
    env = {k: os.environ[k] for k in keep if k in os.environ}
    env |= {"HOME": str(home), "PYTHONPATH": str(repo_root() / "platform")}
    out = subprocess.run(
        [sys.executable, "-c", script, str(storage)], cwd=cwd, env=env, capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout.strip().splitlines()[-1]) == {"loss": 1.0}
    assert (storage / "mlruns").is_dir()
    assert list(home.iterdir()) == [] and list(cwd.iterdir()) == []  # no telemetry id in HOME, no ./mlruns


def test_step_metrics_name_every_loop_and_params_use_set_keys():
    record = StepRecord(4, 2.5, [3.0, 2.0], 1e-3, 0.5, 100, 0.2, 500.0, 1.0, 0)
    assert step_metrics(record) == {
        "loss": 2.5,
        "lr": 1e-3,
        "grad_norm": 0.5,
        "tokens_per_s": 500.0,
        "step_time_s": 0.2,
        "loss_loop1": 3.0,
        "loss_loop2": 2.0,
    }
    params = flatten(job_to_dict(job_from_args("pretrain", ["--no-tracking"])))
    assert params["train.settle.kind"] == "none" and params["optim.betas"] == (0.9, 0.98) and params["tracking"] is None
    assert Path(params["run.storage_path"]).name == "runs"
