"""One trial of a sweep: a Tune function trainable that runs a Ray Train job, then measures its checkpoint.

Ray Train V2 does not run a ``TorchTrainer`` as a Tune trainable; instead each
trial's function runs the job's training stage (``speed.train.launch.train_stage``,
which calls ``fit()``), with ``TuneReportCallback`` forwarding rank 0's reports
(the training and validation losses, every ``checkpoint_every`` steps) to Tune,
whose scheduler may stop the trial there. The Train run is named after the
trial, so a restored sweep resumes an unfinished trial from its last training
checkpoint. A trained trial is measured (``speed.sweep.measure``) in a Ray task
sized like one worker, and reports once more with a Tune checkpoint holding the
measurement: a trial restarted after that re-reports it instead of measuring again.

Failures (``speed.sweep.failures``): a trial's Train run retries nothing itself
(``max_failures=0``); the sweep's Tune retries a trial whose node was lost, up to
the job's ``run.max_failures``, and the restart resumes the Train run from its
newest checkpoint. A trial's own error is recorded and raised again by any
restart, without training.
"""

from __future__ import annotations

import json
import tempfile
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import ray
from ray import tune
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from speed.storage import locate
from speed.sweep.failures import lost_node, record_failure, recorded_failure
from speed.sweep.measure import Measurement
from speed.sweep.space import trial_pattern, trial_scheme, trial_settle
from speed.train.config import JobConfig, job_from_dict, job_to_dict
from speed.train.launch import PreparedData, run_directory, train_stage

MEASUREMENT_FILE = "measurement.json"
EVAL_DIR = "eval_validation"  # in the trial's Train run directory: predictions, trace, summary


@dataclass(frozen=True)
class SweepSetup:
    """What the driver prepared once and every trial shares."""

    sweep: str  # the sweep's name
    job: dict[str, Any]  # the base finetuning job, resolved (model vocabulary = the tokenizer's)
    tokenizer: bytes  # the sweep's tokenizer (speed.hf_tokenizer.pack_tokenizer), resolved once
    data: PreparedData  # the training split and the validation split (periodic losses), tokenized once for all
    train_storage: str  # where the trials' Train runs live: <storage>/<sweep>/train
    measure_limit: int
    cost_limit: int
    max_new_tokens: int
    fail_pattern: str | None  # fault drill: this pattern's trials fail in training
    levers: dict[str, tuple] = field(default_factory=dict)  # SweepConfig.levers: the costs' lever values


def trial_name(trial: Any) -> str:
    """``<index>-<pattern>-<loss weights>[-<settle>]``: the trial id's counter and its config, no timestamp.

    Tune's ``trial_name_creator`` and ``trial_dirname_creator``; also the name of the trial's Train run.
    The settle term (``SettleConfig.label``) is named only when there is one.
    """
    index = trial.trial_id.rsplit("_", 1)[-1]
    settle = trial_settle(trial.config)
    name = f"{index}-{trial_pattern(trial.config)}-{trial_scheme(trial.config)}"
    return f"{name}-{settle.label}" if settle.active else name


def trial_job(setup: SweepSetup, trial_config: dict[str, Any], name: str) -> JobConfig:
    """The trial's job: the base job with its pattern, loss weights, settle term, run name and storage; its Train
    run retries nothing (the sweep's Tune retries a trial whose node was lost, ``speed.sweep.failures``)."""
    base = job_from_dict(setup.job)
    train = replace(base.train, loss_weights=trial_scheme(trial_config))
    if "settle" in trial_config.get("grid", trial_config):  # a sweep over settle terms sets it; else the base job's
        train = replace(train, settle=trial_settle(trial_config))
    run = replace(base.run, name=name, storage_path=setup.train_storage, max_failures=0)
    pattern = trial_pattern(trial_config)
    if pattern == setup.fail_pattern:
        # The last worker raises on reaching the step after the first checkpoint: the trial's own error.
        train = replace(train, fail_at_step=train.checkpoint_every + 1)
    return replace(base, model=base.model.replace(pattern=pattern), train=train, run=run)


def run_trial(trial_config: dict[str, Any], setup: SweepSetup) -> None:
    """Train the trial's job on Ray Train (reports forwarded to Tune), measure it, report the measurement.

    Raises what failed it: a lost node as it is (Tune retries it), the trial's own error once recorded (a restart
    raises it again at once)."""
    previous = tune.get_checkpoint()
    if previous is not None:  # measured before an interruption or a lost node: report it again
        with previous.as_directory() as directory:
            tune.report(json.loads((Path(directory) / MEASUREMENT_FILE).read_text())["report"])
        return
    job = trial_job(setup, trial_config, tune.get_context().get_trial_name())
    run_dir = run_directory(job)
    if (failure := recorded_failure(run_dir)) is not None:
        raise failure
    try:
        _train_and_measure(job, setup)
    except Exception as error:
        if not lost_node(error):
            record_failure(run_dir, error)
        raise


def _train_and_measure(job: JobConfig, setup: SweepSetup) -> None:
    from ray.tune.integration.ray_train import TuneReportCallback

    trained = train_stage(job, setup.tokenizer, setup.data, callbacks=[TuneReportCallback()])  # rank 0 -> Tune
    checkpoint, run_dir = trained.checkpoint, trained.run_dir
    gpus = job.scale.gpus_per_worker if job.scale.use_gpu else 0
    # Outside the trial's placement group (a bundle of memory only): the task takes the workers' resources.
    outside = PlacementGroupSchedulingStrategy(placement_group=None)
    task = ray.remote(_measure).options(num_cpus=job.scale.cpus_per_worker, num_gpus=gpus, scheduling_strategy=outside)
    measurement, validation = ray.get(task.remote(job_to_dict(job), checkpoint, setup, f"{run_dir}/{EVAL_DIR}"))
    # From the final checkpoint, not from fit()'s metrics: a resumed run that had no step left reports none.
    report = {"step": trained.step, "loss": trained.metrics.get("loss"), "checkpoint": checkpoint, **validation}
    with tempfile.TemporaryDirectory() as tmp:
        data = {"report": report, "measurement": measurement}
        (Path(tmp) / MEASUREMENT_FILE).write_text(json.dumps(data))
        tune.report(report, checkpoint=tune.Checkpoint.from_directory(tmp))


def read_measurement(checkpoint: tune.Checkpoint | None) -> tuple[dict[str, Any], Measurement] | None:
    """(final report, measurement) from a trial's Tune checkpoint, or None if it never got measured."""
    if checkpoint is None:
        return None
    with checkpoint.as_directory() as directory:
        path = Path(directory) / MEASUREMENT_FILE
        if not path.is_file():
            return None
        data = json.loads(path.read_text())
    return data["report"], Measurement(**data["measurement"])


def _measure(
    job_dict: dict[str, Any], checkpoint: str, setup: SweepSetup, out_uri: str
) -> tuple[dict[str, Any], dict[str, float]]:
    """The measurement and the validation losses of a checkpoint (``val_loss_loop*``, ``val_loss_last``)."""
    import torch

    from speed.data.corpus import open_corpus
    from speed.eval.validation import validation_metrics
    from speed.hf_tokenizer import load_tokenizer
    from speed.models.checkpoint import load_model
    from speed.sweep.measure import lever_settings, measure

    job = job_from_dict(job_dict)
    device = torch.device("cuda" if job.scale.use_gpu and torch.cuda.is_available() else "cpu")
    torch.set_num_threads(job.train.num_threads or max(1, int(job.scale.cpus_per_worker)))
    loaded = load_model(checkpoint, map_location=device)
    with tempfile.TemporaryDirectory() as out:
        result = measure(
            loaded.model.to(device).eval(),
            job.family,
            load_tokenizer(loaded.tokenizer_path),
            job.data.task,
            job.data.source,
            setup.measure_limit,
            setup.cost_limit,
            job.data.max_source_len,
            setup.max_new_tokens,
            out,
            lever_settings(setup.levers, loaded.model.n_loops),
        )
        locate(out_uri).upload(out)
        validation = validation_metrics(loaded.model, job.family, open_corpus(setup.data.validation), job.micro_batch)
    return result.to_dict(), validation
