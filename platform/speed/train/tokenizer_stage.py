"""The first stage of a training job (``speed.train.launch``): the tokenizer, and the job it completes.

``tokenizer_stage(job, scratch)`` resolves where the tokenizer comes from (a resumed run's or ``--init-from``'s
checkpoint, an imported LM's own folder, a Hugging Face model of a ``job_pattern`` form with its tokenizer file,
``data.tokenizer``, or one trained on the job's corpora and cached by everything that determines it) and the model
config it fixes (the checkpoint's, the converted one's, or the job's with the tokenizer's vocabulary):
a ``ResolvedJob``. No Ray.
"""

from __future__ import annotations

import hashlib
import json
import time
from dataclasses import dataclass, replace
from pathlib import Path

from speed.config import LMConfig, ModelConfig, to_dict
from speed.hf_tokenizer import load_tokenizer, pack_tokenizer, unpack_tokenizer
from speed.models.checkpoint import (
    TOKENIZER_FILE,
    checkpoint_family,
    checkpoint_tokenizer,
    local_checkpoint,
    read_checkpoint_config,
)
from speed.models.family import config_from_dict
from speed.models.form import get_form
from speed.models.pretrained import pretrained_config
from speed.paths import data_dir
from speed.storage import locate
from speed.tokenizer import train_tokenizer
from speed.train.config import JobConfig
from speed.train.origin import HubOrigin, hub_origin, imported_origin


@dataclass(frozen=True)
class ResolvedJob:
    """The tokenizer stage's result."""

    job: JobConfig  # completed: the model config (vocabulary, or the checkpoint's or Hugging Face model's)
    tokenizer_path: Path  # a local .model file, or a folder with tokenizer.json (in the caller's scratch folder
    # when taken from a checkpoint)
    tokenizer: bytes  # its contents (``speed.hf_tokenizer.pack_tokenizer``), which the workers receive

    @classmethod
    def of(cls, job: JobConfig, tokenizer_path: Path) -> ResolvedJob:
        """``job`` with the tokenizer (and its contents)."""
        return cls(job, tokenizer_path, pack_tokenizer(tokenizer_path))


def tokenizer_stage(job: JobConfig, scratch: Path) -> ResolvedJob:
    """Resolve the tokenizer and the model config.

    A tokenizer taken from a checkpoint is copied into ``scratch`` (the caller's temporary folder).

    Resume and ``--init-from`` take model and tokenizer from the checkpoint (or
    the Hugging Face model); otherwise the tokenizer is ``data.tokenizer`` or is
    trained (and cached) on ``data.tokenizer_tasks``, and the model's vocabulary
    is exactly the tokenizer's.
    """
    origin = job.resume or job.init_from
    hub = hub_origin(origin) if origin and not job.resume else None
    imported = imported_origin(origin) if origin and not job.resume else None
    if imported is not None:  # an Ouro, Huginn or Llama folder: its converted config, its own tokenizer
        model = pretrained_config(origin)
        _note_replaced(job.model, model, origin)
        return ResolvedJob.of(replace(job, model=model), Path(origin).expanduser())
    if origin and hub is None:
        with local_checkpoint(origin) as directory:
            saved = read_checkpoint_config(directory)
            tokenizer = checkpoint_tokenizer(str(directory), saved)
            if tokenizer is None:
                raise FileNotFoundError(f"checkpoint {origin} has no {TOKENIZER_FILE}; cannot tokenize for it")
            tokenizer_path = unpack_tokenizer(pack_tokenizer(tokenizer), scratch, TOKENIZER_FILE)
        model = config_from_dict(saved["model"], checkpoint_family(saved))
        _note_replaced(job.model, model, origin)
        return ResolvedJob.of(replace(job, model=model), tokenizer_path)
    if origin:
        model = get_form(hub.form).hub_config(hub.name, job.model.pattern)
        _note_replaced(job.model, model, origin)
        return ResolvedJob.of(replace(job, model=model), _hub_tokenizer(hub))
    tokenizer_path = Path(job.data.tokenizer) if job.data.tokenizer else _trained_tokenizer(job)
    # Exactly the tokenizer's size, unpadded: ids past it would be undecodable if an undertrained model chose them.
    vocab = load_tokenizer(tokenizer_path).vocab_size
    return ResolvedJob.of(replace(job, model=job.model.replace(vocab_size=vocab)), tokenizer_path)


def _note_replaced(asked: ModelConfig | LMConfig, used: ModelConfig | LMConfig, origin: str) -> None:
    if type(asked) is not type(used):
        raise ValueError(
            f"{origin} holds a {type(used).__name__}, but the job asks for a {type(asked).__name__} (--model)"
        )
    changed = {k: v for k, v in to_dict(used).items() if to_dict(asked)[k] != v}
    if changed:
        print(f"model config taken from {origin}: {changed}", flush=True)


def _hub_tokenizer(hub: HubOrigin) -> Path:
    """The tokenizer file of the hub model or directory ``hub`` (its form's ``tokenizer_file``), downloaded from the
    hub when it is not a local directory."""
    file = get_form(hub.form).tokenizer_file
    local = Path(hub.name).expanduser() / file
    if local.is_file():
        return local
    from huggingface_hub import hf_hub_download

    return Path(hf_hub_download(hub.name, file))


def _trained_tokenizer(job: JobConfig) -> Path:
    """Train a tokenizer on the job's corpora, cached by everything that determines it."""
    from speed.data import load_records

    tasks = job.data.tokenizer_tasks or (job.data.task,)
    key = json.dumps(
        {"tasks": tasks, "source": job.data.source, "limit": job.data.limit, "vocab": job.data.vocab_size},
        sort_keys=True,
    )
    digest = hashlib.sha256((key + str(data_dir())).encode()).hexdigest()[:12]
    storage = locate(job.run.storage_path)
    root = Path(storage.path) / "tokenizers" if storage.local else Path.home() / ".cache" / "speed"
    path = root / f"spm-{digest}" / TOKENIZER_FILE
    if path.is_file():
        print(f"tokenizer: reusing {path}", flush=True)
        return path
    texts: list[str] = []
    for task in tasks:
        own = task == job.data.task
        records = load_records(task, "train", job.data.source if own else None, job.data.limit if own else None)
        for column in ("text", "source", "target"):
            if column in records.column_names:
                texts.extend(records[column])
    start = time.perf_counter()
    with locate(path).atomic() as partial:  # concurrent jobs never read a half-written file
        train_tokenizer(texts, partial, vocab_size=job.data.vocab_size)
    print(f"tokenizer: trained {job.data.vocab_size} pieces on {tasks} in {time.perf_counter() - start:.0f}s -> {path}")
    return path
