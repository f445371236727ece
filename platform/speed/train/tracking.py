"""Live experiment tracking in MLflow, through Ray's integrations (``ray.air.integrations.mlflow``).

A job's ``tracking`` section (``speed.train.config.TrackingConfig``) says where:
``--tracking-uri`` (a server, ``http://...``, or a store), by default a file
store ``<storage_path>/mlruns`` beside the runs; a run on remote storage
(``s3://...``) is tracked only with an explicit URI, and ``--no-tracking`` turns
it off. ``check`` reaches the store before any work, so a wrong URI or a server
that is down fails the job at its start.

In a Train run, rank 0 opens one MLflow run per Train run (``session``, with
Ray's ``setup_mlflow``), named like it and tagged ``speed.run``; its params are
the resolved job, flattened to the dotted keys ``--set`` takes. At every progress
line (``log_step``) it logs each loop's loss ``loss_loop<i>`` (L_1..L_M), the
weighted loss, the learning rate, the gradient norm, tokens/s and s/step (the
means since the previous line, as printed); with every checkpoint report
(``log_report``) the rest of that report: the settle term, and the validation
metrics where a validation split is given. A rerun or a retried worker group
continues the same MLflow run and logs only steps after those it holds. Logging
that fails mid-run prints one warning and stops tracking: training goes on.

A sweep tracks its trials from the Tune driver instead (``sweep_callback``:
Ray's ``MLflowLoggerCallback``): one MLflow run per trial, in an experiment named
after the sweep, with the trial's config and every report.

MLflow is imported only here, and only when a run is tracked; its usage
telemetry is off unless the environment turns it on (``MLFLOW_DISABLE_TELEMETRY``).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from types import ModuleType
from typing import Any

from speed.train.config import JobConfig, job_from_dict
from speed.train.train_log import StepRecord

RUN_TAG = "speed.run"  # the Train run's name, on its MLflow run
SWEEP_TAG = "speed.sweep"

# Read by MLflow at import (telemetry) or per call (file store, HTTP); a value set in the environment wins.
_ENVIRONMENT = {
    "MLFLOW_DISABLE_TELEMETRY": "true",  # no usage reports to MLflow's servers, no id written into $HOME
    "MLFLOW_ALLOW_FILE_STORE": "true",  # MLflow 3 keeps the file store in maintenance mode, behind this switch
    "MLFLOW_HTTP_REQUEST_MAX_RETRIES": "2",  # a server that is down stalls a step for seconds, not minutes
    "MLFLOW_HTTP_REQUEST_TIMEOUT": "20",
}


class TrackingError(ValueError):
    """The tracking store or server cannot be used (a user's mistake: ``speed.cli.user_errors`` reports it)."""


def tracking_uri(job: JobConfig) -> str | None:
    """Where ``job`` is tracked (``TrackingConfig.store_uri``), or None when it is not."""
    return job.tracking.store_uri(job.run.storage_path) if job.tracking is not None else None


def experiment_name(job: JobConfig, default: str | None = None) -> str:
    """The MLflow experiment: ``tracking.experiment``, else ``default`` (a sweep's name), else the job kind."""
    assert job.tracking is not None
    return job.tracking.experiment or default or job.kind


def import_mlflow() -> ModuleType:
    """``mlflow``, imported with this module's environment defaults (telemetry off, file store allowed)."""
    for key, value in _ENVIRONMENT.items():
        os.environ.setdefault(key, value)
    import mlflow

    return mlflow


def check(job: JobConfig) -> None:
    """Reach the job's tracking store now (a file store is created); ``TrackingError`` naming the URI if not."""
    uri = tracking_uri(job)
    if uri is None:
        return
    mlflow = import_mlflow()
    try:
        mlflow.MlflowClient(uri).search_experiments(max_results=1)
    except Exception as err:  # MlflowException, connection errors, a URI scheme MLflow does not know
        reason = " ".join(str(err).split())[:300]
        raise TrackingError(
            f"MLflow tracking at {uri} cannot be used ({type(err).__name__}: {reason}); "
            "start the server, fix --tracking-uri, or pass --no-tracking"
        ) from None


def flatten(config: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """Nested sections as one level of dotted keys (``train.settle.kind``), the keys ``--set`` takes."""
    out: dict[str, Any] = {}
    for key, value in config.items():
        if isinstance(value, dict) and value:
            out |= flatten(value, f"{prefix}{key}.")
        else:
            out[f"{prefix}{key}"] = value
    return out


# ----- a Train run: rank 0's MLflow run ---------------------------------------------------------------


class _Session:
    """Rank 0's open MLflow run in this worker process."""

    def __init__(self, mlflow: ModuleType, after_step: int) -> None:
        self.mlflow = mlflow
        self.after_step = after_step  # steps up to this one are in the MLflow run already (an earlier launch)

    def log(self, step: int, metrics: dict[str, float]) -> None:
        global _session
        if step <= self.after_step or not metrics:
            return
        try:
            self.mlflow.log_metrics(metrics, step=step)
        except Exception as err:  # a server gone mid-run: say so once, keep training
            print(f"warning: MLflow logging failed at step {step}, tracking stops here: {err}", flush=True)
            _session = None


_session: _Session | None = None


@contextmanager
def session(
    job_dict: dict[str, Any], params: dict[str, Any] | None = None, step_metric: str = "loss"
) -> Iterator[None]:
    """Around a Train worker's loop: on rank 0 of a tracked job, its MLflow run (ended FINISHED or FAILED).

    ``job_dict``: the resolved job (``job_to_dict``), its run named. An MLflow run of the same experiment tagged
    with this Train run's name is continued (from the last step of its ``step_metric``); otherwise
    ``setup_mlflow`` starts one and logs ``params`` (default: the job) as params.
    """
    global _session
    import ray.train

    job = job_from_dict(job_dict)
    uri = tracking_uri(job)
    if job.tracking is None or ray.train.get_context().get_world_rank() != 0:
        yield
        return
    if uri is None:
        print(f"tracking: off (no default store for storage {job.run.storage_path}; pass --tracking-uri)", flush=True)
        yield
        return
    mlflow = import_mlflow()
    from ray.air.integrations.mlflow import setup_mlflow

    name = job.run.name
    experiment = experiment_name(job)
    params = flatten(job_dict if params is None else params)
    after_step = 0
    existing = _tagged_run(mlflow.MlflowClient(uri), experiment, RUN_TAG, name)
    if existing is not None:
        mlflow.set_tracking_uri(uri)
        mlflow.start_run(run_id=existing.info.run_id)  # setup_mlflow keeps an active run
        params = {k: v for k, v in params.items() if k not in existing.data.params}  # MLflow params never change
        history = mlflow.MlflowClient(uri).get_metric_history(existing.info.run_id, step_metric)
        after_step = max((m.step for m in history), default=0)
    tracked = setup_mlflow(
        params,
        tracking_uri=uri,
        experiment_name=experiment,
        run_name=name,
        create_experiment_if_not_exists=True,
        tags={RUN_TAG: name},
    )
    _session = _Session(tracked, after_step)
    print(f"tracking: {uri}, experiment {experiment}, run {name}", flush=True)
    status = "FAILED"
    try:
        yield
        status = "FINISHED"
    finally:
        _session = None
        try:
            tracked.end_run(status=status)
        except Exception as err:  # the server gone: the run stays open there; the training's outcome stands
            print(f"warning: MLflow could not end run {name} ({status}): {err}", flush=True)


def _tagged_run(client: Any, experiment: str, tag: str, value: str) -> Any | None:
    """The newest MLflow run of ``experiment`` whose ``tag`` is ``value``, or None."""
    found = client.get_experiment_by_name(experiment)
    if found is None:
        return None
    runs = client.search_runs(
        [found.experiment_id], filter_string=f"tags.`{tag}` = '{value}'", max_results=1, order_by=["start_time DESC"]
    )
    return runs[0] if runs else None


def log_step(record: StepRecord) -> None:
    """Log a progress line's values (``speed.train.train_log.window_mean``) to the open MLflow run, if any."""
    if _session is not None:
        _session.log(record.step, step_metrics(record))


_STEP_FIELDS = ("loss", "lr", "grad_norm", "tokens_per_s", "step_time_s")  # of a StepRecord, beside loop_losses


def step_metrics(record: StepRecord) -> dict[str, float]:
    """What ``log_step`` logs: the weighted loss, ``loss_loop<i>`` per loop, lr, gradient norm, tokens/s, s/step."""
    loops = {f"loss_loop{i + 1}": x for i, x in enumerate(record.loop_losses)}
    return {key: float(getattr(record, key)) for key in _STEP_FIELDS} | loops


def log_metrics(step: int, metrics: dict[str, float]) -> None:
    """Log ``metrics`` at ``step`` to the open MLflow run, if any (a job's own numbers: ``jobs/train_exits.py``)."""
    if _session is not None:
        _session.log(step, metrics)


def log_report(step: int, metrics: dict[str, Any]) -> None:
    """Log a checkpoint report's numbers that ``log_step`` does not (validation, the settle term), if tracked."""
    if _session is None:
        return
    logged = {"step", *_STEP_FIELDS}
    rest = {
        k: float(v)
        for k, v in metrics.items()
        if isinstance(v, (int, float)) and k not in logged and not k.startswith("loss_loop")
    }
    _session.log(step, rest)


# ----- a sweep: one MLflow run per trial from the Tune driver ----------------------------------------------


def sweep_callback(job: JobConfig, sweep: str) -> Any | None:
    """Ray's ``MLflowLoggerCallback`` for a sweep of ``job``s (experiment: the sweep's name), or None untracked.

    A restored sweep continues a trial's MLflow run (found by its ``trial_name`` tag) instead of opening another.
    """
    uri = tracking_uri(job)
    if uri is None:
        return None
    import_mlflow()
    from ray.air.integrations.mlflow import MLflowLoggerCallback

    class TrialRuns(MLflowLoggerCallback):
        def log_trial_start(self, trial: Any) -> None:
            if trial not in self._trial_runs:
                client = self.mlflow_util._get_client()
                existing = _tagged_run(client, self.experiment_name, "trial_name", str(trial))
                if existing is not None:
                    self._trial_runs[trial] = existing.info.run_id
            super().log_trial_start(trial)

    return TrialRuns(uri, experiment_name=experiment_name(job, sweep), tags={SWEEP_TAG: sweep})
