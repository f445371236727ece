"""What the OpenAI routes answer: whole answers, server-sent chunks, logprobs and errors in OpenAI's shapes, and
the response models the published OpenAPI document describes them with.

``Surface`` shapes the answers of one route: ``COMPLETIONS`` (``text``) or
``CHAT`` (``message``, ``delta``); ``Choice`` is one decoded choice.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict


class _Out(BaseModel):
    model_config = ConfigDict(extra="forbid")


class ErrorDetail(_Out):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorResponse(_Out):
    """OpenAI's error body."""

    error: ErrorDetail


class Usage(_Out):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class CompletionLogprobs(_Out):
    tokens: list[str]
    token_logprobs: list[float]
    top_logprobs: list[dict[str, float]]
    text_offset: list[int]


class CompletionChoice(_Out):
    text: str
    index: int
    logprobs: CompletionLogprobs | None
    finish_reason: Literal["stop", "length"]


class CompletionResponse(_Out):
    """A whole ``/v1/completions`` answer."""

    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage
    speed: dict[str, Any]


class TopLogprob(_Out):
    token: str
    logprob: float
    bytes: list[int]


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(_Out):
    content: list[ChatTokenLogprob]


class AssistantMessage(_Out):
    role: Literal["assistant"]
    content: str


class ChatChoice(_Out):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None
    finish_reason: Literal["stop", "length"]


class ChatResponse(_Out):
    """A whole ``/v1/chat/completions`` answer."""

    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    speed: dict[str, Any]


@dataclass
class TokenInfo:
    """One token of a choice as the client sees it: its text piece, log-probability and top alternatives."""

    piece: str
    logprob: float
    top: list[tuple[str, float]]
    offset: int  # where its text starts in the choice's text


@dataclass
class Choice:
    """One decoded choice, ready to answer."""

    index: int
    prompt: int  # index of its prompt (a prompt's n choices share it)
    text: str
    finish_reason: str  # "stop" (EOS or a stop string) or "length"
    prompt_tokens: int
    completion_tokens: int
    speed: dict[str, Any]  # the decoder's statistics of this choice
    tokens: list[TokenInfo] | None = None  # with logprobs


def error_body(message: str, param: str | None = None, kind: str = "invalid_request_error") -> dict[str, Any]:
    """OpenAI's error object."""
    return {"error": {"message": message, "type": kind, "param": param, "code": None}}


def usage(choices: list[Choice]) -> dict[str, int]:
    """OpenAI's token counts (each prompt counted once, however many choices it has)."""
    prompt = sum({c.prompt: c.prompt_tokens for c in choices}.values())
    completion = sum(c.completion_tokens for c in choices)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def speed_object(replica: str, settings: dict[str, Any], choices: list[Choice]) -> dict[str, Any]:
    """The ``speed`` object of an answer: who decoded it, how, and each choice's statistics."""
    return {"replica": replica, **settings, "choices": [c.speed for c in sorted(choices, key=lambda c: c.index)]}


def completion_logprobs(tokens: list[TokenInfo] | None) -> dict[str, Any] | None:
    """OpenAI completions' ``logprobs`` object of some tokens."""
    if tokens is None:
        return None
    return {
        "tokens": [t.piece for t in tokens],
        "token_logprobs": [t.logprob for t in tokens],
        "top_logprobs": [dict(t.top) for t in tokens],
        "text_offset": [t.offset for t in tokens],
    }


def _entry(piece: str, logprob: float) -> dict[str, Any]:
    return {"token": piece, "logprob": logprob, "bytes": list(piece.encode("utf-8"))}


def chat_logprobs(tokens: list[TokenInfo] | None) -> dict[str, Any] | None:
    """OpenAI chat's ``logprobs`` object of some tokens."""
    if tokens is None:
        return None
    content = [{**_entry(t.piece, t.logprob), "top_logprobs": [_entry(p, lp) for p, lp in t.top]} for t in tokens]
    return {"content": content}


@dataclass(frozen=True)
class Surface:
    """How one OpenAI route shapes its answers: completions (``text``) or chat (``message``/``delta``)."""

    chat: bool

    @property
    def object(self) -> str:
        return "chat.completion" if self.chat else "text_completion"

    @property
    def chunk_object(self) -> str:
        return "chat.completion.chunk" if self.chat else "text_completion"

    def logprobs(self, tokens: list[TokenInfo] | None) -> dict[str, Any] | None:
        return chat_logprobs(tokens) if self.chat else completion_logprobs(tokens)

    def choice(self, c: Choice) -> dict[str, Any]:
        out = {"index": c.index, "logprobs": self.logprobs(c.tokens), "finish_reason": c.finish_reason}
        if self.chat:
            return {**out, "message": {"role": "assistant", "content": c.text}}
        return {"text": c.text, **out}

    def body(
        self, request_id: str, created: int, model: str, choices: list[Choice], speed: dict[str, Any]
    ) -> dict[str, Any]:
        """A whole (non-streamed) answer."""
        return {
            "id": request_id,
            "object": self.object,
            "created": created,
            "model": model,
            "choices": [self.choice(c) for c in sorted(choices, key=lambda c: c.index)],
            "usage": usage(choices),
            "speed": speed,
        }

    def chunk(
        self,
        request_id: str,
        created: int,
        model: str,
        index: int,
        text: str | None,
        finish_reason: str | None,
        tokens: list[TokenInfo] | None = None,
        include_usage: bool = False,
    ) -> str:
        """One server-sent event with a text delta of choice ``index`` (chat: ``text`` None sends the role)."""
        choice: dict[str, Any] = {"index": index, "logprobs": self.logprobs(tokens), "finish_reason": finish_reason}
        if self.chat:
            choice["delta"] = {"role": "assistant", "content": ""} if text is None else {"content": text}
        else:
            choice = {"text": text or "", **choice}
        body = {"id": request_id, "object": self.chunk_object, "created": created, "model": model}
        body["choices"] = [choice]
        if include_usage:
            body["usage"] = None  # OpenAI: null on every chunk but the last when usage is asked for
        return sse(body)

    def final(
        self,
        request_id: str,
        created: int,
        model: str,
        choices: list[Choice],
        speed: dict[str, Any],
        include_usage: bool,
    ) -> str:
        """The last chunk before ``[DONE]``: no choices, the ``speed`` object and (when asked for) the usage."""
        body = {"id": request_id, "object": self.chunk_object, "created": created, "model": model, "choices": []}
        if include_usage:
            body["usage"] = usage(choices)
        return sse({**body, "speed": speed})


COMPLETIONS = Surface(chat=False)
CHAT = Surface(chat=True)


def sse(body: dict[str, Any] | str) -> str:
    """A server-sent event line: ``data: <json>`` (or a literal such as ``[DONE]``)."""
    return f"data: {body if isinstance(body, str) else json.dumps(body)}\n\n"


DONE = sse("[DONE]")


def now() -> int:
    """OpenAI's ``created``: Unix seconds."""
    return int(time.time())
