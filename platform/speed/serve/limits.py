"""Parsing a request: what its body must pass before any work is done on it (its size, its JSON, its text, its
prompt count), then its fields (``speed.serve.protocol``'s models).

``read_request`` is the whole of it: the body read, parsed and validated as the route's request model.
``read_body`` stops reading at ``max_bytes`` (a 413, also when the client sent
no Content-Length); ``parse_body`` turns every malformed body into a
``BadRequest`` that says what is wrong (not JSON, not UTF-8, nested too deeply
for the parser, an integer too long to convert, a string that holds a lone
UTF-16 surrogate, which is not text) and caps the prompts of one request,
like OpenAI's prompt array, before a prompt is validated or tokenized. A number
whose value is whole (``5.0``, ``1e3``) is read as an integer, as JSON Schema reads
it (its ``integer`` is any number without a fractional part, which is what
schema-driven clients and fuzzers send) and as vLLM accepts it.
"""

from __future__ import annotations

import json
import re
from decimal import Decimal
from typing import Any

from pydantic import BaseModel, ValidationError
from starlette.requests import Request as StarletteRequest

from speed.serve.protocol import BadRequest, validation_message


async def read_request(http: StarletteRequest, model: type[BaseModel], max_bytes: int, max_prompts: int) -> Any:
    """The request body as a ``model`` (``CompletionRequest``, ``ChatRequest``); anything else is a ``BadRequest``
    saying what to fix. Size, JSON, text and prompt count are checked first, before any work."""
    data = parse_body(await read_body(http, max_bytes), max_prompts)
    try:
        return model.model_validate(data)
    except ValidationError as err:
        message, param = validation_message(err, model)
        raise BadRequest(message, param) from None


_SURROGATE = re.compile("[\ud800-\udfff]")  # only escapes (\\ud800) make these; UTF-8 cannot hold them
_WHOLE_DIGITS = 19  # whole numbers below 10**19 (every int64) become ints; beyond, they stay floats (no huge ints)


async def read_body(http: StarletteRequest, max_bytes: int) -> bytes:
    """The raw body, read no further than ``max_bytes`` (a 413 beyond, before reading it when the size is sent)."""
    too_large = f"the body is larger than this server accepts ({max_bytes} bytes): send fewer or shorter prompts"
    declared = http.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > max_bytes:
        raise BadRequest(too_large, status=413)
    chunks, size = [], 0
    async for chunk in http.stream():
        size += len(chunk)
        if size > max_bytes:
            raise BadRequest(too_large, status=413)
        chunks.append(chunk)
    return b"".join(chunks)


def parse_body(raw: bytes, max_prompts: int) -> dict[str, Any]:
    """The body as a JSON object of clean text holding at most ``max_prompts`` prompts, else a ``BadRequest``."""
    example = 'send a JSON object like {"prompt": "..."}'
    try:
        data = json.loads(raw, parse_float=_number)
    except UnicodeDecodeError as err:
        raise BadRequest(f"the body is not valid UTF-8 ({err}); {example}") from None
    except json.JSONDecodeError as err:
        raise BadRequest(f"the body is not valid JSON ({err}); {example}") from None
    except RecursionError:
        raise BadRequest(f"the body nests arrays or objects too deeply to parse; {example}") from None
    except ValueError as err:  # an integer of more digits than Python converts
        raise BadRequest(f"the body holds a number this server cannot read ({err})") from None
    if not isinstance(data, dict):
        raise BadRequest(f"the body must be a JSON object with a prompt, got {type(data).__name__}")
    where = _lone_surrogate(data)
    if where is not None:
        raise BadRequest(f"{where} holds a lone UTF-16 surrogate (an unpaired \\ud800-\\udfff escape): not text", where)
    prompt = data.get("prompt")
    count = len(prompt) if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)) else 1
    if count > max_prompts:
        raise BadRequest(
            f"prompt holds {count} prompts; this server takes at most {max_prompts} per request: split them",
            "prompt",
        )
    return data


def _number(text: str) -> int | float:
    """A JSON number written with a fraction or an exponent: an int when its value is whole (exactly: ``Decimal``,
    not a float's rounding), else a float."""
    value = Decimal(text)
    if value.is_finite() and value == value.to_integral_value() and value.adjusted() < _WHOLE_DIGITS:
        return int(value)
    return float(text)


def _lone_surrogate(data: Any) -> str | None:
    """The path (``prompt[2]``) of the first string, key or value, holding a lone surrogate; None if there is none."""
    stack: list[tuple[str, Any]] = [("body", data)]
    while stack:  # iterative: the parser already bounded the depth, but not to Python's recursion limit
        where, value = stack.pop()
        if isinstance(value, str):
            if not value.isascii() and _SURROGATE.search(value):
                return where
        elif isinstance(value, dict):
            for key, item in value.items():
                if not key.isascii() and _SURROGATE.search(key):
                    return f"{where} key"
                stack.append((key if where == "body" else f"{where}.{key}", item))
        elif isinstance(value, list):
            stack.extend((f"{where}[{i}]", item) for i, item in enumerate(value))
    return None
