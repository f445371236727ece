"""Shared fixtures: one local Ray instance for the whole test session, a tiny tokenizer for training tests.

``make test`` runs the suite on two pytest-xdist workers (``--dist loadfile``): each worker is a test session
of its own (its own Ray, when one of its tests needs one) and runs whole modules, so a module's fixtures (a Serve
deployment, a sweep, a trained model, a reference run) are built once; the modules with slow tests are handed
out first, so that the two workers finish together.

Ray 2.60 uses token authentication for every local cluster and, on a machine
without one, writes a new token into ``~/.ray/auth_token``. The test session
brings a token of its own (``RAY_AUTH_TOKEN_PATH``, inherited by every Ray
process and job it starts), so tests pass with an empty ``HOME`` and never read
or write the user's ``~/.ray``. Likewise the node's spool of statistics bound for
an object store (``SPEED_SPOOL_DIR``, else ``~/.cache/speed/spool``) is a folder
of the session's, inherited by every Ray worker, replica and job it starts.
"""

from __future__ import annotations

import os
import secrets
import shutil
import tempfile
import time
import warnings
from pathlib import Path

import pytest
from hypothesis import settings

SESSION_ENV = "SPEED_TEST_SESSION"

# Hypothesis draws its examples from a fixed seed (a property test or a fuzz run generates the same cases every
# run, in any order), so a failure is reproducible, never a chance one that passes on rerun;
# `pytest --hypothesis-profile=explore` draws new examples on purpose (and prints the seed of a failure).
settings.register_profile("speed", derandomize=True, database=None, deadline=None)
settings.register_profile("explore", database=None, deadline=None)
settings.load_profile("speed")
SLOW_EXIT_S = 10  # processes still ending this long after the last test: named in a warning


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """In an xdist worker, the modules with slow tests first, each module's tests kept together in their order
    (file order, or pytest-randomly's): xdist hands modules out in the order its workers collected them."""
    if not hasattr(config, "workerinput"):
        return
    heavy = {item.path for item in items if item.get_closest_marker("slow")}
    items.sort(key=lambda item: item.path not in heavy)


def pytest_configure(config: pytest.Config) -> None:
    import torch

    from speed.cluster import NODE_IP_ENV
    # Without a GPU the Triton decode kernels run under Triton's interpreter (tests/test_triton_kernels.py), which
    # Triton reads when it defines its own kernels (tl.sum's, at its import): set before any module imports it.
    if not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")
    from speed.paths import SPOOL_DIR_ENV
    from speed.train.local_ray import PREEMPTION_WATCHER_ENV

    # Every process a test starts inherits the session's mark (pytest_sessionfinish looks for those left).
    os.environ[SESSION_ENV] = secrets.token_hex(8)
    folder = Path(tempfile.mkdtemp(prefix="speed-test-ray-"))
    token = folder / "auth_token"
    token.write_text(secrets.token_hex(32))  # what `ray get-auth-token --generate` writes: 256 random bits
    token.chmod(0o600)
    os.environ.pop("RAY_AUTH_TOKEN", None)  # takes precedence over the path
    os.environ.pop(NODE_IP_ENV, None)  # the suite's Rays and the jobs it runs listen on loopback, whatever the user set
    os.environ["RAY_AUTH_TOKEN_PATH"] = str(token)
    os.environ[SPOOL_DIR_ENV] = str(folder / "spool")  # before any Ray starts: its workers inherit it
    # The suite's Rays are single nodes, or nodes lost by SIGKILL, never preempted: without Ray Train's preemption
    # watcher each of the suite's ~30 Train runs starts one actor process fewer (as a job's private Ray does).
    os.environ.setdefault(PREEMPTION_WATCHER_ENV, "0")
    # Ray Train's controller polls its workers every 2 s: a run that ends waits up to that long to be noticed, and
    # its start waits on the first poll too. The suite's runs are seconds long: polling at 0.2 s saves ~4 s per run
    # (measured: an empty 1-worker TorchTrainer.fit 12.6 s -> 7.7 s on a warm Ray). Inherited by every Ray started.
    os.environ.setdefault("RAY_TRAIN_HEALTH_CHECK_INTERVAL_S", "0.2")
    config.add_cleanup(lambda: shutil.rmtree(folder, ignore_errors=True))


@pytest.fixture(scope="session", autouse=True)
def no_process_left():
    """A test run leaves no process behind: any process started under this session (a Ray, a job, a server)
    still running once every other fixture is torn down (this one is set up first, so torn down last) is
    ended, and the run fails naming it. Processes that take over ``SLOW_EXIT_S`` to end are named in a warning."""
    from speed.train.local_ray import end_processes, marked_processes

    yield
    token, started = os.environ[SESSION_ENV], time.monotonic()
    deadline = started + 60  # Ray's agents may take a while to go
    left = marked_processes(token, name=SESSION_ENV)
    first = sorted({_describe(pid) for pid in left})  # named while they run
    while left and time.monotonic() < deadline:
        time.sleep(0.5)
        left = marked_processes(token, name=SESSION_ENV)
    if (waited := time.monotonic() - started) > SLOW_EXIT_S:  # the run's last seconds: say what they waited on
        warnings.warn(f"the session waited {waited:.0f} s for processes to end: {', '.join(first)}", stacklevel=1)
    if left:
        names = sorted({_name(pid) for pid in left})
        end_processes(left)
        pytest.fail(f"{len(left)} processes started by the tests outlived them: {', '.join(names)}")


def _describe(pid: int) -> str:
    """A lingering process for the warning: its name, the Ray it belongs to (the owner mark a job's or a cluster's
    private Ray gives its processes; none: the session's own Ray or a plain process), its parent (1: orphaned) and
    its age, so that the test that left it can be found."""
    from speed.train.local_ray import OWNER_ENV

    proc = Path(f"/proc/{pid}")
    try:
        env = dict(e.split(b"=", 1) for e in (proc / "environ").read_bytes().split(b"\0") if b"=" in e)
        fields = (proc / "stat").read_text().rsplit(")", 1)[1].split()
        age = time.clock_gettime(time.CLOCK_BOOTTIME) - int(fields[19]) / os.sysconf("SC_CLK_TCK")
    except (OSError, IndexError, ValueError):
        return _name(pid)
    owner = env.get(OWNER_ENV.encode(), b"none").decode(errors="replace")
    return f"{_name(pid)} (pid {pid}, parent {fields[1]}, {age:.0f} s old, Ray owner {owner})"


def _name(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[0].decode(errors="replace") or str(pid)
    except OSError:
        return str(pid)


@pytest.fixture(scope="session")
def ray_session():
    """A private local Ray (2 CPUs, no dashboard) shared by every @pytest.mark.ray test; shut down at the end.

    ``address="local"`` always starts a new instance, so a test never joins another
    cluster running on this machine (``ray.init()`` alone would attach to the last
    one started with ``ray start``).
    """
    import ray

    from speed.cluster import local_ray_options

    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=True, **local_ray_options())
    yield ray
    ray.shutdown()


@pytest.fixture(scope="session")
def ray_cluster():
    """A real ``ray start --head`` cluster on 127.0.0.1 (tests/cluster_helpers.py), shared by the tests whose
    subject is a cluster as users start one (``ray job submit``, its listeners): (dashboard address, env for the
    ``ray`` CLI). 2 CPUs; no ``$PYTHONPATH``, so its workers import only what is installed and what a job ships.
    Its tests are in tests/test_cluster.py: one such cluster per test run."""
    import cluster_helpers

    with cluster_helpers.local_cluster(num_cpus=2, keep_pythonpath=False) as cluster:
        yield cluster


@pytest.fixture(scope="session")
def tiny_tokenizer(tmp_path_factory):
    """A 300-piece SentencePiece model trained on the first 40 pretraining documents (~2 s)."""
    from speed.data import load_records
    from speed.tokenizer import train_tokenizer

    path = tmp_path_factory.mktemp("tokenizer") / "spm.model"
    train_tokenizer(load_records("pretrain", "train", limit=40)["text"], path, vocab_size=300)
    return path


@pytest.fixture
def memory_store():
    """A ``memory://`` URI (fsspec's in-memory file system, through speed.storage) standing in for object
    storage; the store is emptied afterwards."""
    from fsspec.implementations.memory import MemoryFileSystem

    yield "memory://bucket/store"
    MemoryFileSystem.store.clear()
    MemoryFileSystem.pseudo_dirs[:] = [""]


# A real S3 API on loopback (tests/s3_helpers.py): its address is in the environment from the start, so that
# every Ray process and job the session starts inherits it; the ``s3_bucket`` fixture starts the server.
pytest_plugins = ["s3_helpers"]
