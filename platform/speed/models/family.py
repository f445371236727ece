"""The two model families, behind one seam: the T5 encoder-decoder (``t5``) and the decoder-only looped LM (``lm``).

A family names its config class, its model class, its presets, and what training needs of it: how a batch
of examples becomes the forward's keyword arguments (``collate``) and how many tokens a batch holds; and what
decoding a task needs of it: how the task reads (``read_task``) and how its source texts become the decoder's
inputs (``encode_sources``), the same for evaluation, sweeps and benchmarks. Jobs
choose a family with ``--model t5|lm`` (the ``model`` section's ``family`` key); checkpoints record it
(config.json's ``family``, absent in T5 checkpoints written before the LM existed), so that
``speed.models.checkpoint.load_model`` rebuilds the right model.

Imports of ``speed.data`` stay inside the methods: loading a checkpoint (serving) does not pay for
``datasets``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, Protocol

import torch
from torch import Tensor, nn

from speed.config import LMConfig, ModelConfig, from_dict, lm_preset, preset
from speed.models.looped_lm import LoopedLM
from speed.models.t5 import SpeedT5

if TYPE_CHECKING:
    from speed.data.tasks import Task
    from speed.tokenizer import Tokenizer

DEFAULT_FAMILY = "t5"


class Family(Protocol):
    """What the library needs to know of a model family."""

    name: str
    config: type  # the frozen config dataclass
    model: type  # the nn.Module built from it

    def preset(self, name: str) -> Any:
        """The named preset config (``mini``, ``tiny``, ...)."""

    def collate(self, columns: Mapping[str, Sequence]) -> dict[str, Tensor]:
        """A batch of examples (columns of a prepared corpus) as the forward's keyword arguments, ``labels``
        among them (-100 = no loss)."""

    def tokens(self, batch: Mapping[str, Tensor]) -> int:
        """Tokens a collated batch costs (the tokens/s of the training log)."""

    def read_task(self, task: Task) -> Task:
        """The source/target task as this family reads it (its source texts' prefix)."""

    def encode_sources(self, sources: Sequence[str], tokenizer: Tokenizer, max_len: int) -> list[list[int]]:
        """The decoder's inputs for source texts (of ``read_task``'s task), at most ``max_len`` tokens each."""


class T5Family:
    """``SpeedT5`` trained on (input_ids, labels) pairs: span-corrupted text or source/target tasks."""

    name = "t5"
    config = ModelConfig
    model = SpeedT5

    def preset(self, name: str) -> ModelConfig:
        return preset(name)

    def collate(self, columns: Mapping[str, Sequence]) -> dict[str, Tensor]:
        from speed.data import collate

        return collate(columns)  # input_ids, attention_mask, labels, decoder_input_ids

    def tokens(self, batch: Mapping[str, Tensor]) -> int:
        return int(batch["attention_mask"].sum()) + int((batch["labels"] != -100).sum())

    def read_task(self, task: Task) -> Task:
        return task  # T5's task prefix ("translate English to German: ")

    def encode_sources(self, sources: Sequence[str], tokenizer: Tokenizer, max_len: int) -> list[list[int]]:
        from speed.data import truncate

        return [truncate(ids, max_len) for ids in tokenizer.encode_batch(sources)]  # EOS-terminated encoder inputs


class LMFamily:
    """``LoopedLM`` trained on next tokens: packed text rows, or prompted examples with the loss on the answer."""

    name = "lm"
    config = LMConfig
    model = LoopedLM

    def preset(self, name: str) -> LMConfig:
        return lm_preset(name)

    def collate(self, columns: Mapping[str, Sequence]) -> dict[str, Tensor]:
        from speed.data.batching import collate_lm

        return collate_lm(columns)  # input_ids, labels

    def tokens(self, batch: Mapping[str, Tensor]) -> int:
        from speed.tokenizer import PAD_ID

        return int((batch["input_ids"] != PAD_ID).sum())

    def read_task(self, task: Task) -> Task:
        from speed.data.tasks import lm_task

        return lm_task(task)  # the task's instruction before every source text

    def encode_sources(self, sources: Sequence[str], tokenizer: Tokenizer, max_len: int) -> list[list[int]]:
        from speed.data.batching import encode_prompts

        return encode_prompts(sources, tokenizer, max_len)  # chat prompts, ending in the answer's cue


FAMILIES: dict[str, Family] = {"t5": T5Family(), "lm": LMFamily()}


def get_family(name: str) -> Family:
    """The family ``name`` (``t5`` or ``lm``); an unknown name is an error listing both."""
    if name not in FAMILIES:
        raise ValueError(f"unknown model family {name!r}; choose one of {sorted(FAMILIES)}")
    return FAMILIES[name]


def family_of(obj: nn.Module | Any) -> Family:
    """The family of a model or of a model config."""
    for family in FAMILIES.values():
        if isinstance(obj, (family.model, family.config)):
            return family
    raise TypeError(f"{type(obj).__name__} belongs to no model family")


def config_from_dict(data: dict[str, Any], family: str = DEFAULT_FAMILY) -> ModelConfig | LMConfig:
    """A model config of ``family`` from its fields (unknown keys are errors)."""
    return from_dict(get_family(family).config, data, "model")


def config_of_any_family(data: dict[str, Any]) -> ModelConfig | LMConfig:
    """A model config from its fields, of the family they fit (a T5's first): for files that do not name it."""
    try:
        return config_from_dict(data, "t5")
    except ValueError as t5_error:
        try:
            return config_from_dict(data, "lm")
        except ValueError:
            raise t5_error from None


def build_model(config: ModelConfig | LMConfig) -> SpeedT5 | LoopedLM:
    """A freshly initialised model of the config's family."""
    return family_of(config).model(config)


def parameter_count(config: ModelConfig | LMConfig) -> int:
    """Parameters of a model of ``config`` (built on the meta device: no memory, no initialisation)."""
    with torch.device("meta"):
        return sum(p.numel() for p in build_model(config).parameters())


def match_parameters(config: ModelConfig | LMConfig, target: int) -> ModelConfig | LMConfig:
    """``config`` with the FFN width ``d_ff`` that brings its parameter count closest to ``target`` (the count is
    linear in ``d_ff``), so that two families compare at equal size; ``ValueError`` when no width reaches it."""
    base, wider = parameter_count(config.replace(d_ff=1)), parameter_count(config.replace(d_ff=2))
    per_unit = wider - base  # parameters one more FFN unit adds, over every layer
    d_ff = 1 + round((target - base) / per_unit)
    if d_ff < 1:
        raise ValueError(f"no d_ff brings {config.pattern} to {target} parameters: d_ff=1 already has {base}")
    return config.replace(d_ff=d_ff)
