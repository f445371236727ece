"""The Serve application serving a looped LM for real: one deployment of a tiny LM checkpoint, the official client.

The checkpoint is written as training writes one (``speed.models.checkpoint.save_model``: ``"family": "lm"`` and a
chat template in its config.json), with a template of its own (``User: ...``) in place of the default, so
that a server applying any other template would be caught. Its EOS logit is pinned to 0, so answers run to
max_tokens. Every answer must equal offline sequential decoding of the context the model should read: the
raw text, the task's finetuning prompt (``speed.chat.task_prompt``), or the rendered chat
(``speed.chat.render_chat``); an API key guards the routes; a context over ``max_source_len`` is a 400
saying what to fix; every choice leaves a statistics row naming the family.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import requests
import torch
from test_serve_app import Deployment, _answers, _free_port  # its ledger of answers: ours is kept, unread

from speed import generate
from speed.chat import ChatTemplate, render_chat, task_prompt
from speed.config import lm_preset, to_dict
from speed.data import get_task
from speed.engine.sampling import Sampling, choice_seed
from speed.models.checkpoint import save_model
from speed.models.looped_lm import LoopedLM
from speed.serve.readers import read_requests
from speed.tokenizer import EOS_ID, Tokenizer

pytestmark = pytest.mark.ray

APP, KEY, NAME = "speed-lm-test", "sk-lm-test", "tiny-lm"
SETTINGS = {"max_active": 4, "max_source_len": 64, "max_target_len": 32, "row_budget": 8, "max_tokens": 6}
TEMPLATE = ChatTemplate(turn="{role}: {content}\n", cue="assistant:")  # not speed.chat's default


def _no_redeploy(settings):
    raise AssertionError("the LM deployment is never redeployed")


@pytest.fixture(scope="module")
def server(ray_session, tiny_tokenizer, tmp_path_factory):
    """URL, model, tokenizer and stats path of one deployment of a tiny LM checkpoint behind an API key."""
    from ray import serve

    from speed.serve.app import start_app
    from speed.serve.settings import AppConfig

    root = tmp_path_factory.mktemp("serve-lm")
    tokenizer = Tokenizer.load(tiny_tokenizer)
    torch.manual_seed(0)
    model = LoopedLM(lm_preset("tiny", pattern="2x3", vocab_size=tokenizer.vocab_size)).eval()
    with torch.no_grad():
        model.lm_head.weight[EOS_ID] = 0  # EOS never the argmax: answers run to max_tokens
    ckpt = save_model(root / "ckpt", model, tiny_tokenizer)
    config = json.loads((ckpt / "config.json").read_text())
    assert config["family"] == "lm" and "chat_template" in config
    (ckpt / "config.json").write_text(json.dumps(config | {"chat_template": to_dict(TEMPLATE)}))
    options = {"stats_path": str(root / "stats"), "model_name": NAME, "device": "cpu", "name": APP, "api_key": KEY}
    options |= {"port": _free_port(), "num_cpus": 1, "route_prefix": "/lm"}
    url = start_app(AppConfig(str(ckpt), settings=SETTINGS, **options))
    yield Deployment(url, model, tokenizer, options["stats_path"], redeploy=_no_redeploy)
    if APP in serve.status().applications:
        serve.delete(APP)
    serve.shutdown()


@pytest.fixture(scope="module")
def client(server):
    import openai

    return openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0, timeout=120)


def _offline(server, context: str | list[int], max_tokens: int, **sampling) -> tuple[str, int, int]:
    """Text, token count and context length of sequential decoding of ``context`` (text: encoded without EOS)."""
    tok = server.tokenizer
    ids = context if isinstance(context, list) else tok.encode(context, add_eos=False)
    s = Sampling(**sampling) if sampling else None
    result = generate(server.model, torch.tensor([ids]), method="sequential", max_new_tokens=max_tokens, sampling=s)
    return tok.decode(result.tokens[0]), len(result.tokens[0]), len(ids)


def test_the_card_names_the_family_and_the_key_guards_the_routes(server, client):
    (card,) = client.models.list().data
    assert (card.id, card.family, card.pattern, card.n_loops, card.max_source_len) == (NAME, "lm", "2x3", 3, 64)
    refused = requests.post(server.url + "/v1/completions", json={"prompt": "a"}, timeout=30)
    assert refused.status_code == 401 and refused.json()["error"]["code"] == "invalid_api_key"
    assert requests.get(server.url + "/healthz", timeout=30).status_code == 200


@pytest.mark.parametrize("stream", [False, True])
def test_completions_read_the_text_or_the_tasks_finetuning_prompt(server, client, stream):
    """Without a task the prompt is the raw context; with one, the task's instruction and the text as one chat
    turn (a finetuned LM's training prompt); token ids pass through; the usage counts the whole context."""
    text = "A dog runs on the grass."
    instruction = get_task("translate_en_de").instruction
    cases = [
        ({"prompt": text}, text),
        ({"prompt": text, "extra_body": {"task": "translate_en_de"}}, task_prompt(instruction, text, TEMPLATE)),
        ({"prompt": [37, 52, 9, 101], "extra_body": {"method": "sequential"}}, [37, 52, 9, 101]),
    ]
    for args, context in cases:
        expected, n, prompt_tokens = _offline(server, context, 6)
        usage = {"stream_options": {"include_usage": True}} if stream else {}
        answer = client.completions.create(model=NAME, max_tokens=6, **args, stream=stream, **usage)
        texts, reasons, last, _ = _answers(server, answer)
        assert (texts[0], reasons[0]) == (expected, "length"), args
        assert (last.usage.prompt_tokens, last.usage.completion_tokens) == (prompt_tokens, n)


def test_seeded_sampling_with_n_equals_offline_sampling(server, client):
    prompt = "Two men play chess in a park."
    sampling = {"temperature": 0.9, "top_p": 0.95, "top_k": 50}
    answer = client.completions.create(
        model=NAME, prompt=prompt, max_tokens=6, n=2, seed=7, temperature=0.9, top_p=0.95, extra_body={"top_k": 50}
    )
    texts = {c.index: c.text for c in answer.choices}
    for i in range(2):
        assert texts[i] == _offline(server, prompt, 6, seed=choice_seed(7, i), **sampling)[0]


@pytest.mark.parametrize("stream", [False, True])
def test_stop_strings_logprobs_and_echo(server, client, stream):
    prompt = "Three dogs play in the snow."
    full, n, _ = _offline(server, prompt, 8)
    stop = full[len(full) // 2 : len(full) // 2 + 3]
    assert stop.strip(), full
    args = {"model": NAME, "prompt": prompt, "max_tokens": 8}
    texts, reasons, _, _ = _answers(server, client.completions.create(**args, stop=[stop], stream=stream))
    assert (texts[0], reasons[0]) == (full[: full.find(stop)], "stop")
    echoed = client.completions.create(**args, echo=True, stream=stream)
    assert _answers(server, echoed).texts[0] == prompt + full
    texts, _, last, entries = _answers(server, client.completions.create(**args, logprobs=2, stream=stream))
    assert texts[0] == full and len(entries[0]) == n
    if not stream:
        lp = last.choices[0].logprobs
        assert "".join(lp.tokens) == full and len(lp.token_logprobs) == n
        assert all(v <= 0 for v in lp.token_logprobs) and all(len(t) <= 2 for t in lp.top_logprobs)


@pytest.mark.parametrize("stream", [False, True])
def test_chat_reads_the_messages_in_the_checkpoints_template(server, client, stream):
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hello."},
        {"role": "assistant", "content": "Hi."},
        {"role": "user", "content": "A child is eating."},
    ]
    context = render_chat(messages, TEMPLATE)
    expected, n, prompt_tokens = _offline(server, context, 6)
    args = {"model": NAME, "messages": messages, "max_tokens": 6, "logprobs": True, "top_logprobs": 1}
    usage = {"stream_options": {"include_usage": True}} if stream else {}
    texts, reasons, last, entries = _answers(server, client.chat.completions.create(**args, stream=stream, **usage))
    assert (texts[0], reasons[0], len(entries[0])) == (expected, "length", n)
    assert (last.usage.prompt_tokens, last.usage.completion_tokens) == (prompt_tokens, n)
    if not stream:
        assert last.choices[0].message.role == "assistant"
    # under a task, its instruction opens the last user message: a finetuning prompt for a one-turn chat
    one = [{"role": "user", "content": "A child is eating."}]
    instruction = get_task("translate_en_de").instruction
    tasked = client.chat.completions.create(
        model=NAME, messages=one, max_tokens=6, extra_body={"task": "translate_en_de"}
    )
    assert (
        tasked.choices[0].message.content
        == _offline(server, task_prompt(instruction, one[0]["content"], TEMPLATE), 6)[0]
    )


def test_a_context_over_max_source_len_is_a_400_saying_what_to_fix(server, client):
    import openai

    with pytest.raises(
        openai.BadRequestError, match=r"prompt 1 is \d+ tokens .* more than the deployment's max_source_len 64"
    ):
        client.completions.create(model=NAME, prompt=["short", "word " * 100], max_tokens=4)
    long_chat = [{"role": "system", "content": "word " * 50}, {"role": "user", "content": "word " * 50}]
    with pytest.raises(openai.BadRequestError, match="the chat is .* chat template .* raise max_source_len"):
        client.chat.completions.create(model=NAME, messages=long_chat, max_tokens=4)


def test_every_choice_leaves_a_statistics_row_naming_the_family(server, client):
    answer = client.completions.create(model=NAME, prompt="People walk.", max_tokens=5, n=2, seed=3, temperature=0.5)
    chat = client.chat.completions.create(model=NAME, messages=[{"role": "user", "content": "Hi."}], max_tokens=5)
    rows = read_requests(server.stats).to_pylist()  # on local storage a row is logged before its answer leaves
    ours = [r for r in rows if r["request_id"] in (answer.id, chat.id)]
    assert sorted((r["route"], r["choice"]) for r in ours) == [("chat", 0), ("completions", 0), ("completions", 1)]
    assert {(r["family"], r["model"]) for r in ours} == {("lm", NAME)}
    assert {r["prompt_tokens"] for r in ours if r["route"] == "chat"} == {chat.usage.prompt_tokens}
    assert all(r["completion_tokens"] == 5 and r["finish_reason"] == "length" for r in ours)
    assert {r["family"] for r in rows} == {"lm"}


def test_the_checkpoint_family_and_template_reach_the_replica(server):
    """The served model is the checkpoint's LM (not a T5), with the template the checkpoint stores."""
    from speed.serve.settings import load_served_model

    served = load_served_model(str(Path(server.stats).parent / "ckpt"), "cpu")
    assert served.family.name == "lm" and isinstance(served.model, LoopedLM) and served.template == TEMPLATE
