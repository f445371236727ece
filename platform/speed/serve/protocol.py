"""The HTTP protocol: OpenAI-style completion requests (validated, unknown fields rejected) and answers.

``POST /v1/completions`` takes OpenAI's completion fields that make sense for
greedy decoding plus SPEED's own (``method``, ``launch_loop``,
``invalidation``, ``task``); every answer carries a ``speed`` object with the
decoder's statistics. Errors follow OpenAI's shape:
``{"error": {"message", "type", "param", "code"}}``.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

PROMPT_SHAPES = "a non-empty string, a list of strings, a list of token ids, or a list of token-id lists"


class CompletionRequest(BaseModel):
    """A completion request; fields left out take the deployment's defaults (``ServeSettings``)."""

    model_config = ConfigDict(extra="forbid", strict=True)

    prompt: str | list[str] | list[int] | list[list[int]]
    model: str | None = None  # must name the served model when given
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float | int | None = None  # greedy only: 0 (or left out)
    n: int = 1
    stream: bool = False
    user: str | None = None  # accepted for OpenAI clients, not used
    method: Literal["speed", "sequential"] | None = None
    launch_loop: int | None = Field(default=None, ge=1)
    invalidation: Literal["eager", "final"] | None = None
    task: str | None = None  # a speed.data.tasks name whose prefix goes before each text prompt

    @field_validator("prompt", mode="before")
    @classmethod
    def _prompt_shape(cls, value: Any) -> Any:
        if isinstance(value, str):
            if not value.strip():
                raise ValueError("prompt is empty: send the text to complete")
            return value
        if not isinstance(value, list) or not value:
            raise ValueError(f"prompt must be {PROMPT_SHAPES}")
        if all(isinstance(p, str) for p in value):
            empty = next((i for i, p in enumerate(value) if not p.strip()), None)
            if empty is not None:
                raise ValueError(f"prompt[{empty}] is empty: every prompt needs text")
            return value
        if all(_is_id(t) for t in value):
            return value
        if all(isinstance(p, list) for p in value):
            bad = next((i for i, p in enumerate(value) if not p or not all(_is_id(t) for t in p)), None)
            if bad is not None:
                raise ValueError(f"prompt[{bad}] must be a non-empty list of token ids (integers >= 0)")
            return value
        raise ValueError(f"prompt must be {PROMPT_SHAPES}, not a mixture")

    @field_validator("temperature")
    @classmethod
    def _greedy(cls, value: float | int | None) -> float | int | None:
        if value is not None and value != 0:
            raise ValueError(f"this server decodes greedily only: temperature must be 0 or left out, got {value}")
        return value

    @field_validator("n")
    @classmethod
    def _one_choice(cls, value: int) -> int:
        if value != 1:
            raise ValueError(f"greedy decoding has one answer per prompt: n must be 1, got {value}")
        return value

    def prompts(self) -> list[str] | list[list[int]]:
        """The prompts as a list: texts or token-id lists."""
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if p and all(isinstance(t, int) for t in p):
            return [p]  # type: ignore[list-item]
        return p  # type: ignore[return-value]


_BRANCHES = {"str", "int", "float", "bool"}


def _is_id(value: Any) -> bool:
    return type(value) is int and value >= 0


# ----- errors --------------------------------------------------------------------------------------


def error_body(message: str, param: str | None = None, kind: str = "invalid_request_error") -> dict[str, Any]:
    """OpenAI's error object."""
    return {"error": {"message": message, "type": kind, "param": param, "code": None}}


def validation_message(error: ValidationError | list[dict[str, Any]]) -> tuple[str, str | None]:
    """One readable message (and the first offending field) from pydantic's or FastAPI's errors."""
    errors = error.errors() if isinstance(error, ValidationError) else error
    parts, first = [], None
    allowed = ", ".join(CompletionRequest.model_fields)
    for e in errors:
        loc = [str(x) for x in e.get("loc", ()) if x != "body"]
        # a union's branch names ("str", "list[int]") are noise next to the message
        loc = [x for x in loc if x not in _BRANCHES and not x.startswith(("list[", "literal["))]
        where = ".".join(loc) or "body"
        first = first or where
        msg = str(e.get("msg", "invalid")).removeprefix("Value error, ")
        if e.get("type") == "extra_forbidden":
            msg = f"unknown field; the fields are: {allowed}"
        elif e.get("type") == "json_invalid":
            msg = "the body is not valid JSON"
        parts.append(f"{where}: {msg}")
    return "; ".join(dict.fromkeys(parts)), first


# ----- answers -------------------------------------------------------------------------------------


@dataclass
class Choice:
    """One decoded prompt, ready to answer."""

    index: int
    text: str
    finish_reason: str  # "stop" or "length"
    prompt_tokens: int
    completion_tokens: int
    speed: dict[str, Any]  # the decoder's statistics of this prompt


def usage(choices: list[Choice]) -> dict[str, int]:
    """OpenAI's token counts."""
    prompt = sum(c.prompt_tokens for c in choices)
    completion = sum(c.completion_tokens for c in choices)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def speed_object(replica: str, settings: dict[str, Any], choices: list[Choice]) -> dict[str, Any]:
    """The ``speed`` object of an answer: who decoded it, how, and each prompt's statistics."""
    return {"replica": replica, **settings, "choices": [c.speed for c in sorted(choices, key=lambda c: c.index)]}


def completion_body(
    request_id: str, created: int, model: str, choices: list[Choice], speed: dict[str, Any]
) -> dict[str, Any]:
    """A whole (non-streamed) completion answer."""
    return {
        "id": request_id,
        "object": "text_completion",
        "created": created,
        "model": model,
        "choices": [
            {"text": c.text, "index": c.index, "logprobs": None, "finish_reason": c.finish_reason}
            for c in sorted(choices, key=lambda c: c.index)
        ],
        "usage": usage(choices),
        "speed": speed,
    }


def chunk(request_id: str, created: int, model: str, index: int, text: str, finish_reason: str | None) -> str:
    """One server-sent event with a text delta of choice ``index``."""
    body = {
        "id": request_id,
        "object": "text_completion",
        "created": created,
        "model": model,
        "choices": [{"text": text, "index": index, "logprobs": None, "finish_reason": finish_reason}],
    }
    return sse(body)


def sse(body: dict[str, Any] | str) -> str:
    """A server-sent event line: ``data: <json>`` (or a literal such as ``[DONE]``)."""
    return f"data: {body if isinstance(body, str) else json.dumps(body)}\n\n"


DONE = sse("[DONE]")


def now() -> int:
    """OpenAI's ``created``: Unix seconds."""
    return int(time.time())


class TextStream:
    """Incremental detokenisation: the text a new token adds to what was already sent.

    SentencePiece joins pieces with context (a leading ``▁`` is a space except
    at the start), so each delta is the difference of whole decodes; text that
    is not yet a clean extension is held back until it is.
    """

    def __init__(self, decode: Any) -> None:
        self._decode = decode
        self.tokens: list[int] = []
        self.sent = ""

    def push(self, token: int) -> str:
        """Add a token; return the new text to send (possibly empty)."""
        self.tokens.append(token)
        text = self._decode(self.tokens)
        if text.endswith("\ufffd") or not text.startswith(self.sent):  # a split character, or a rewrite
            return ""
        delta, self.sent = text[len(self.sent) :], text
        return delta

    def finish(self) -> str:
        """Whatever the final decode adds beyond what was sent (after held-back text)."""
        text = self._decode(self.tokens)
        delta = text[len(self.sent) :] if text.startswith(self.sent) else ""
        self.sent = text
        return delta
