"""A local job's torch process group opens nothing beyond loopback (``speed.train.process_group``): two Train
workers on a private local Ray (as a job without ``$RAY_ADDRESS`` starts it) form the group, sum across it, and
list their own listening sockets once it is up: every one on loopback, the rendezvous store (torch's TCPStore,
which by itself binds "::") among them. Run as its own process: the private Ray's loopback switch is per process."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

pytestmark = [pytest.mark.ray, pytest.mark.slow]

JOB = textwrap.dedent(
    """
    import json, os, sys
    import psutil, ray, ray.train, torch, torch.distributed as dist
    from ray.train.torch import TorchTrainer
    from speed.cluster import code_runtime_env
    from speed.train import local_ray
    from speed.train.process_group import LoopbackTorchConfig, torch_config

    def work(config):
        total = torch.tensor([float(dist.get_rank() + 1)])
        dist.all_reduce(total)
        listening = [c.laddr for c in psutil.Process().net_connections("tcp") if c.status == psutil.CONN_LISTEN]
        sockets = [(a.ip, a.port) for a in listening]
        with open(f"{config['out']}/rank{dist.get_rank()}.json", "w") as f:
            store = int(os.environ["MASTER_PORT"])
            json.dump({"sum": total.item(), "listening": sockets, "world": dist.get_world_size(), "store": store}, f)

    local_ray.start(num_cpus=2, runtime_env=code_runtime_env())
    chosen = torch_config() if sys.argv[2] == "loopback" else None  # None: Ray's own TorchConfig
    assert sys.argv[2] != "loopback" or isinstance(chosen, LoopbackTorchConfig), chosen
    TorchTrainer(
        work, train_loop_config={"out": sys.argv[1]}, torch_config=chosen,
        scaling_config=ray.train.ScalingConfig(num_workers=2, resources_per_worker={"CPU": 1}),
        run_config=ray.train.RunConfig(name="store", storage_path=sys.argv[1]),
    ).fit()
    """
)


def test_a_local_jobs_process_group_listens_on_loopback_only(tmp_path):
    done = subprocess.run(
        [sys.executable, "-c", JOB, str(tmp_path), "loopback"], capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-3000:]
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert [r["sum"] for r in ranks] == [3.0, 3.0] and [r["world"] for r in ranks] == [2, 2]  # 1 + 2 on both
    assert (ranks[0]["store"] == ranks[1]["store"]) and ["127.0.0.1", ranks[0]["store"]] in ranks[0]["listening"]
    beyond = [(ip, port) for r in ranks for ip, port in r["listening"] if ip not in ("127.0.0.1", "::ffff:127.0.0.1")]
    assert not beyond, f"listening beyond loopback: {beyond}"
