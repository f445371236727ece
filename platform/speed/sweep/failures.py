"""Which failures of a trial a sweep retries: a lost node (or process), never an error of the trial itself.

Ray Tune retries a failed trial up to ``FailureConfig(max_failures)`` whatever failed it. A sweep wants two
answers: a trial whose node was lost (its own process, its Train controller or a Train worker killed with the
node) is started again elsewhere, from its Train run's newest checkpoint; a trial that failed on its own (a bad
config, a NaN, a bug, an injected failure) is recorded as ``failed`` with its error and never run again. So the
trial classifies what it raises (``lost_node``). A lost node is raised as it is, for Tune to retry. Its own error
is first written beside the trial's Train run (``record_failure``); a restart of that trial (Tune's) finds it
(``recorded_failure``) and raises it again at once, without training: Tune's retries of it cost a few seconds.
A trial whose own process dies with its node never gets to classify anything: Tune sees the actor die and
retries it.
"""

from __future__ import annotations

import json

from ray import exceptions as rex

from speed.storage import locate

FAILURE_FILE = "trial_failure.json"  # in the trial's Train run directory: its own error, recorded

# A process or node of the trial died, or an object lost with one. ObjectLostError's subclasses for objects
# freed by the program (ObjectFreedError, ReferenceCountingAssertionError) are the program's own errors.
_LOST = (
    rex.ActorDiedError,  # an actor's process or node died (a Train worker, the Train controller)
    rex.ActorUnavailableError,  # its node unreachable
    rex.NodeDiedError,
    rex.WorkerCrashedError,  # a task's process died
    rex.LocalRayletDiedError,
    rex.OwnerDiedError,
    rex.ObjectReconstructionFailedError,
    rex.ObjectFetchTimedOutError,
)


class RecordedFailure(RuntimeError):
    """The trial's own error, raised again by a restart of the trial (its message: the error's last line)."""


def lost_node(error: BaseException) -> bool:
    """Whether ``error`` says that a process or node the trial ran on died, not that the trial's code failed.

    Looks through Ray's wrappers: a task's error (``RayTaskError``: its cause), Ray Train's run errors (a
    ``WorkerGroupError``: any worker's failure; a ``ControllerError``: the controller's), a worker's failed
    health check (its cause), and explicit causes (``raise ... from``). One lost worker among others' errors
    counts as lost: the survivors of a lost rank fail too (a collective's peer gone), as Ray Train's own
    failure policy reasons for preemptions; a genuine error comes back on the retry, and is recorded then.
    """
    return any(isinstance(e, _LOST) or _train_lost(e) for e in _causes(error))


def _causes(error: BaseException, seen: set[int] | None = None) -> list[BaseException]:
    """``error`` and every error inside it, as far as Ray's and Ray Train's wrappers tell."""
    seen = set() if seen is None else seen
    if error is None or id(error) in seen:
        return []
    seen.add(id(error))
    inner: list[BaseException | None] = [error.__cause__]  # `raise ... from`: not any error being handled
    if isinstance(error, rex.RayTaskError):
        inner.append(error.cause)
    inner.append(getattr(error, "health_check_failure", None))  # Train's WorkerHealthCheckFailedError
    inner.append(getattr(error, "controller_failure", None))  # Train's ControllerError
    inner.extend(getattr(error, "worker_failures", {}).values())  # Train's WorkerGroupError: each rank's error
    return [error] + [c for e in inner if isinstance(e, BaseException) for c in _causes(e, seen)]


def _train_lost(error: BaseException) -> bool:
    """Ray Train's own words for a lost worker: a health check that timed out, a worker group that could not
    start (no room left after a loss, or a worker dying as it started)."""
    from ray.train.v2._internal import exceptions as train

    lost = (train.WorkerHealthCheckTimeoutError, train.WorkerGroupStartupTimeoutError)
    return isinstance(error, lost + (train.WorkerGroupStartupFailedError,))


def record_failure(run_dir: str, error: BaseException) -> None:
    """Write the trial's own ``error`` (its type and last line) beside its Train run, for a restart to find."""
    folder = locate(run_dir)
    folder.makedirs()
    (folder / FAILURE_FILE).write_text(json.dumps({"type": type(error).__name__, "error": last_line(error)}))


def recorded_failure(run_dir: str) -> RecordedFailure | None:
    """The error ``record_failure`` wrote for this trial, as a ``RecordedFailure``; None when there is none."""
    path = locate(run_dir) / FAILURE_FILE
    if not path.exists():
        return None
    data = json.loads(path.read_text())
    return RecordedFailure(f"{data['type']} (recorded; not retried): {data['error']}")


def last_line(error: BaseException) -> str:
    """An error's last non-empty line (a traceback's: what failed), or its type's name."""
    lines = [line for line in str(error).strip().splitlines() if line.strip()]
    return lines[-1].strip() if lines else type(error).__name__
