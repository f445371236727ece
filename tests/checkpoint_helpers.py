"""Tiny models the tests train or save for real: a few AdamW steps on real batches, and a checkpoint with its
tokenizer for the job tests. The data and tokenizer modules are imported when called (a test that needs the data
libraries skips first)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn


def train_steps(model: nn.Module, batch_loss: Callable[[], Tensor], steps: int, lr: float = 3e-3) -> float:
    """``steps`` AdamW steps (learning rate ``lr``) of ``model``, each on ``batch_loss()`` (a new batch's loss);
    the last step's loss."""
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    for _ in range(steps):
        loss = batch_loss()
        opt.zero_grad()
        loss.backward()
        opt.step()
    return loss.item()


def tiny_checkpoint(root: Path, model_of: Callable[[int], Any]) -> Path:
    """A checkpoint folder of ``model_of(vocab_size)`` (built after seeding torch with 0), untrained, beside a
    200-piece tokenizer trained on 200 Multi30k EN-DE pairs: what an evaluate job's test reads."""
    from speed.data import load_records
    from speed.models.checkpoint import save_model
    from speed.tokenizer import train_tokenizer

    ds = load_records("translate_en_de", "train", limit=200)
    tok = train_tokenizer([*ds["source"], *ds["target"]], root / "spm.model", vocab_size=200, num_extra=10)
    torch.manual_seed(0)
    return save_model(root / "model", model_of(tok.vocab_size), tok.path)
