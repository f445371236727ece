"""A served model: the checkpoint (a path or URI, or a run's newest), its tokenizer and family, on a device."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from speed.chat import CHAT_TEMPLATE, ChatTemplate
from speed.checkpoint import checkpoint_family, load_model
from speed.config import from_dict
from speed.tokenizer import Tokenizer


@dataclass(frozen=True)
class ServedModel:
    """What a replica serves: the model (eval mode, on its device), its tokenizer, its family (``t5`` or ``lm``,
    from the checkpoint's config.json) and, for an LM, the chat template its prompts were written in."""

    model: torch.nn.Module
    tokenizer: Tokenizer
    family: str
    template: ChatTemplate | None  # an LM's (config.json's ``chat_template``; ``speed.chat``'s when absent)


def load_served_model(checkpoint: str, device: str, exits: bool = True) -> ServedModel:
    """The served model of a checkpoint path or URI (or a run's newest); a checkpoint without spm.model is an error.

    With ``exits`` the checkpoint's exit adapters (``speed.exits``), when it has them, adapt the drafts; the
    answers are the same either way."""
    loaded = load_model(checkpoint, map_location=device, exits=exits)
    if loaded.tokenizer_path is None:
        raise FileNotFoundError(f"checkpoint {loaded.checkpoint} holds no spm.model: serving needs its tokenizer")
    tokenizer = Tokenizer.load(loaded.tokenizer_path)  # reads the file into memory
    family = checkpoint_family(loaded.config)
    template = None
    if family == "lm":
        stored = loaded.config.get("chat_template")
        template = from_dict(ChatTemplate, stored, "chat_template") if stored is not None else CHAT_TEMPLATE
    return ServedModel(loaded.model.to(device).eval(), tokenizer, family, template)
