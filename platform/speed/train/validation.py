"""Every loop's loss on a prepared validation split, reported beside the training metrics.

A sweep's scheduler ranks trials by the last loop's validation loss
(``val_loss_last``): unlike the weighted training loss it does not depend on
the loss-weight scheme.
"""

from __future__ import annotations

import torch

from speed.data import collate
from speed.data.corpus import TokenizedCorpus
from speed.model import SpeedT5


def validation_losses(model: SpeedT5, corpus: TokenizedCorpus, batch_size: int) -> list[float]:
    """(M,) mean token cross-entropy of every loop's exit over the whole corpus (eval mode, no dropout)."""
    device = next(model.parameters()).device
    was_training = model.training
    model.eval()
    total = torch.zeros(model.n_loops, dtype=torch.float64)
    tokens = 0
    try:
        with torch.no_grad():
            for start in range(0, len(corpus), batch_size):
                indices = range(start, min(start + batch_size, len(corpus)))
                batch = {k: v.to(device) for k, v in collate(corpus.examples(indices, 0, 0)).items()}
                out = model(
                    input_ids=batch["input_ids"],
                    decoder_input_ids=batch["decoder_input_ids"],
                    attention_mask=batch["attention_mask"],
                    labels=batch["labels"],
                )
                n = int((batch["labels"] != -100).sum())
                total += out.loop_losses.double().cpu() * n  # (M,): per-token means back to sums
                tokens += n
    finally:
        model.train(was_training)
    if tokens == 0:
        raise ValueError("the validation corpus has no target tokens")
    return (total / tokens).tolist()


def validation_metrics(model: SpeedT5, corpus: TokenizedCorpus, batch_size: int) -> dict[str, float]:
    """``val_loss_loop1`` .. ``val_loss_loopM`` and ``val_loss_last`` (= loop M) for a report."""
    losses = validation_losses(model, corpus, batch_size)
    return {**{f"val_loss_loop{i + 1}": x for i, x in enumerate(losses)}, "val_loss_last": losses[-1]}
