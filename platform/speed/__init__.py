"""speed: SPEED (speculative pipelined decoding) for parameter-shared T5 decoders."""

from speed.config import PRESETS, ModelConfig, SharingPattern, preset
from speed.decoding import DecodeStats, GenerateResult, generate
from speed.losses import loss_weights
from speed.model import SpeedT5

__all__ = [
    "PRESETS",
    "DecodeStats",
    "GenerateResult",
    "ModelConfig",
    "SharingPattern",
    "SpeedT5",
    "generate",
    "loss_weights",
    "preset",
]
