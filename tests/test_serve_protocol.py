"""The OpenAI surface without Ray: request fields (supported, not supported, unknown), stop strings cut across
tokens, logprobs aligned with the text, and the published schemas."""

from __future__ import annotations

import json
import re
from typing import NamedTuple

import pytest

from speed.serve.answers import ChoiceText
from speed.serve.limits import parse_body
from speed.serve.protocol import (
    TEXT_CHAR,
    BadRequest,
    ChatRequest,
    CompletionRequest,
    inline_schema,
    served_schema,
    validation_message,
)
from speed.serve.responses import CHAT, COMPLETIONS, ChatResponse, Choice, CompletionResponse, TokenInfo


def _message(model, body):
    with pytest.raises(Exception) as caught:
        model.model_validate(body)
    return validation_message(caught.value, model)


@pytest.mark.parametrize(
    "body, says, param",
    [
        ({"prompt": "x", "best_of": 2}, "best_of: not supported by this server", "best_of"),
        ({"prompt": "x", "suffix": "y"}, "suffix: not supported by this server", "suffix"),
        ({"prompt": "x", "logit_bias": {"5": 1}}, "logit_bias: not supported by this server", "logit_bias"),
        ({"prompt": "x", "foo": 1}, "foo: unknown field; the fields are: model, max_tokens", "foo"),
        ({"prompt": "x", "temperature": 2.5}, "temperature: Input should be less than or equal to 2", "temperature"),
        ({"prompt": "x", "top_p": 0}, "top_p: Input should be greater than 0", "top_p"),
        ({"prompt": "x", "top_k": 2**40}, "top_k: Input should be less than 2147483648", "top_k"),
        ({"prompt": "x", "n": 17}, "n: Input should be less than or equal to 16", "n"),
        ({"prompt": "x", "stop": ["a", "b", "c", "d", "e"]}, "stop", "stop"),
        ({"prompt": "x", "stop": ""}, "stop", "stop"),
        ({"prompt": "x", "logprobs": 6}, "logprobs: Input should be less than or equal to 5", "logprobs"),
        ({"prompt": "x", "stream_options": {"include_usage": True}}, "stream_options applies to streamed", "body"),
        ({"prompt": "x", "stream": True, "stream_options": {"x": 1}}, "stream_options.x: unknown field", None),
        ({"prompt": "x", "echo": True, "logprobs": 1}, "echo with logprobs is not supported", "body"),
        ({"prompt": "\x1c\t "}, "prompt is empty", "prompt"),
    ],
)
def test_completion_fields(body, says, param):
    message, first = _message(CompletionRequest, body)
    assert says in message
    if param is not None:
        assert first == param


def test_completion_fields_accepted():
    r = CompletionRequest.model_validate(
        {"prompt": "x", "temperature": 1, "top_p": 0.9, "top_k": -1, "seed": -5, "n": 3, "stop": ["a", "bc"]}
        | {"logprobs": 2, "stream": True, "stream_options": {"include_usage": True}, "presence_penalty": 0.5}
    )
    assert (r.stops(), r.include_usage, r.top_logprobs, r.temperature) == (["a", "bc"], True, 2, 1.0)
    assert CompletionRequest.model_validate({"prompt": "x", "stop": "\n"}).stops() == ["\n"]


@pytest.mark.parametrize(
    "body, says",
    [
        ({"messages": [{"role": "user", "content": "hi"}], "tools": []}, "tools: not supported by this server"),
        ({"messages": []}, "messages: List should have at least 1 item"),
        ({"messages": [{"role": "system", "content": "be brief"}]}, "no user message with text"),
        ({"messages": [{"role": "user", "content": "hi"}], "top_logprobs": 2}, "top_logprobs needs logprobs"),
        ({"messages": [{"role": "tool", "content": "x"}]}, "messages.0.role"),
        ({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "max_completion_tokens": 3}, "not both"),
    ],
)
def test_chat_fields(body, says):
    assert says in _message(ChatRequest, body)[0]


def test_chat_source_is_the_last_user_message():
    messages = [
        {"role": "system", "content": "Translate."},
        {"role": "user", "content": "A first text."},
        {"role": "assistant", "content": "Ein erster Text."},
        {"role": "user", "content": [{"type": "text", "text": "A dog "}, {"type": "text", "text": "runs."}]},
        {"role": "user", "content": "  "},
    ]
    r = ChatRequest.model_validate({"messages": messages, "max_completion_tokens": 5})
    assert (r.source(), r.requested_tokens) == ("A dog runs.", 5)


# ----- stop strings and logprobs ----------------------------------------------------------------


class _Logprob(NamedTuple):
    token: int
    logprob: float
    top: list


PIECES = {1: "", 10: "Hel", 11: "lo", 12: " wo", 13: "rld", 14: "!", 15: " END", 16: " more"}


def _decode(ids):
    out = []
    for t in ids:
        if t == 1:
            break
        out.append(PIECES[t])
    return "".join(out)


def _run(tokens, stop, logprobs=False, prefix=""):
    text = ChoiceText(_decode, PIECES.get, stop, logprobs, prefix)
    deltas = []
    for t in tokens:
        d = text.push(t, _Logprob(t, -0.5, [(t, -0.5), (16, -2.0)]) if logprobs else None)
        deltas.append(d)
        if d.stopped:
            break
    if not text.stopped:
        deltas.append(text.finish())
    return text, deltas


@pytest.mark.parametrize(
    "stop, text, consumed",
    [
        (["rld"], "Hello wo", 4),  # the stop string is a whole token
        (["lo w"], "Hel", 3),  # across two tokens: held back after "lo", cut when " wo" arrives
        (["o wor"], "Hell", 4),
        (["xyz"], "Hello world! END more", 7),  # never appears: all of it, at the end
        (["!", " wo"], "Hello", 3),  # the earliest of several
        ([" ENDS"], "Hello world! END more", 7),  # a prefix held back, then released
    ],
)
def test_stop_strings_are_cut_across_tokens(stop, text, consumed):
    got, deltas = _run([10, 11, 12, 13, 14, 15, 16], stop)
    assert got.text == text == "".join(d.text for d in deltas)
    assert got.consumed == consumed and got.stopped == (text != "Hello world! END more")


def test_text_that_could_start_a_stop_string_waits():
    got, deltas = _run([10, 11, 12, 13], ["lo x"])
    assert [d.text for d in deltas] == ["He", "l", "lo wo", "rld", ""]  # "l", then "lo", wait for the next piece


def test_logprobs_go_out_with_their_text():
    got, deltas = _run([10, 11, 12, 13, 1], ["lo x"], logprobs=True)
    assert [d.text for d in deltas] == ["He", "l", "lo wo", "rld", "", ""]
    assert [[t.piece for t in d.tokens] for d in deltas] == [["Hel"], ["lo"], [" wo"], ["rld"], [], [""]]
    sent = [t for d in deltas for t in d.tokens]
    assert [t.offset for t in sent] == [0, 3, 5, 8, 11]
    assert sent[0].top == [("Hel", -0.5), (" more", -2.0)]


def test_echo_prefix_comes_first():
    got, deltas = _run([10, 11, 1], [], prefix="Say: ")
    assert got.text == "Say: Hello" and "".join(d.text for d in deltas) == "Hello"


def test_answer_shapes_match_the_published_schemas():
    tokens = [TokenInfo("Hel", -0.1, [("Hel", -0.1), ("lo", -3.0)], 0)]
    choice = Choice(0, 0, "Hel", "length", 4, 1, {"tokens": 1}, tokens)
    CompletionResponse.model_validate(COMPLETIONS.body("cmpl-1", 0, "m", [choice], {}))
    chat = CHAT.body("chatcmpl-1", 0, "m", [choice], {})
    ChatResponse.model_validate(chat)
    assert chat["choices"][0]["logprobs"]["content"][0]["top_logprobs"][1] == {
        "token": "lo",
        "logprob": -3.0,
        "bytes": [108, 111],
    }
    body = COMPLETIONS.body("cmpl-1", 0, "m", [choice, Choice(1, 0, "x", "stop", 4, 2, {}, None)], {})
    assert body["usage"] == {"prompt_tokens": 4, "completion_tokens": 3, "total_tokens": 7}  # one prompt, 2 choices


def test_schemas_are_self_contained_and_refuse_empty_prompts():
    schema = inline_schema(CompletionRequest)
    assert "$defs" not in str(schema) and "$ref" not in str(schema)
    assert schema["additionalProperties"] is False and "best_of" not in schema["properties"]
    text = schema["properties"]["prompt"]["anyOf"][0]
    assert text == {"type": "string", "pattern": TEXT_CHAR}
    assert "$ref" not in str(inline_schema(ChatRequest))


def test_the_published_text_pattern_is_python_s_non_whitespace():
    """The schema's pattern (an ECMA-262 regex to its readers) names Python's whitespace one by one, so that a
    fuzzer's idea of text and the server's agree (with "\\S", ECMA's, "\\x85" was text to one, not the other)."""
    every = map(chr, range(0x110000))
    assert [c for c in every if (re.fullmatch(TEXT_CHAR, c) is None) != c.isspace()] == []
    assert re.fullmatch(TEXT_CHAR, "\ufeff") and not re.fullmatch(TEXT_CHAR, "\x85")


_USER = {"role": "user", "content": "hi"}
_STREAM_USAGE = {"stream_options": {"include_usage": True}}
_PART = {"type": "text", "text": "a"}


@pytest.mark.parametrize(
    "model, body",
    [
        (CompletionRequest, {"prompt": "x", **_STREAM_USAGE}),  # stream left out: false
        (CompletionRequest, {"prompt": "x", "stream": False, **_STREAM_USAGE}),
        (CompletionRequest, {"prompt": "x", "stream": True, **_STREAM_USAGE}),
        (CompletionRequest, {"prompt": "x", "stream": False, "stream_options": None}),
        (CompletionRequest, {"prompt": "x", "echo": True, "logprobs": 1}),
        (CompletionRequest, {"prompt": "x", "echo": True, "logprobs": None}),
        (CompletionRequest, {"prompt": "x", "echo": False, "logprobs": 1}),
        (ChatRequest, {"messages": [_USER], "stream": False, **_STREAM_USAGE}),
        (ChatRequest, {"messages": [_USER], "stream": True, **_STREAM_USAGE}),
        (ChatRequest, {"messages": [_USER], "max_tokens": 3, "max_completion_tokens": 4}),
        (ChatRequest, {"messages": [_USER], "max_tokens": 3, "max_completion_tokens": None}),
        (ChatRequest, {"messages": [_USER], "top_logprobs": 2}),
        (ChatRequest, {"messages": [_USER], "top_logprobs": 2, "logprobs": False}),
        (ChatRequest, {"messages": [_USER], "top_logprobs": 2, "logprobs": True}),
        (ChatRequest, {"messages": [_USER], "top_logprobs": None}),
        (ChatRequest, {"messages": [{"role": "system", "content": "hi"}]}),
        (ChatRequest, {"messages": [{"role": "user", "content": " \t"}, {"role": "assistant", "content": "a"}]}),
        (ChatRequest, {"messages": [{"role": "user", "content": [{"type": "text", "text": " "}]}]}),
        (ChatRequest, {"messages": [{"role": "user", "content": [{"type": "text", "text": " "}, _PART]}]}),
    ],
)
def test_published_schema_states_every_cross_field_rule(model, body):
    """What the server refuses across fields (``stream_options`` without ``stream: true``, ``echo`` with
    ``logprobs``, ...) the published schema refuses too, and what it accepts the schema allows (OpenAI refuses
    ``stream_options`` without streaming as well), so a generated client or a fuzzer sees the rule."""
    import jsonschema

    try:
        model.model_validate(body)
        accepted = True
    except ValueError:  # pydantic's ValidationError
        accepted = False
    schema = inline_schema(model)
    jsonschema.Draft202012Validator.check_schema(schema)
    assert jsonschema.Draft202012Validator(schema).is_valid(body) == accepted


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_every_body_schemathesis_generates_from_the_published_schema_is_accepted(path):
    """Schemathesis's positive cases from ``/openapi.json`` as served, sent as JSON: each passes the server's
    parsing and validation (what is left for its "schema-valid request rejected" are the limits that depend on
    the model and the deployment: vocabulary, lengths, prompts per request)."""
    import jsonschema
    import schemathesis
    from hypothesis import HealthCheck, Phase, given, settings
    from schemathesis import GenerationMode

    from speed.serve.app import api

    schema = schemathesis.openapi.from_dict(api.openapi())
    model = ChatRequest if "chat" in path else CompletionRequest
    body = api.openapi()["paths"][path]["post"]["requestBody"]["content"]["application/json"]["schema"]
    published = jsonschema.Draft202012Validator(body)
    refused = []
    fixed = {"deadline": None, "database": None, "derandomize": True, "suppress_health_check": list(HealthCheck)}

    @settings(max_examples=150, phases=[Phase.generate], **fixed)
    @given(case=schema[path]["POST"].as_strategy(GenerationMode.POSITIVE))
    def generated(case):
        if not published.is_valid(case.body):
            return  # the generator's own slip (an int64 bound rounded through a float), not the server's
        try:
            model.model_validate(parse_body(json.dumps(case.body).encode(), max_prompts=10**6))
        except (ValueError, BadRequest) as err:
            refused.append((case.body, err.message if isinstance(err, BadRequest) else validation_message(err, model)))

    generated()
    assert not refused, refused[:3]


def test_whole_numbers_are_integers_as_json_schema_reads_them():
    """JSON Schema's ``integer`` is any number without a fractional part, so schema-driven clients send ``5.0``:
    the server reads it as 5, exactly (no float rounding), and keeps a fraction a float, which stays a 400."""
    raw = b'{"prompt": [3.0, 1e1, 7], "max_tokens": 5.0, "seed": 9223372036854775807.0, "temperature": 1.0}'
    data = parse_body(raw, max_prompts=8)
    assert data == {"prompt": [3, 10, 7], "max_tokens": 5, "seed": 2**63 - 1, "temperature": 1}
    assert [type(v) for v in data["prompt"]] == [int, int, int] and type(data["max_tokens"]) is int
    request = CompletionRequest.model_validate(data)
    assert (request.prompts(), request.max_tokens, request.temperature) == ([[3, 10, 7]], 5, 1.0)
    assert parse_body(b'{"top_p": 0.5, "big": 1e19, "huge": 1e400, "zero": -0.0}', 8) == {
        "top_p": 0.5,
        "big": 1e19,  # beyond every int64: left a float (no 400-digit ints from 1e400)
        "huge": float("inf"),
        "zero": 0,
    }
    message, _ = _message(CompletionRequest, parse_body(b'{"prompt": "x", "max_tokens": 5.5}', 8))
    assert "max_tokens: Input should be a valid integer" in message


@pytest.mark.parametrize("exit_gate", [True, False])
def test_the_published_schema_describes_the_served_models_exit_gate(exit_gate):
    """A replica publishes ``method: "exit_gate"`` and the exit rule's fields only for a model with an exit gate
    (Ouro's); without one they are refused by the schema, as the server refuses them (schemathesis's ST202)."""
    import jsonschema

    from speed.serve import app

    app.api.state.exit_gate = exit_gate  # as a replica sets it for its model
    try:
        for path, model in app.ROUTES.items():
            body = app.api.openapi()["paths"][path]["post"]["requestBody"]["content"]["application/json"]["schema"]
            assert body == served_schema(model, exit_gate)
            jsonschema.Draft202012Validator.check_schema(body)
            valid = jsonschema.Draft202012Validator(body).is_valid
            chat = {"messages": [{"role": "user", "content": "A"}]}
            text = {"prompt": "A dog."} if model is CompletionRequest else chat
            assert valid({**text, "method": "speed"}) and valid({**text, "exit_kind": None})
            assert valid({**text, "method": "exit_gate"}) == exit_gate
            assert valid({**text, "method": "exit_gate", "exit_threshold": 0.5}) == exit_gate
            assert not valid({**text, "method": "speed", "exit_threshold": 0.5})  # the server's 400 either way
    finally:
        del app.api.state.exit_gate  # unset: every method, as before a replica
    assert served_schema(CompletionRequest, True) == inline_schema(CompletionRequest)
