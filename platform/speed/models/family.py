"""The model families, behind one seam: the T5 encoder-decoder (``t5``) and the decoder-only looped LM (``lm``).

A ``Family`` is the one place that knows a family: its config class, its model class, its presets; what
training needs of it (how a batch of examples becomes the forward's keyword arguments, ``collate``; how many
tokens a batch holds; how data prepares its splits, ``preparation``); what decoding a task needs of it (how
the task reads, ``read_task``, and how its source texts become the decoder's inputs, ``encode_sources``: the
same for evaluation, sweeps and benchmarks); what Serve needs of it (how a served prompt or chat becomes the
decoder's input, and whether Serve checks its length itself); and what its checkpoint holds beside the
weights (``checkpoint_config``, read back by ``chat_template``). A model hands out its engine ``Stepper``
itself (``model.stepper()``). Jobs choose a family with ``--model t5|lm`` (the ``model`` section's
``family`` key); checkpoints record it (config.json's ``family``, absent in T5 checkpoints written before
the LM existed), so that ``speed.models.checkpoint.load_model`` rebuilds the right model. Nothing outside
``speed.models`` compares a family's name (``tests/test_layers.py``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Protocol

import torch
from torch import Tensor, nn

from speed.chat import CHAT_TEMPLATE, ChatRenderer, ChatTemplate, render_chat, task_prompt
from speed.config import LMConfig, ModelConfig, from_dict, lm_preset, preset, to_dict
from speed.data import batching
from speed.data.tasks import Task, lm_task
from speed.hf_tokenizer import prompt_ids
from speed.models.looped_lm import LoopedLM
from speed.models.t5 import SpeedT5
from speed.tokenizer import PAD_ID, Tokenizer

DEFAULT_FAMILY = "t5"
Messages = Sequence[Mapping[str, str]]  # a served chat: every message's role and content


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

    def encode_sources(
        self, sources: Sequence[str], tokenizer: Tokenizer, max_len: int, template: ChatRenderer = CHAT_TEMPLATE
    ) -> list[list[int]]:
        """The decoder's inputs for source texts (of ``read_task``'s task), at most ``max_len`` tokens each (an LM's
        prompts in chat ``template``: the platform's, or an imported model's)."""

    preparation: str  # how its splits are tokenized: a ``speed.data.encoders.PREPARATIONS`` name (CorpusSpec.family)

    # Serve
    whole_context: bool  # a served prompt is the whole context (chat template, instruction): Serve checks its length

    def served_prompts(
        self, texts: Sequence[str], task: Task | None, tokenizer: Tokenizer, template: ChatRenderer
    ) -> list[list[int]]:
        """Served text prompts as the decoder's inputs, under ``task`` when one is named."""

    def served_chat(
        self, messages: Messages, last_user: int, task: Task | None, tokenizer: Tokenizer, template: ChatRenderer
    ) -> list[int]:
        """A served chat (``role``/``content`` messages; ``last_user``: the last user message's index) as the
        decoder's input, under ``task`` when one is named."""

    # checkpoints and imports
    hub_init: bool  # ``--init-from hf:<name>`` loads Hugging Face weights into it (``speed.models.convert_t5``)
    encoder_decoder: bool  # it decodes a target from a source text (exit training's ``decoded`` targets)

    def checkpoint_config(self) -> dict[str, Any]:
        """What a checkpoint's config.json holds for this family beside the model config (sections by name)."""

    def chat_template(self, config: Mapping[str, Any]) -> ChatTemplate | None:
        """The chat template a checkpoint's prompts were written in, from its config.json; None: it has none."""


class T5Family:
    """``SpeedT5`` trained on (input_ids, labels) pairs: span-corrupted text or source/target tasks."""

    name = "t5"
    config = ModelConfig
    model = SpeedT5
    preparation = "t5"  # token runs, span-corrupted when read; source/target pairs
    whole_context = False  # T5 reads a prompt as sent (prefix and EOS aside): the engine's length check words it
    hub_init = True
    encoder_decoder = True

    def preset(self, name: str) -> ModelConfig:
        return preset(name)

    def collate(self, columns: Mapping[str, Sequence]) -> dict[str, Tensor]:
        return batching.collate(columns)  # input_ids, attention_mask, labels, decoder_input_ids

    def tokens(self, batch: Mapping[str, Tensor]) -> int:
        return int(batch["attention_mask"].sum()) + int((batch["labels"] != -100).sum())

    def read_task(self, task: Task) -> Task:
        return task  # T5's task prefix ("translate English to German: ")

    def encode_sources(
        self, sources: Sequence[str], tokenizer: Tokenizer, max_len: int, template: ChatRenderer = CHAT_TEMPLATE
    ) -> list[list[int]]:
        encoded = tokenizer.encode_batch(sources)  # EOS-terminated encoder inputs
        return [batching.truncate(ids, max_len) for ids in encoded]

    def served_prompts(
        self, texts: Sequence[str], task: Task | None, tokenizer: Tokenizer, template: ChatRenderer
    ) -> list[list[int]]:
        prefix = task.prefix if task is not None else ""
        return tokenizer.encode_batch([prefix + text for text in texts])  # the task's prefix before, EOS after

    def served_chat(
        self, messages: Messages, last_user: int, task: Task | None, tokenizer: Tokenizer, template: ChatRenderer
    ) -> list[int]:
        return self.served_prompts([messages[last_user]["content"]], task, tokenizer, template)[0]  # its source text

    def checkpoint_config(self) -> dict[str, Any]:
        return {}

    def chat_template(self, config: Mapping[str, Any]) -> ChatTemplate | None:
        return None


class LMFamily:
    """``LoopedLM`` trained on next tokens: packed text rows, or prompted examples with the loss on the answer."""

    name = "lm"
    config = LMConfig
    model = LoopedLM
    preparation = "lm"  # next-token rows; chat prompts and answers
    whole_context = True
    hub_init = False
    encoder_decoder = False

    def preset(self, name: str) -> LMConfig:
        return lm_preset(name)

    def collate(self, columns: Mapping[str, Sequence]) -> dict[str, Tensor]:
        return batching.collate_lm(columns)  # input_ids, labels

    def tokens(self, batch: Mapping[str, Tensor]) -> int:
        return int((batch["input_ids"] != PAD_ID).sum())

    def read_task(self, task: Task) -> Task:
        return lm_task(task)  # the task's instruction before every source text

    def encode_sources(
        self, sources: Sequence[str], tokenizer: Tokenizer, max_len: int, template: ChatRenderer = CHAT_TEMPLATE
    ) -> list[list[int]]:
        return batching.encode_prompts(sources, tokenizer, max_len, template)  # chat prompts, ending in the cue

    def served_prompts(
        self, texts: Sequence[str], task: Task | None, tokenizer: Tokenizer, template: ChatRenderer
    ) -> list[list[int]]:
        if task is None:  # raw text, as the published tokenizer reads it (Huginn's BOS first)
            return prompt_ids(tokenizer, texts)
        # the instruction and the text as one user turn: exactly a finetuning prompt
        return prompt_ids(tokenizer, [task_prompt(task.instruction, text, template) for text in texts], template)

    def served_chat(
        self, messages: Messages, last_user: int, task: Task | None, tokenizer: Tokenizer, template: ChatRenderer
    ) -> list[int]:
        instruction = task.instruction if task is not None else ""  # opens the last user message
        turns = [{**m, "content": instruction + m["content"]} if i == last_user else m for i, m in enumerate(messages)]
        return prompt_ids(tokenizer, [render_chat(turns, template)], template)[0]

    def checkpoint_config(self) -> dict[str, Any]:
        return {"chat_template": to_dict(CHAT_TEMPLATE)}  # the template its prompts are written in

    def chat_template(self, config: Mapping[str, Any]) -> ChatTemplate | None:
        stored = config.get("chat_template")
        return from_dict(ChatTemplate, stored, "chat_template") if stored is not None else CHAT_TEMPLATE


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
