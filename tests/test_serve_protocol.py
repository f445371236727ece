"""The OpenAI surface without Ray: request fields (supported, not supported, unknown), stop strings cut across
tokens, logprobs aligned with the text, and the published schemas."""

from __future__ import annotations

from typing import NamedTuple

import pytest

from speed.serve.protocol import ChatRequest, CompletionRequest, inline_schema, validation_message
from speed.serve.responses import CHAT, COMPLETIONS, ChatResponse, Choice, CompletionResponse, TokenInfo
from speed.serve.text import ChoiceText


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
    assert text == {"type": "string", "pattern": r"\S"}
    assert "$ref" not in str(inline_schema(ChatRequest))
