"""A real `ray start --head` cluster on loopback for job-API tests, stopped by ending exactly its processes.

The cluster gets its own --temp-dir and explicit free ports, and token
authentication on explicitly, with the test session's token (conftest:
``RAY_AUTH_TOKEN_PATH``), whatever ~/.ray holds or however empty $HOME is. Every
process it starts inherits an owner mark (``speed.train.local_ray``), by which
exactly those processes are ended (never `ray stop`, which would end every Ray
on the machine). It listens on loopback only (``LOOPBACK_ENV``, as in the
clusters/README.md flow).
"""

from __future__ import annotations

import contextlib
import ipaddress
import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import NamedTuple

from speed.paths import SPOOL_DIR_ENV
from speed.train.local_ray import OWNER_ENV, end_processes, marked_processes

RAY = str(Path(sys.executable).parent / "ray")
# Ray's single-node switch (named for Windows and macOS, honoured on Linux): the node's address is 127.0.0.1, so the
# GCS, the raylet, the agents, the metrics servers and the Ray client server bind loopback. Without it Ray replaces
# `--node-ip-address 127.0.0.1` with the machine's address and most of them bind every interface.
LOOPBACK_SWITCH = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"  # in-process: speed.cluster.local_ray_options
LOOPBACK_ENV = {LOOPBACK_SWITCH: "0"}
# Each node of ``nodes``: a small object store (Ray's default takes 30% of the machine's memory per node).
NODE_FLAGS = ("--object-store-memory", str(200 * 2**20))
API_SERVER_ENV = "RAY_API_SERVER_ADDRESS"  # the dashboard: the address Ray's state and job clients use first
JOIN = Path(__file__).with_name("ray_join.py")  # `ray start` for a further node, on loopback too


# ----- who listens where -----


class Listener(NamedTuple):
    """A listening TCP socket of a process."""

    name: str  # the process's
    ip: str
    pid: int
    port: int


def listeners(pids: list[int]) -> set[Listener]:
    """Every TCP listener of these processes."""
    import psutil

    found = set()
    for pid in pids:
        try:
            process = psutil.Process(pid)
            name = process.name()
            listening = [c.laddr for c in process.net_connections("tcp") if c.status == psutil.CONN_LISTEN]
            found |= {Listener(name, address.ip, pid, address.port) for address in listening}
        except psutil.Error:  # ended meanwhile
            continue
    return found


def is_loopback(address: str) -> bool:
    ip = ipaddress.ip_address(address)
    return ip.is_loopback or (ip.version == 6 and ip.ipv4_mapped is not None and ip.ipv4_mapped.is_loopback)


# A Train worker, whose rank 0 hosts torch.distributed's rendezvous store (TCPStore): on loopback for a local job
# (speed.train.process_group), on every interface under Ray's own TorchConfig (docs/training.md).
TRAIN_WORKER = "ray::RayTrainW"  # a Train worker's process title begins so (whatever task it runs, cut or not)


def free_ports(n: int) -> list[int]:
    """``n`` distinct loopback ports free right now."""
    sockets = [socket.socket() for _ in range(n)]
    for s in sockets:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in sockets]
    for s in sockets:
        s.close()
    return ports


@contextlib.contextmanager
def local_cluster(num_cpus: int = 2, keep_pythonpath: bool = True) -> Iterator[tuple[str, dict[str, str]]]:
    """A Ray head on 127.0.0.1 with token auth; yields (dashboard address, environment for the `ray` CLI).

    Its processes are those whose environment holds ``env[OWNER_ENV]`` (``marked_processes``).

    ``keep_pythonpath=False`` starts the cluster without ``$PYTHONPATH``, so that its
    workers see only what is installed in the virtualenv (and what a job ships).
    """
    temp = tempfile.mkdtemp(prefix="rayjob", dir="/tmp")  # short: Ray's unix socket paths are length-limited
    drop = {"RAY_ADDRESS"} | (set() if keep_pythonpath else {"PYTHONPATH"})
    env = {k: v for k, v in os.environ.items() if k not in drop}
    env["PATH"] = f"{Path(sys.executable).parent}:{env['PATH']}"  # the job's `python` is this venv's
    # Token auth on both sides, told explicitly (the job CLI sends the token only when told to).
    env["RAY_AUTH_MODE"] = "token"
    env |= LOOPBACK_ENV
    token = env[OWNER_ENV] = secrets.token_hex(8)  # every process of this cluster inherits the mark
    try:
        # A second try on fresh ports: another Ray on the machine may take a port between our probe and its bind.
        ports = _retried(lambda: _start_head(num_cpus, temp, env), token)
        yield f"http://127.0.0.1:{ports['dashboard']}", env
    finally:
        _end_all(token)
        shutil.rmtree(temp, ignore_errors=True)


def _end_all(token: str, looks: int = 5) -> None:
    """End every process marked ``token``, looking again until none is left: a raylet that is ending may start
    a process (an agent) after the first look, which would outlive the cluster."""
    for _ in range(looks):
        if not (pids := marked_processes(token)):
            return
        end_processes(pids)


def _retried(start, token: str) -> dict[str, int]:
    """``start()`` -> (ports, finished `ray start`), a second time on fresh ports when the first fails (another Ray
    on the machine may take a port between our probe and its bind); its ports."""
    for attempt in (1, 2):
        ports, started = start()
        if started.returncode == 0:
            return ports
        output = started.stdout[-3000:] + started.stderr[-3000:]
        print(f"ray start failed ({started.returncode}, attempt {attempt}):\n{output}", file=sys.stderr)
        _end_all(token)
    raise RuntimeError("ray start failed twice (its output is above)")


def _node_ports() -> tuple[dict[str, int], list[str]]:
    """Free ports for what every node runs (raylet, object manager, agents, metrics); (ports, `ray start` flags)."""
    names = ("node-manager", "object-manager", "dashboard-agent-listen", "dashboard-agent-grpc", "runtime-env-agent")
    ports = dict(zip(names + ("metrics-export",), free_ports(len(names) + 1)))
    flags = [f for name, port in ports.items() for f in (f"--{name}-port", str(port))]
    return ports, flags


def _start_head(
    num_cpus: int, temp: str, env: dict[str, str], extra: tuple[str, ...] = ()
) -> tuple[dict[str, int], subprocess.CompletedProcess]:
    """`ray start --head` on loopback with every port explicit and free; (its ports, the finished command).

    ``env`` gets the dashboard's address as ``RAY_API_SERVER_ADDRESS``, for every process of the cluster.
    """
    gcs, dashboard, client = free_ports(3)
    # Where Ray's state API, called inside the cluster's own workers, finds it. Untold, it looks for the
    # machine's running GCS processes, and with other Rays on the machine raises "Found multiple active Ray
    # instances": Ray Train's PlacementGroupCleaner (on the head) then stops, and a Train controller lost with
    # its node leaves its workers' placement group behind, rescheduled onto the next node that joins.
    env[API_SERVER_ENV] = f"http://127.0.0.1:{dashboard}"
    ports, flags = _node_ports()
    command = [
        RAY, "start", "--head", "--node-ip-address", "127.0.0.1", "--port", str(gcs), "--num-cpus", str(num_cpus),
        "--include-dashboard", "true", "--dashboard-host", "127.0.0.1", "--dashboard-port", str(dashboard),
        "--ray-client-server-port", str(client), *flags, "--temp-dir", temp, "--disable-usage-stats",
        *extra,
    ]  # fmt: skip
    ports |= {"gcs": gcs, "dashboard": dashboard}
    return ports, subprocess.run(command, env=env, capture_output=True, text=True, timeout=180)


# ----- several nodes on this machine ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Node:
    """One node of a ``nodes`` cluster: a raylet of its own, with its own CPUs, resources and spool."""

    name: str  # also a custom resource of 1 it holds, by which a test places work on it
    token: str  # the owner mark its raylet, agents and workers inherit (``marked_processes``)
    spool: Path  # its SPEED_SPOOL_DIR: the node's own disk, lost with it


@dataclass
class Cluster:
    """A head and further nodes started with `ray start` on 127.0.0.1, each a raylet of its own."""

    address: str  # the GCS, 127.0.0.1:<port>: what a driver's $RAY_ADDRESS names
    env: dict[str, str]  # for a driver (RAY_ADDRESS set), marked as the head's, so that teardown ends it too
    root: Path
    nodes: dict[str, Node] = field(default_factory=dict)
    dashboard: str = ""  # http://127.0.0.1:<port>, for the state API

    def placement(self, class_name: str, alive: bool = True) -> list[str]:
        """The nodes (names, sorted) of the live actors of ``class_name`` (Ray's state API, through its CLI); with
        ``alive=False``, of every actor of that class the cluster has seen, dead ones included."""
        ask = [RAY, "list", "nodes", "--address", self.dashboard, "--format", "json", "--limit", "100"]
        names = {n["node_id"]: _node_name(n["resources_total"]) for n in self._state(ask)}
        ask = [RAY, "list", "actors", "--address", self.dashboard, "--format", "json", "--limit", "1000"]
        ask += ["--filter", f"class_name={class_name}", *(["--filter", "state=ALIVE"] if alive else [])]
        return sorted(names.get(a["node_id"], a["node_id"]) for a in self._state(ask))

    def _state(self, command: list[str]) -> list[dict]:
        done = subprocess.run(command, env=self.env, capture_output=True, text=True, timeout=60)
        if done.returncode != 0:
            raise RuntimeError(f"{' '.join(command[:3])} failed: {done.stderr[-2000:]}")
        return json.loads(done.stdout) if done.stdout.lstrip().startswith("[") else []  # none: a sentence

    def add_node(self, name: str, num_cpus: int) -> Node:
        """Start a node ``name`` joining the head: ``num_cpus`` CPUs and a resource ``{name: 1}``."""
        node = Node(name, secrets.token_hex(8), self.root / name / "spool")
        env = self.env | {OWNER_ENV: node.token, SPOOL_DIR_ENV: str(node.spool)}
        env.pop("RAY_ADDRESS")

        def start() -> tuple[dict[str, int], subprocess.CompletedProcess]:
            ports, flags = _node_ports()
            command = [
                sys.executable, str(JOIN), "start", "--address", self.address, "--node-ip-address", "127.0.0.1",
                "--num-cpus", str(num_cpus), "--resources", json.dumps({name: 1}), *flags, *NODE_FLAGS,
                "--disable-usage-stats",
            ]  # fmt: skip
            return ports, subprocess.run(command, env=env, capture_output=True, text=True, timeout=180)

        _retried(start, node.token)
        self.nodes[name] = node
        return node

    def kill(self, name: str) -> list[int]:
        """The node lost: SIGKILL its raylet, its agents and every worker on it at once (and any it started
        meanwhile, looking again until none is left); their pids."""
        killed: set[int] = set()
        for _ in range(5):
            if not (pids := marked_processes(self.nodes[name].token)):
                break
            for pid in pids:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            killed.update(pids)
        return sorted(killed)


def _node_name(resources: dict[str, float]) -> str:
    """A node's name: its one custom resource of ``nodes`` (the others are Ray's own)."""
    (name,) = [r for r in resources if r not in ("CPU", "GPU", "memory", "object_store_memory") and ":" not in r]
    return name


@contextlib.contextmanager
def nodes(
    head_cpus: int, env: dict[str, str] | None = None, head_flags: tuple[str, ...] = (), **others: int
) -> Iterator[Cluster]:
    """A head with ``head_cpus`` CPUs (and a resource ``{"head": 1}``, and `ray start` ``head_flags``) and a node
    per keyword (name=CPUs) on 127.0.0.1 with token auth, each its own raylet and spool; every process of every
    node (and of any node added later) is ended afterwards, passed or failed. Workers inherit the test session's
    environment: the S3 server's address and credentials (tests/s3_helpers.py), and ``env``."""
    root = Path(tempfile.mkdtemp(prefix="raynodes", dir="/tmp"))  # short: Ray's unix socket paths are limited
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"} | (env or {})
    env["PATH"] = f"{Path(sys.executable).parent}:{env['PATH']}"
    env["RAY_AUTH_MODE"] = "token"
    env |= LOOPBACK_ENV
    head = Node("head", secrets.token_hex(8), root / "head" / "spool")
    env |= {OWNER_ENV: head.token, SPOOL_DIR_ENV: str(head.spool)}
    cluster = Cluster("", env, root, {"head": head})
    try:
        extra = ("--resources", json.dumps({"head": 1}), *NODE_FLAGS, *head_flags)
        ports = _retried(lambda: _start_head(head_cpus, str(root / "ray"), env, extra), head.token)
        cluster.address = f"127.0.0.1:{ports['gcs']}"
        cluster.dashboard = f"http://127.0.0.1:{ports['dashboard']}"
        env["RAY_ADDRESS"] = cluster.address
        for name, cpus in others.items():
            cluster.add_node(name, cpus)
        yield cluster
    finally:
        for node in list(cluster.nodes.values())[::-1]:
            _end_all(node.token)
        shutil.rmtree(root, ignore_errors=True)
