"""The real cluster client: `ray start --head` on loopback, `ray job submit jobs/pretrain.py`, check, stop.

The cluster (tests/cluster_helpers.py) gets its own --temp-dir, free ports and
token, and is stopped by ending exactly the processes it started.
"""

from __future__ import annotations

import json
import subprocess

import cluster_helpers
import pytest

from speed.checkpoint import load_model
from speed.paths import data_dir, repo_root
from speed.train.state import load_training_state

pytestmark = [pytest.mark.ray, pytest.mark.slow]


@pytest.fixture
def local_cluster():
    """A 2-CPU Ray head on 127.0.0.1 with explicit ports and its own token; yields (address, env for the CLI)."""
    with cluster_helpers.local_cluster(num_cpus=2) as cluster:
        yield cluster


def test_ray_job_submit_pretrains_and_checkpoints(local_cluster, tiny_tokenizer, tmp_path):
    address, env = local_cluster
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
    assert loaded.tokenizer_path is not None and loaded.tokenizer_path.read_bytes() == tiny_tokenizer.read_bytes()
