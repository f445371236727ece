"""The HTTP protocol: OpenAI-style completion and chat requests (validated, unknown fields rejected) and errors.

``POST /v1/completions`` takes OpenAI's completion fields: ``prompt``,
``max_tokens``, ``temperature``, ``top_p``, ``seed``, ``n``, ``stop``,
``logprobs``, ``echo``, ``stream`` with ``stream_options.include_usage``,
``presence_penalty``, ``frequency_penalty``, ``user``, ``model``; vLLM's
``top_k``; and SPEED's own (``method``, ``launch_loop``, ``invalidation``,
``branches``, ``branch_depth``, ``branch_below``, ``min_confidence``,
``task``; with ``method: "exit_gate"``, Ouro's exit gate's rule: ``exit_kind``,
``exit_threshold``, ``exit_step``, ``speed.engine.ExitRule``'s fields).
``POST /v1/chat/completions`` takes the same decoding fields with
``messages``: for a T5 the last user message is the source text, under the request's
``task`` or the deployment's; a looped LM reads every message in its chat template
(``speed.serve.planning``). A field OpenAI defines that this server does not
implement (``best_of``, ``suffix``, ``logit_bias``, tools, ...) is a 400 saying
it is not supported; any other unknown field is a 400 too. Every answer carries
a ``speed`` object with the decoder's statistics. Errors follow OpenAI's shape:
``{"error": {"message", "type", "param", "code"}}`` (``speed.serve.responses.error_body``).

Choice ``i`` of a request (prompt-major: prompt ``p``'s ``n`` choices are
``p*n .. p*n+n-1``) samples with ``speed.engine.sampling.choice_seed(seed, i)``; a
request without ``seed`` gets a random one, returned in ``speed.seed`` and in
the statistics rows, so every sampled answer can be reproduced. The answers'
shapes are ``speed.serve.responses``; their text, ``speed.serve.answers``.
"""

from __future__ import annotations

import re
from typing import Annotated, Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, WithJsonSchema, field_validator, model_validator
from pydantic_core import PydanticCustomError

from speed.data.tasks import TASKS, get_task
from speed.engine import ExitKind, Invalidation

PROMPT_SHAPES = "a non-empty string, a list of strings, a list of token ids, or a list of token-id lists"
MAX_N = 16  # choices per prompt
MAX_STOP = 4  # stop strings per request (OpenAI's bound)
MAX_COMPLETION_LOGPROBS = 5  # completions' ``logprobs`` (OpenAI's bound)
MAX_CHAT_LOGPROBS = 20  # chat's ``top_logprobs`` (OpenAI's bound)

# Fields OpenAI defines that this server does not implement: a 400 naming them, not "unknown field".
NOT_SUPPORTED = {
    "best_of": "every choice is returned; ask for n choices instead",
    "suffix": "a seq2seq decoder completes no text after a suffix",
    "logit_bias": "per-token biases are not applied",
}
CHAT_NOT_SUPPORTED = NOT_SUPPORTED | {
    name: "this server answers text only"
    for name in (
        "tools",
        "tool_choice",
        "parallel_tool_calls",
        "functions",
        "function_call",
        "response_format",
        "audio",
        "modalities",
        "prediction",
        "web_search_options",
    )
}

# A character of text: anything but whitespace (Python's ``str.isspace``), spelled out, because JSON Schema's
# patterns are ECMA-262 regexes, whose \s lacks \x1c-\x1f and \x85 and holds \ufeff: with "\S" a fuzzer sends
# "\x85" as text. One regex for the schema and the check (``_has_text``).
TEXT_CHAR = r"[^\t-\r\x1c- \x85\xa0\u1680\u2000-\u200a\u2028\u2029\u202f\u205f\u3000]"
_TEXT = {"type": "string", "pattern": TEXT_CHAR}
_IDS = {"type": "array", "items": {"type": "integer", "minimum": 0}, "minItems": 1}
_TEXTS = {"type": "array", "items": _TEXT, "minItems": 1}
PROMPT_SCHEMA = {
    "anyOf": [
        _TEXT,
        _TEXTS,
        _IDS,
        {"type": "array", "items": _IDS, "minItems": 1},
    ]
}


Stop = Annotated[str, Field(min_length=1)]  # a stop string


def _has_text(value: str) -> bool:
    return re.search(TEXT_CHAR, value) is not None


def _given(field: str, kind: str) -> dict[str, Any]:
    """JSON Schema: ``field`` is present and not null (of JSON type ``kind``)."""
    return {"required": [field], "properties": {field: {"type": kind}}}


def _is_true(field: str) -> dict[str, Any]:
    """JSON Schema: ``field`` is present and true."""
    return {"required": [field], "properties": {field: {"const": True}}}


def _absent(field: str) -> dict[str, Any]:
    """JSON Schema: ``field`` is left out or null."""
    return {"properties": {field: {"type": "null"}}}


# What the models' ``model_validator``s check across fields (``_stream_options_need_stream``,
# ``_echo_without_logprobs``, ``_task_needs_text``, ``_chat_checks``) in JSON Schema, published in each model's
# schema (``allOf``) so that a generated client or a fuzzer knows the rules too, not only the server.
STREAM_OPTIONS_RULE = {"if": _given("stream_options", "object"), "then": _is_true("stream")}
ECHO_RULE = {"if": _is_true("echo"), "then": _absent("logprobs")}
EXIT_FIELDS = ("exit_kind", "exit_threshold", "exit_step")  # Ouro's exit gate's rule (method "exit_gate" only)
EXIT_RULE = {  # the exit gate's fields need its method, named in the request (whatever the deployment's default)
    "if": {"anyOf": [_given(f, k) for f, k in zip(EXIT_FIELDS, ("string", "number", "integer"))]},
    "then": {"required": ["method"], "properties": {"method": {"const": "exit_gate"}}},
}
TASK_RULE = {"if": _given("task", "string"), "then": {"properties": {"prompt": {"anyOf": [_TEXT, _TEXTS]}}}}
TOP_LOGPROBS_RULE = {"if": _given("top_logprobs", "integer"), "then": _is_true("logprobs")}
ONE_MAX_TOKENS_RULE = {"not": {"allOf": [_given("max_tokens", "integer"), _given("max_completion_tokens", "integer")]}}
_TEXT_PART = {"required": ["text"], "properties": {"text": _TEXT}}
_USER_TEXT = {
    "required": ["role", "content"],
    "properties": {"role": {"const": "user"}, "content": {"anyOf": [_TEXT, {"type": "array", "contains": _TEXT_PART}]}},
}
USER_MESSAGE_RULE = {"required": ["messages"], "properties": {"messages": {"contains": _USER_TEXT}}}


def _publish_rules(schema: dict[str, Any], model: type) -> None:
    """pydantic's ``json_schema_extra``: the model's cross-field rules (``rules``) as the schema's ``allOf``."""
    schema["allOf"] = [*schema.get("allOf", []), *model.rules]


class StreamOptions(BaseModel):
    """OpenAI's ``stream_options``."""

    model_config = ConfigDict(extra="forbid", strict=True)

    include_usage: bool = False  # a last chunk with empty choices and the usage


class _Decoding(BaseModel):
    """The decoding fields both surfaces share; fields left out take the deployment's defaults (``ServeSettings``)."""

    model_config = ConfigDict(extra="forbid", strict=True, json_schema_extra=_publish_rules)
    not_supported: ClassVar[dict[str, str]] = NOT_SUPPORTED
    rules: ClassVar[list[dict[str, Any]]] = [STREAM_OPTIONS_RULE, EXIT_RULE]  # the checks below, in JSON Schema

    model: str | None = None  # must name the served model when given
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0, le=2)  # 0 (the default): greedy
    top_p: float | None = Field(default=None, gt=0, le=1)
    top_k: int | None = Field(default=None, ge=-1, lt=2**31)  # vLLM's extension; 0 or -1: off
    seed: int | None = Field(default=None, ge=-(2**63), lt=2**63)
    n: int = Field(default=1, ge=1, le=MAX_N)
    stop: Stop | Annotated[list[Stop], Field(max_length=MAX_STOP)] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: float | None = Field(default=None, ge=-2, le=2)
    frequency_penalty: float | None = Field(default=None, ge=-2, le=2)
    user: str | None = None  # accepted for OpenAI clients, not used
    method: Literal["speed", "sequential", "exit_gate"] | None = None  # this order: the 400 names speed first
    # SPEED's settings (speed.engine.Speculation, its bounds; the upper ones are the model's loops): None, the server's
    launch_loop: int | None = Field(default=None, ge=1)
    invalidation: Invalidation | None = None
    branches: int | None = Field(default=None, ge=0)
    branch_depth: int | None = Field(default=None, ge=1)
    branch_below: float | None = Field(default=None, gt=0, le=1)
    min_confidence: float | None = Field(default=None, ge=0, le=1)
    # Ouro's exit gate (method "exit_gate" only; speed.engine.ExitRule, its defaults when left out): a lossy baseline
    exit_kind: ExitKind | None = None
    exit_threshold: float | None = Field(default=None, gt=0, le=1)
    exit_step: int | None = Field(default=None, ge=0)  # 0-based loop, as Ouro's exit_at_step
    # A speed.data.tasks name whose prefix goes before each text prompt: the schema lists the registry's names.
    task: Literal[tuple(TASKS)] | None = None  # type: ignore[valid-type]

    @field_validator("task", mode="before")
    @classmethod
    def _known_task(cls, value: Any) -> Any:
        if isinstance(value, str):
            get_task(value)  # an unknown name: the registry's error, which lists the names
        return value

    @model_validator(mode="before")
    @classmethod
    def _supported(cls, data: Any) -> Any:
        if isinstance(data, dict):
            for name, why in cls.not_supported.items():
                if name in data:
                    raise PydanticCustomError(
                        "not_supported", "{field}: not supported by this server ({why})", {"field": name, "why": why}
                    )
        return data

    @model_validator(mode="after")
    def _stream_options_need_stream(self) -> _Decoding:
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options applies to streamed answers only: set stream to true or leave it out")
        return self

    @model_validator(mode="after")
    def _exit_fields_need_exit_gate(self) -> _Decoding:
        if self.method != "exit_gate" and self.exit_fields():
            raise ValueError(
                f"exit_kind, exit_threshold and exit_step need method exit_gate in the request, got {self.method}"
            )
        return self

    def exit_fields(self) -> dict[str, Any]:
        """The exit gate's rule fields given, by ``ExitRule``'s names (kind, threshold, step)."""
        given = {"kind": self.exit_kind, "threshold": self.exit_threshold, "step": self.exit_step}
        return {k: v for k, v in given.items() if v is not None}

    def stops(self) -> list[str]:
        """The stop strings as a list (empty: none)."""
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


class CompletionRequest(_Decoding):
    """A ``/v1/completions`` request."""

    rules: ClassVar[list[dict[str, Any]]] = [*_Decoding.rules, ECHO_RULE, TASK_RULE]

    prompt: Annotated[str | list[str] | list[int] | list[list[int]], WithJsonSchema(PROMPT_SCHEMA)]
    logprobs: int | None = Field(default=None, ge=0, le=MAX_COMPLETION_LOGPROBS)  # top alternatives per token
    echo: bool = False  # the prompt's text before each choice's text

    @field_validator("prompt", mode="before")
    @classmethod
    def _prompt_shape(cls, value: Any) -> Any:
        if isinstance(value, str):
            if not _has_text(value):
                raise ValueError("prompt is empty: send the text to complete")
            return value
        if not isinstance(value, list) or not value:
            raise ValueError(f"prompt must be {PROMPT_SHAPES}")
        if all(isinstance(p, str) for p in value):
            empty = next((i for i, p in enumerate(value) if not _has_text(p)), None)
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

    @model_validator(mode="after")
    def _echo_without_logprobs(self) -> CompletionRequest:
        if self.echo and self.logprobs is not None:
            raise ValueError("echo with logprobs is not supported: the prompt's tokens get no log-probabilities")
        return self

    @model_validator(mode="after")
    def _task_needs_text(self) -> CompletionRequest:
        if self.task is not None and not isinstance(self.prompts()[0], str):
            raise ValueError("task applies to text prompts only; token-id prompts are sent as they are")
        return self

    def prompts(self) -> list[str] | list[list[int]]:
        """The prompts as a list: texts or token-id lists."""
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if p and all(isinstance(t, int) for t in p):
            return [p]  # type: ignore[list-item]
        return p  # type: ignore[return-value]

    @property
    def top_logprobs(self) -> int | None:
        return self.logprobs


class TextPart(BaseModel):
    """One part of a message's content list (text only)."""

    model_config = ConfigDict(extra="forbid", strict=True)

    type: Literal["text"]
    text: str


class Message(BaseModel):
    """One chat message."""

    model_config = ConfigDict(extra="forbid", strict=True)

    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextPart]
    name: str | None = None

    def text(self) -> str:
        c = self.content
        return c if isinstance(c, str) else "".join(p.text for p in c)


class ChatRequest(_Decoding):
    """A ``/v1/chat/completions`` request: the last user message is the source text."""

    not_supported: ClassVar[dict[str, str]] = CHAT_NOT_SUPPORTED
    rules: ClassVar[list[dict[str, Any]]] = [
        *_Decoding.rules,
        ONE_MAX_TOKENS_RULE,
        TOP_LOGPROBS_RULE,
        USER_MESSAGE_RULE,
    ]

    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)  # OpenAI's newer name for max_tokens
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_CHAT_LOGPROBS)

    @model_validator(mode="after")
    def _chat_checks(self) -> ChatRequest:
        if self.max_tokens is not None and self.max_completion_tokens is not None:
            raise ValueError("send max_tokens or max_completion_tokens, not both")
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs set to true")
        if not any(m.role == "user" and _has_text(m.text()) for m in self.messages):
            raise ValueError("messages hold no user message with text: the last one is the text to decode")
        return self

    def source(self) -> str:
        """The text to decode (a T5's): the last user message's."""
        return self.messages[self.last_user()].text()

    def last_user(self) -> int:
        """The index of the last user message with text."""
        return max(i for i, m in enumerate(self.messages) if m.role == "user" and _has_text(m.text()))

    @property
    def requested_tokens(self) -> int | None:
        return self.max_tokens if self.max_tokens is not None else self.max_completion_tokens


def _is_id(value: Any) -> bool:
    return type(value) is int and value >= 0


def served_schema(model: type[BaseModel], exit_gate: bool) -> dict[str, Any]:
    """A request model's schema as a replica publishes it for its model: without an exit gate (Ouro's), no
    ``method: "exit_gate"`` and the exit rule's fields null or left out, so that the schema allows nothing the
    served model refuses (as ``task`` lists only the registry's names)."""
    schema = inline_schema(model)
    if exit_gate:
        return schema
    props = schema["properties"]
    for option in props["method"]["anyOf"]:
        if "enum" in option:
            option["enum"] = [m for m in option["enum"] if m != "exit_gate"]
    for name in EXIT_FIELDS:
        props[name] = {"type": "null", "default": None, "title": props[name].get("title", name)}
    schema["allOf"] = [rule for rule in schema["allOf"] if rule != EXIT_RULE]  # nothing left for it to say
    return schema


def inline_schema(model: type[BaseModel]) -> dict[str, Any]:
    """A model's JSON schema with its ``$defs`` inlined, to embed in the OpenAPI document."""
    schema = model.model_json_schema()
    defs = schema.pop("$defs", {})

    def expand(node: Any) -> Any:
        if isinstance(node, dict):
            if "$ref" in node:
                return expand(defs[node["$ref"].rsplit("/", 1)[-1]])
            return {k: expand(v) for k, v in node.items()}
        if isinstance(node, list):
            return [expand(v) for v in node]
        return node

    return expand(schema)


# ----- errors ---------------------------------------------------------------------------------------


class BadRequest(Exception):
    """A request the server cannot decode as asked: answered ``status`` (400) with ``message``."""

    def __init__(self, message: str, param: str | None = None, status: int = 400) -> None:
        super().__init__(message)
        self.message, self.param, self.status = message, param, status


_BRANCHES = {"str", "int", "float", "bool"}
_BRANCH_PREFIXES = ("list[", "literal[", "function-", "constrained-")


def validation_message(
    error: ValidationError | list[dict[str, Any]], model: type[BaseModel] = CompletionRequest
) -> tuple[str, str | None]:
    """One readable message (and the first offending field) from pydantic's or FastAPI's errors."""
    errors = error.errors() if isinstance(error, ValidationError) else error
    parts, first = [], None
    allowed = ", ".join(model.model_fields)
    for e in errors:
        loc = [str(x) for x in e.get("loc", ()) if x != "body"]
        # a union's branch names ("str", "list[int]") are noise next to the message
        loc = [x for x in loc if x not in _BRANCHES and not x.startswith(_BRANCH_PREFIXES)]
        msg = str(e.get("msg", "invalid")).removeprefix("Value error, ")
        if e.get("type") == "not_supported":
            first = first or e["ctx"]["field"]
            parts.append(msg)
            continue
        where = ".".join(loc) or "body"
        first = first or where
        if e.get("type") == "extra_forbidden":
            msg = f"unknown field; the fields are: {allowed}" if len(loc) == 1 else "unknown field"
        elif e.get("type") == "json_invalid":
            msg = "the body is not valid JSON"
        parts.append(f"{where}: {msg}")
    return "; ".join(dict.fromkeys(parts)), first
