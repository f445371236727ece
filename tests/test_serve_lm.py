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

import copy
import json
from pathlib import Path

import pytest
import requests
import torch
from imported_helpers import write_chat_ouro
from serve_helpers import shutdown_serve
from test_hf_tokenizer import QWEN_CHATML
from test_serve_app import Deployment, _answers, _free_port  # its ledger of answers: ours is kept, unread

from speed import DecodeOptions, generate
from speed.chat import ChatTemplate, render_chat, task_prompt
from speed.config import lm_preset, to_dict
from speed.data import get_task
from speed.engine import matmuls
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
    shutdown_serve()


@pytest.fixture(scope="module")
def client(server):
    import openai

    return openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0, timeout=120)


def _offline(server, context: str | list[int], max_tokens: int, **sampling) -> tuple[str, int, int]:
    """Text, token count and context length of sequential decoding of ``context`` (text: encoded without EOS)."""
    tok = server.tokenizer
    ids = context if isinstance(context, list) else tok.encode(context, add_eos=False)
    s = Sampling(**sampling) if sampling else None
    result = generate(
        server.model,
        torch.tensor([ids]),
        options=DecodeOptions(method="sequential", max_new_tokens=max_tokens, sampling=s),
    )
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


# An imported chat model: a tiny Ouro directory as downloaded (safetensors, tokenizer.json, a ChatML template),
# deployed beside the LM above. Its template refuses a chat that does not end with the user's turn, as templates
# do with raise_exception; <|im_end|> is likely enough that some answers end at it.
OURO_TEMPLATE = (
    "{% if messages[-1]['role'] != 'user' %}{{ raise_exception('the last message must be the user\\'s') }}"
    "{% endif %}" + QWEN_CHATML
)
OURO_SETTINGS = {"max_active": 4, "max_source_len": 128, "max_target_len": 16, "max_tokens": 12}


@pytest.fixture(scope="module")
def ouro(server, tmp_path_factory):
    """A deployment of a tiny imported Ouro directory named by its folder (``Ouro-tiny``), SPEED on, on the LM
    server's Serve: its Deployment (model from ``from_pretrained``, tokenizer from ``load_tokenizer``)."""
    from ray import serve

    from speed import from_pretrained
    from speed.hf_tokenizer import load_tokenizer
    from speed.serve.app import start_app
    from speed.serve.settings import AppConfig

    root = tmp_path_factory.mktemp("serve-ouro")
    directory = write_chat_ouro(root / "Ouro-tiny", end_of_turn_bias=0.3, chat_template=OURO_TEMPLATE)
    port = int(server.url.rsplit(":", 1)[1].split("/")[0])
    options = {"stats_path": str(root / "stats"), "device": "cpu", "name": "speed-ouro-test", "api_key": KEY}
    options |= {"port": port, "num_cpus": 0.5, "route_prefix": "/ouro"}
    url = start_app(AppConfig(str(directory), settings=OURO_SETTINGS, **options))
    yield Deployment(url, from_pretrained(directory), load_tokenizer(directory), options["stats_path"], _no_redeploy)
    if "speed-ouro-test" in serve.status().applications:
        serve.delete("speed-ouro-test")


def _ouro_offline(ouro, ids: list[int], max_tokens: int = 12) -> tuple[str, str]:
    """Text and finish reason of sequential decoding of ``ids``, ending at the tokenizer's stop ids."""
    result = generate(
        ouro.model,
        torch.tensor([ids]),
        options=DecodeOptions(method="sequential", max_new_tokens=max_tokens, stop_ids=ouro.tokenizer.stop_ids),
    )
    return ouro.tokenizer.decode(result.tokens[0]), "stop" if result.stopped[0] else "length"


def test_an_imported_ouro_serves_chat_and_completions_in_its_template_stopping_at_its_end_of_turn(ouro):
    import openai

    client = openai.OpenAI(base_url=ouro.url + "/v1", api_key=KEY, max_retries=0, timeout=120)
    (card,) = client.models.list().data
    assert (card.id, card.family, card.n_loops) == ("Ouro-tiny", "lm", 3)
    tok, reasons = ouro.tokenizer, []
    assert tok.stop_ids == {0, 2}  # <|endoftext|> and ChatML's <|im_end|>
    for content in ("Translate to German: A dog runs.", "What is 12 + 30?", "Hi!"):
        messages = [{"role": "user", "content": content}]
        expected = _ouro_offline(ouro, tok.encode_chat(messages))
        answer = client.chat.completions.create(model="Ouro-tiny", messages=messages, max_tokens=12)
        assert (answer.choices[0].message.content, answer.choices[0].finish_reason) == expected, content
        assert answer.speed["method"] == "speed"
        reasons.append(expected[1])
    assert set(reasons) == {"stop", "length"}  # some chats ended at <|im_end|>, some ran to max_tokens
    for stream in (False, True):
        prompt = "A man in a blue shirt."
        answer = client.completions.create(model="Ouro-tiny", prompt=prompt, max_tokens=12, stream=stream)
        texts, finish, _, _ = _answers(ouro, answer)
        assert (texts[0], finish[0]) == _ouro_offline(ouro, tok.encode(prompt, add_eos=False))
    with pytest.raises(openai.BadRequestError, match="messages: .*the last message must be the user's"):
        client.chat.completions.create(
            model="Ouro-tiny", messages=[{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}]
        )
    rows = [r for r in read_requests(ouro.stats).to_pylist() if r["route"] == "chat"]
    assert {(r["model"], r["family"]) for r in rows} == {("Ouro-tiny", "lm")} and len(rows) == 3
    spec = requests.get(ouro.url + "/openapi.json", headers={"Authorization": f"Bearer {KEY}"}, timeout=30).json()
    body = spec["paths"]["/v1/chat/completions"]["post"]["requestBody"]["content"]["application/json"]["schema"]
    methods = next(o["enum"] for o in body["properties"]["method"]["anyOf"] if "enum" in o)
    assert methods == ["speed", "sequential", "exit_gate"]  # Ouro's exit gate: its schema offers the method
    assert sorted(r["finish_reason"] for r in rows) == sorted(reasons)


# bf16 weights (``jobs/serve.py --dtype bfloat16``): the tiny Ouro directory deployed in bf16 beside the others.
@pytest.fixture(scope="module")
def ouro_bf16(server, tmp_path_factory):
    """A deployment of a tiny imported Ouro in bf16 weights, on the LM server's Serve: its Deployment (the model
    ``from_pretrained`` in bfloat16, what the replica must decode with)."""
    from ray import serve

    from speed import from_pretrained
    from speed.hf_tokenizer import load_tokenizer
    from speed.serve.app import start_app
    from speed.serve.settings import AppConfig

    root = tmp_path_factory.mktemp("serve-ouro-bf16")
    directory = write_chat_ouro(root / "Ouro-tiny", end_of_turn_bias=0.3)
    port = int(server.url.rsplit(":", 1)[1].split("/")[0])
    options = {"stats_path": str(root / "stats"), "device": "cpu", "name": "speed-bf16-test", "api_key": KEY}
    options |= {"port": port, "num_cpus": 0.5, "route_prefix": "/bf16", "dtype": "bfloat16"}
    url = start_app(AppConfig(str(directory), settings=OURO_SETTINGS, **options))
    model = from_pretrained(directory, dtype=torch.bfloat16)
    decoder = copy.deepcopy(model)
    decoder.pack_for_decoding()  # as the replica decodes (speed.serve.settings.load_served_model)
    deployment = Deployment(url, decoder, load_tokenizer(directory), options["stats_path"], _no_redeploy)
    deployment.directory = directory  # the float32 model's too
    deployment.unpacked = model  # its forward's logits
    yield deployment
    if "speed-bf16-test" in serve.status().applications:
        serve.delete("speed-bf16-test")


def test_a_bf16_deployment_answers_as_offline_bf16_decoding_and_says_its_dtype(ouro_bf16, client):
    """Greedy completions and chats of the bf16 deployment (SPEED on) equal offline sequential decoding of the same
    directory in bf16 weights token for token, its logprobs bf16's (not float32's); its card and statistics say
    bfloat16, a default one's float32."""
    import openai

    from speed import from_pretrained

    bf16 = openai.OpenAI(base_url=ouro_bf16.url + "/v1", api_key=KEY, max_retries=0, timeout=120)
    (card,) = bf16.models.list().data
    assert (card.id, card.dtype, client.models.list().data[0].dtype) == ("Ouro-tiny", "bfloat16", "float32")
    headers = {"Authorization": f"Bearer {KEY}"}
    stats = requests.get(ouro_bf16.url + "/v1/stats", headers=headers, timeout=30).json()
    assert stats["dtype"] == "bfloat16"
    linears = [m for m in ouro_bf16.model.modules() if isinstance(m, torch.nn.Linear)]
    assert stats["packed_weights"] == sum(map(matmuls.is_packed, linears)) > 0  # as the offline reference's
    assert ouro_bf16.model.lm_head.weight.dtype == torch.bfloat16  # the reference is bf16 weights
    tok = ouro_bf16.tokenizer
    for prompt in ("A man in a blue shirt.", "Two dogs play in the snow.", "What is 12 + 30?"):
        answer = bf16.completions.create(model="Ouro-tiny", prompt=prompt, max_tokens=12)
        texts, finish, _, _ = _answers(ouro_bf16, answer)
        assert (texts[0], finish[0]) == _ouro_offline(ouro_bf16, tok.encode(prompt, add_eos=False)), prompt
        assert answer.speed["method"] == "speed"
    messages = [{"role": "user", "content": "Translate to German: A dog runs."}]
    answer = bf16.chat.completions.create(model="Ouro-tiny", messages=messages, max_tokens=12)
    expected = _ouro_offline(ouro_bf16, tok.encode_chat(messages))
    assert (answer.choices[0].message.content, answer.choices[0].finish_reason) == expected
    # The tokens of these prompts are float32's too: the logprobs tell bf16 weights from float32 ones.
    prompt = tok.encode("A girl reads a book.", add_eos=False)
    answer = bf16.completions.create(model="Ouro-tiny", prompt=prompt, max_tokens=8, logprobs=1)
    served = torch.tensor(answer.choices[0].logprobs.token_logprobs, dtype=torch.float64)
    tokens = generate(
        ouro_bf16.model, torch.tensor([prompt]), options=DecodeOptions(method="sequential", max_new_tokens=8)
    ).tokens[0]
    assert len(tokens) == len(served)
    whole = torch.tensor([prompt + tokens])
    offline = {}
    for name, model in (("bfloat16", ouro_bf16.unpacked), ("float32", from_pretrained(ouro_bf16.directory))):
        logits = model(whole, return_logits=True).loop_logits[-1][0, len(prompt) - 1 : -1].double()
        offline[name] = logits.log_softmax(-1).gather(1, torch.tensor(tokens)[:, None])[:, 0]
    torch.testing.assert_close(served, offline["bfloat16"], atol=1e-4, rtol=0)
    assert (served - offline["float32"]).abs().max() > 1e-3
