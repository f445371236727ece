"""Stopping a served application within a deadline (``jobs/serve.py`` on Ctrl-C or SIGTERM), with Ray's public
API only.

``stop_serving`` deletes the application (Serve drains every replica, which writes its remaining statistics),
shuts Serve and Ray down, and writes the write-ahead logs of replicas that could not drain as their Parquet files,
so that any Parquet reader sees every answered row. A SIGTERM to the whole process group (systemd's default, a
terminal's Ctrl-C) stops Ray's own processes too: then nothing is left to drain, and the stop says so at once
instead of waiting out its deadline. It knows by the one public sign of a local Ray's life, its GCS's port.
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable
from typing import Literal

import ray
from ray import serve

from speed.serve.sink import compact_orphans, write_ahead_logs

StopOutcome = Literal["stopped", "failed", "ray_gone", "timed_out"]


def stop_serving(app: str, stats_path: str, timeout_s: float, gcs_address: str | None = None) -> float:
    """Stop ``app`` gracefully within ``timeout_s`` (``drain_app``, bounded by ``bounded_stop``), shut this
    process's Ray down, then write the replicas' leftover logs under ``stats_path`` as Parquet, waiting for the
    rest of ``timeout_s`` for replicas still ending. ``gcs_address``: the GCS of a Ray this process started
    (``ray.init(...).address_info["gcs_address"]``), watched to give up once it died; None (a joined cluster,
    which outlives this process) watches nothing. Returns the seconds the stop took."""
    started = time.monotonic()
    alive = (lambda: gcs_listening(gcs_address)) if gcs_address else (lambda: True)
    bounded_stop(lambda: drain_app(app, shutdown=gcs_address is None), timeout_s, alive)
    ray.shutdown()
    compact_statistics(stats_path, wait_s=max(0.0, timeout_s - (time.monotonic() - started)))
    took = time.monotonic() - started
    print(f"stopped in {took:.1f} s", flush=True)
    return took


def drain_app(app: str, shutdown: bool = True) -> None:
    """Serve's graceful stop: delete ``app`` (each replica finishes its requests for up to the deployment's
    graceful_shutdown_timeout_s, then writes its statistics; this blocks until the replicas are gone), then, with
    ``shutdown``, shut Serve down. A Ray this process started skips that: its controller and proxies end with
    ``ray.shutdown``, whereas ``serve.shutdown`` has the controller kill itself inside the call, which Ray prints
    as ``Task ServeController.graceful_shutdown failed ... killed by ray.kill``, a failure that is none."""
    if app in serve.status().applications:
        serve.delete(app)
    if shutdown:
        serve.shutdown()


def bounded_stop(
    drain: Callable[[], None], timeout_s: float, alive: Callable[[], bool], poll_s: float = 0.5
) -> StopOutcome:
    """Run ``drain`` on a thread for up to ``timeout_s``, giving up early once ``alive()`` says Ray's own
    processes died (nothing left to drain). Past the bound, or when they died, every answered row is on this
    node's disk anyway, whatever the storage: the replicas log each row before answering."""
    failure: list[BaseException] = []

    def graceful() -> None:
        try:
            drain()
        except Exception as err:  # Ray's processes gone (a signal to the whole process group): nothing to drain
            failure.append(err)
            print(f"stopping: Serve could not be stopped gracefully ({type(err).__name__}: {err})", flush=True)

    worker = threading.Thread(target=graceful, name="serve-stop", daemon=True)
    worker.start()
    deadline = time.monotonic() + timeout_s
    while worker.is_alive() and time.monotonic() < deadline:
        worker.join(min(poll_s, max(0.0, deadline - time.monotonic())))
        if worker.is_alive() and not alive():
            print("stopping: the local Ray's processes were stopped as well; answered rows are in the logs")
            return "ray_gone"
    if worker.is_alive():
        print(f"stopping: Serve's graceful stop ran past {timeout_s} s; giving up on it", flush=True)
        return "timed_out"
    return "failed" if failure else "stopped"


def gcs_listening(address: str, timeout_s: float = 0.5) -> bool:
    """Whether a Ray GCS at ``host:port`` accepts connections: a local Ray's processes stopped (its GCS among
    them) refuse them."""
    host, _, port = address.rpartition(":")
    try:
        with socket.create_connection((host.strip("[]"), int(port)), timeout=timeout_s):
            return True
    except OSError:
        return False


def compact_statistics(stats_path: str, wait_s: float) -> None:
    """Once the replicas are gone: their write-ahead logs on this node (rows of replicas stopped before they
    could write them) into Parquet, uploaded on an object store, waiting up to ``wait_s`` for replicas still
    ending to let go."""
    compacted = compact_orphans(stats_path, wait_s=wait_s)
    left = write_ahead_logs(stats_path)
    if compacted or left:
        held = f"; {len(left)} still held by a running writer (read_requests reads them)" if left else ""
        print(f"stopping: {compacted} write-ahead logs of stopped replicas written as Parquet{held}", flush=True)
