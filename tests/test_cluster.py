"""A job sent with `ray job submit --working-dir` runs the submitted `speed`, in its driver and in its workers."""

from __future__ import annotations

import json
import shutil
import subprocess
import uuid

import cluster_helpers
import pytest

from speed.cluster import JOB_CONFIG_ENV, code_runtime_env, package_dir
from speed.paths import DATA_DIR_ENV, repo_root

# Runs the entry point's module body (its sys.path set-up and imports), then asks a Ray worker where its speed is.
PROBE = """
import os, runpy
import ray
runpy.run_path("jobs/pretrain.py")
from speed.cluster import package_dir
from speed.train.launch import ensure_ray

@ray.remote
def worker_package():
    from speed.cluster import package_dir
    return str(package_dir()), (package_dir() / "MARKER").read_text()

ensure_ray()
print("RESULT", json.dumps({"cwd": os.getcwd(), "driver": str(package_dir()),
      "driver_marker": (package_dir() / "MARKER").read_text(), "worker": ray.get(worker_package.remote())}))
""".replace("import os,", "import json, os,")


def test_code_runtime_env_ships_this_package_unless_the_job_chose_py_modules(monkeypatch, tmp_path):
    monkeypatch.delenv(JOB_CONFIG_ENV, raising=False)
    monkeypatch.setenv(DATA_DIR_ENV, str(tmp_path))  # the driver's corpora: the workers are told where
    shipped = {"py_modules": [str(package_dir())], "env_vars": {DATA_DIR_ENV: str(tmp_path.resolve())}}
    assert code_runtime_env() == shipped
    assert (package_dir() / "cluster.py").is_file()
    monkeypatch.setenv(JOB_CONFIG_ENV, json.dumps({"runtime_env": {"working_dir": "gcs://_ray_pkg_x.zip"}}))
    assert code_runtime_env() == shipped
    monkeypatch.setenv(JOB_CONFIG_ENV, json.dumps({"runtime_env": {"env_vars": {"A": "1"}}}))
    assert code_runtime_env() == {"py_modules": [str(package_dir())]}  # the job's own env_vars are not merged
    monkeypatch.setenv(DATA_DIR_ENV, str(tmp_path / "missing"))
    monkeypatch.delenv(JOB_CONFIG_ENV)
    assert code_runtime_env() == {"py_modules": [str(package_dir())]}  # no corpora here: nothing to point at
    monkeypatch.setenv(JOB_CONFIG_ENV, json.dumps({"runtime_env": {"py_modules": ["s3://bucket/speed.zip"]}}))
    assert code_runtime_env() == {}


@pytest.mark.ray
@pytest.mark.slow
def test_submitted_job_imports_speed_from_its_working_dir(tmp_path):
    """The cluster has no $PYTHONPATH: without the shipping, driver and workers would import the venv's install."""
    work = tmp_path / "submitted"
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc")
    shutil.copytree(repo_root() / "platform", work / "platform", ignore=ignore)
    shutil.copytree(repo_root() / "jobs", work / "jobs", ignore=ignore)
    marker = uuid.uuid4().hex  # only the submitted copy holds it
    (work / "platform" / "speed" / "MARKER").write_text(marker)
    (work / "probe.py").write_text(PROBE)

    with cluster_helpers.local_cluster(num_cpus=1, keep_pythonpath=False) as (address, env):
        submit = [cluster_helpers.RAY, "job", "submit", "--address", address, "--working-dir", str(work)]
        submit += ["--", "python", "probe.py"]
        done = subprocess.run(submit, env=env, capture_output=True, text=True, timeout=300)
    output = done.stdout + done.stderr
    assert done.returncode == 0 and "succeeded" in output, output[-4000:]
    (line,) = [ln for ln in output.splitlines() if ln.startswith("RESULT ")]
    result = json.loads(line.removeprefix("RESULT "))
    worker_dir, worker_marker = result["worker"]
    assert result["driver"] == f"{result['cwd']}/platform/speed"  # the job's copy of the working dir
    assert result["driver_marker"] == marker and worker_marker == marker
    assert str(repo_root()) not in result["driver"] + worker_dir and "site-packages" not in worker_dir
