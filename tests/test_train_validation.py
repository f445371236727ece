"""Validation losses: token-weighted over batches, so the batch size does not change them."""

from __future__ import annotations

import pytest
import torch

from speed.config import preset
from speed.data import collate
from speed.eval.validation import validate, validation_losses, validation_metrics
from speed.models.family import get_family
from speed.models.t5 import SpeedT5

T5 = get_family("t5")


class _Corpus:
    """Stands in for a prepared TokenizedCorpus: examples by index."""

    def __init__(self, examples: list[dict[str, list[int]]]) -> None:
        self._examples = examples

    def __len__(self) -> int:
        return len(self._examples)

    def examples(self, indices, epoch, seed):
        rows = [self._examples[i] for i in indices]
        return {"input_ids": [r["input_ids"] for r in rows], "labels": [r["labels"] for r in rows]}


def _examples(count: int, seed: int) -> list[dict[str, list[int]]]:
    g = torch.Generator().manual_seed(seed)
    return [
        {
            "input_ids": torch.randint(3, 128, (int(n),), generator=g).tolist() + [1],
            "labels": torch.randint(3, 128, (int(t),), generator=g).tolist() + [1],
        }
        for n, t in zip(torch.randint(2, 9, (count,), generator=g), torch.randint(1, 12, (count,), generator=g))
    ]


def test_validation_losses_are_per_token_means_over_the_whole_split():
    torch.manual_seed(0)
    model = SpeedT5(preset("tiny", pattern="2x3")).train()
    corpus = _Corpus(_examples(7, seed=1))
    one_batch = validation_losses(model, T5, corpus, batch_size=7)
    assert model.training  # left as it was
    batch = collate(corpus.examples(range(7), 0, 0))
    with torch.no_grad():
        model.eval()
        out = model(batch["input_ids"], batch["decoder_input_ids"], batch["attention_mask"], labels=batch["labels"])
    torch.testing.assert_close(torch.tensor(one_batch), out.loop_losses, rtol=1e-5, atol=1e-6)
    # Uneven batches (3 + 3 + 1 examples of different target lengths) give the same per-token means.
    uneven = validation_losses(model, T5, corpus, batch_size=3)
    torch.testing.assert_close(torch.tensor(uneven), torch.tensor(one_batch))
    metrics = validation_metrics(model, T5, corpus, 3)
    losses = ["val_loss_last", "val_loss_loop1", "val_loss_loop2", "val_loss_loop3"]
    flips = [f"val_flip_{kind}_loop{i}" for kind in ("final", "prev") for i in (1, 2, 3)]
    perplexities = ["val_ppl_loop1", "val_ppl_loop2", "val_ppl_loop3"]
    assert sorted(metrics) == sorted([*losses, *perplexities, *flips, "val_flip_cost"])
    assert metrics["val_loss_last"] == metrics["val_loss_loop3"]


def test_validation_flip_rates_are_every_loops_argmax_changes_over_the_split():
    torch.manual_seed(0)
    model = SpeedT5(preset("tiny", pattern="1x4")).eval()
    corpus = _Corpus(_examples(9, seed=2))
    v = validate(model, T5, corpus, batch_size=4)  # batches of 4, 4, 1
    batch = collate(corpus.examples(range(9), 0, 0))
    with torch.no_grad():
        out = model(batch["input_ids"], batch["decoder_input_ids"], batch["attention_mask"], return_logits=True)
    keep = batch["labels"] != -100
    preds = [lg.argmax(-1)[keep] for lg in out.loop_logits]  # M x (tokens,)
    assert v.tokens == int(keep.sum())
    expected_prev = [0.0] + [float((preds[k] != preds[k - 1]).float().mean()) for k in range(1, 4)]
    expected_final = [float((p != preds[-1]).float().mean()) for p in preds]
    assert v.flip_rate_prev == pytest.approx(expected_prev) and v.flip_rate_final == pytest.approx(expected_final)
    assert v.flip_rate_final[-1] == 0 and max(v.flip_rate_prev[1:]) > 0  # a random model changes its mind
    assert v.flip_cost == pytest.approx(sum(k * r for k, r in enumerate(expected_prev)))
    assert validation_metrics(model, T5, corpus, 9)["val_flip_cost"] == pytest.approx(v.flip_cost)
