"""The Serve application for real: deployed on the session's local Ray, answering HTTP on a free loopback port.

One tiny 2x3 model (its EOS logit pinned to 0, so answers run to max_tokens and
disconnects find work to cancel) behind one replica. Answers must equal offline
sequential decoding of the same input; hostile bodies are 4xx; a replica killed
hard is replaced and loses no answered row; after the app is deleted, the Parquet
statistics hold exactly one finished row per answered prompt. The tests share
one deployment and each passes alone and in any order: they record what they
answered and cancelled, and the one that deletes the application deploys it again.
The ``jobs/serve.py`` tests start the real job (its own Ray), SIGTERM it and count
the rows on disk.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import time
from collections import Counter
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

import pyarrow.compute as pc
import pyarrow.parquet as pq
import pytest
import requests
import torch
from serve_helpers import shutdown_serve

from speed import DecodeOptions, SpeedT5, generate, preset
from speed.data import get_task
from speed.loadtest.loadgen import LoadConfig, run_load
from speed.models.checkpoint import save_model
from speed.paths import repo_root
from speed.serve.readers import read_requests, read_traces
from speed.tokenizer import EOS_ID, Tokenizer

pytestmark = pytest.mark.ray

APP = "speed-test"
SETTINGS = {"max_active": 4, "max_source_len": 48, "max_target_len": 400, "row_budget": 8, "max_tokens": 12}
SETTINGS |= {"flush_rows": 3, "flush_s": 60}  # the size bound writes during the tests, __del__ the rest
SETTINGS |= {"max_prompts": 8, "max_body_bytes": 16384}
SETTINGS |= {"allow_branches": True}  # requests ask for runner-up branches (a CPU deploys without them by default)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _tiny_checkpoint(tiny_tokenizer, directory: Path) -> tuple[SpeedT5, Tokenizer]:
    """The served model (EOS never the argmax: answers run to max_tokens), saved with its tokenizer."""
    tokenizer = Tokenizer.load(tiny_tokenizer)
    torch.manual_seed(0)
    model = SpeedT5(preset("tiny", pattern="2x3", vocab_size=tokenizer.vocab_size)).eval()
    with torch.no_grad():
        model.lm_head.weight[EOS_ID] = 0
    save_model(directory, model, tiny_tokenizer)
    return model, tokenizer


@dataclass
class Deployment:
    """The module's one deployment: where it answers and what it serves, and the ledger of what the tests had it
    answer, which the statistics on disk must hold exactly (each test adds its own answers through ``answer``)."""

    url: str
    model: SpeedT5
    tokenizer: Tokenizer
    stats: str  # its stats_path
    redeploy: Callable[[dict[str, Any]], str]  # deploy it again with these settings; returns the URL
    answered: list[tuple[str, int]] = field(default_factory=list)  # (request id, choices) answered in full
    cancelled: int = 0  # disconnected streams: one cancelled row each

    def answer(self, request_id: str, choices: int = 1) -> None:
        """Note an answered request: its choices' finished rows must be in the statistics."""
        self.answered.append((request_id, choices))


@pytest.fixture(scope="module")
def server(ray_session, tiny_tokenizer, tmp_path_factory) -> Deployment:
    """The deployment every test of the module talks to (one replica), removed at the end."""
    from ray import serve

    from speed.serve.app import start_app
    from speed.serve.settings import AppConfig

    root = tmp_path_factory.mktemp("serve")
    model, tokenizer = _tiny_checkpoint(tiny_tokenizer, root / "ckpt")
    options = {"stats_path": str(root / "stats"), "model_name": "tiny", "device": "cpu", "name": APP}
    options |= {"port": _free_port(), "num_cpus": 1, "max_ongoing_requests": 8, "max_queued_requests": 8}
    url = start_app(AppConfig(str(root / "ckpt"), settings=SETTINGS, **options))
    yield Deployment(
        url,
        model,
        tokenizer,
        options["stats_path"],
        lambda settings: start_app(AppConfig(str(root / "ckpt"), settings=settings, **options)),
    )
    if APP in serve.status().applications:
        serve.delete(APP)
    shutdown_serve()


def _complete(server: Deployment, body, answered=True):
    r = requests.post(server.url + "/v1/completions", json=body, timeout=120)
    if answered and r.status_code == 200:
        server.answer(r.json()["id"], len(r.json()["choices"]))
    return r


def _offline(server, prompt, max_tokens, task=None):
    """Text and token count of sequential greedy decoding of the same input, alone."""
    tok = server.tokenizer
    ids = prompt if isinstance(prompt, list) else tok.encode((get_task(task).prefix if task else "") + prompt)
    tokens = generate(
        server.model, torch.tensor([ids]), options=DecodeOptions(method="sequential", max_new_tokens=max_tokens)
    ).tokens[0]
    return tok.decode(tokens), len(tokens)


def test_health_and_models(server):
    health = requests.get(server.url + "/healthz", timeout=30).json()
    assert health["status"] == "ok" and health["replica"].startswith(APP)
    (card,) = requests.get(server.url + "/v1/models", timeout=30).json()["data"]
    assert (card["id"], card["pattern"], card["n_loops"], card["max_source_len"]) == ("tiny", "2x3", 3, 48)
    assert card["allow_branches"] is True  # SETTINGS allows them


def test_concurrent_answers_equal_offline_decoding(server):
    bodies = [
        {"prompt": "A dog runs on the grass.", "max_tokens": 10},
        {"prompt": "Two men play chess in a park.", "max_tokens": 14, "method": "sequential"},
        {"prompt": "A child is eating.", "max_tokens": 9, "task": "translate_en_de", "launch_loop": 2},
        {"prompt": "People walk down a busy street.", "invalidation": "final"},
        {"prompt": [37, 52, 9, 101, 1], "max_tokens": 11},
        {"prompt": "The sun sets over the sea.", "max_tokens": 16, "launch_loop": 3},
    ]
    with ThreadPoolExecutor(len(bodies)) as pool:
        answers = list(pool.map(lambda b: _complete(server, b), bodies))
    for body, answer in zip(bodies, answers):
        assert answer.status_code == 200, answer.text
        a = answer.json()
        text, n = _offline(server, body["prompt"], body.get("max_tokens", SETTINGS["max_tokens"]), body.get("task"))
        (choice,) = a["choices"]
        assert (choice["text"], a["usage"]["completion_tokens"]) == (text, n)
        assert choice["finish_reason"] == "length" and a["object"] == "text_completion" and a["model"] == "tiny"
        stats = a["speed"]["choices"][0]
        assert stats["tokens"] == n and len(stats["flip_rate"]) == 3 and stats["latency_ms"] > 0
        assert a["speed"]["method"] == body.get("method", "speed")
        spec = stats["spec_decode"]
        assert spec["num_accepted_tokens"] == sum(spec["num_accepted_tokens_per_pos"]) <= spec["num_draft_tokens"]
        never = body.get("method") == "sequential" or body.get("launch_loop") == 3  # launch after the last loop
        assert (spec["num_drafts"] == 0) == never


def test_branches_and_confidence_gate_change_no_token_and_are_recorded(server):
    """SPEED's levers through HTTP: runner-up branches and the confidence gate give the sequential tokens; each
    answer's ``speed`` object and statistics row hold the values used (null for sequential decoding)."""
    prompt = "A woman rides a bicycle down the hill."
    bodies = [
        {"prompt": prompt, "max_tokens": 14},
        {"prompt": prompt, "max_tokens": 14, "branches": 3, "branch_depth": 2},
        {"prompt": prompt, "max_tokens": 14, "branches": 2, "branch_below": 0.9, "min_confidence": 0.3},
        {"prompt": prompt, "max_tokens": 14, "method": "sequential", "branches": 3},
    ]
    answers = [_complete(server, b) for b in bodies]
    chat = {"messages": [{"role": "user", "content": prompt}], "max_tokens": 14, "branches": 3, "branch_depth": 3}
    answer = requests.post(server.url + "/v1/chat/completions", json=chat, timeout=120)
    assert answer.status_code == 200, answer.text
    server.answer(answer.json()["id"], 1)
    text, _ = _offline(server, prompt, 14)
    assert [a.json()["choices"][0]["text"] for a in answers] == [text] * 4
    assert answer.json()["choices"][0]["message"]["content"] == text
    default = {"branches": 0, "branch_depth": 1, "branch_below": 1.0, "min_confidence": 0.0}
    expected = [default, {**default, "branches": 3, "branch_depth": 2}]
    expected += [{**default, "branches": 2, "branch_below": 0.9, "min_confidence": 0.3}, dict.fromkeys(default)]
    expected.append({**default, "branches": 3, "branch_depth": 3})
    ids = [a.json()["id"] for a in [*answers, answer]]
    for a, want in zip([*answers, answer], expected):
        assert {k: a.json()["speed"][k] for k in default} == want
    rows = {r["request_id"]: r for r in read_requests(server.stats).to_pylist()}
    assert [{k: rows[i][k] for k in default} for i in ids] == expected
    spec = requests.get(server.url + "/openapi.json", timeout=30).json()
    for path in ("/v1/completions", "/v1/chat/completions"):
        body = spec["paths"][path]["post"]["requestBody"]["content"]["application/json"]["schema"]
        assert {"minimum": 0, "type": "integer"} in body["properties"]["branches"]["anyOf"]
        assert {"maximum": 1.0, "minimum": 0.0, "type": "number"} in body["properties"]["min_confidence"]["anyOf"]
        methods = next(o["enum"] for o in body["properties"]["method"]["anyOf"] if "enum" in o)
        assert methods == ["speed", "sequential"]  # the served T5 has no exit gate: the schema offers none


def test_prompt_list_answers_each_prompt(server):
    prompts = ["A red car.", "A woman sings on a stage.", "Kids jump."]
    a = _complete(server, {"prompt": prompts, "max_tokens": 7}).json()
    assert [c["index"] for c in a["choices"]] == [0, 1, 2]
    assert [c["text"] for c in a["choices"]] == [_offline(server, p, 7)[0] for p in prompts]
    assert a["usage"]["completion_tokens"] == 21 and len(a["speed"]["choices"]) == 3


def test_streaming_sends_deltas_then_usage_then_done(server):
    body = {"prompt": ["A man reads a book.", "Birds fly."], "max_tokens": 9, "stream": True}
    body["stream_options"] = {"include_usage": True}
    with requests.post(server.url + "/v1/completions", json=body, stream=True, timeout=120) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        events = [line.decode()[len("data: ") :] for line in r.iter_lines() if line]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    final = chunks[-1]
    assert final["choices"] == [] and final["usage"]["completion_tokens"] == 18
    assert all(c["usage"] is None for c in chunks[:-1])  # OpenAI: null until the last chunk
    server.answer(final["id"], 2)
    for index, prompt in enumerate(body["prompt"]):
        mine = [c["choices"][0] for c in chunks[:-1] if c["choices"][0]["index"] == index]
        assert "".join(c["text"] for c in mine) == _offline(server, prompt, 9)[0]
        assert [c["finish_reason"] for c in mine][-1] == "length" and len(mine) >= 2  # streamed, not in one piece


# ----- the official openai client, every field streamed and not ----------------------------------------


@pytest.fixture(scope="module")
def client(server):
    import openai

    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)


def _sampled_offline(server, prompt, max_tokens, **sampling):
    """Tokens of the same choice decoded alone, sequentially, with the same sampling (choice seed included)."""
    from speed.engine import Engine, EngineConfig, Request
    from speed.engine.sampling import Sampling

    ids = server.tokenizer.encode(prompt)
    engine = Engine(server.model, EngineConfig(max_active=1, max_source_len=48, max_target_len=64))
    engine.add(Request(ids, max_tokens, "sequential", sampling=Sampling(**sampling)))
    while True:
        step = engine.step()
        if step.finished:
            return server.tokenizer.decode(step.finished[0].tokens)


class Answers(NamedTuple):
    """An answer's choices as the ``openai`` client returned them, whole or streamed."""

    texts: dict[int, str]  # per choice index
    reasons: dict[int, str]  # finish reasons
    last: Any  # the response, or the stream's last chunk (its usage, when the request asked for it)
    logprobs: dict[int, list]  # logprob entries: a completion's tokens, a chat message's content entries


def _answers(server, response) -> Answers:
    """The choices of a completion or chat completion, or of a stream of their chunks; the answer's id and choice
    count go to the deployment's ledger (``Deployment.answer``) (whose records the statistics tests look for)."""
    texts, reasons, logprobs, last = {}, {}, {}, None
    for chunk in [response] if hasattr(response, "choices") else response:
        last = chunk
        for c in chunk.choices:
            message = getattr(c, "delta", None) or getattr(c, "message", None)  # a chat's; None: a completion's
            piece = message.content if message is not None else c.text
            texts[c.index] = texts.get(c.index, "") + (piece or "")
            if c.finish_reason:
                reasons[c.index] = c.finish_reason
            if c.logprobs is not None:
                entries = c.logprobs.content if message is not None else c.logprobs.tokens
                logprobs.setdefault(c.index, []).extend(entries or [])
    server.answer(last.id, len(texts))
    return Answers(texts, reasons, last, logprobs)


@pytest.mark.parametrize("stream", [False, True])
def test_openai_client_sampling_fields_n_and_seed(server, client, stream):
    from speed.engine.sampling import choice_seed

    prompt = "A woman rides a horse."
    args = {"model": "tiny", "prompt": prompt, "max_tokens": 8, "temperature": 0.8, "top_p": 0.9, "seed": 11, "n": 3}
    args |= {"presence_penalty": 0.3, "frequency_penalty": 0.2, "extra_body": {"top_k": 40}}
    usage = {"stream_options": {"include_usage": True}} if stream else {}
    texts, reasons, last, _ = _answers(server, client.completions.create(**args, stream=stream, **usage))
    prompt_tokens = len(server.tokenizer.encode(prompt))
    assert (last.usage.completion_tokens, last.usage.prompt_tokens) == (24, prompt_tokens)
    sampling = {"temperature": 0.8, "top_p": 0.9, "top_k": 40, "presence_penalty": 0.3, "frequency_penalty": 0.2}
    for i in range(3):
        assert texts[i] == _sampled_offline(server, prompt, 8, seed=choice_seed(11, i), **sampling)
        assert reasons[i] == "length"


@pytest.mark.parametrize("stream", [False, True])
def test_openai_client_stop_strings_end_the_choice(server, client, stream):
    prompt = "Three dogs play in the snow."
    full, _ = _offline(server, prompt, 12)
    stop = full[len(full) // 2 : len(full) // 2 + 3]
    assert stop.strip(), full
    expected = full[: full.find(stop)]
    args = {"model": "tiny", "prompt": prompt, "max_tokens": 12, "stop": [stop, "\u2603never"]}
    texts, reasons, last, _ = _answers(server, client.completions.create(**args, stream=stream))
    assert (texts[0], reasons[0]) == (expected, "stop")
    if not stream:
        assert last.usage.completion_tokens < 12


@pytest.mark.parametrize("stream", [False, True])
def test_openai_client_logprobs_and_echo(server, client, stream):
    prompt = "An old man sits on a bench."
    full, n = _offline(server, prompt, 7)
    args = {"model": "tiny", "prompt": prompt, "max_tokens": 7, "logprobs": 2}
    texts, _, last, entries = _answers(server, client.completions.create(**args, stream=stream))
    assert texts[0] == full and len(entries[0]) == n
    if not stream:
        lp = last.choices[0].logprobs
        assert len(lp.token_logprobs) == n and all(v <= 0 for v in lp.token_logprobs)
        assert all(len(top) <= 2 and max(top.values()) <= 0 for top in lp.top_logprobs)
        assert lp.text_offset == sorted(lp.text_offset) and lp.text_offset[0] == 0
    echoed = client.completions.create(model="tiny", prompt=prompt, max_tokens=7, echo=True, stream=stream)
    assert _answers(server, echoed).texts[0] == prompt + full


@pytest.mark.parametrize("stream", [False, True])
def test_openai_client_chat_translates_the_last_user_message(server, client, stream):
    messages = [
        {"role": "system", "content": "You translate."},
        {"role": "user", "content": "Ignored earlier text."},
        {"role": "user", "content": "A child is eating."},
    ]
    full, n = _offline(server, "A child is eating.", 9, task="translate_en_de")
    args = {"model": "tiny", "messages": messages, "max_tokens": 9, "extra_body": {"task": "translate_en_de"}}
    usage = {"stream_options": {"include_usage": True}} if stream else {}
    answer = client.chat.completions.create(**args, stream=stream, logprobs=True, top_logprobs=2, **usage)
    texts, reasons, last, entries = _answers(server, answer)
    assert (texts[0], reasons[0], last.usage.completion_tokens) == (full, "length", n)
    assert len(entries[0]) == n and all(len(e.top_logprobs) <= 2 for e in entries[0])
    if not stream:
        assert answer.object == "chat.completion" and answer.choices[0].message.role == "assistant"


def test_openai_client_gets_a_400_for_what_is_not_supported(server, client):
    import openai

    with pytest.raises(openai.BadRequestError, match="best_of: not supported by this server"):
        client.completions.create(model="tiny", prompt="x", best_of=2)
    with pytest.raises(openai.BadRequestError, match="tools: not supported by this server"):
        client.chat.completions.create(
            model="tiny",
            messages=[{"role": "user", "content": "x"}],
            tools=[{"type": "function", "function": {"name": "f", "parameters": {}}}],
        )


def test_unseeded_sampling_returns_its_seed_and_repeats_with_it(server, client):
    first = client.completions.create(model="tiny", prompt="A bird sings.", max_tokens=6, temperature=1.0)
    seed = first.model_extra["speed"]["seed"]
    again = client.completions.create(model="tiny", prompt="A bird sings.", max_tokens=6, temperature=1.0, seed=seed)
    server.answer(first.id)
    server.answer(again.id)
    assert isinstance(seed, int) and again.choices[0].text == first.choices[0].text


@pytest.mark.parametrize(
    "body, status, says",
    [
        ({"prompt": ""}, 400, "prompt is empty"),
        ({"prompt": "x", "best_of": 2}, 400, "best_of: not supported by this server"),
        ({"prompt": "x", "top_p": 0}, 400, "top_p: Input should be greater than 0"),
        ({"prompt": "x", "foo": 1}, 400, "foo: unknown field"),
        ({"prompt": 12}, 400, "prompt must be"),
        ({"prompt": "x", "max_tokens": 401}, 400, "max_tokens must be at most 400"),
        ({"prompt": ["x", "word " * 80]}, 400, "prompt[1]: prompt has"),
        ({"prompt": "x", "max_tokens": 0}, 400, "max_tokens"),
        ({"prompt": "word " * 80}, 400, "tokens, more than 48 (the engine"),
        ({"prompt": "x", "launch_loop": 4}, 400, "launch_loop must be in 1..3"),
        ({"prompt": "x", "branches": 4}, 400, "branches must be in 0..3 (the model's loops), got 4"),
        ({"prompt": "x", "branch_depth": 4}, 400, "branch_depth must be in 1..3 (the model's loops), got 4"),
        ({"prompt": "x", "branches": -1}, 400, "branches: Input should be greater than or equal to 0"),
        ({"prompt": "x", "min_confidence": 1.5}, 400, "min_confidence: Input should be less than or equal to 1"),
        ({"prompt": "x", "branch_below": 0}, 400, "branch_below: Input should be greater than 0"),
        ({"prompt": "x", "task": "nope"}, 400, "unknown task 'nope'"),
        ({"prompt": [5, 99999]}, 400, "prompt must be token ids in [0, 400), got 99999"),
        ({"prompt": [5, 99999], "echo": True}, 400, "token id 99999 outside the vocabulary"),
        ({"prompt": [5, 6], "task": "translate_en_de"}, 400, "task applies to text prompts only"),
        ({"prompt": "x", "model": "gpt-4"}, 404, "this server serves 'tiny'"),
        ("not json {", 400, "not valid JSON"),
        (b'{"prompt": ' + b"[" * 5000 + b"]" * 5000 + b"}", 400, "nests arrays or objects too deeply"),
        (b'{"prompt": "lone \\ud800 surrogate"}', 400, "prompt holds a lone UTF-16 surrogate"),
        (b'{"prompt": "x", "max_tokens": ' + b"7" * 5000 + b"}", 400, "a number this server cannot read"),
        ({"prompt": ["A dog."] * 9}, 400, "prompt holds 9 prompts; this server takes at most 8"),
        ({"prompt": ["A dog."] * 10_000}, 413, "larger than this server accepts (16384 bytes)"),
        ({"prompt": "word " * 20_000}, 413, "larger than this server accepts"),
        (iter([b'{"prompt": "', b"word " * 5000, b'"}']), 413, "larger than this server accepts"),  # chunked
    ],
)
def test_bad_requests_are_4xx_saying_what_to_fix(server, body, status, says):
    url = server.url + "/v1/completions"
    if not isinstance(body, dict):  # raw bytes; an iterator is sent chunked, without a Content-Length
        r = requests.post(url, data=body, headers={"content-type": "application/json"}, timeout=60)
    else:
        r = requests.post(url, json=body, timeout=60)
    assert r.status_code == status
    assert says in r.json()["error"]["message"]


def _answered(response):
    """(id, choices) of a 200 answer, whole or streamed, for the statistics check at the end; a stream counts
    only when read to its end: every choice's last chunk, then [DONE]."""
    kind = {k.lower(): v for k, v in response.headers.items()}.get("content-type", "")
    if "text/event-stream" in str(kind):
        events = [line[len("data: ") :] for line in response.text.splitlines() if line.startswith("data: ")]
        assert not response.stream_cut_short and events[-1] == "[DONE]", response.text
        chunks = [json.loads(e) for e in events[:-1]]
        seen = {c["index"] for chunk in chunks for c in chunk["choices"]}
        assert seen == {c["index"] for chunk in chunks for c in chunk["choices"] if c["finish_reason"]}, response.text
        return chunks[0]["id"], len(seen)
    return response.json()["id"], len(response.json()["choices"])


def _smaller(body, vocabulary: int, loops: int = 3):
    """A valid body made cheap to decode and within what the published schema cannot know (the served model's
    loops and ``vocabulary``, a text's length in its tokens), still valid: few tokens, few choices, few and
    short prompts. The texts of one body share 4 characters (each non-empty text keeps one at least), and a chat
    keeps two messages at most, so a prompt stays within the deployment's 48 tokens with a task's prefix and EOS
    (4 bytes a character at most, a byte-fallback token each; 8 characters a text allowed a chat of two parts to
    reach 61 tokens, answered 400 by the engine: a fuzz failure that depended on the examples drawn)."""
    bounds = {"max_tokens": 4, "max_completion_tokens": 4, "n": 2}  # chat's newer name for max_tokens too
    bounds |= dict.fromkeys(("launch_loop", "branches", "branch_depth"), loops)
    for key, most in bounds.items():
        if _whole(body.get(key)) and body[key] > most:
            body[key] = most
    left = [4]  # characters the body's texts may still hold

    def cut(value):  # texts shortened, token ids into the vocabulary, lists to two items
        if isinstance(value, str):
            text = value.lstrip()
            text = text[: max(1, left[0])] if text else text
            left[0] = max(0, left[0] - len(text))
            return text
        if _whole(value):
            return int(value) % vocabulary
        if isinstance(value, list):
            return [cut(v) for v in value[:2]]
        return value

    if "prompt" in body:
        body["prompt"] = cut(body["prompt"])
    if isinstance(body.get("messages"), list):
        body["messages"] = body["messages"][:2]
    for message in body.get("messages") or []:
        content = message.get("content") if isinstance(message, dict) else None
        if isinstance(content, str):
            message["content"] = cut(content)
        for part in content if isinstance(content, list) else ():
            if isinstance(part, dict) and isinstance(part.get("text"), str):
                part["text"] = cut(part["text"])


def _whole(value) -> bool:
    """A JSON Schema integer: a number without a fractional part (``5.0`` too), not a boolean."""
    return type(value) in (int, float) and float(value).is_integer()


def _published_body(server, path: str):
    """A validator of the request body that /openapi.json publishes for ``path``."""
    import jsonschema

    spec = requests.get(server.url + "/openapi.json", timeout=30).json()
    body = spec["paths"][path]["post"]["requestBody"]["content"]["application/json"]["schema"]
    return jsonschema.Draft202012Validator(body)


def _fuzz_schema(server):
    """The app's /openapi.json as schemathesis loads it, reading every event stream to its end: by default it stops
    after 20 events and closes the connection, and the replica cancels the rest of an answer the fuzz saw as a 200
    (rows "cancelled": issue 24). 10 000 events: far above any stream of a `_smaller` body (about 50 at most)."""
    import schemathesis
    from schemathesis.config import SchemathesisConfig

    # A refusal is a 400, or a 413 for a body over max_body_bytes (both documented in the schema).
    rejection = {"negative_data_rejection": {"expected-statuses": ["400", "413"]}}
    config = SchemathesisConfig.from_dict({"max-stream-events": 10_000, "checks": rejection})
    return schemathesis.openapi.from_url(server.url + "/openapi.json", config=config)


def test_schemathesis_reads_a_long_stream_to_its_end_and_its_rows_are_finished(server):
    """Issue 24: streamed answers of more than 20 events, sent as the fuzz sends them, are read to [DONE], and
    every choice counted as answered is a finished row with all its tokens, none cancelled."""
    schema = _fuzz_schema(server)
    bodies = {
        "/v1/completions": {"prompt": ["A dog runs.", "Birds fly."], "stream": True, "temperature": 0.157},
        "/v1/chat/completions": {"messages": [{"role": "user", "content": "A dog runs."}], "stream": True}
        | {"max_completion_tokens": 24},
    }
    ids = []
    for path, body in bodies.items():
        case = schema[path]["POST"].Case(body=body, media_type="application/json")
        response = case.call(base_url=server.url, timeout=120)
        assert response.status_code == 200 and response.text.count("data: ") > 20
        ids.append(_answered(response))
        server.answer(*ids[-1])
    rows = read_requests(server.stats).to_pylist()
    got = sorted((r["request_id"], r["choice"], r["finish_reason"], r["completion_tokens"]) for r in rows)
    (completion, n), (chat, one) = ids
    want = [(completion, i, "length", 12) for i in range(n)] + [(chat, 0, "length", 24)]
    assert (n, one) == (2, 1) and [g for g in got if g[0] in (completion, chat)] == sorted(want)


@pytest.mark.parametrize("mode", ["positive", "negative"])
def test_schemathesis_finds_no_5xx_and_every_answer_matches_the_schema(server, mode):
    """Schemathesis (a third-party fuzzer) against the published /openapi.json: no 5xx, answers and statuses
    as documented, everything the schema allows accepted (positive mode: no 400 for a schema-valid body, such as
    a ``task`` outside the registry's names) and everything it forbids refused with a 4xx (negative mode)."""
    from hypothesis import HealthCheck, Phase, given, settings
    from schemathesis import GenerationMode
    from schemathesis.checks import not_a_server_error
    from schemathesis.specs.openapi import checks

    schema = _fuzz_schema(server)
    run_checks = [not_a_server_error, checks.status_code_conformance, checks.content_type_conformance]
    run_checks += [checks.response_schema_conformance]
    run_checks.append(checks.negative_data_rejection if mode == "negative" else checks.positive_data_acceptance)
    calls = []
    paths = ("/v1/completions", "/v1/chat/completions")
    published = {path: _published_body(server, path) for path in paths}
    for path in paths:

        @settings(
            max_examples=30,
            deadline=None,
            database=None,
            phases=[Phase.generate],
            suppress_health_check=list(HealthCheck),
        )
        @given(case=schema[path]["POST"].as_strategy(GenerationMode(mode)))
        def fuzz(case):
            if mode == "positive" and isinstance(case.body, dict):
                _smaller(case.body, server.tokenizer.vocab_size)
                if not published[case.path].is_valid(case.body):
                    return  # the generator's own slip (an int64 bound rounded through a float), not the server's
            response = case.call_and_validate(base_url=server.url, checks=run_checks, timeout=120)
            calls.append(response.status_code)
            if response.status_code == 200:
                server.answer(*_answered(response))

        fuzz()
    assert len(calls) >= 40 and all(c < 500 for c in calls)
    if mode == "negative":
        assert 200 not in calls


def test_replica_healthy_after_bad_requests(server):
    before = requests.get(server.url + "/v1/stats", timeout=30).json()["rejected"]
    assert _complete(server, {"prompt": "", "max_tokens": 4}).status_code == 400
    assert _complete(server, {"prompt": "Still here?", "max_tokens": 4}).status_code == 200
    stats = requests.get(server.url + "/v1/stats", timeout=30).json()
    assert stats["rejected"] == before + 1 and stats["active"] == 0
    spec = stats["spec_decode"]
    assert spec["num_drafts"] > 0 and spec["acceptance_rate"] == spec["num_accepted_tokens"] / spec["num_draft_tokens"]
    assert len(spec["num_accepted_tokens_per_pos"]) == 2 and stats["prompt_tokens"] > 0
    assert sum(spec["num_draft_tokens_per_pos"]) == spec["num_draft_tokens"]
    assert all(r is None or 0 <= r <= 1 for r in spec["acceptance_rate_per_pos"])


def test_disconnect_frees_the_rows(server):
    before = requests.get(server.url + "/v1/stats", timeout=30).json()["cancelled"]
    body = {"prompt": "Tell me a long story.", "max_tokens": 400, "method": "sequential", "stream": True}
    with requests.post(server.url + "/v1/completions", json=body, stream=True, timeout=120) as r:
        next(line for line in r.iter_lines() if line)  # one token arrived: it is decoding
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        stats = requests.get(server.url + "/v1/stats", timeout=30).json()
        if stats["cancelled"] > before and stats["active"] == 0:
            break
        time.sleep(0.2)
    assert stats["cancelled"] == before + 1 and stats["active"] == 0 and stats["queue_depth"] == 0
    server.cancelled += 1


def test_overload_is_a_fast_503_never_a_hang(server):
    """8 ongoing requests in the replica + 8 queued at the proxy: 48 long requests at once overflow."""
    body = {"prompt": "Overload me.", "max_tokens": 24}

    def timed(_):
        start = time.monotonic()
        r = _complete(server, body)
        return r.status_code, time.monotonic() - start

    with ThreadPoolExecutor(48) as pool:
        results = list(pool.map(timed, range(48)))
    codes = [c for c, _ in results]
    assert set(codes) <= {200, 503} and 200 in codes and 503 in codes
    rejected_s = max(s for c, s in results if c == 503)
    answered_s = max(s for c, s in results if c == 200)
    assert rejected_s < answered_s  # turned away at once, not after waiting for decoding


LOAD_PROMPTS = ["A dog.", "A cat sleeps.", "Rain falls on the city."]


def _load_runs(server):
    """A closed-loop run of 6 requests and an open-loop one of 5 (5 tokens each), recorded as answered."""
    url = server.url
    closed = run_load(LoadConfig(url=url, concurrency=3, requests=6, max_tokens=5, label="closed"), LOAD_PROMPTS)
    opened = run_load(
        LoadConfig(url=url, concurrency=4, requests=5, rate=20.0, max_tokens=5, stream=False, label="open"),
        LOAD_PROMPTS,
    )
    for r in (r for run in (closed, opened) for r in run.table.to_pylist()):
        server.answer(r["request_id"])
    return closed, opened


def test_load_generator_closed_and_open_loop(server):
    closed, opened = _load_runs(server)
    for result, n in ((closed, 6), (opened, 5)):
        s = result.summary()
        assert (s["requests"], s["errors"], s["tokens"]) == (n, 0, 5 * n) and s["tokens_per_s"] > 0
        assert s["p50_ms"] <= s["p99_ms"]
        rows = result.table.to_pylist()
        assert all(r["text"] == _offline(server, LOAD_PROMPTS[r["prompt"]], 5)[0] for r in rows)
    assert all(r["ttft_ms"] is not None and r["ttft_ms"] <= r["latency_ms"] for r in closed.table.to_pylist())
    assert all(r["scheduled_s"] == r["start_s"] for r in closed.table.to_pylist())  # closed loop: from the send
    assert all(r["scheduled_s"] <= r["start_s"] for r in opened.table.to_pylist())  # open loop: from the arrival


def test_a_short_soak_answers_every_kind_without_failures_and_loses_no_row(server):
    """``jobs/soak.py``'s run, for 12 s at 4 clients: every kind of request is sent and answered (the
    abandoned ones cancelled on the replica or finished first), no failure, the replica reports its memory,
    and the statistics hold one row per answered choice."""
    from speed.loadtest.soak import SOAK_KINDS, SoakConfig, run_soak

    config = SoakConfig(url=server.url, minutes=0.2, concurrency=4, max_tokens=6, abandon_tokens=300)
    result = run_soak(config)
    table = result.table.to_pylist()
    answered = [r for r in table if r["error"] is None]
    for r in answered:  # the module's bookkeeping: finished rows as answered, abandoned ones by what they say
        if r["kind"] != "abandoned":
            server.answer(r["request_id"], r["choices"])
    rows = read_requests(server.stats)
    check = result.check_rows(rows)
    reasons = dict(zip(rows["request_id"].to_pylist(), rows["finish_reason"].to_pylist()))
    for r in answered:
        if r["kind"] == "abandoned":
            if reasons.get(r["request_id"]) == "cancelled":
                server.cancelled += 1
            else:
                server.answer(r["request_id"], 1)
    assert {r["kind"] for r in table} == set(SOAK_KINDS) and result.failures == 0, result.errors()
    assert check.complete and check.answered == sum(r["choices"] for r in answered), check
    assert check.abandoned and check.cancelled_rows >= 1  # 300 tokens: the replica noticed the disconnect
    assert any(r["kind"] == "n2" and r["choices"] == 2 for r in answered)
    assert result.rss_start and set(result.rss_start) == set(result.rss_end)
    assert result.rss_growth is not None and result.per_minute()[0]["answered"] == len(answered)


def _parquet_rows(stats: str) -> int:
    """Request rows already in Parquet files (not counting the write-ahead logs)."""
    files = sorted((Path(stats) / "requests").glob("*.parquet"))
    return sum(pq.read_metadata(f).num_rows for f in files)


def _kill_replica(url: str) -> str:
    """SIGKILL the process of the (one) replica behind ``url`` (no drain, no ``__del__``); returns its id."""
    import ray

    replica = requests.get(url + "/v1/stats", timeout=30).json()["replica"]
    actor = ray.get_actor(f"SERVE_REPLICA::{replica}", namespace="serve")
    os.kill(ray.get(actor.__ray_call__.remote(lambda _: os.getpid())), signal.SIGKILL)
    return replica


def _wait_for_a_new_replica(url: str, before: str) -> None:
    """Until ``url`` answers from a replica other than ``before``: Serve noticed the death and started another
    (a model load), whose statistics sink compacted the dead one's logs first."""
    deadline, health = time.monotonic() + 300, None
    while time.monotonic() < deadline:
        try:
            health = requests.get(url + "/healthz", timeout=10)
            if health.status_code == 200 and health.json()["replica"] != before:
                return
        except requests.RequestException:
            pass
        time.sleep(0.5)
    pytest.fail(f"no replica replaced {before} within 300 s (last answer: {health and health.text})")


def test_a_replica_killed_hard_is_replaced_and_loses_no_answered_row(server):
    """SIGKILL (no drain, no ``__del__``) while the replica still buffers answered rows: its logs keep them."""
    for _ in range(10):  # flush_rows=3: within three answers some row is only in the replica's log (10: margin)
        assert _complete(server, {"prompt": "Kill me softly.", "max_tokens": 5}).status_code == 200
        # all rows (cancelled ones are in Parquet too), counted before Parquet's: a flush landing between is no hit
        logged = read_requests(server.stats).num_rows
        if _parquet_rows(server.stats) < logged:
            break
    else:
        pytest.fail("every row was in Parquet after each of 10 answers")
    before = _kill_replica(server.url)
    rows = read_requests(server.stats)
    finished = rows.filter(pc.not_equal(rows["finish_reason"], "cancelled"))
    assert finished.num_rows == sum(n for _, n in server.answered)  # nothing lost: answered means logged
    _wait_for_a_new_replica(server.url, before)
    a = _complete(server, {"prompt": "Back again.", "max_tokens": 6}).json()
    assert a["choices"][0]["text"] == _offline(server, "Back again.", 6)[0]


def test_redeploy_applies_settings_and_the_old_replica_loses_no_statistics(server):
    """A redeploy through the Python API replaces the replica: Serve drains the old one and calls its
    ``__del__``, which must write every buffered row; the new one gets the settings via ``reconfigure``."""
    before = requests.get(server.url + "/v1/stats", timeout=30).json()
    server.redeploy({**SETTINGS, "max_active": 2, "row_budget": None})
    after = requests.get(server.url + "/v1/stats", timeout=30).json()
    assert after["settings"]["max_active"] == 2 and after["settings"]["row_budget"] is None
    assert after["replica"] != before["replica"] and after["finished"] == 0
    rows = read_requests(server.stats)
    finished = rows.filter(pc.not_equal(rows["finish_reason"], "cancelled"))
    assert finished.num_rows == sum(n for _, n in server.answered)  # the old replica's rows, none left behind
    a = _complete(server, {"prompt": "After the change.", "max_tokens": 6}).json()
    assert a["choices"][0]["text"] == _offline(server, "After the change.", 6)[0]


def test_statistics_hold_one_row_per_answered_prompt_after_shutdown(server):
    from ray import serve

    assert _complete(server, {"prompt": "Before the end.", "max_tokens": 4}).status_code == 200
    serve.delete(APP)  # drains the replica; its __del__ writes what is buffered
    try:
        _check_statistics_after_shutdown(server)
    finally:
        server.redeploy(SETTINGS)  # for the tests that run after this one, pass or fail


def _check_statistics_after_shutdown(server):
    rows = read_requests(server.stats)
    finished = rows.filter(pc.not_equal(rows["finish_reason"], "cancelled"))
    answered = sorted((rid, choice) for rid, n in server.answered for choice in range(n))
    got = sorted(zip(finished["request_id"].to_pylist(), finished["choice"].to_pylist()))
    assert got == answered  # exactly one row each, none missing, none extra
    assert rows.num_rows - finished.num_rows == server.cancelled  # the disconnected streams
    traces = read_traces(server.stats)
    per_choice = Counter(zip(traces["request_id"].to_pylist(), traces["choice"].to_pylist()))
    assert set(per_choice) <= {(r["request_id"], r["choice"]) for r in rows.to_pylist()}
    for r in rows.to_pylist():  # one trace row per committed token and loop (3 loops)
        traced = per_choice[(r["request_id"], r["choice"])]
        if r["finish_reason"] == "stop":  # a stop string keeps fewer tokens than the engine committed by then
            assert traced % 3 == 0 and traced >= 3 * r["completion_tokens"], r
        else:
            assert traced == 3 * r["completion_tokens"], r
    from speed.engine.sampling import choice_seed

    for r in rows.to_pylist():  # whichever tests ran before: every row's own invariants
        assert r["accepted_tokens"] == sum(r["accepted_per_pos"]) and r["route"] in ("completions", "chat")
        if r["temperature"] == 0.8 and r["top_k"] == 40:  # the seeded n=3 request: choice i has choice_seed(11, i)
            assert r["seed"] == choice_seed(11, r["choice"])


def _copy_if_there(source: str, destination: str) -> None:
    import shutil

    with contextlib.suppress(FileNotFoundError):
        shutil.copy2(source, destination)


@pytest.mark.slow
def test_serving_notebook_on_the_applications_own_files(server, tmp_path):
    """The analysis of serving reads what the application and the load generator really wrote."""
    import shutil

    from speed.analysis import acceptance, discover, load_summary, rows_per_step
    from speed.analysis.notebooks import run_notebooks
    from speed.analysis.results import read_tables

    # Its own answers (the test needs no other to run first): a sampled one, then the load runs' greedy ones,
    # which push the sampled row out of the buffer into a Parquet file (flush_rows=3).
    sampled = {"prompt": "A sampled answer.", "max_tokens": 4, "temperature": 0.8, "seed": 3}
    assert _complete(server, sampled).status_code == 200
    runs = _load_runs(server)
    root = tmp_path / "results"
    # The live replica may write (a hidden partial file, renamed when complete) or retire a log while this copies.
    shutil.copytree(server.stats, root / "stats", ignore=shutil.ignore_patterns(".*"), copy_function=_copy_if_there)
    (root / "load").mkdir()
    for run in runs:
        pq.write_table(run.table, root / "load" / f"{run.table['run'][0]}.parquet")
    found = discover(root)
    assert [p.name for p in found.load] == ["closed.parquet", "open.parquet"]
    assert len(found.requests) >= 2 and not found.evaluations and not found.sweeps
    runs = {r["run"]: r for r in load_summary(read_tables(found.load)).to_pylist()}
    assert (runs["closed"]["requests"], runs["open"]["requests"]) == (6, 5)
    assert runs["closed"]["errors"] == 0 and 1 <= runs["closed"]["concurrency"] <= 3 and runs["closed"]["replicas"] == 1
    per_request = rows_per_step(read_tables(found.requests))
    assert per_request.num_rows == _parquet_rows(str(root / "stats"))  # a live replica's newest rows: in its log
    run_notebooks(root, [repo_root() / "analysis" / "serving.ipynb"])
    assert (found.load[0].parent / "serving_load.png").stat().st_size > 0
    assert (found.requests[0].parent / "serving_rows_per_step.png").stat().st_size > 0
    assert (found.requests[0].parent / "serving_acceptance.png").stat().st_size > 0
    temperatures = set(acceptance(read_tables(found.requests))["temperature"].to_pylist())
    assert {0.0, 0.8} <= temperatures  # the load runs' greedy answers and the sampled one
