"""The Train workers' torch process group, its rendezvous store on loopback when the job's Ray is.

Ray Train's ``TorchConfig`` has the rank-0 worker start torch's ``TCPStore`` inside ``init_process_group("env://")``,
and that store binds every interface ("::" for torch 2.13's libuv daemon, the wildcard for its legacy one) whatever
``MASTER_ADDR`` says: only a socket bound beforehand (``master_listen_fd``) keeps it on one address. So where every
node of the job's Ray listens on loopback (a local job's private Ray, ``speed.train.local_ray``: one machine),
``torch_config`` gives ``LoopbackTorchConfig``: the rank-0 worker binds 127.0.0.1, hosts the store on that socket,
and every rank, rank 0 too, joins it as a client (torch's rule for a store hosted by someone else,
``TORCHELASTIC_USE_AGENT_STORE``), gloo's pairs on the loopback device; the job then opens nothing beyond loopback.
A Ray on other addresses (a cluster, ``$SPEED_RAY_NODE_IP``) keeps Ray's own ``TorchConfig``.
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass
from datetime import timedelta
from ipaddress import ip_address
from typing import Any

import ray
import torch.distributed as dist
from ray.train.torch import TorchConfig
from ray.train.torch.config import (
    V1WorkerGroup,
    _set_torch_distributed_env_vars,
    _setup_torch_process_group,
    _TorchBackend,
)

LOOPBACK = "127.0.0.1"
_hosted: list[Any] = []  # the rank-0 worker's listening socket and store, alive as long as the worker


def torch_config() -> TorchConfig | None:
    """``LoopbackTorchConfig()`` when every node of the connected Ray listens on loopback, else None (Ray's own)."""
    nodes = [node["NodeManagerAddress"] for node in ray.nodes() if node.get("Alive")]
    return LoopbackTorchConfig() if nodes and all(ip_address(a).is_loopback for a in nodes) else None


@dataclass
class LoopbackTorchConfig(TorchConfig):
    """Ray Train's ``TorchConfig`` with the process group's store on 127.0.0.1 (the module's docstring)."""

    @property
    def backend_cls(self) -> type:
        return _LoopbackTorchBackend


class _LoopbackTorchBackend(_TorchBackend):
    """``_TorchBackend.on_start`` (CPU: gloo, GPU: nccl), its store hosted on loopback by the rank-0 worker."""

    def on_start(self, worker_group: Any, backend_config: TorchConfig) -> None:
        size, timeout_s = len(worker_group), backend_config.timeout_s
        port = worker_group.execute_single(0, _host_store, timeout_s=timeout_s)
        worker_group.execute(_join_store, port=port)
        if not isinstance(worker_group, V1WorkerGroup):  # as Ray's: LOCAL_RANK and the rest, before the group
            worker_group.execute(_set_torch_distributed_env_vars)
        gpus = worker_group.get_resources_per_worker().get("GPU", 0)
        backend = backend_config.backend or ("nccl" if gpus > 0 else "gloo")
        started = [
            worker_group.execute_single_async(
                rank,
                _setup_torch_process_group,
                backend=backend,
                world_rank=rank,
                world_size=size,
                init_method="env://",
                timeout_s=timeout_s,
            )  # fmt: skip
            for rank in range(size)
        ]
        ray.get(started)


def _host_store(timeout_s: int) -> int:
    """On the rank-0 worker: a ``TCPStore`` served on a socket bound to 127.0.0.1; returns its port."""
    listening = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listening.bind((LOOPBACK, 0))
    listening.listen()
    port = listening.getsockname()[1]
    store = dist.TCPStore(
        LOOPBACK, port, is_master=True, master_listen_fd=listening.fileno(), wait_for_workers=False,
        timeout=timedelta(seconds=timeout_s),
    )  # fmt: skip
    _hosted[:] = [listening, store]
    return port


def _join_store(port: int) -> None:
    """On every worker: ``init_process_group("env://")`` joins the hosted store as a client, gloo on loopback."""
    os.environ.update(MASTER_ADDR=LOOPBACK, MASTER_PORT=str(port), TORCHELASTIC_USE_AGENT_STORE="True")
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
