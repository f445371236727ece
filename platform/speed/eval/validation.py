"""Every loop's loss and teacher-forced flip rates on a prepared validation split, beside the training metrics.

A sweep's scheduler ranks trials by the last loop's validation loss
(``val_loss_last``): unlike the weighted training loss it does not depend on
the loss-weight scheme. The flip rates come from the same teacher-forced pass
(every loop's argmax at every target position, no decoding): ``val_flip_cost``
(``speed.losses.flip_cost``) estimates the steps per token SPEED loses to flips. Both model families
(``speed.models.family``): the LM's targets are its next tokens, so its per-loop perplexities
(``Validation.perplexities``) are the language-model's.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

import torch

from speed.data.corpus import TokenizedCorpus
from speed.losses import flip_cost, teacher_forced_flips
from speed.models.family import Family
from speed.models.looped_lm import LoopedLM
from speed.models.t5 import SpeedT5


@dataclass(frozen=True)
class Validation:
    """Per loop (loop 1 first), token-weighted over the whole split."""

    losses: list[float]  # mean token cross-entropy of every loop's exit
    flip_rate_prev: list[float]  # share of target positions where the loop's argmax differs from the previous loop's
    flip_rate_final: list[float]  # ... from the last loop's
    tokens: int

    @property
    def flip_cost(self) -> float:
        return flip_cost(self.flip_rate_prev)

    @property
    def perplexities(self) -> list[float]:
        """exp of every loop's mean token cross-entropy."""
        return [math.exp(x) for x in self.losses]


def validate(model: SpeedT5 | LoopedLM, family: Family, corpus: TokenizedCorpus, batch_size: int) -> Validation:
    """Every loop's loss and flip rates over the whole corpus (eval mode, no dropout, teacher forcing); ``family``
    is the model's."""
    starts = range(0, len(corpus), batch_size)
    batches = (corpus.examples(range(s, min(s + batch_size, len(corpus))), 0, 0) for s in starts)
    return validate_batches(model, family, batches)


def validate_batches(
    model: SpeedT5 | LoopedLM, family: Family, batches: Iterable[Mapping[str, Sequence]]
) -> Validation:
    """Every loop's loss and flip rates over batches of examples (columns ``input_ids`` and ``labels``, as the
    ``family``'s ``collate`` takes them; eval mode, no dropout, teacher forcing)."""
    device = next(model.parameters()).device
    was_training = model.training
    model.eval()
    total = torch.zeros(model.n_loops, dtype=torch.float64)
    prev = torch.zeros(model.n_loops, dtype=torch.int64)
    final = torch.zeros(model.n_loops, dtype=torch.int64)
    tokens = 0
    try:
        with torch.no_grad():
            for columns in batches:
                batch = {k: v.to(device) for k, v in family.collate(columns).items()}
                out = model(**batch, return_logits=True)  # the family's collate gives the forward's arguments
                flips_prev, flips_final, n = teacher_forced_flips(out.loop_logits, batch["labels"])
                total += out.loop_losses.double().cpu() * n  # (M,): per-token means back to sums
                prev += flips_prev.cpu()
                final += flips_final.cpu()
                tokens += n
    finally:
        model.train(was_training)
    if tokens == 0:
        raise ValueError("the validation examples have no target tokens")
    return Validation((total / tokens).tolist(), (prev / tokens).tolist(), (final / tokens).tolist(), tokens)


def validation_losses(
    model: SpeedT5 | LoopedLM, family: Family, corpus: TokenizedCorpus, batch_size: int
) -> list[float]:
    """(M,) mean token cross-entropy of every loop's exit over the whole corpus (eval mode, no dropout)."""
    return validate(model, family, corpus, batch_size).losses


def validation_metrics(
    model: SpeedT5 | LoopedLM, family: Family, corpus: TokenizedCorpus, batch_size: int
) -> dict[str, float]:
    """For a report: ``val_loss_loop1`` .. ``val_loss_loopM``, ``val_loss_last`` (= loop M),
    ``val_ppl_loop{i}`` (perplexity), ``val_flip_prev_loop{i}``, ``val_flip_final_loop{i}`` and ``val_flip_cost``."""
    v = validate(model, family, corpus, batch_size)
    return {
        **{f"val_loss_loop{i + 1}": x for i, x in enumerate(v.losses)},
        "val_loss_last": v.losses[-1],
        **{f"val_ppl_loop{i + 1}": x for i, x in enumerate(v.perplexities)},
        **{f"val_flip_prev_loop{i + 1}": x for i, x in enumerate(v.flip_rate_prev)},
        **{f"val_flip_final_loop{i + 1}": x for i, x in enumerate(v.flip_rate_final)},
        "val_flip_cost": v.flip_cost,
    }
