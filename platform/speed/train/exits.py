"""Training exit adapters (``speed.models.exits``) on a frozen checkpoint, with Ray Train: ``jobs/train_exits.py``.

The model of ``checkpoint`` is loaded and frozen (no gradient, eval mode: no dropout); fresh adapters are attached
to its early exits and trained with ``sum_k KL(loop M || loop k)`` (``speed.models.exits.exit_kl``) on the training
split its finetuning (or pretraining) job used, read from the same prepared shards (``speed.launch.data_stage``),
teacher-forced on the split's targets (``targets="split"``) or on the model's own greedy outputs for the
split's inputs (``targets="decoded"``, T5 only). Loop M's exit is never adapted, so the adapters change no
output of the model, only its drafts.

A run lives in ``<storage_path>/<name>`` as the training jobs' do: ``checkpoint_<step>`` folders holding the
adapters (exits.pt, exits.json) and the optimizer state (exits_state.pt), each complete once it holds
``complete``; a rerun of the same command, or a worker Ray retries, resumes from the newest. Rank 0 logs
every adapted loop's KL and agreement to MLflow (``speed.train.tracking``). When the run ends, its adapters are
written beside the checkpoint they were trained for (``speed.models.checkpoint.save_exits``): evaluation, Serve and
the sweep load them from there.

A Hugging Face directory (Ouro, Huginn, Llama, T5 v1.1: ``speed.models.pretrained``) records no job: ``task`` names
the split, and the run first writes a platform checkpoint of it into its own folder, ``<run>/model``
(``import_checkpoint``: the converted model, the directory's tokenizer and a job naming that split, as a run
finetuned from the directory writes its checkpoints), then trains the adapters beside that one.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import shutil
import tempfile
import time
import uuid
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Literal, get_args

import ray
import ray.train
import ray.train.torch
import torch
import torch.distributed as dist

from speed.config import LMConfig, ModelConfig, from_dict, to_dict
from speed.models.checkpoint import (
    COMPLETE_FILE,
    TOKENIZER_FILE,
    checkpoint_family,
    checkpoint_tokenizer,
    latest_checkpoint,
    load_exits,
    local_checkpoint,
    newest_complete_checkpoint,
    read_checkpoint_config,
    save_exits,
)
from speed.models.exits import EXITS_CONFIG_FILE, EXITS_FILE, ExitAdapters, ExitConfig, attach, exit_kl, exits_for
from speed.models.family import family_of
from speed.models.form import get_form
from speed.models.pretrained import converted_config, load_pretrained, model_source
from speed.storage import absolute, locate
from speed.train import tracking
from speed.train.config import DEFAULTS, JobConfig, TrackingConfig, job_from_dict, job_to_dict, merge
from speed.train.process_group import torch_config
from speed.train.state import mark_complete, save_job_model

Targets = Literal["split", "decoded"]
TARGETS: tuple[Targets, ...] = get_args(Targets)
STATE_FILE = "exits_state.pt"  # step, optimizer, RNG: what resumes an adapter run exactly
IMPORTED_DIR = "model"  # <run>/model: the platform checkpoint of a Hugging Face directory, adapters beside it


@dataclass(frozen=True)
class ExitTrainConfig:
    """An exit-adapter run: the frozen checkpoint, the adapters, the loop, the Ray run."""

    checkpoint: str  # the frozen model: a checkpoint or a run's newest complete one (a path or a URI)
    rank: int = 64  # the adapters' bottleneck
    loops: tuple[int, ...] = ()  # adapted loops, 1-based, each < M; (): every early loop
    targets: Targets = "split"  # teacher forcing on the split's targets, or on the model's own greedy outputs
    steps: int = 600
    batch_size: int = 32  # sequences per optimizer step, all workers together
    lr: float = 1e-3  # AdamW, linear warm-up then constant
    warmup_steps: int = 20
    seed: int = 0  # adapter init and data order
    limit: int | None = None  # first N training records (None: as the checkpoint's job had it)
    # the split's task and lengths; None: the checkpoint's job's (a Hugging Face directory, which has none, needs
    # the task, and takes the lengths of a job finetuning it: speed.train.config.DEFAULTS)
    task: str | None = None
    max_source_len: int | None = None
    max_target_len: int | None = None
    log_every: int = 20
    checkpoint_every: int = 200
    keep_checkpoints: int = 2
    stop_at_step: int | None = None  # stop cleanly with a checkpoint at this step (the run resumes later)
    num_workers: int = 1
    cpus_per_worker: float = 2.0
    use_gpu: bool = False
    storage_path: str = "runs"
    name: str | None = None  # None: ``exits_run_name``
    max_failures: int = 2
    tracking: TrackingConfig | None = field(default_factory=TrackingConfig)

    def __post_init__(self) -> None:
        object.__setattr__(self, "loops", tuple(self.loops))
        for name in ("rank", "steps", "batch_size", "log_every", "checkpoint_every", "keep_checkpoints", "num_workers"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")
        if self.targets not in TARGETS:
            raise ValueError(f"targets must be one of {TARGETS}, got {self.targets!r}")
        if self.lr <= 0 or self.warmup_steps < 0 or self.cpus_per_worker <= 0:
            raise ValueError("lr and cpus_per_worker must be positive, warmup_steps at least 0")
        if self.batch_size % self.num_workers:
            raise ValueError(f"batch_size={self.batch_size} must divide evenly into num_workers={self.num_workers}")
        if self.stop_at_step is not None and not 1 <= self.stop_at_step <= self.steps:
            raise ValueError(f"stop_at_step={self.stop_at_step} must be in [1, steps={self.steps}]")
        for name in ("limit", "max_source_len", "max_target_len"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise ValueError(f"{name} must be positive or None, got {getattr(self, name)}")
        if self.task is not None:
            from speed.data import get_task

            get_task(self.task)  # an unknown task: its line


_LAUNCH_ONLY = ("stop_at_step", "log_every", "num_workers", "cpus_per_worker", "use_gpu", "storage_path", "name",
                "max_failures", "tracking", "keep_checkpoints")  # fmt: skip


_SPLIT = ("task", "max_source_len", "max_target_len")  # the split's settings a run may name (None: the job's)


def exits_run_name(config: ExitTrainConfig) -> str:
    """A deterministic name: ``exits-<checkpoint folder>-r<rank>-<hash of what changes the result>``; launch-only
    settings are left out, so that relaunching the same command resumes the same run."""
    d = {k: v for k, v in to_dict(config).items() if k not in _LAUNCH_ONLY}
    for key in _SPLIT:
        if d[key] is None:
            del d[key]  # runs named before these settings existed keep their names
    d["checkpoint"] = absolute(config.checkpoint)
    digest = hashlib.sha256(json.dumps(d, sort_keys=True).encode()).hexdigest()[:8]
    folder = config.checkpoint.rstrip("/").rsplit("/", 1)[-1]
    return f"exits-{folder}-r{config.rank}-{digest}"


@dataclass(frozen=True)
class ExitOutcome:
    """What a finished run left where."""

    config: ExitTrainConfig  # named: ``name`` filled in
    run_dir: str
    checkpoint: str  # the model checkpoint the adapters now sit beside
    step: int
    metrics: dict[str, Any]  # the last report of this launch (empty if it trained no step)


def source_job(checkpoint: str, config: ExitTrainConfig | None = None) -> JobConfig:
    """The training job that made ``checkpoint`` (config.json's ``job`` and ``model``): its data is the split the
    adapters train on, with ``config``'s split settings (``limit``, ``task``, the lengths) in place of its own."""
    saved = read_checkpoint_config(checkpoint)
    if "job" not in saved:
        raise ValueError(f"{checkpoint} holds no training job (config.json has no 'job'): no training split to use")
    job = job_from_dict({**saved["job"], "model": {**saved["model"], "family": checkpoint_family(saved)}})
    return job if config is None else _with_split(job, config)


def _with_split(job: JobConfig, config: ExitTrainConfig) -> JobConfig:
    given = {k: getattr(config, k) for k in ("limit", *_SPLIT) if getattr(config, k) is not None}
    return replace(job, data=replace(job.data, **given)) if given else job


def imported_job(config: ExitTrainConfig, model: ModelConfig | LMConfig, source: str) -> JobConfig:
    """The job whose split a Hugging Face directory's adapters train on: a job finetuning it (pretraining, for the
    ``pretrain`` task) as ``speed.train.config.DEFAULTS`` has one, on ``config.task``, its model the converted
    ``model``'s config, its data prepared under ``config.storage_path``."""
    from speed.data import get_task

    if config.task is None:
        raise ValueError(f"{config.checkpoint} is a Hugging Face {source} directory: it records no task; pass --task")
    kind = "pretrain" if get_task(config.task).is_pretrain else "finetune"
    given = {"kind": kind, "eval": None, "tracking": None, "init_from": absolute(config.checkpoint),
             "run": {"storage_path": config.storage_path}}  # fmt: skip
    job = merge(DEFAULTS[kind], given) | {"model": {**to_dict(model), "family": family_of(model).name}}
    return _with_split(job_from_dict(job), config)


def directory_tokenizer(directory: str, source: str) -> Path:
    """The tokenizer of a (local) Hugging Face directory of form ``source``, as its ``Form.tokenizer`` finds it
    (a T5 v1.1's ``spiece.model``, an LM's own folder with its tokenizer.json); one it lacks is a
    ``FileNotFoundError``."""
    return get_form(source).tokenizer(Path(directory).expanduser())


def check_inputs(config: ExitTrainConfig) -> None:
    """Fail now on a checkpoint, task, loops, target or tracking store that cannot work (``ValueError``,
    ``FileNotFoundError``): a directory the platform cannot read (``model_source``), a Hugging Face one without
    ``task`` or its tokenizer, a split that is not there: one line before anything is written."""
    from speed.data import get_task, resolve_source

    source = model_source(config.checkpoint)
    if source == "platform":
        checkpoint = latest_checkpoint(absolute(config.checkpoint))
        job = source_job(checkpoint, config)
        if checkpoint_tokenizer(checkpoint, read_checkpoint_config(checkpoint)) is None:
            raise FileNotFoundError(f"checkpoint {checkpoint} has no {TOKENIZER_FILE}: its split cannot be read")
    else:
        if not locate(config.checkpoint).local:
            raise ValueError(f"{config.checkpoint}: a Hugging Face directory trains adapters from a local folder")
        job = imported_job(config, converted_config(config.checkpoint), source)
        directory_tokenizer(config.checkpoint, source)
    resolve_source(get_task(job.data.task), "train", job.data.source)  # the split is there
    if config.targets == "decoded" and not job.family.encoder_decoder:
        raise ValueError("targets 'decoded' decodes T5 sources; a looped LM trains on its split ('split')")
    ExitConfig(job.model.sharing.n_loops, job.model.d_model, config.rank, config.loops)  # the loops fit the model
    tracking.check(_tracked_job(config))


def import_checkpoint(config: ExitTrainConfig, run_dir: str) -> str:
    """The platform checkpoint of the Hugging Face directory ``config.checkpoint`` in ``<run_dir>/model``, written
    unless a complete one is there (``speed.train.state.save_job_model``: the converted model, the directory's
    tokenizer, ``imported_job``; an LM's tokenizer files in tokenizer/, a T5's spiece.model as spm.model). It
    appears whole or not at all: written in a scratch folder, moved (or uploaded) there, marked ``complete``."""
    target = f"{run_dir}/{IMPORTED_DIR}"
    where = locate(target)
    if (where / COMPLETE_FILE).is_file():
        print(f"the platform checkpoint of {config.checkpoint}: {target} (written by an earlier launch)", flush=True)
        return target
    source = model_source(config.checkpoint)
    loaded = load_pretrained(config.checkpoint, exits=False)
    job = imported_job(config, loaded.model.config, source)
    where.delete()  # an earlier launch's, stopped before it was complete
    with tempfile.TemporaryDirectory(prefix="speed-import-") as scratch:
        save_job_model(scratch, loaded.model, directory_tokenizer(config.checkpoint, source), job_to_dict(job), 0)
        if where.local:  # a rename: the folder appears whole
            partial = f"{run_dir}/.{IMPORTED_DIR}-{uuid.uuid4().hex[:8]}"
            shutil.copytree(scratch, partial)
            os.replace(partial, where.path)
        else:
            where.upload(scratch)
    mark_complete(target, 0)
    print(f"converted {config.checkpoint} ({source}) into the platform checkpoint {target}", flush=True)
    return target


def _tracked_job(config: ExitTrainConfig) -> JobConfig:
    """The ``JobConfig`` whose run and tracking sections ``speed.train.tracking`` reads (experiment ``exits``)."""
    track = config.tracking
    if track is not None and track.experiment is None:
        track = replace(track, experiment="exits")
    run = {"storage_path": config.storage_path, "name": config.name, "max_failures": config.max_failures}
    return job_from_dict({"run": run, "tracking": None if track is None else to_dict(track), "eval": None})


def run_exits(config: ExitTrainConfig) -> ExitOutcome:
    """Train exit adapters as configured (resuming the run's newest checkpoint) and save them beside the model."""
    from speed.train.launch import data_stage, ensure_ray

    started = time.time()
    imported = model_source(config.checkpoint) != "platform"
    if not imported:  # a run's newest: the adapters belong to that one
        config = replace(config, checkpoint=latest_checkpoint(absolute(config.checkpoint)))
    config = replace(config, name=config.name or exits_run_name(config))
    run_dir = f"{absolute(config.storage_path).rstrip('/')}/{config.name}"
    if imported:  # the run's own platform checkpoint of the directory: the adapters go beside it
        config = replace(config, checkpoint=import_checkpoint(config, run_dir))
    checkpoint = config.checkpoint
    job = source_job(checkpoint, config)
    print(f"run {config.name}: exit adapters (rank {config.rank}) for {checkpoint} -> {run_dir}", flush=True)
    ensure_ray()
    with local_checkpoint(checkpoint) as directory:  # spm.model, or an imported model's tokenizer/ folder
        data = data_stage(job, Path(checkpoint_tokenizer(str(directory), read_checkpoint_config(directory))))
    own = newest_complete_checkpoint(run_dir)
    if own is not None:
        print(f"resuming at step {_saved_step(own)} from {own}", flush=True)
    os.environ.setdefault("RAY_TRAIN_ENABLE_PRINT_PATCH", "0")  # as the training jobs: each worker line printed once
    resources = {"CPU": config.cpus_per_worker} | ({"GPU": 1} if config.use_gpu else {})
    loop_config = {"exits": to_dict(config), "job": job_to_dict(job), "corpus": data.train, "run_dir": run_dir}
    result = ray.train.torch.TorchTrainer(
        exits_loop_per_worker,
        train_loop_config=loop_config,
        torch_config=torch_config(),  # a local job's process group on loopback
        scaling_config=ray.train.ScalingConfig(
            num_workers=config.num_workers, use_gpu=config.use_gpu, resources_per_worker=resources
        ),
        run_config=ray.train.RunConfig(
            name=config.name,
            storage_path=absolute(config.storage_path),
            failure_config=ray.train.FailureConfig(max_failures=config.max_failures),
            checkpoint_config=ray.train.CheckpointConfig(num_to_keep=config.keep_checkpoints),
        ),
    ).fit()
    final = newest_complete_checkpoint(run_dir)
    if final is None:
        raise RuntimeError(f"run {config.name} finished without a checkpoint in {run_dir}")
    step = _saved_step(final)
    adapters = load_exits(final)
    assert adapters is not None, final
    save_exits(checkpoint, adapters, {"job": to_dict(config), "step": step, "run": run_dir})
    print(
        f"finished in {(time.time() - started) / 60:.1f} min at step {step}; adapters of loops "
        f"{list(adapters.config.loops)} written beside {checkpoint} ({EXITS_FILE}, {EXITS_CONFIG_FILE})",
        flush=True,
    )
    return ExitOutcome(config, run_dir, checkpoint, step, dict(result.metrics or {}))


def _saved_step(checkpoint: str) -> int:
    return int(json.loads((locate(checkpoint) / EXITS_CONFIG_FILE).read_text())["step"])


# ----- the worker ------------------------------------------------------------------------------------------


def exits_loop_per_worker(loop_config: dict[str, Any]) -> None:
    """One worker's share: load and freeze the model, attach the adapters (resumed when the run has a checkpoint),
    train them; rank 0 logs and writes checkpoints."""
    from speed.data.corpus import open_corpus
    from speed.train.batches import BatchPlan

    config = from_dict(ExitTrainConfig, loop_config["exits"], "exits")
    job = job_from_dict(loop_config["job"])
    ctx = ray.train.get_context()
    rank, world = ctx.get_world_rank(), ctx.get_world_size()
    torch.set_num_threads(max(1, int(config.cpus_per_worker)))
    device = ray.train.torch.get_device()
    with local_checkpoint(config.checkpoint) as directory:
        model = load_pretrained(directory, exits=False).model
    model.requires_grad_(False)
    torch.manual_seed(config.seed)
    adapters = exits_for(model, config.rank, config.loops)
    attach(model, adapters)
    model.to(device).eval()  # eval: no dropout, the frozen model computes what it decodes with
    optimizer = torch.optim.AdamW(adapters.parameters(), lr=config.lr, weight_decay=0.0)
    step = 0
    own = newest_complete_checkpoint(loop_config["run_dir"])
    if own is not None:
        step = _restore(adapters, optimizer, own)
        if rank == 0:
            print(f"resumed at step {step} from {own}", flush=True)
    corpus = open_corpus(loop_config["corpus"])
    plan = BatchPlan(corpus.lengths, config.batch_size, world, rank, 1, config.seed, True)
    last, start = config.stop_at_step or config.steps, step
    with tracking.session(job_to_dict(_tracked_job(config)), params=to_dict(config), step_metric="kl"):
        while step < last:
            started = time.perf_counter()
            (indices,) = plan.micro_batches(step)
            columns = corpus.examples(indices, plan.epoch_at(step), config.seed)
            if config.targets == "decoded":
                columns = _decoded(model, columns, job.data.max_target_len)
            batch = {k: v.to(device) for k, v in job.family.collate(columns).items()}
            for group in optimizer.param_groups:
                group["lr"] = config.lr * min(1.0, (step + 1) / max(1, config.warmup_steps))
            kl, agree = exits_loss(model, batch)
            optimizer.zero_grad(set_to_none=True)
            kl.sum().backward()
            if world > 1:  # the adapters are small: one all-reduce of each gradient, no DDP wrapper around them
                for p in adapters.parameters():
                    dist.all_reduce(p.grad)
                    p.grad /= world
            optimizer.step()
            step += 1
            stats = torch.cat([kl.detach(), agree]).float()
            if world > 1:
                dist.all_reduce(stats)
                stats /= world
            metrics = _metrics(step, adapters.config.loops, stats, time.perf_counter() - started)
            if rank == 0 and (step % config.log_every == 0 or step == last):
                print(_progress(metrics, config.steps), flush=True)
                tracking.log_metrics(step, {k: v for k, v in metrics.items() if k != "step"})
            if step % config.checkpoint_every == 0 or step == last:  # the report says where this launch began
                _checkpoint(adapters, optimizer, config, step, metrics | {"resumed_from": start}, rank)


def exits_loss(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """What a training step minimises: per adapted loop, KL(loop M || loop k) over a collated batch's labelled
    positions, and the share of them where loop k's argmax is loop M's (``speed.models.exits.exit_kl``), for the model's
    attached adapters."""
    inputs = {k: v for k, v in batch.items() if k != "labels"}  # no cross-entropy: the KL is the loss
    logits = model(**inputs, return_logits=True).loop_logits
    return exit_kl(logits, batch["labels"] != -100, model.exit_adapters.config.loops)


def _decoded(model: torch.nn.Module, columns: dict[str, list[list[int]]], max_new: int) -> dict[str, list[list[int]]]:
    """``columns`` with the model's greedy sequential outputs for its inputs as the targets."""
    from speed.data import pad_inputs
    from speed.decode.generate import DecodeOptions, generate

    input_ids, mask = pad_inputs(columns["input_ids"])
    device = model.lm_head.weight.device
    out = generate(
        model,
        input_ids.to(device),
        mask.to(device),
        DecodeOptions(method="sequential", max_new_tokens=max_new, trace=False),
    )
    return {**columns, "labels": out.tokens}


def _metrics(step: int, loops: tuple[int, ...], stats: torch.Tensor, seconds: float) -> dict[str, float]:
    """``kl_loop<k>`` and ``agree_loop<k>`` per adapted loop, their KL sum ``kl``, and ``step_time_s``."""
    n = len(loops)
    kl, agree = stats[:n].tolist(), stats[n:].tolist()
    out: dict[str, float] = {"step": step, "kl": float(sum(kl)), "step_time_s": seconds}
    out |= {f"kl_loop{k}": x for k, x in zip(loops, kl)}
    return out | {f"agree_loop{k}": x for k, x in zip(loops, agree)}


def _progress(metrics: dict[str, float], steps: int) -> str:
    agree = " ".join(f"{k.removeprefix('agree_')} {v:.3f}" for k, v in metrics.items() if k.startswith("agree_"))
    return (
        f"step {int(metrics['step'])}/{steps}  kl {metrics['kl']:.4f}  agreement with the last loop: {agree}  "
        f"{metrics['step_time_s']:.2f} s/step"
    )


def _restore(adapters: ExitAdapters, optimizer: torch.optim.Optimizer, checkpoint: str) -> int:
    """Load a run checkpoint's (a path or a URI) adapters, optimizer and RNG; returns its step."""
    saved = load_exits(checkpoint)
    if saved is None or saved.config != adapters.config:
        held = None if saved is None else saved.config
        raise ValueError(f"{checkpoint} holds adapters {held}, not {adapters.config}: another run's")
    adapters.load_state_dict(saved.state_dict())
    raw = io.BytesIO((locate(checkpoint) / STATE_FILE).read_bytes())
    state = torch.load(raw, map_location="cpu", weights_only=False)  # our own file: the RNG state
    optimizer.load_state_dict(state["optimizer"])
    torch.set_rng_state(state["rng"])
    return int(state["step"])


def _checkpoint(
    adapters: ExitAdapters,
    optimizer: torch.optim.Optimizer,
    config: ExitTrainConfig,
    step: int,
    metrics: dict[str, float],
    rank: int,
) -> None:
    """Every rank reports (a barrier); rank 0 writes the adapters and the optimizer state."""
    from speed.train.state import checkpoint_name
    from speed.train.worker_checkpoint import upload_with_marker

    with tempfile.TemporaryDirectory() as tmp:
        checkpoint = None
        if rank == 0:
            save_exits(tmp, adapters, {"job": to_dict(config), "step": step})
            state = {"step": step, "optimizer": optimizer.state_dict(), "rng": torch.get_rng_state()}
            torch.save(state, Path(tmp) / STATE_FILE)
            checkpoint = ray.train.Checkpoint.from_directory(tmp)
        ray.train.report(
            metrics,
            checkpoint=checkpoint,
            checkpoint_dir_name=checkpoint_name(step),
            checkpoint_upload_fn=upload_with_marker(step),
        )
