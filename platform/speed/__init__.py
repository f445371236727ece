"""speed: SPEED (speculative pipelined decoding) for parameter-shared T5 decoders and looped decoder-only LMs."""

from speed.config import PRESETS, LMConfig, ModelConfig, SharingPattern, lm_preset, preset
from speed.decode.generate import DecodeOptions, DecodeStats, GenerateResult, Speculation, generate
from speed.losses import loss_weights
from speed.models.looped_lm import LoopedLM
from speed.models.pretrained import from_pretrained
from speed.models.t5 import SpeedT5

__all__ = [
    "PRESETS",
    "DecodeOptions",
    "DecodeStats",
    "GenerateResult",
    "LMConfig",
    "LoopedLM",
    "ModelConfig",
    "SharingPattern",
    "Speculation",
    "SpeedT5",
    "from_pretrained",
    "generate",
    "lm_preset",
    "loss_weights",
    "preset",
]
