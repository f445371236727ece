"""The chat template of a finetuned looped LM: chat messages -> the prompt text the model was finetuned on.

LM finetuning (``speed.data`` with the ``lm`` family) writes every example as one user turn, the task's
instruction before the source text (``Translate to German: A dog runs.``), rendered by this template, with
the loss on the answer that follows; so a chat request with that user message renders to exactly a
training prompt, and the model answers it. The template is stored in every LM checkpoint's config.json
(``chat_template``), for the serving side to apply with ``render_chat``.

    <user> Translate to German: A dog runs.
    <assistant>

Each message is ``turn`` with its role and content; ``cue`` ends the prompt, where the answer begins.

An imported model brings its own Jinja template instead (``speed.hf_chat_template.HFChatTemplate``, read from its
``tokenizer_config.json`` or ``chat_template.jinja``). Both have the shape ``ChatRenderer``: ``render(messages)``
is the prompt text, ending where the assistant's answer begins; ``render_chat`` and ``task_prompt`` take either.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

ROLES = ("system", "user", "assistant")


@runtime_checkable
class ChatRenderer(Protocol):
    """Chat messages (``{"role", "content"}`` mappings) -> the prompt text, ending where the answer begins."""

    def render(self, messages: Sequence[Mapping[str, Any]]) -> str: ...


@dataclass(frozen=True)
class ChatTemplate:
    """How messages become prompt text: ``turn`` per message (``{role}``, ``{content}``), then ``cue``."""

    turn: str = "<{role}> {content}\n"
    cue: str = "<assistant>"

    def __post_init__(self) -> None:
        for placeholder in ("{role}", "{content}"):
            if placeholder not in self.turn:
                raise ValueError(f"ChatTemplate.turn must hold {placeholder}, got {self.turn!r}")

    def render(self, messages: Sequence[Mapping[str, Any]]) -> str:
        """``render_chat(messages, self)``."""
        return _render(messages, self)


CHAT_TEMPLATE = ChatTemplate()


def render_chat(messages: Sequence[Mapping[str, Any]], template: ChatRenderer = CHAT_TEMPLATE) -> str:
    """The prompt text of chat ``messages`` (each ``{"role": system|user|assistant, "content": str}``).

    A ``ChatTemplate``: a message of another role, without text content, or an empty list is a ``ValueError``.
    Any other ``ChatRenderer`` (an imported model's Jinja template) renders them itself, its errors
    ``ValueError`` too.
    """
    return template.render(messages)


def _render(messages: Sequence[Mapping[str, Any]], template: ChatTemplate) -> str:
    if not messages:
        raise ValueError("a chat needs at least one message")
    turns = []
    for i, message in enumerate(messages):
        role, content = message.get("role"), message.get("content")
        if role not in ROLES:
            raise ValueError(f"message {i}: role must be one of {list(ROLES)}, got {role!r}")
        if not isinstance(content, str):
            raise ValueError(f"message {i}: content must be text, got {type(content).__name__}")
        turns.append(template.turn.format(role=role, content=content))
    return "".join(turns) + template.cue


def task_prompt(instruction: str, source: str, template: ChatRenderer = CHAT_TEMPLATE) -> str:
    """The prompt of one finetuning example: a single user turn, ``instruction`` before ``source``."""
    return render_chat([{"role": "user", "content": instruction + source}], template)
