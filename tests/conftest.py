"""Shared fixtures: one local Ray instance for the whole test session, a tiny tokenizer for training tests."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def ray_session():
    """A private local Ray (2 CPUs, no dashboard) shared by every @pytest.mark.ray test; shut down at the end.

    ``address="local"`` always starts a new instance, so a test never joins another
    cluster running on this machine (``ray.init()`` alone would attach to the last
    one started with ``ray start``).
    """
    import ray

    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=True)
    yield ray
    ray.shutdown()


@pytest.fixture(scope="session")
def tiny_tokenizer(tmp_path_factory):
    """A 300-piece SentencePiece model trained on the first 40 pretraining documents (~2 s)."""
    from speed.data import load_records
    from speed.tokenizer import train_tokenizer

    path = tmp_path_factory.mktemp("tokenizer") / "spm.model"
    train_tokenizer(load_records("pretrain", "train", limit=40)["text"], path, vocab_size=300)
    return path
