"""Frozen configs of a training job, and their parsing from YAML and command-line flags.

A job is one ``JobConfig``: the model, the data, the optimiser, the loop, the
Ray scaling, the run (storage, name, retries), the final evaluation and the
MLflow tracking (``speed.train.tracking``). YAML
files and flags are only input: they are merged over the job kind's defaults
(``defaults < YAML < flags``) and turned into dataclasses by
``speed.config.from_dict``, so a misspelled key is an error naming it.

The ``model`` section may name a ``family`` (``t5``, the default, or ``lm``:
``speed.models.family``; the flag ``--model``) and a ``preset`` of it plus field
overrides; it resolves to a full ``ModelConfig`` or ``LMConfig`` (the form
stored in checkpoints, which parses back).
"""

from __future__ import annotations

import argparse
import copy
import hashlib
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from speed.cli import JobParser, parse_set, parse_yaml
from speed.config import ConfigError, LMConfig, ModelConfig, from_dict, require_positive, to_dict
from speed.data.tasks import TASKS
from speed.eval.evaluate import EvalConfig
from speed.losses import GATE, SCHEMES, SettleConfig, check_scheme
from speed.models.checkpoint import checkpoint_family, local_checkpoint, read_checkpoint_config
from speed.models.family import DEFAULT_FAMILY, Family, family_of, get_family
from speed.models.looped_lm import CHECKPOINTING, TrainRun
from speed.train.optim import SCHEDULES, OptimConfig
from speed.train.origin import HF_PREFIX, origin_family
from speed.train.state import IncompatibleCheckpointError

KINDS = ("pretrain", "finetune")
STRATEGIES = ("ddp", "fsdp")


@dataclass(frozen=True)
class DataConfig:
    """The training corpus, its tokenization and the tokenizer."""

    task: str = "pretrain"  # a speed.data task; "pretrain" applies span corruption
    source: str | None = None  # local folder or hub name; None = the task's local corpus under speed.paths.data_dir()
    limit: int | None = None  # first N training records (quick runs)
    max_source_len: int = 128
    max_target_len: int = 64
    pack: bool = False  # pretraining: pack documents into full max_source_len inputs
    tokenizer: str | None = None  # a SentencePiece .model, or (lm) a Hugging Face model folder; None = train one
    vocab_size: int = 8000  # SentencePiece pieces of a trained tokenizer (T5's 100 sentinels come on top)
    tokenizer_tasks: tuple[str, ...] = ()  # corpora (train splits) a new tokenizer learns from; () = (task,)

    def __post_init__(self) -> None:
        object.__setattr__(self, "tokenizer_tasks", tuple(self.tokenizer_tasks))
        for task in (self.task, *self.tokenizer_tasks):
            if task not in TASKS:
                raise ValueError(f"unknown task {task!r}; choose one of {sorted(TASKS)}")
        require_positive(self, "max_source_len", "max_target_len", "vocab_size")
        if self.limit is not None and self.limit < 1:
            raise ValueError(f"DataConfig.limit must be positive or None, got {self.limit}")


@dataclass(frozen=True)
class TrainConfig:
    """The training loop: loss, batch, length, checkpoints, stops and fault injection."""

    loss_weights: str = "linear"  # speed.losses scheme for L_w = sum_i w_i L_i
    settle: SettleConfig = field(default_factory=SettleConfig)  # agreement term: L = L_w + lambda_t * S
    batch_size: int = 32  # global sequences per optimizer step (all workers x grad_accum micro-batches)
    grad_accum: int = 1  # micro-batches per optimizer step on each worker
    max_steps: int = 200  # optimizer steps; the LR schedule spans them
    seed: int = 0  # model init, data order and dropout
    group_by_length: bool = True  # batches of similar length (less padding); still a pure function of the seed
    log_every: int = 10
    checkpoint_every: int = 100
    keep_checkpoints: int = 2  # newest checkpoints kept in storage
    time_budget_min: float | None = None  # wall clock for this launch; stops cleanly with a final checkpoint
    stop_at_step: int | None = None  # stop cleanly (final checkpoint) at this step, schedule unchanged
    fail_at_step: int | None = None  # fault injection: the last worker raises once on reaching this step
    hang_at_step: int | None = None  # fault drill: every worker stops before this step until ended (a lost node)
    num_threads: int | None = None  # torch threads per worker; None = cpus_per_worker
    bf16: bool = True  # bf16 autocast when training on GPU (FSDP: bf16 parameters in compute, float32 reduction)
    checkpoint_activations: str = "none"  # none | block | loop (looped LM): recompute in the backward pass
    recurrence_sampling: bool = False  # looped LM: Huginn's sampled loop count per step, mean the model's M
    backprop_depth: int | None = None  # looped LM: gradients through the last K loops only (Huginn's 8); None: all
    gate_entropy: float = 0.05  # loss_weights gate (Ouro): the entropy bonus beta of speed.losses.gate_objective

    def __post_init__(self) -> None:
        check_scheme(self.loss_weights)
        if self.checkpoint_activations not in CHECKPOINTING:
            raise ValueError(
                f"unknown checkpoint_activations {self.checkpoint_activations!r}; choose one of {list(CHECKPOINTING)}"
            )
        if self.backprop_depth is not None and self.backprop_depth < 1:
            raise ValueError(f"TrainConfig.backprop_depth must be positive or None, got {self.backprop_depth}")
        if self.gate_entropy < 0 or not math.isfinite(self.gate_entropy):
            raise ValueError(f"TrainConfig.gate_entropy must be a finite number >= 0, got {self.gate_entropy}")
        if self.loss_weights == GATE and (self.recurrence_sampling or self.backprop_depth is not None):
            raise ValueError("the gate objective weighs every loop: it cannot train a sampled or truncated recurrence")
        counts = ("batch_size", "grad_accum", "max_steps", "log_every", "checkpoint_every", "keep_checkpoints")
        require_positive(self, *counts)
        if self.time_budget_min is not None and self.time_budget_min <= 0:
            raise ValueError(f"TrainConfig.time_budget_min must be positive, got {self.time_budget_min}")
        if self.stop_at_step is not None and not 1 <= self.stop_at_step <= self.max_steps:
            raise ValueError(f"TrainConfig.stop_at_step={self.stop_at_step} must be in [1, max_steps={self.max_steps}]")
        for name in ("fail_at_step", "hang_at_step"):
            at = getattr(self, name)
            if at is not None and not self.checkpoint_every < at <= self.max_steps:
                raise ValueError(
                    f"TrainConfig.{name}={at} must lie after the first checkpoint "
                    f"(checkpoint_every={self.checkpoint_every}) and at most max_steps={self.max_steps}, "
                    "so that the retried run resumes from a checkpoint instead of failing again"
                )
        if self.num_threads is not None and self.num_threads < 1:
            raise ValueError(f"TrainConfig.num_threads must be positive, got {self.num_threads}")


@dataclass(frozen=True)
class ScaleConfig:
    """Ray Train workers and their resources (becomes ``ray.train.ScalingConfig``)."""

    num_workers: int = 1
    use_gpu: bool = False
    cpus_per_worker: float = 2.0  # the laptop default: one worker on both cores
    gpus_per_worker: float = 1.0  # used only with use_gpu
    strategy: str = "ddp"  # ddp (every worker holds everything) | fsdp (FSDP2: parameters, gradients, state sharded)
    device_memory_gb: float | None = None  # one worker's device memory for the plan's check; None: found out

    def __post_init__(self) -> None:
        if self.strategy not in STRATEGIES:
            raise ValueError(f"unknown strategy {self.strategy!r}; choose one of {list(STRATEGIES)}")
        if self.device_memory_gb is not None and self.device_memory_gb <= 0:
            raise ValueError(f"ScaleConfig.device_memory_gb must be positive, got {self.device_memory_gb}")
        if self.num_workers < 1:
            raise ValueError(f"ScaleConfig.num_workers must be positive, got {self.num_workers}")
        if self.cpus_per_worker <= 0 or self.gpus_per_worker <= 0:
            raise ValueError("ScaleConfig.cpus_per_worker and gpus_per_worker must be positive")


@dataclass(frozen=True)
class RunSettings:
    """Where and under which name the run persists, and how often Ray retries a failed worker group."""

    storage_path: str = "runs"  # local folder (made absolute) or a URI such as s3://bucket/prefix
    name: str | None = None  # None = deterministic from the config (see run_name)
    max_failures: int = 2  # worker-group restarts from the last checkpoint (Ray FailureConfig)

    def __post_init__(self) -> None:
        if self.max_failures < -1:
            raise ValueError(f"RunSettings.max_failures must be -1 (forever) or >= 0, got {self.max_failures}")


@dataclass(frozen=True)
class TrackingConfig:
    """Where the run's live metrics go in MLflow (``speed.train.tracking``); the job's ``tracking: null`` logs none."""

    uri: str | None = None  # tracking server (http://...) or store; None = a file store <storage_path>/mlruns
    experiment: str | None = None  # MLflow experiment; None = the job kind (pretrain, finetune) or the sweep's name

    def __post_init__(self) -> None:
        for name in ("uri", "experiment"):
            value = getattr(self, name)
            if value is not None and not (isinstance(value, str) and value.strip()):
                raise ValueError(f"TrackingConfig.{name} must be a non-empty string or None, got {value!r}")

    def store_uri(self, storage_path: str) -> str | None:
        """The tracking URI: ``uri``, else a file store beside local runs; None (no tracking) for URI storage.

        A local ``uri`` path becomes an absolute ``file://`` URI. Runs on remote storage (``s3://...``) have no
        default: MLflow's file store is local only, and a store in the working directory would scatter runs.
        """
        if self.uri is not None:
            return self.uri if "://" in self.uri else Path(self.uri).expanduser().resolve().as_uri()
        if "://" in storage_path:
            return None
        return (Path(storage_path).expanduser().resolve() / "mlruns").as_uri()


@dataclass(frozen=True)
class JobConfig:
    """Everything a pretraining or finetuning job needs; travels inside every checkpoint."""

    kind: str = "pretrain"  # pretrain | finetune
    model: ModelConfig | LMConfig = field(default_factory=ModelConfig)  # its class is the family (speed.models.family)
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    scale: ScaleConfig = field(default_factory=ScaleConfig)
    run: RunSettings = field(default_factory=RunSettings)
    eval: EvalConfig | None = field(default_factory=EvalConfig)  # finetune: evaluated at the end; None: not
    tracking: TrackingConfig | None = field(default_factory=TrackingConfig)  # MLflow; None: no live tracking
    init_from: str | None = None  # finetune: a speed checkpoint dir/URI, a T5 v1.1 (hf:<name or path>, a folder) or
    # an imported LM's folder (Ouro, Huginn, Llama: speed.models.pretrained), trained with its own tokenizer
    resume: str | None = None  # continue a finished or interrupted run from this checkpoint (or run) dir/URI

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"unknown job kind {self.kind!r}; choose one of {list(KINDS)}")
        per_step = self.scale.num_workers * self.train.grad_accum
        if self.train.batch_size % per_step:
            raise ValueError(
                f"batch_size={self.train.batch_size} must divide evenly into num_workers={self.scale.num_workers} "
                f"x grad_accum={self.train.grad_accum} micro-batches"
            )
        if self.kind == "finetune" and self.eval is not None:
            self.final_eval.check_complete()  # checked now, not after training: e.g. a task without references
        if not self.family.hub_init and self.init_from is not None and self.init_from.startswith(HF_PREFIX):
            raise ValueError(f"--init-from {self.init_from}: Hugging Face T5 weights need --model t5")
        t = self.train
        looped = t.checkpoint_activations != "none" or t.recurrence_sampling or t.backprop_depth is not None
        if (looped or t.loss_weights == GATE) and not isinstance(self.model, LMConfig):
            raise ValueError(
                "activation checkpointing, recurrence sampling, --backprop-depth and the gate objective train the "
                "looped LM (--model lm)"
            )
        if t.loss_weights == GATE and not self.model.exit_gate:
            raise ValueError("--loss-weights gate trains the exit gate: the model has none (model.exit_gate, Ouro's)")

    @property
    def run_shape(self) -> TrainRun:
        """The looped LM's training forward before a step's sampled loop count (``speed.train.recurrence``)."""
        t = self.train
        return TrainRun(
            backprop=t.backprop_depth,
            checkpoint=t.checkpoint_activations,
            gate_entropy=t.gate_entropy if t.loss_weights == GATE else None,
        )

    @property
    def family(self) -> Family:
        """The model family (``speed.models.family``) that ``model`` belongs to."""
        return family_of(self.model)

    @property
    def final_eval(self) -> EvalConfig:
        """The evaluation of a finetuning job's final checkpoint: ``eval`` following the ``data`` section."""
        if self.eval is None:
            raise ValueError("this job has no evaluation (eval: null)")
        return self.eval.following(self.data.task, self.data.source, self.data.max_source_len)

    @property
    def micro_batch(self) -> int:
        """Sequences per forward pass on one worker."""
        return self.train.batch_size // (self.scale.num_workers * self.train.grad_accum)


# ----- defaults per job kind ----------------------------------------------------------------------

# A few-minute run on a 2-core CPU (~1.3 s/step): the `mini` preset, 2 unique layers looped 6 times.
DEFAULTS: dict[str, dict[str, Any]] = {
    "pretrain": {
        "model": {"preset": "mini", "pattern": "2x6"},
        "data": {"task": "pretrain", "max_source_len": 128, "max_target_len": 32, "pack": True},
        "optim": {"lr": 1e-3, "warmup_steps": 10},
        "train": {"batch_size": 16, "max_steps": 100, "log_every": 10, "checkpoint_every": 50},
        "eval": None,
    },
    "finetune": {
        "model": {"preset": "mini", "pattern": "2x6"},
        "data": {"task": "translate_en_de", "max_source_len": 64, "max_target_len": 64},
        "optim": {"lr": 1e-3, "warmup_steps": 20},
        "train": {"batch_size": 32, "max_steps": 60, "log_every": 5, "checkpoint_every": 30},
        "eval": {"limit": 100},
    },
}


def resolve_model(section: dict[str, Any]) -> ModelConfig | LMConfig:
    """``{"family": t5|lm, "preset": name, **overrides}`` or a full field dict -> the family's model config
    (unknown keys are errors; no family: t5)."""
    section = dict(section)
    family = get_family(section.pop("family", DEFAULT_FAMILY))
    name = section.pop("preset", None)
    base = family.preset(name) if name is not None else family.config()
    return from_dict(family.config, {**to_dict(base), **section}, "model") if section else base


def job_from_dict(data: dict[str, Any]) -> JobConfig:
    """Build a ``JobConfig`` from a nested dict (YAML layout or a checkpoint's resolved ``job`` section)."""
    if not isinstance(data, dict):
        raise ConfigError(f"a job config must be a mapping, got {type(data).__name__}")
    data = dict(data)
    model = data.pop("model", {})
    if not isinstance(model, dict):
        raise ConfigError(f"the 'model' section must be a mapping, got {type(model).__name__}")
    return from_dict(JobConfig, data, built={"model": resolve_model(model)})  # one JobConfig: its checks see the model


def job_to_dict(job: JobConfig) -> dict[str, Any]:
    """The fully resolved job as plain data (parses back with ``job_from_dict``); ``model`` names its family."""
    d = to_dict(job)
    d["model"]["family"] = job.family.name
    return d


def merge(base: dict[str, Any], override: dict[str, Any]) -> dict[str, Any]:
    """Deep-merge ``override`` into a copy of ``base`` (sections merge, values replace)."""
    out = copy.deepcopy(base)
    for key, value in override.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = merge(out[key], value)
        else:
            out[key] = copy.deepcopy(value)
    return out


def load_yaml(path: str | Path) -> dict[str, Any]:
    """A YAML job file as a dict (an empty file is ``{}``)."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"no config file at {path}")
    data = parse_yaml(path.read_text(), str(path)) or {}
    if not isinstance(data, dict):
        raise ValueError(f"{path} must hold a mapping of sections (model, data, optim, ...), got {type(data).__name__}")
    return data


def run_name(job: JobConfig) -> str:
    """A deterministic name: kind, task, pattern and a hash of everything that changes the result.

    Launch-only settings (time budget, stops, fault injection, threads, storage,
    retries, evaluation, tracking) are left out, so relaunching the same experiment lands
    in the same run and Ray resumes it from its last checkpoint.
    """
    d = job_to_dict(job)
    for key in (*LAUNCH_ONLY["train"], "num_threads", "log_every", "checkpoint_activations"):
        d["train"].pop(key)
    if not job.train.settle.active:
        d["train"].pop("settle")  # runs named before the settle term existed keep their names
    for key, value in _UNNAMED_DEFAULTS.items():
        if d["train"][key] == value:
            d["train"].pop(key)  # and before these: a default changes no earlier run's name
    if job.family.name == DEFAULT_FAMILY:
        d["model"].pop("family")  # T5 runs named before the LM existed too
    for key in ("run", "eval", "resume", "scale", "tracking"):
        d.pop(key)
    digest = hashlib.sha256(json.dumps(d, sort_keys=True).encode()).hexdigest()[:8]
    return f"{job.kind}-{job.data.task}-{job.model.pattern}-{digest}"


# train fields added later, left out of run names at their defaults (checkpointing changes no result)
_UNNAMED_DEFAULTS = {"recurrence_sampling": False, "backprop_depth": None, "gate_entropy": 0.05}


# ----- resuming a run --------------------------------------------------------------------------------

# Launch-only settings a resumed run must not inherit from the run it continues.
LAUNCH_ONLY = {"train": ("time_budget_min", "stop_at_step", "fail_at_step", "hang_at_step"), "run": ("name",)}


def resumable_job(path: str) -> dict[str, Any]:
    """The resolved job of the checkpoint a ``--resume`` names, minus launch-only settings; ``resume`` set."""
    with local_checkpoint(path) as directory:
        saved = read_checkpoint_config(directory)
    if "job" not in saved:
        raise IncompatibleCheckpointError(f"{path} is a model checkpoint without a training job; use --init-from")
    job = {**saved["job"], "model": {**saved["model"], "family": checkpoint_family(saved)}, "resume": path}
    for section, keys in LAUNCH_ONLY.items():
        for key in keys:
            job[section][key] = None
    return job


# ----- command-line flags -------------------------------------------------------------------------

# flag -> (dotted key, type, help). Everything else: --set section.key=value (value parsed as YAML).
FLAGS: dict[str, tuple[str, Any, str]] = {
    "--model": ("model.family", str, "model family: t5 (encoder-decoder, default) or lm (decoder-only looped LM)"),
    "--preset": ("model.preset", str, "model preset: base, small, mini, tiny"),
    "--pattern": ("model.pattern", str, "decoder sharing pattern NxM, e.g. 2x6 (lm: P+NxM+C, e.g. 1+2x6+1)"),
    "--task": ("data.task", str, f"one of {', '.join(sorted(TASKS))}"),
    "--source": ("data.source", str, "corpus folder or hub name (e.g. allenai/c4); default: the local corpus"),
    "--limit": ("data.limit", int, "use only the first N training records"),
    "--max-source-len": ("data.max_source_len", int, "encoder tokens per example (lm: prompt or packed row)"),
    "--max-target-len": ("data.max_target_len", int, "decoder tokens per example (lm: answer)"),
    "--tokenizer": ("data.tokenizer", str, "a SentencePiece .model, or (lm) a model folder's tokenizer.json"),
    "--vocab-size": ("data.vocab_size", int, "pieces of a newly trained tokenizer"),
    "--optimizer": ("optim.name", str, "adamw or adafactor"),
    "--lr": ("optim.lr", float, "peak learning rate"),
    "--weight-decay": ("optim.weight_decay", float, "decoupled weight decay"),
    "--warmup-steps": ("optim.warmup_steps", int, "linear warm-up steps"),
    "--schedule": ("optim.schedule", str, f"decay after warm-up: {', '.join(SCHEDULES)}"),
    "--grad-clip": ("optim.grad_clip", float, "max global gradient norm (0: off)"),
    "--loss-weights": ("train.loss_weights", str, f"loop-loss weights: {', '.join(sorted(SCHEMES))}, power:P, ratio:R"),
    "--batch-size": ("train.batch_size", int, "global sequences per optimizer step"),
    "--grad-accum": ("train.grad_accum", int, "micro-batches per step on each worker"),
    "--max-steps": ("train.max_steps", int, "optimizer steps"),
    "--seed": ("train.seed", int, "seed of init, data order and dropout"),
    "--log-every": ("train.log_every", int, "steps between progress lines"),
    "--checkpoint-every": ("train.checkpoint_every", int, "steps between checkpoints"),
    "--time-budget-min": ("train.time_budget_min", float, "wall-clock minutes; then stop with a final checkpoint"),
    "--stop-at-step": ("train.stop_at_step", int, "stop cleanly at this step (schedule unchanged)"),
    "--fail-at-step": ("train.fail_at_step", int, "fault injection: a worker fails once at this step"),
    "--hang-at-step": ("train.hang_at_step", int, "fault drill: the workers stop at this step until ended"),
    "--num-threads": ("train.num_threads", int, "torch threads per worker"),
    "--checkpoint-activations": (
        "train.checkpoint_activations",
        str,
        f"lm: recompute activations in the backward pass: {', '.join(CHECKPOINTING)}",
    ),
    "--recurrence-sampling": ("train.recurrence_sampling", bool, "lm: Huginn's sampled loop count per step (mean M)"),
    "--backprop-depth": ("train.backprop_depth", int, "lm: gradients through the last K loops only (Huginn: 8)"),
    "--gate-entropy": ("train.gate_entropy", float, "--loss-weights gate: the entropy coefficient beta (Ouro's)"),
    "--strategy": ("scale.strategy", str, "ddp (default) or fsdp (parameters, gradients, optimizer sharded)"),
    "--device-memory-gb": ("scale.device_memory_gb", float, "one worker's device memory for the memory plan"),
    "--num-workers": ("scale.num_workers", int, "Ray Train workers"),
    "--use-gpu": ("scale.use_gpu", bool, "one GPU per worker, bf16 autocast"),
    "--cpus-per-worker": ("scale.cpus_per_worker", float, "CPUs reserved per worker"),
    "--gpus-per-worker": ("scale.gpus_per_worker", float, "GPUs reserved per worker (with --use-gpu)"),
    "--storage-path": ("run.storage_path", str, "local folder or URI (s3://...) for checkpoints and results"),
    "--name": ("run.name", str, "run name (default: deterministic from the config)"),
    "--max-failures": ("run.max_failures", int, "retries from the newest checkpoint (sweeps: of lost nodes)"),
    "--init-from": ("init_from", str, "a speed checkpoint, a T5 v1.1 (hf:<name or path>), an Ouro/Huginn/Llama folder"),
    "--resume": ("resume", str, "continue from a checkpoint or run directory"),
    "--eval-split": ("eval.split", str, "split evaluated after finetuning"),
    "--eval-limit": ("eval.limit", int, "first N records of the evaluation split"),
    "--no-eval": ("eval", None, "skip the evaluation after finetuning"),
    "--tracking-uri": ("tracking.uri", str, "MLflow tracking server or store (default: file store <storage>/mlruns)"),
    "--no-tracking": ("tracking", None, "log nothing to MLflow"),
}


def build_parser(kind: str, description: str) -> argparse.ArgumentParser:
    """The jobs' shared flag parser; flags left out keep the YAML or default value."""
    parser = JobParser(
        prog=f"{kind}.py",
        description=description,
        argument_default=argparse.SUPPRESS,
        allow_abbrev=False,  # a truncated or misspelled flag is an error, never a guess
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sections = "model, data, optim, train, scale, run, eval, tracking"
    parser.add_argument("--config", help=f"YAML job file (sections: {sections})")
    parser.add_argument(
        "--set", action="append", metavar="KEY=VALUE", help="any other field, e.g. optim.betas=[0.9,0.99]"
    )
    for flag, (key, kind_, help_) in FLAGS.items():
        if kind_ is bool:
            parser.add_argument(flag, dest=key, action="store_true", help=help_)
        elif kind_ is None:
            parser.add_argument(flag, dest=key, action="store_const", const=None, help=help_)
        else:
            parser.add_argument(flag, dest=key, type=kind_, metavar=key.rpartition(".")[2].upper(), help=help_)
    return parser


def job_from_args(kind: str, argv: list[str] | None = None, description: str = "") -> JobConfig:
    """Parse a job's command line (``--config`` YAML, flags, ``--set``) into its ``JobConfig``."""
    args = vars(build_parser(kind, description).parse_args(argv))
    return job_from_layers(kind, args.pop("config", None), args.pop("set", None) or [], args)


def job_from_layers(kind: str, config_path: str | Path | None, sets: list[str], flags: dict[str, Any]) -> JobConfig:
    """``defaults[kind] < YAML < --set < flags`` -> ``JobConfig``; ``resume`` starts from the checkpoint's job."""
    if kind not in KINDS:
        raise ValueError(f"unknown job kind {kind!r}; choose one of {list(KINDS)}")
    user: dict[str, Any] = load_yaml(config_path) if config_path else {}
    if user.get("kind", kind) != kind:
        raise ValueError(f"{config_path} is a {user['kind']!r} config, not {kind!r}")
    for key, value in map(parse_set, sets):
        user = merge(user, _dotted(key, value))
    for key, value in flags.items():
        user = merge(user, _dotted(key, value))
    user = origin_family(user)
    base = merge(DEFAULTS[kind], {"kind": kind})
    if user.get("resume"):
        base = resumable_job(user["resume"])
        if base.get("kind") != kind:
            raise ValueError(f"--resume {user['resume']} is a {base.get('kind')!r} run, not {kind!r}")
    return job_from_dict(merge(base, user))


def _dotted(key: str, value: Any) -> dict[str, Any]:
    head, _, rest = key.partition(".")
    return {head: _dotted(rest, value) if rest else value}
