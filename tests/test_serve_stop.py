"""``speed.serve.stop`` without a Ray: the bounded stop's four outcomes, and the GCS's port as the sign of a local
Ray's life. The real job stopped by SIGTERM, its Ray alive or stopped with it: tests/test_serve_job.py."""

from __future__ import annotations

import socket
import threading
import time

from speed.serve.stop import bounded_stop, gcs_listening


def test_a_drain_that_ends_stops():
    drained = []
    assert bounded_stop(lambda: drained.append(1), 5.0, lambda: True) == "stopped" and drained == [1]


def test_a_drain_that_raises_is_reported_and_the_stop_goes_on(capsys):
    def drain() -> None:
        raise ConnectionError("GCS unreachable")

    assert bounded_stop(drain, 5.0, lambda: True) == "failed"
    assert "Serve could not be stopped gracefully (ConnectionError: GCS unreachable)" in capsys.readouterr().out


def test_a_hung_drain_is_given_up_at_the_deadline_or_once_ray_died(capsys):
    release = threading.Event()
    try:
        started = time.monotonic()
        assert bounded_stop(release.wait, 0.3, lambda: True, poll_s=0.05) == "timed_out"
        assert 0.3 <= time.monotonic() - started < 5 and "ran past 0.3 s" in capsys.readouterr().out
        checks = iter([True, False])  # Ray's processes die during the drain
        started = time.monotonic()
        assert bounded_stop(release.wait, 60.0, lambda: next(checks), poll_s=0.05) == "ray_gone"
        assert time.monotonic() - started < 5 and "processes were stopped as well" in capsys.readouterr().out
    finally:
        release.set()


def test_a_gcs_listens_until_its_process_is_gone():
    server = socket.create_server(("127.0.0.1", 0))
    address = f"127.0.0.1:{server.getsockname()[1]}"
    assert gcs_listening(address)
    server.close()
    assert not gcs_listening(address)
