"""Model checkpoints: a directory holding weights, the resolved config and the tokenizer; finding them.

Layout (shared by training, evaluation and serving):
    model.pt     the model's state dict
    config.json  {"model": the model config's fields, "family": "t5" or "lm" (``speed.models.family``; absent: t5),
                  "chat_template": an LM's (``speed.chat``), "initial_state": an injecting LM's seeded random state
                 before its first loop when it has one (``speed.models.looped_lm.InitialState``: seed, std),
                 ...any other resolved configs}
    spm.model    the SentencePiece tokenizer, when one was given, or
    tokenizer/   an imported model's tokenizer files (``speed.hf_tokenizer.tokenizer_files``); config.json then
                 says so: {"tokenizer": {"kind": "huggingface", "path": "tokenizer"}}
    exits.pt     the early exits' adapters (``speed.models.exits``), when trained (``jobs/train_exits.py``)
    exits.json   {"exits": which loops are adapted and the rank (``ExitConfig``), "job": ..., "step": ...};
                 written after exits.pt: a checkpoint has exit adapters when it holds exits.json
Training jobs add their own files (optimizer, scheduler, RNG; ``speed.train.state``) beside these.
A training run's directory holds ``checkpoint_<step>`` folders; one is complete once it holds
``complete``, written after its other files are on storage. Checkpoints and runs are named by a
local path or a URI alike (``speed.storage``).
"""

from __future__ import annotations

import io
import json
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import pyarrow.fs as pafs
import torch

from speed.config import from_dict, to_dict
from speed.hf_tokenizer import tokenizer_files
from speed.models.exits import EXITS_CONFIG_FILE, EXITS_FILE, ExitAdapters, ExitConfig, attach
from speed.models.family import DEFAULT_FAMILY, build_model, config_from_dict, family_of
from speed.models.looped_lm import InitialState, LoopedLM
from speed.models.t5 import SpeedT5
from speed.storage import absolute, locate

MODEL_FILE = "model.pt"
SHARDED_DIR = "sharded"  # FSDP's checkpoints: model and optimizer state in torch.distributed.checkpoint's shards
CONFIG_FILE = "config.json"
TOKENIZER_FILE = "spm.model"
HF_TOKENIZER_DIR = "tokenizer"  # an imported model's tokenizer files, in place of spm.model
CHECKPOINT_PREFIX = "checkpoint_"
COMPLETE_FILE = "complete"  # written after every other file of a checkpoint is on storage (holds the step)


@dataclass
class LoadedModel:
    """A model restored from a checkpoint, with its tokenizer's location and full config."""

    model: SpeedT5 | LoopedLM
    tokenizer_path: str | None  # spm.model, or the tokenizer/ folder (a local path or a URI: ``load_tokenizer``)
    config: dict[str, Any]
    checkpoint: str  # the checkpoint read (a local path made absolute, or a URI): the one named, or a run's newest


def save_model(
    directory: str | Path,
    model: SpeedT5 | LoopedLM,
    tokenizer_path: str | Path | None = None,
    extra_config: dict[str, Any] | None = None,
    weights: bool = True,
) -> Path:
    """Write weights, config (the family, plus ``extra_config`` sections) and tokenizer into ``directory``; without
    ``weights`` no model.pt (a sharded checkpoint's weights are in ``SHARDED_DIR``, written by every worker).

    ``tokenizer_path``: a SentencePiece ``.model`` file (copied to spm.model) or a Hugging Face model directory
    (its ``tokenizer_files`` copied to tokenizer/, and config.json's ``tokenizer`` section says so).

    The family adds its own sections (``Family.checkpoint_config``: an LM's chat template, ``speed.chat``). The
    model's exit adapters, if it has any, are written beside it (``save_exits``), never into model.pt. A looped
    LM's seeded initial state (``LoopedLM.initial_state``), when it has one, is config.json's ``initial_state``, so
    ``load_model`` computes as the saved model did.
    """
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    family = family_of(model)
    config = {"model": to_dict(model.config), "family": family.name, **(extra_config or {})}
    config |= family.checkpoint_config()
    if getattr(model, "initial_state", None) is not None:
        config["initial_state"] = asdict(model.initial_state)
    imported = tokenizer_path is not None and Path(tokenizer_path).is_dir()
    if imported:
        config["tokenizer"] = {"kind": "huggingface", "path": HF_TOKENIZER_DIR}
        files = tokenizer_files(tokenizer_path)  # read before writing: the folder may be this checkpoint's own
        for name, data in files.items():
            (directory / HF_TOKENIZER_DIR / name).parent.mkdir(parents=True, exist_ok=True)
            (directory / HF_TOKENIZER_DIR / name).write_bytes(data)
    if weights:
        torch.save(backbone_state(model), directory / MODEL_FILE)
    (directory / CONFIG_FILE).write_text(json.dumps(config, indent=2, sort_keys=True))
    if tokenizer_path is not None and not imported:
        if Path(tokenizer_path).resolve() != (directory / TOKENIZER_FILE).resolve():
            shutil.copyfile(tokenizer_path, directory / TOKENIZER_FILE)
    if model.exit_adapters is not None:
        save_exits(directory, model.exit_adapters)
    return directory


def backbone_state(model: SpeedT5 | LoopedLM) -> dict[str, torch.Tensor]:
    """The model's state dict without its exit adapters: what model.pt holds."""
    return {k: v for k, v in model.state_dict().items() if not k.startswith("exit_adapters.")}


def save_exits(directory: str, adapters: ExitAdapters, extra_config: dict[str, Any] | None = None) -> None:
    """Write exit adapters beside the checkpoint at ``directory`` (a local path or a URI): exits.pt, then
    exits.json (``ExitConfig`` plus ``extra_config`` sections), which marks them complete."""
    where = locate(str(directory))
    buffer = io.BytesIO()
    torch.save({k: v.detach().cpu() for k, v in adapters.state_dict().items()}, buffer)
    (where / EXITS_FILE).write_bytes(buffer.getvalue())
    config = {"exits": to_dict(adapters.config), **(extra_config or {})}
    (where / EXITS_CONFIG_FILE).write_text(json.dumps(config, indent=2, sort_keys=True))


def load_exits(directory: str, map_location: str | torch.device = "cpu") -> ExitAdapters | None:
    """The exit adapters saved beside the checkpoint at ``directory``; None when it has none."""
    where = locate(str(directory))
    if not (where / EXITS_CONFIG_FILE).is_file():
        return None
    stored = json.loads((where / EXITS_CONFIG_FILE).read_text())
    adapters = ExitAdapters(from_dict(ExitConfig, stored.get("exits"), "exits"))
    weights = io.BytesIO((where / EXITS_FILE).read_bytes())
    adapters.load_state_dict(torch.load(weights, map_location=map_location, weights_only=True))
    return adapters.eval()


def load_model(where: str | Path, map_location: str | torch.device = "cpu", exits: bool = True) -> LoadedModel:
    """Rebuild the model of a checkpoint, or of a run's newest complete one, at a local path or a URI.

    Reads ``config.json`` and ``model.pt`` where they are, and finds the tokenizer (``checkpoint_tokenizer``),
    downloading nothing else; a missing file is named in the error. With ``exits`` the checkpoint's exit adapters
    (exits.pt, when it has them) are attached to the model (``speed.models.exits``); they never change its output.
    """
    directory = locate(latest_checkpoint(absolute(where)))
    sharded = not (directory / MODEL_FILE).is_file() and (directory / SHARDED_DIR / ".metadata").is_file()
    for name in (CONFIG_FILE,) if sharded else (CONFIG_FILE, MODEL_FILE):
        if not (directory / name).is_file():
            raise FileNotFoundError(f"checkpoint {directory.uri} has no {name}")
    config = json.loads((directory / CONFIG_FILE).read_text())
    if "model" not in config:
        raise ValueError(f"checkpoint config {(directory / CONFIG_FILE).uri} has no 'model' section")
    model = build_model(config_from_dict(config["model"], checkpoint_family(config)))
    if sharded:
        consolidate_sharded(directory.uri, model)
        model.to(map_location)
    else:
        weights = io.BytesIO((directory / MODEL_FILE).read_bytes())
        model.load_state_dict(torch.load(weights, map_location=map_location, weights_only=True))
    if "initial_state" in config:
        model.initial_state = InitialState(**config["initial_state"])
    if exits:
        attach(model, load_exits(directory.uri, map_location))
    model.eval()
    return LoadedModel(model, checkpoint_tokenizer(directory.uri, config), config, directory.uri)


def consolidate_sharded(directory: str, model: SpeedT5 | LoopedLM) -> None:
    """Load the whole model of a sharded training checkpoint (``SHARDED_DIR``, written by FSDP's workers:
    ``speed.train.sharding``) into ``model`` in this one process; its optimizer state is left unread."""
    from torch.distributed.checkpoint import DefaultLoadPlanner
    from torch.distributed.checkpoint import load as dcp_load

    state = {"model": model.state_dict()}
    with local_checkpoint(directory) as local:
        planner = DefaultLoadPlanner(allow_partial_load=True)  # the model's part of the model's and the optimizer's
        dcp_load(state, checkpoint_id=str(Path(local) / SHARDED_DIR), planner=planner, no_dist=True)
    model.load_state_dict(state["model"])


def checkpoint_tokenizer(directory: str, config: dict[str, Any]) -> str | None:
    """Where the tokenizer of the checkpoint at ``directory`` (its config.json dict ``config``) lies: spm.model,
    or the folder config.json's ``tokenizer`` section names; None when it holds none."""
    where = locate(directory)
    section = config.get("tokenizer")
    tok = where / (section["path"] if isinstance(section, dict) else TOKENIZER_FILE)
    return tok.uri if tok.is_file() or (section and tok.is_dir()) else None


def checkpoint_family(config: dict[str, Any]) -> str:
    """The model family a checkpoint's config.json names (``t5`` when it names none: older checkpoints)."""
    return config.get("family", DEFAULT_FAMILY)


def read_checkpoint_config(directory: str | Path) -> dict[str, Any]:
    """A checkpoint's config.json (sections ``model``, ``job``, ``step``), from a local path or a URI."""
    config = locate(directory) / CONFIG_FILE
    if not config.is_file():
        raise FileNotFoundError(f"{directory} is not a checkpoint: it has no {CONFIG_FILE}")
    return json.loads(config.read_text())


def newest_complete_checkpoint(run_dir: str) -> str | None:
    """The newest ``checkpoint_*`` of a run directory that holds the completion marker; None when there is none.

    Checkpoints on storage, not Ray's ``checkpoint_manager_snapshot.json``, which
    lags them: a run stopped hard resumes at most one checkpoint interval back.
    """
    run = locate(run_dir)
    folders = [i.base_name for i in run.entries() if i.type == pafs.FileType.Directory]
    for name in sorted((n for n in folders if n.startswith(CHECKPOINT_PREFIX)), reverse=True):
        if (run / name / COMPLETE_FILE).is_file():
            return f"{run_dir.rstrip('/')}/{name}"
    return None


def latest_checkpoint(path: str) -> str:
    """``path`` itself when it is a checkpoint, else the newest complete ``checkpoint_*`` inside a run directory."""
    where = locate(path)
    if not where.is_dir():
        raise FileNotFoundError(f"no checkpoint or run directory at {path}")
    if (where / CONFIG_FILE).is_file():
        return path
    newest = newest_complete_checkpoint(path)
    if newest is None:
        raise FileNotFoundError(f"{path} holds no {CONFIG_FILE} and no complete {CHECKPOINT_PREFIX}* directory")
    return newest


@contextmanager
def local_checkpoint(path: str) -> Iterator[Path]:
    """A checkpoint (or the newest one of a run) as a local directory, downloaded first when ``path`` is a URI."""
    from ray.train import Checkpoint

    uri = latest_checkpoint(path)
    where = locate(uri)
    if where.local:
        yield Path(where.path)
        return
    with Checkpoint(uri).as_directory() as local:
        yield Path(local)
