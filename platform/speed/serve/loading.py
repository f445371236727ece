"""A served model: the checkpoint (a path or URI, or a run's newest) and its tokenizer, on a device."""

from __future__ import annotations

import torch

from speed.checkpoint import load_model
from speed.tokenizer import Tokenizer


def load_served_model(checkpoint: str, device: str) -> tuple[torch.nn.Module, Tokenizer]:
    """The model (eval mode, on ``device``) and tokenizer of a checkpoint path or URI (or a run's newest)."""
    loaded = load_model(checkpoint, map_location=device)
    if loaded.tokenizer_path is None:
        raise FileNotFoundError(f"checkpoint {loaded.checkpoint} holds no spm.model: serving needs its tokenizer")
    tokenizer = Tokenizer.load(loaded.tokenizer_path)  # reads the file into memory
    return loaded.model.to(device).eval(), tokenizer
