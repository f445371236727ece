"""What every stage of the GPU check (``speed.benchmarks.gpu``) reads: how much it does (``CheckSize``: ``FULL``
on a GPU, ``TINY`` as a dry run on the CPU), and ``sync``, which waits for the device before a clock is read.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from speed.benchmarks.shapes import OURO_1_4B, Shape
from speed.config import ModelConfig, preset
from speed.models.convert_ouro import config_from_ouro


@dataclass(frozen=True)
class CheckSize:
    """How much each stage does: ``FULL`` fits the 8-minute budget on one GPU, ``TINY`` is a CPU dry run."""

    preset: str = "base"
    vocab_size: int = 16384  # jobs/bench_decode.py's: the CPU table's
    pattern: str = "2x6"
    batches: tuple[int, ...] = (1, 8)
    source_len: int = 32
    new_tokens: int = 64  # per timed decode
    reps: int = 5  # timed rounds per batch size, interleaved
    timing_s: float = 150.0  # a further batch size is timed only while the stage stays under this
    agree_batch: int = 8
    agree_tokens: int = 32
    train_steps: int = 4
    train_batch: int = 8
    train_target_len: int = 32
    pytest_timeout_s: float = 120.0
    shape: str | Shape = "ouro-1.4b"  # the real-shape and Llama stages' (a name of SHAPES, or a Shape)
    shape_batches: tuple[int, ...] = (1, 32, 8)  # the goals read batch 1 and 32: 8 only if time is left
    shape_tokens: int = 16
    shape_reps: int = 3
    shape_s: float = 150.0  # the real-shape stage's budget: a further batch runs only while it fits
    llama_batches: tuple[int, ...] = (1,)  # each batch size is one more compilation of transformers' forward
    llama_tokens: int = 32
    llama_reps: int = 3
    launch_tokens: int = 8  # tokens profiled for the launch counts
    bandwidth_bytes: int = 2**30  # the bandwidth buffers' size

    def model(self) -> ModelConfig:
        """The model every stage builds (random weights)."""
        return preset(self.preset, pattern=self.pattern, vocab_size=self.vocab_size)


FULL = CheckSize()
TINY = CheckSize(
    preset="tiny", vocab_size=128, batches=(1, 2), source_len=6, new_tokens=6, reps=1, agree_batch=2,
    agree_tokens=6, train_steps=2, train_batch=2, train_target_len=5, shape_tokens=4, shape_s=30.0,
    shape_batches=(1, 4), shape_reps=2, llama_batches=(1, 2), llama_tokens=5, llama_reps=1, launch_tokens=3,
    bandwidth_bytes=2**24,
    shape=Shape(
        OURO_1_4B | {"hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2, "num_attention_heads": 4,
                     "num_key_value_heads": 4, "head_dim": 16, "vocab_size": 128},
        config_from_ouro,
    ),  # Ouro's form at tiny size
)  # fmt: skip


def sync(device: torch.device) -> None:
    """Wait until ``device`` finished its queued work (a no-op off CUDA)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
