"""The sweep driver: prepare once, run (or resume) the trials with Ray Tune, tabulate, find the frontier, time it.

``run_sweep(sweep, job)`` is what ``jobs/sweep.py`` calls. Stages:

1. the tokenizer and the tokenized training and validation splits (``speed.train.launch``'s
   tokenizer and data stages: prepared once, cached), shared by every trial;
2. the trials (``speed.sweep.trial``) under ``<storage>/<name>``: a second run
   of the same sweep finds that folder and continues it with ``Tuner.restore``
   (finished and failed trials stay as they are, unfinished ones resume); with
   tracking, one MLflow run per trial (``speed.train.tracking.sweep_callback``);
3. ``results.parquet`` (one row per trial) and ``frontier.parquet``;
4. the latency stage (``speed.sweep.latency``) in one Ray task: ``latency.parquet``.
"""

from __future__ import annotations

import json
import tempfile
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import ray
from ray import tune

from speed.losses import flip_cost
from speed.paths import TRAIN_LOG_FILE
from speed.storage import absolute, locate
from speed.sweep.failures import last_line
from speed.sweep.measure import PLAIN
from speed.sweep.results import (
    FRONTIER_FILE,
    LATENCY_FILE,
    RESULTS_FILE,
    RESULTS_SCHEMA,
    format_frontier,
    format_latency,
    format_results,
    frontier,
    sequential_layers,
)
from speed.sweep.space import (
    METRIC,
    SWEPT_LEVERS,
    SchedulerPlan,
    SweepConfig,
    check_job,
    param_space,
    sweep_digest,
    trial_scheme,
)
from speed.sweep.trial import SweepSetup, read_measurement, run_trial, trial_job, trial_name
from speed.train import tracking
from speed.train.config import JobConfig, job_to_dict
from speed.train.launch import data_stage, ensure_ray
from speed.train.tokenizer_stage import tokenizer_stage

# A trial's own process only waits on its Train run and its measurement task, which reserve the CPUs and
# GPUs; Tune needs a non-empty bundle, so it asks for a little memory instead of a CPU a worker would miss.
TRIAL_DRIVER_RESOURCES = {"cpu": 0, "memory": 64 * 2**20}


@dataclass(frozen=True)
class SweepOutcome:
    """Where a sweep left its results, and the tables."""

    name: str
    directory: str  # <storage>/<name>: Tune's experiment, the trials' Train runs under train/, the Parquet files
    results: pa.Table  # speed.sweep.results.RESULTS_SCHEMA
    frontier: pa.Table  # FRONTIER_SCHEMA
    latency: pa.Table | None  # LATENCY_SCHEMA; None when the stage is off or nothing finished


def sweep_name(sweep: SweepConfig, job: JobConfig) -> str:
    """``sweep-<task>-<hash of the sweep and the base job>``, unless the job names its run."""
    where = job_to_dict(job)
    where.pop("run")  # storage, retries: where the sweep runs, not what it finds
    where.pop("tracking")  # where it is watched
    return job.run.name or f"sweep-{job.data.task}-{sweep_digest(sweep, where)}"


def run_sweep(sweep: SweepConfig, job: JobConfig, callbacks: list[tune.Callback] | None = None) -> SweepOutcome:
    """Run (or resume) the sweep; write and print its tables. ``callbacks``: Tune callbacks of a new sweep.

    A sweep that cannot work with its job raises ``ValueError`` before any work (``check_job``).
    """
    plan = check_job(sweep, job)
    for note in plan.notes:
        print(f"note: {note}", flush=True)
    with tempfile.TemporaryDirectory(prefix="speed-tokenizer-") as scratch:
        resolved = tokenizer_stage(job, Path(scratch))
        job = replace(resolved.job, eval=None)  # trials measure on the validation split instead (speed.sweep.measure)
        name = sweep_name(sweep, job)
        storage = absolute(job.run.storage_path)
        directory = f"{storage.rstrip('/')}/{name}"
        data = data_stage(job, resolved.tokenizer_path, validation_limit=sweep.val_limit)
    setup = SweepSetup(
        sweep=name,
        job=job_to_dict(replace(job, tracking=None)),  # the sweep's MLflow callback tracks the trials
        tokenizer=resolved.tokenizer,
        data=data,
        train_storage=f"{directory}/train",
        measure_limit=sweep.measure_limit,
        cost_limit=sweep.cost_limit,
        max_new_tokens=sweep.max_new_tokens,
        fail_pattern=sweep.fail_pattern,
        levers=sweep.levers,
    )
    ensure_ray()
    trainable = tune.with_resources(tune.with_parameters(run_trial, setup=setup), TRIAL_DRIVER_RESOURCES)
    if tune.Tuner.can_restore(directory):
        print(f"sweep {name}: resuming {directory}", flush=True)
        tuner = tune.Tuner.restore(directory, trainable, resume_unfinished=True, resume_errored=False)
    else:
        print(f"sweep {name}: {len(sweep.expanded_patterns)} patterns -> {directory}", flush=True)
        tuner = tune.Tuner(
            trainable,
            param_space=param_space(sweep),
            tune_config=tune_config(sweep, job, plan),
            run_config=tune.RunConfig(
                name=name,
                storage_path=storage,
                # A trial whose node was lost is retried; one that failed on its own raises its error again at
                # once on each retry (speed.sweep.failures), so it ends failed with it.
                failure_config=tune.FailureConfig(max_failures=job.run.max_failures),
                callbacks=[*(callbacks or []), *filter(None, [tracking.sweep_callback(job, name)])],
                verbose=1,
            ),
        )
    grid = tuner.fit()
    results = results_table(grid, setup)
    # Tune creates trials as it goes: an interrupted sweep may not have created them all yet.
    unfinished = results.column("status").to_pylist().count("unfinished") + sweep.trials - results.num_rows
    if unfinished:
        print(f"sweep {name}: interrupted with {unfinished} of {sweep.trials} trials not done; rerun to resume")
    front = frontier(results)
    _write(results, directory, RESULTS_FILE)
    _write(front, directory, FRONTIER_FILE)
    print(f"\nsweep {name}: {results.num_rows} trials -> {directory}/{RESULTS_FILE}\n{format_results(results)}")
    print(f"\nPareto frontier (accuracy vs SPEED cost) -> {directory}/{FRONTIER_FILE}\n{format_frontier(front)}")
    latency = None
    if sweep.latency_limit and front.num_rows and not unfinished:
        latency = _time_frontier(front, results, job, sweep)
        _write(latency, directory, LATENCY_FILE)
        print(f"\nlatency (batch 1, interleaved) -> {directory}/{LATENCY_FILE}\n{format_latency(latency)}", flush=True)
    return SweepOutcome(name, directory, results, front, latency)


def tune_config(sweep: SweepConfig, job: JobConfig, plan: SchedulerPlan) -> tune.TuneConfig:
    """Searcher, scheduler (``plan``: ``check_job``'s), concurrency and deterministic trial names."""
    from ray.tune.search import BasicVariantGenerator

    return tune.TuneConfig(
        metric=sweep.metric,
        mode="min",
        # Grid or seeded random draws. Tune applies max_concurrent_trials only to the generator it builds itself.
        search_alg=BasicVariantGenerator(max_concurrent=max_concurrent_trials(job), random_state=job.train.seed),
        scheduler=scheduler(sweep, plan),
        num_samples=sweep.samples,
        trial_name_creator=trial_name,
        trial_dirname_creator=trial_name,
    )


def scheduler(sweep: SweepConfig, plan: SchedulerPlan) -> tune.schedulers.TrialScheduler:
    """ASHA with ``plan``'s rungs, or FIFO."""
    from ray.tune.schedulers import ASHAScheduler, FIFOScheduler

    if plan.scheduler == "fifo":
        return FIFOScheduler()
    # Rungs up to max_t, the last report before the last step; stop_last_trials=False: reaching max_t stops
    # no trial, so a trial that passed every rung trains to the end and is measured.
    return ASHAScheduler(
        time_attr="step",
        max_t=plan.max_t,
        grace_period=plan.grace_steps,
        reduction_factor=sweep.reduction_factor,
        stop_last_trials=False,
    )


def max_concurrent_trials(job: JobConfig) -> int:
    """How many trials the cluster's CPUs (and GPUs) hold at once, each with all its workers."""
    total = ray.cluster_resources()
    s = job.scale
    n = int(total.get("CPU", 0) // (s.num_workers * s.cpus_per_worker))
    if s.use_gpu:
        n = min(n, int(total.get("GPU", 0) // (s.num_workers * s.gpus_per_worker)))
    return max(1, n)


def results_table(grid: tune.ResultGrid, setup: SweepSetup) -> pa.Table:
    """One ``RESULTS_SCHEMA`` row per trial: finished (measured), stopped by the scheduler, or failed."""
    rows = [_row(result, setup) for result in grid]
    return pa.Table.from_pylist(sorted(rows, key=lambda r: r["trial"]), schema=RESULTS_SCHEMA)


def _row(result: tune.Result, setup: SweepSetup) -> dict[str, Any]:
    name = Path(result.path).name
    config = result.config
    job = trial_job(setup, config, name)
    sharing = job.model.sharing
    metrics = result.metrics or {}
    measured = None if result.error is not None else read_measurement(result.checkpoint)
    row: dict[str, Any] = dict.fromkeys(RESULTS_SCHEMA.names)
    row |= {
        "sweep": setup.sweep,
        "trial": name,
        "status": _status(result, measured is not None),
        "error": last_line(result.error) if result.error is not None else None,
        "task": job.data.task,
        "family": job.family.name,
        "pattern": str(sharing),
        "n_unique": sharing.n_unique,
        "n_loops": sharing.n_loops,
        "depth": sequential_layers(sharing),
        "loss_weights": trial_scheme(config),
        "settle": job.train.settle.label,
        "job": json.dumps(job_to_dict(job), sort_keys=True),
        "steps": metrics.get("step"),
        "train_loss": metrics.get("loss"),
        "val_loss_last": metrics.get(METRIC),
        "val_flip_cost": metrics.get("val_flip_cost"),
        "checkpoint": metrics.get("checkpoint") or metrics.get("checkpoint_path"),
    }
    row["restarts"] = _restarts(row["checkpoint"])
    losses = [metrics.get(f"val_loss_loop{i + 1}") for i in range(sharing.n_loops)]
    row["val_loss_loops"] = losses if None not in losses else None
    flips = [metrics.get(f"val_flip_prev_loop{i + 1}") for i in range(sharing.n_loops)]
    row["val_flip_rate_prev"] = flips if None not in flips else None
    if measured is not None:
        _, m = measured
        best = m.best_cost()
        row |= {
            "accuracy_metric": m.accuracy_metric,
            "accuracy": m.accuracy,
            **{k: m.scores.get(k) for k in ("bleu", "chrf", "rouge1", "rouge2", "rougeL")},
            "flip_rate_prev": m.flip_rate_prev,
            "flip_rate_final": m.flip_rate_final,
            "flip_rate_loop1": m.flip_rate_final[0],
            "flip_cost": flip_cost(m.flip_rate_prev),
            "costs": m.costs,
            "speed_cost": best["layer_steps_per_token"],
            "speed_steps_per_token": best["steps_per_token"],
            "best_launch_loop": best["launch_loop"],
            "best_invalidation": best["invalidation"],
            **{f"best_{name}": best.get(name, getattr(PLAIN, name)) for name in SWEPT_LEVERS},
            "speed_rows_per_token": best.get("rows_per_token"),
            "examples": m.examples,
        }
    return row


def _status(result: tune.Result, measured: bool) -> str:
    if result.error is not None:
        return "failed"
    if measured:
        return "finished"
    return "stopped" if (result.metrics or {}).get("done") else "unfinished"  # Tune marks a stopped trial done


def _restarts(checkpoint: str | None) -> int | None:
    """Times the trial's training resumed from a checkpoint before its last one (its train log's ``restarts``):
    a retry after a lost node, or a resumed sweep. None without a checkpoint."""
    if checkpoint is None:
        return None
    log = locate(checkpoint) / TRAIN_LOG_FILE
    if not log.is_file():
        return None
    restarts = pq.read_table(log.path, filesystem=log.fs, columns=["restarts"]).column("restarts")
    return restarts[-1].as_py() if len(restarts) else 0


def _time_frontier(front: pa.Table, results: pa.Table, job: JobConfig, sweep: SweepConfig) -> pa.Table:
    """The latency stage in one Ray task sized like one training worker."""
    gpus = job.scale.gpus_per_worker if job.scale.use_gpu else 0
    task = ray.remote(_latency_task).options(num_cpus=job.scale.cpus_per_worker, num_gpus=gpus)
    return ray.get(task.remote(front, results, job_to_dict(job), sweep))


def _latency_task(front: pa.Table, results: pa.Table, job_dict: dict[str, Any], sweep: SweepConfig) -> pa.Table:
    import torch

    from speed.sweep.latency import time_frontier
    from speed.train.config import job_from_dict

    job = job_from_dict(job_dict)
    torch.set_num_threads(job.train.num_threads or max(1, int(job.scale.cpus_per_worker)))
    device = "cuda" if job.scale.use_gpu and torch.cuda.is_available() else "cpu"
    d = job.data
    return time_frontier(
        front,
        results,
        d.task,
        d.source,
        sweep.latency_limit,
        d.max_source_len,
        sweep.max_new_tokens,
        sweep.latency_reps,
        device,
    )


def _write(table: pa.Table, directory: str, file: str) -> None:
    folder = locate(directory)
    folder.makedirs()
    pq.write_table(table, (folder / file).path, filesystem=folder.fs)
