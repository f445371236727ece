"""Validation losses: token-weighted over batches, so the batch size does not change them."""

from __future__ import annotations

import torch

from speed.config import preset
from speed.data import collate
from speed.model import SpeedT5
from speed.train.validation import validation_losses, validation_metrics


class _Corpus:
    """Stands in for a prepared TokenizedCorpus: examples by index."""

    def __init__(self, examples: list[dict[str, list[int]]]) -> None:
        self._examples = examples

    def __len__(self) -> int:
        return len(self._examples)

    def examples(self, indices, epoch, seed):
        rows = [self._examples[i] for i in indices]
        return {"input_ids": [r["input_ids"] for r in rows], "labels": [r["labels"] for r in rows]}


def test_validation_losses_are_per_token_means_over_the_whole_split():
    torch.manual_seed(0)
    model = SpeedT5(preset("tiny", pattern="2x3")).train()
    g = torch.Generator().manual_seed(1)
    examples = [
        {
            "input_ids": torch.randint(3, 128, (int(n),), generator=g).tolist() + [1],
            "labels": torch.randint(3, 128, (int(t),), generator=g).tolist() + [1],
        }
        for n, t in zip(torch.randint(2, 9, (7,), generator=g), torch.randint(1, 12, (7,), generator=g))
    ]
    corpus = _Corpus(examples)
    one_batch = validation_losses(model, corpus, batch_size=7)
    assert model.training  # left as it was
    batch = collate(corpus.examples(range(7), 0, 0))
    with torch.no_grad():
        model.eval()
        out = model(batch["input_ids"], batch["decoder_input_ids"], batch["attention_mask"], labels=batch["labels"])
    torch.testing.assert_close(torch.tensor(one_batch), out.loop_losses, rtol=1e-5, atol=1e-6)
    # Uneven batches (3 + 3 + 1 examples of different target lengths) give the same per-token means.
    torch.testing.assert_close(torch.tensor(validation_losses(model, corpus, batch_size=3)), torch.tensor(one_batch))
    metrics = validation_metrics(model, corpus, 3)
    assert sorted(metrics) == ["val_loss_last", "val_loss_loop1", "val_loss_loop2", "val_loss_loop3"]
    assert metrics["val_loss_last"] == metrics["val_loss_loop3"]
