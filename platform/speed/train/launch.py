"""The driver side of a training job, as named stages: tokenizer, data, training, evaluation.

``run_job(job)`` is what ``jobs/pretrain.py``, ``jobs/finetune.py`` and
``jobs/demo.py`` call; it composes the stages, and a sweep (``speed.sweep``)
calls the same ones:

1. ``tokenizer_stage`` (``speed.train.tokenizer_stage``): the tokenizer (given, trained and cached, or a
   checkpoint's) and the job it completes (the model's vocabulary is the tokenizer's) -> ``ResolvedJob``; then
   ``plan_stage``: the memory plan of a worker's step printed (``speed.train.memory_plan``), a job that would
   not fit refused;
2. ``data_stage``: the splits tokenized once on storage (``speed.data.shards``) -> ``PreparedData``;
3. ``train_stage``: the ``TorchTrainer`` run, resumed from the run's newest complete checkpoint -> ``Trained``;
4. ``evaluation_stage``: a finetuned model's evaluation (``speed.eval.evaluate``), in a Ray task.

``run_job`` connects to ``$RAY_ADDRESS`` when set (``ray job submit`` sets it)
and otherwise starts a local Ray in-process (``ensure_ray``).
"""

from __future__ import annotations

import os
import tempfile
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import pyarrow.fs as pafs
import ray
import ray.train
from ray.train.torch import TorchTrainer

from speed.cli import user_errors
from speed.cluster import code_runtime_env
from speed.data.shards import CorpusSpec, cache_root, prepare_corpus
from speed.hf_tokenizer import load_tokenizer
from speed.models.checkpoint import (
    SHARDED_DIR,
    latest_checkpoint,
    newest_complete_checkpoint,
    read_checkpoint_config,
)
from speed.storage import absolute, locate
from speed.train import local_ray
from speed.train.config import JobConfig, job_from_args, job_to_dict, run_name
from speed.train.memory_plan import MemoryPlan, PlanRefused, check_fits, device_memory, plan_memory
from speed.train.origin import hub_origin, imported_origin
from speed.train.process_group import torch_config
from speed.train.state import IncompatibleCheckpointError, check_compatible
from speed.train.tokenizer_stage import tokenizer_stage


@dataclass(frozen=True)
class TrainOutcome:
    """Where a finished job left its results."""

    job: JobConfig  # resolved: model vocabulary, initial model and run name filled in
    run_dir: str  # storage_path/name (a local path or a URI)
    checkpoint: str  # the final checkpoint (path or URI), readable by speed.models.checkpoint.load_model
    step: int  # optimizer steps in that checkpoint
    metrics: dict[str, Any]  # the last metrics rank 0 reported in this launch (empty if it trained no step)
    evaluation: dict[str, Any] | None  # speed.eval.evaluate summary (finetuning), else None


@dataclass(frozen=True)
class PreparedData:
    """The data stage's result: prepared splits on storage (paths or URIs for ``speed.data.corpus.open_corpus``)."""

    train: str
    validation: str | None = None  # the validation split whose loop losses every checkpoint report carries


@dataclass(frozen=True)
class Trained:
    """The training stage's result."""

    run_dir: str  # storage_path/name (a local path or a URI)
    checkpoint: str  # the run's newest complete checkpoint (path or URI)
    step: int  # optimizer steps in that checkpoint
    metrics: dict[str, Any]  # the last metrics rank 0 reported in this launch (empty if it trained no step)


# ----- the driver: the stages composed -------------------------------------------------------------------


def run_job(job: JobConfig) -> TrainOutcome:
    """Train (pretrain or finetune) as configured, evaluate a finetuned model, print the run layout."""
    started = time.time()
    deadline = started + 60 * job.train.time_budget_min if job.train.time_budget_min else None
    with tempfile.TemporaryDirectory(prefix="speed-tokenizer-") as scratch:
        resolved = tokenizer_stage(job, Path(scratch))
        job = resolved.job
        job = replace(job, run=replace(job.run, name=job.run.name or run_name(job)))
        print(
            f"run {job.run.name}: {job.kind} {job.data.task}, model {job.model.pattern}, -> {run_directory(job)}",
            flush=True,
        )
        with user_errors((PlanRefused, IncompatibleCheckpointError)):  # one line, status 2, before any worker starts
            check_resumable(job, resolved.tokenizer)
            plan_stage(job)
        ensure_ray()
        data = data_stage(job, resolved.tokenizer_path)
    trained = train_stage(job, resolved.tokenizer, data, deadline)
    evaluation = evaluation_stage(job, trained)
    outcome = TrainOutcome(job, trained.run_dir, trained.checkpoint, trained.step, trained.metrics, evaluation)
    print(describe(outcome, time.time() - started), flush=True)
    return outcome


def plan_stage(job: JobConfig) -> MemoryPlan:
    """Print the job's memory plan (``speed.train.memory_plan``) and refuse (``PlanRefused``) a job whose worker's
    share would not fit its device."""
    plan = plan_memory(job)
    print("\n".join(plan.lines()), flush=True)
    check_fits(plan, device_memory(job))
    return plan


def job_main(kind: str, argv: list[str] | None, description: str) -> int:
    """The entry point of ``jobs/pretrain.py`` and ``jobs/finetune.py``: flags (and --config YAML) into a checked
    ``JobConfig`` (a mistake is one ``error:`` line, status 2), then ``run_job``; prints the checkpoint and, for
    a finetuned model, its evaluation's summary."""
    from speed.eval.summary import format_summary

    with user_errors():  # a mistake in the flags, the config or the files they name: one line, status 2
        job = job_from_args(kind, argv, description=description)
        check_inputs(job)
    outcome = run_job(job)
    print(f"{'pretrained' if kind == 'pretrain' else 'finetuned'} checkpoint: {outcome.checkpoint}")
    if outcome.evaluation is not None:
        print(format_summary(outcome.evaluation))
    return 0


# ----- checking inputs ----------------------------------------------------------------------------------


def check_inputs(job: JobConfig) -> None:
    """Fail now, not after training, on what the job names but cannot find.

    The training split and the split evaluated at the end (local sources; hub data
    sets are not contacted), the tokenizer file, the checkpoint ``init_from``
    or ``resume`` names, and the MLflow tracking store or server. Raises
    ``FileNotFoundError`` or ``ValueError`` naming it.
    """
    from speed.data import get_task, resolve_source
    from speed.train import tracking

    resolve_source(get_task(job.data.task), "train", job.data.source)
    if job.kind == "finetune" and job.eval is not None:
        final = job.final_eval
        resolve_source(get_task(final.task), final.split, final.source)
    if job.data.tokenizer is not None and not Path(job.data.tokenizer).expanduser().exists():
        raise FileNotFoundError(f"no tokenizer file at {job.data.tokenizer}")
    hub = hub_origin(job.init_from) if job.init_from is not None else None  # an unreadable directory: its line
    if hub is not None and not job.family.hub_init:
        raise ValueError(f"--init-from {job.init_from}: Hugging Face T5 weights need --model t5")
    imported = imported_origin(job.init_from) if job.init_from is not None and not job.resume else None
    if imported is not None and job.family.encoder_decoder:
        raise ValueError(f"--init-from {job.init_from}: a Hugging Face {imported} directory is a looped LM: --model lm")
    if (job.data.tokenizer is not None and Path(job.data.tokenizer).expanduser().is_dir()) or imported is not None:
        _check_imported_tokenizer(job)
    for origin in (None if hub or imported else job.init_from, job.resume):
        if origin is not None:
            latest_checkpoint(origin)
    if job.resume:
        check_strategy(job, latest_checkpoint(job.resume))
    tracking.check(job)


def check_strategy(job: JobConfig, checkpoint: str) -> None:
    """Refuse to resume ``checkpoint`` with the other strategy than the one that wrote it (FSDP's are sharded; a
    sharded checkpoint reads on any number of workers)."""
    sharded = (locate(checkpoint) / SHARDED_DIR / ".metadata").is_file()
    ran = "fsdp" if sharded else "ddp"
    if ran != job.scale.strategy:
        raise IncompatibleCheckpointError(
            f"{checkpoint} is a {ran} checkpoint: resume it with --strategy {ran} (or start a {job.scale.strategy} "
            "run from its weights: --init-from)"
        )


def _check_imported_tokenizer(job: JobConfig) -> None:
    """A Hugging Face tokenizer (an imported LM's folder) trains the looped LM only: T5's encoder-decoder inputs,
    decoder start and span corruption's sentinels follow the platform's SentencePiece conventions."""
    where = job.data.tokenizer or job.init_from
    if job.family.encoder_decoder:
        what = "span corruption needs T5 sentinels" if job.data.task == "pretrain" else "T5 reads SentencePiece ids"
        raise ValueError(
            f"--tokenizer {where}: a Hugging Face tokenizer (tokenizer.json) trains the looped LM only (--model lm); "
            f"{what} (a SentencePiece .model)"
        )
    load_tokenizer(where)  # a folder without tokenizer.json, or a broken one: its line


# ----- Ray -------------------------------------------------------------------------------------------


def ensure_ray() -> None:
    """Connect to ``$RAY_ADDRESS`` when set, else start a private local Ray (``speed.train.local_ray``).

    Never joins a stray local cluster; the private one leaves no process behind when the driver ends.
    The workers import this driver's ``speed`` (``speed.cluster``), whatever copy their nodes hold.
    """
    if ray.is_initialized():
        return
    if os.environ.get("RAY_ADDRESS"):
        ray.init(address=os.environ["RAY_ADDRESS"], log_to_driver=True, runtime_env=code_runtime_env())
    else:
        local_ray.start(runtime_env=code_runtime_env())


# ----- 2. the data stage -------------------------------------------------------------------------------


def data_stage(job: JobConfig, tokenizer_path: Path, validation_limit: int | None = None) -> PreparedData:
    """The job's training split (and, with ``validation_limit``, that many validation records) tokenized once
    into shards under ``<storage_path>/data``, or found there."""
    d, root = job.data, cache_root(absolute(job.run.storage_path))
    family = job.family.preparation  # how the family's splits are tokenized
    spec = CorpusSpec(d.task, "train", d.source, d.limit, d.max_source_len, d.max_target_len, d.pack, family=family)
    train = prepare_corpus(spec, tokenizer_path, root).uri
    if validation_limit is None:
        return PreparedData(train)
    spec = CorpusSpec(
        d.task, "validation", d.source, validation_limit, d.max_source_len, d.max_target_len, family=family
    )
    return PreparedData(train, prepare_corpus(spec, tokenizer_path, root).uri)


# ----- 3. the training stage ---------------------------------------------------------------------------


def run_directory(job: JobConfig) -> str:
    """Where the job's run lives: ``<storage_path>/<run name>`` (a local path made absolute, or a URI)."""
    return f"{absolute(job.run.storage_path).rstrip('/')}/{job.run.name}"


def train_stage(
    job: JobConfig,
    tokenizer: bytes,
    data: PreparedData,
    deadline: float | None = None,
    callbacks: list[ray.train.UserCallback] | None = None,
) -> Trained:
    """Train ``job`` (named: ``job.run.name``) on the prepared data; a rerun resumes its newest checkpoint.

    ``tokenizer``: the tokenizer's bytes (``speed.hf_tokenizer.pack_tokenizer``); ``deadline``: Unix time of the
    wall-clock budget;
    ``callbacks``: Ray Train callbacks (a sweep's ``TuneReportCallback``).
    """
    run_dir = run_directory(job)
    start = check_resumable(job, tokenizer)
    if start is not None:  # said here, not by a worker: a worker's output may never reach the job's
        print(f"resuming at step {start.step} from {start.checkpoint}", flush=True)
    result = build_trainer(job, tokenizer, data, run_dir, deadline, callbacks).fit()
    # The run's newest checkpoint on storage: Ray's result lags it when this launch trained no step.
    checkpoint = newest_complete_checkpoint(run_dir)
    if checkpoint is None:
        raise RuntimeError(f"run {job.run.name} finished without a checkpoint in {run_dir}")
    step = read_checkpoint_config(checkpoint)["step"]
    return Trained(run_dir, checkpoint, step, dict(result.metrics or {}))


@dataclass(frozen=True)
class ResumePoint:
    """Where a launch's workers start: ``checkpoint`` (path or URI), saved at ``step``."""

    step: int
    checkpoint: str


def resume_point(job: JobConfig, run_dir: str) -> ResumePoint | None:
    """The checkpoint this launch continues: the run's newest complete one (a rerun), else the one ``--resume``
    names; None for a fresh run. The workers choose the same one (``speed.train.loop``)."""
    checkpoint = newest_complete_checkpoint(run_dir) or (latest_checkpoint(job.resume) if job.resume else None)
    if checkpoint is None:
        return None
    return ResumePoint(read_checkpoint_config(checkpoint)["step"], checkpoint)


def check_resumable(job: JobConfig, tokenizer: bytes) -> ResumePoint | None:
    """The checkpoint this launch continues (``resume_point``), refused (``IncompatibleCheckpointError``, one line
    naming what differs and what to pass) where it cannot continue this run: another strategy, model, task,
    optimizer or tokenizer. ``tokenizer``: this run's (``speed.hf_tokenizer.pack_tokenizer``'s bytes)."""
    start = resume_point(job, run_directory(job))
    if start is not None:
        check_strategy(job, start.checkpoint)
        check_compatible(read_checkpoint_config(start.checkpoint), job_to_dict(job), tokenizer, start.checkpoint)
    return start


def build_trainer(
    job: JobConfig,
    tokenizer: bytes,
    data: PreparedData,
    run_dir: str,
    deadline: float | None,
    callbacks: list[ray.train.UserCallback] | None = None,
) -> TorchTrainer:
    """A ``TorchTrainer`` running ``train_loop_per_worker`` on the prepared data.

    With ``data.validation``, each checkpoint report carries its every-loop losses.
    """
    from speed.train.loop import train_loop_per_worker

    resources = {"CPU": job.scale.cpus_per_worker}
    if job.scale.use_gpu:
        resources["GPU"] = job.scale.gpus_per_worker
    # Ray Train's print patch sends worker prints through its logger too (every line shows twice) and
    # bypasses stdout captures (datasets' dill hashing then spills bytecode); plain stdout is forwarded once.
    os.environ.setdefault("RAY_TRAIN_ENABLE_PRINT_PATCH", "0")
    loop_config = {
        "job": job_to_dict(job),
        "tokenizer": tokenizer,  # pack_tokenizer's bytes, shipped so that workers on any node can read it
        "corpus": data.train,
        "deadline": deadline,
        "run_dir": run_dir,
        "validation": data.validation,
    }
    return TorchTrainer(
        train_loop_per_worker,
        train_loop_config=loop_config,
        torch_config=torch_config(),  # a local job's process group on loopback
        scaling_config=ray.train.ScalingConfig(
            num_workers=job.scale.num_workers, use_gpu=job.scale.use_gpu, resources_per_worker=resources
        ),
        run_config=ray.train.RunConfig(
            name=job.run.name,
            storage_path=absolute(job.run.storage_path),
            failure_config=ray.train.FailureConfig(max_failures=job.run.max_failures),
            checkpoint_config=ray.train.CheckpointConfig(num_to_keep=job.train.keep_checkpoints),
            callbacks=callbacks,
        ),
    )


# ----- 4. the evaluation stage (finetuning) -------------------------------------------------------------


def evaluation_stage(job: JobConfig, trained: Trained) -> dict[str, Any] | None:
    """A finetuning job's evaluation of its final checkpoint (``speed.eval.evaluate`` summary), under
    ``<run_dir>/eval_<split>``; None for pretraining or ``eval: null``."""
    if job.kind != "finetune" or job.eval is None:
        return None
    return evaluate_checkpoint(job, trained.checkpoint, f"{trained.run_dir}/eval_{job.final_eval.split}")


def evaluate_checkpoint(job: JobConfig, checkpoint: str, out_uri: str) -> dict[str, Any]:
    """Run ``speed.eval.evaluate.run_evaluation`` on a checkpoint in a Ray task sized like one worker; its Parquet
    files and summary go to ``out_uri`` (a local path or a URI)."""
    ensure_ray()
    gpus = job.scale.gpus_per_worker if job.scale.use_gpu else 0
    task = ray.remote(_evaluate).options(num_cpus=job.scale.cpus_per_worker, num_gpus=gpus)
    return ray.get(task.remote(job_to_dict(job), checkpoint, out_uri))


def _evaluate(job_dict: dict[str, Any], checkpoint: str, out_uri: str) -> dict[str, Any]:
    import torch

    from speed.eval.evaluate import run_evaluation
    from speed.models.checkpoint import load_model
    from speed.train.config import job_from_dict

    job = job_from_dict(job_dict)
    device = torch.device("cuda" if job.scale.use_gpu and torch.cuda.is_available() else "cpu")
    torch.set_num_threads(job.train.num_threads or max(1, int(job.scale.cpus_per_worker)))
    loaded = load_model(checkpoint, map_location=device)
    return run_evaluation(loaded.model.to(device), load_tokenizer(loaded.tokenizer_path), job.final_eval, out_uri)


# ----- the run directory ---------------------------------------------------------------------------------


def describe(outcome: TrainOutcome, seconds: float) -> str:
    """What the run left where: the run directory's entries, the final checkpoint, the evaluation."""
    run_dir = locate(outcome.run_dir)
    lines = [f"finished in {seconds / 60:.1f} min; run directory {outcome.run_dir}"]
    for info in run_dir.entries():
        if info.type == pafs.FileType.Directory:
            files = [c.base_name for c in (run_dir / info.base_name).entries()]
            lines.append(f"  {info.base_name}/  {' '.join(files)}")
        else:
            lines.append(f"  {info.base_name}")
    lines.append(f"final checkpoint: {outcome.checkpoint} (step {outcome.step})")
    if "loss" in outcome.metrics:
        exits = sum(key.startswith("loss_loop") for key in outcome.metrics)  # 1: a sampled or truncated recurrence's
        loops = " ".join(f"{outcome.metrics[f'loss_loop{i + 1}']:.3f}" for i in range(exits))
        lines.append(f"final loss {outcome.metrics['loss']:.4f}, per loop L_i: {loops}")
    if outcome.evaluation is not None:
        lines.append(f"evaluation: {outcome.run_dir}/eval_{outcome.job.final_eval.split}/summary.json")
    return "\n".join(lines)
