"""A job sent with `ray job submit --working-dir` runs the submitted `speed`, in its driver and in its workers;
the local cluster of clusters/README.md listens on loopback only."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import time
import uuid
from pathlib import Path

import cluster_helpers
import pytest

from speed.cluster import JOB_CONFIG_ENV, NODE_IP_ENV, code_runtime_env, local_ray_options, package_dir
from speed.models.checkpoint import load_model
from speed.paths import DATA_DIR_ENV, data_dir, repo_root
from speed.train.local_ray import OWNER_ENV, marked_processes
from speed.train.state import load_training_state

# A job whose task runs for a while, so that its driver, the job supervisor and a worker are listening too.
LONG_JOB = "import ray, time; ray.init(); ray.get(ray.remote(lambda: time.sleep(10)).remote())"

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


class _Stop(Exception):
    """Raised by the stand-in for ``ray.init``: the job has said how it connects, nothing else needs to run."""


@pytest.mark.parametrize("name", ["serve", "bench_serve"])
def test_serving_jobs_ship_their_speed_to_the_replicas(monkeypatch, tmp_path, name):
    """Serve replicas import the driver's speed through the runtime environment, not through $PYTHONPATH. (A real
    checkpoint: jobs/serve.py checks it before it starts Ray.)"""
    from speed.config import preset
    from speed.models.checkpoint import save_model
    from speed.models.t5 import SpeedT5

    checkpoint = save_model(tmp_path / "ckpt", SpeedT5(preset("tiny")))
    spec = importlib.util.spec_from_file_location(f"{name}_job", repo_root() / "jobs" / f"{name}.py")
    job = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(job)
    connected = {}

    def init(**kwargs):
        connected.update(kwargs)
        raise _Stop

    monkeypatch.setattr(job.ray, "init", init)
    monkeypatch.setenv("RAY_worker_niceness", "0")  # bench_serve sets it when unset; the test leaves it as it was
    with pytest.raises(_Stop):
        job.main(["--checkpoint", str(checkpoint)])
    assert connected["runtime_env"] == code_runtime_env()
    assert connected["runtime_env"]["py_modules"] == [str(package_dir())]


@pytest.mark.ray
@pytest.mark.slow
def test_submitted_job_imports_speed_from_its_working_dir(ray_cluster, tmp_path):
    """The cluster has no $PYTHONPATH: without the shipping, driver and workers would import the venv's install."""
    work = tmp_path / "submitted"
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc")
    shutil.copytree(repo_root() / "platform", work / "platform", ignore=ignore)
    shutil.copytree(repo_root() / "jobs", work / "jobs", ignore=ignore)
    marker = uuid.uuid4().hex  # only the submitted copy holds it
    (work / "platform" / "speed" / "MARKER").write_text(marker)
    (work / "probe.py").write_text(PROBE)

    address, env = ray_cluster
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


@pytest.mark.ray
@pytest.mark.slow
def test_local_cluster_listens_on_loopback_only(ray_cluster):
    """`ray start --head` as clusters/README.md runs it, and a job on it: no process of that cluster listens on an
    address other machines can reach; none is exempt (without LOOPBACK_ENV the GCS, the raylet, the agents, the
    metrics servers and the Ray client server listen on every interface or on the machine's address)."""
    address, env = ray_cluster
    submit = [cluster_helpers.RAY, "job", "submit", "--address", address, "--", "python", "-c", LONG_JOB]
    job = subprocess.Popen(submit, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    seen: set[cluster_helpers.Listener] = set()
    while job.poll() is None:  # every listener of the cluster's processes while the job runs
        seen |= cluster_helpers.listeners(marked_processes(env[OWNER_ENV]))
        time.sleep(0.5)
    output = job.stdout.read()
    assert job.returncode == 0 and "succeeded" in output, output[-4000:]
    names = {s.name for s in seen}
    assert {"gcs_server", "raylet"} <= names and any(n.startswith("ray::") for n in names), seen  # not vacuous
    beyond = {(s.name, s.ip) for s in seen if not cluster_helpers.is_loopback(s.ip)}
    assert not beyond, f"listening beyond loopback: {sorted(beyond)}"


@pytest.mark.ray
def test_the_suites_shared_ray_listens_on_loopback_only(ray_session):
    """conftest's ``ray_session`` (``local_ray_options``): the test driver, the GCS, the raylet, the agents and a
    worker listen on loopback only (before, every Ray server of the suite listened on ``::``)."""
    import psutil

    ray = ray_session

    @ray.remote(num_cpus=0)
    class Probe:
        def pid(self) -> int:
            return os.getpid()

    probe = Probe.remote()
    worker = ray.get(probe.pid.remote())
    # ray.init started the GCS, the raylet and the agents as this process's children, the workers under them.
    tree = {c.pid for c in psutil.Process().children(recursive=True)}
    seen = cluster_helpers.listeners(sorted({os.getpid(), worker, *tree}))
    ray.kill(probe)
    assert {"gcs_server", "raylet"} <= {s.name for s in seen} and any(s.pid == worker for s in seen), seen
    beyond = {(s.name, s.ip, s.port) for s in seen if not cluster_helpers.is_loopback(s.ip)}
    assert not beyond, f"listening beyond loopback: {sorted(beyond)}"


def test_a_local_ray_is_on_loopback_unless_opened_on_purpose(monkeypatch):
    """``local_ray_options``: node address 127.0.0.1 with Ray's single-node switch set; a user's
    ``$SPEED_RAY_NODE_IP`` (docs/training.md) is the node's address instead, the switch left as Ray read it
    (seen on this machine: the GCS, the raylet and the workers then listen on ``::``, the agents on the address)."""
    from ray._private import ray_constants

    monkeypatch.setattr(ray_constants, "ENABLE_RAY_CLUSTER", True)
    monkeypatch.delenv(NODE_IP_ENV, raising=False)
    assert local_ray_options() == {"_node_ip_address": "127.0.0.1"} and not ray_constants.ENABLE_RAY_CLUSTER
    monkeypatch.setattr(ray_constants, "ENABLE_RAY_CLUSTER", True)
    monkeypatch.setenv(NODE_IP_ENV, "192.0.2.2")
    assert local_ray_options() == {"_node_ip_address": "192.0.2.2"} and ray_constants.ENABLE_RAY_CLUSTER


def test_the_documented_local_cluster_sets_the_loopback_switch():
    """clusters/README.md starts its local head as cluster_helpers does, with LOOPBACK_ENV."""
    text = (repo_root() / "clusters" / "README.md").read_text()
    (line,) = [ln for ln in text.splitlines() if "ray start --head --node-ip-address 127.0.0.1" in ln]
    assert all(f"{name}={value} ray start" in line for name, value in cluster_helpers.LOOPBACK_ENV.items())


# ----- a training job submitted to the cluster --------------------------------------------------------------


@pytest.mark.ray
@pytest.mark.slow
def test_ray_job_submit_pretrains_and_checkpoints(ray_cluster, tiny_tokenizer, tmp_path):
    address, env = ray_cluster
    storage = tmp_path / "runs"
    flags = ["--preset", "tiny", "--pattern", "2x3", "--limit", "40", "--tokenizer", str(tiny_tokenizer)]
    flags += ["--batch-size", "4", "--max-steps", "4", "--checkpoint-every", "2", "--cpus-per-worker", "1"]
    submit = [cluster_helpers.RAY, "job", "submit", "--address", address, "--working-dir", str(repo_root())]
    submit += ["--runtime-env-json", json.dumps({"env_vars": {"SPEED_DATA_DIR": str(data_dir())}})]
    submit += ["--", "python", "jobs/pretrain.py", *flags, "--storage-path", str(storage)]
    done = subprocess.run(submit, env=env, capture_output=True, text=True, timeout=600)
    output = done.stdout + done.stderr
    assert done.returncode == 0 and "succeeded" in output, output[-4000:]

    (run,) = [p for p in storage.iterdir() if p.name.startswith("pretrain-pretrain-2x3-")]
    checkpoints = sorted(p.name for p in run.glob("checkpoint_*") if p.is_dir())
    assert checkpoints == ["checkpoint_00000002", "checkpoint_00000004"]
    final = run / checkpoints[-1]
    assert f"pretrained checkpoint: {final}" in output
    assert load_training_state(final).step == 4
    loaded = load_model(final)
    assert loaded.model.config.pattern == "2x3" and loaded.config["job"]["train"]["max_steps"] == 4
    assert loaded.tokenizer_path is not None and Path(loaded.tokenizer_path).read_bytes() == tiny_tokenizer.read_bytes()
