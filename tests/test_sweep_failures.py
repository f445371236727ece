"""Which failures of a sweep's trial are a lost node (retried) and which its own (recorded): Ray's and Ray Train's
real exception types as a trial meets them, no Ray running. The retry itself, on two nodes: tests/test_nodes.py."""

from __future__ import annotations

import pytest
from ray import exceptions as rex
from ray.train import ControllerError, WorkerGroupError
from ray.train.v2._internal.exceptions import (
    WorkerGroupStartupTimeoutError,
    WorkerHealthCheckFailedError,
    WorkerHealthCheckTimeoutError,
)

from speed.sweep.failures import RecordedFailure, last_line, lost_node, record_failure, recorded_failure
from speed.sweep.trial import SweepSetup, trial_job
from speed.train.config import JobConfig, job_to_dict
from speed.train.loop import InjectedFailure


def _group_error(failures: dict[int, BaseException]) -> WorkerGroupError:
    """Ray Train's error for failed workers: each rank's exception, and a message of their last lines."""
    message = "\n".join(f"[Rank {r}]:\nTraceback (most recent call last): ...\n{e!r}" for r, e in failures.items())
    return WorkerGroupError(message, failures)


def _task_error(cause: BaseException) -> rex.RayTaskError:
    """What ``ray.get`` raises for a task that raised ``cause`` (an instance of both, as Ray builds it)."""
    return rex.RayTaskError("_measure", "Traceback (most recent call last): ...", cause).as_instanceof_cause()


LOST = {
    "the trial's actor died": rex.ActorDiedError(),
    "an actor's node unreachable": rex.ActorUnavailableError("node unreachable", None),
    "a node died": rex.NodeDiedError("node 1234 died"),
    "a task's process crashed": rex.WorkerCrashedError(),
    "the local raylet died": rex.LocalRayletDiedError(),
    "an object's owner died": rex.OwnerDiedError("ab" * 14, None, "call site"),
    "a worker's node lost": _group_error({1: rex.ActorDiedError()}),
    # the survivor's collective fails too when its peer's node goes: the lost node wins
    "a worker lost, its peer's collective broken": _group_error(
        {0: RuntimeError("Connection closed by peer"), 1: rex.ActorDiedError()}
    ),
    "a worker's health check failed": _group_error(
        {1: WorkerHealthCheckFailedError("health check failed", rex.ActorDiedError())}
    ),
    "a worker's health check timed out": _group_error({0: WorkerHealthCheckTimeoutError("60 s")}),
    "no room to start the workers again": ControllerError(WorkerGroupStartupTimeoutError(num_workers=2)),
    "a measurement task's node lost": _task_error(rex.ActorDiedError()),
}

OWN = {
    "a bad config": ValueError("TrainConfig.lr must be positive"),
    "a NaN loss": FloatingPointError("loss is nan at step 3"),
    "an injected failure in a worker": _group_error({1: InjectedFailure("injected failure on rank 1 before step 3")}),
    "every worker's bug": _group_error({r: KeyError("lm_head") for r in range(2)}),
    "a bug in the measurement task": _task_error(AssertionError("SPEED differs from sequential decoding")),
    "an object the program freed": rex.ObjectFreedError("ab" * 14, None, "call site"),
    "a task that timed out": rex.GetTimeoutError("get timed out"),
}


@pytest.mark.parametrize("what", LOST)
def test_a_lost_node_or_process_is_retried(what):
    assert lost_node(LOST[what])


@pytest.mark.parametrize("what", OWN)
def test_a_trials_own_error_is_not(what):
    assert not lost_node(OWN[what])


def test_only_an_explicit_cause_counts():
    try:
        try:
            raise rex.ActorDiedError()
        except rex.ActorDiedError as lost:
            raise RuntimeError("could not save the checkpoint") from lost
    except RuntimeError as error:
        assert lost_node(error)
    try:
        try:
            raise rex.ActorDiedError()
        except rex.ActorDiedError:
            raise ValueError("a bug in the error handler")  # noqa: B904 (the point: only handled, not its cause)
    except ValueError as error:
        assert not lost_node(error)


def test_a_recorded_failure_is_raised_again_with_its_last_line(tmp_path):
    run_dir = str(tmp_path / "train" / "00002-2x2-linear")
    assert recorded_failure(run_dir) is None
    error = OWN["an injected failure in a worker"]
    record_failure(run_dir, error)
    again = recorded_failure(run_dir)
    assert isinstance(again, RecordedFailure) and type(again) is not type(error)
    assert str(again).startswith("WorkerGroupError") and str(again).endswith(last_line(error))
    assert "injected failure on rank 1 before step 3" in last_line(error)
    assert not lost_node(again)  # a restart that raises it again is recorded too, never retried


def test_a_trials_train_run_retries_nothing():
    base = JobConfig()
    assert base.run.max_failures > 0  # the sweep's Tune retries of a trial whose node was lost (speed.sweep.run)
    setup = SweepSetup(
        sweep="s", job=job_to_dict(base), tokenizer=b"", data=None, train_storage="/tmp/s/train", measure_limit=1,
        cost_limit=1, max_new_tokens=1, fail_pattern="2x2",
    )  # fmt: skip
    for pattern in ("1x2", "2x2"):
        config = {"grid": {"pattern": pattern, "loss_weights": "linear"}}
        job = trial_job(setup, config, f"0-{pattern}")
        assert job.run.max_failures == 0 and job.run.name == f"0-{pattern}"
        assert (job.train.fail_at_step is not None) == (pattern == "2x2")  # the fault drill: its own error
