"""Model checkpoints: a directory holding weights, the resolved config and the tokenizer.

Layout (shared by training, evaluation and serving):
    model.pt     the model's state dict
    config.json  {"model": ModelConfig fields, ...any other resolved configs}
    spm.model    the SentencePiece tokenizer, when one was given
Training jobs add their own files (optimizer, scheduler, RNG) beside these.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from speed.config import ModelConfig, from_dict, to_dict
from speed.model import SpeedT5

MODEL_FILE = "model.pt"
CONFIG_FILE = "config.json"
TOKENIZER_FILE = "spm.model"


@dataclass
class LoadedModel:
    """A model restored from a checkpoint directory, with its tokenizer path and full config."""

    model: SpeedT5
    tokenizer_path: Path | None
    config: dict[str, Any]


def save_model(
    directory: str | Path,
    model: SpeedT5,
    tokenizer_path: str | Path | None = None,
    extra_config: dict[str, Any] | None = None,
) -> Path:
    """Write weights, config (plus ``extra_config`` sections) and tokenizer into ``directory``."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    config = {"model": to_dict(model.config), **(extra_config or {})}
    torch.save(model.state_dict(), directory / MODEL_FILE)
    (directory / CONFIG_FILE).write_text(json.dumps(config, indent=2, sort_keys=True))
    if tokenizer_path is not None and Path(tokenizer_path).resolve() != (directory / TOKENIZER_FILE).resolve():
        shutil.copyfile(tokenizer_path, directory / TOKENIZER_FILE)
    return directory


def load_model(directory: str | Path, map_location: str | torch.device = "cpu") -> LoadedModel:
    """Rebuild the model of a checkpoint directory; missing files are named in the error."""
    directory = Path(directory)
    for name in (CONFIG_FILE, MODEL_FILE):
        if not (directory / name).is_file():
            raise FileNotFoundError(f"checkpoint {directory} has no {name}")
    config = json.loads((directory / CONFIG_FILE).read_text())
    if "model" not in config:
        raise ValueError(f"checkpoint config {directory / CONFIG_FILE} has no 'model' section")
    model = SpeedT5(from_dict(ModelConfig, config["model"]))
    model.load_state_dict(torch.load(directory / MODEL_FILE, map_location=map_location, weights_only=True))
    model.eval()
    tok = directory / TOKENIZER_FILE
    return LoadedModel(model, tok if tok.is_file() else None, config)
