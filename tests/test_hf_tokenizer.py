"""An imported model's tokenizer and chat template, against transformers on tiny directories built here.

Two directories, both trained in a second with the ``tokenizers`` library: an Ouro-like one (Qwen's byte-level
BPE pipeline, ``<|endoftext|>`` ``<|im_start|>`` ``<|im_end|>`` at ids 0 1 2, bos, eos and pad all
``<|endoftext|>``, a ChatML template) and a Huginn-like one (a SentencePiece-style Metaspace BPE, a BOS
post-processor, ``<|begin_header|>`` ... ``<|end_turn|>`` turns). Each is read by ``HFTokenizer`` and by
transformers (``AutoTokenizer`` and ``PreTrainedTokenizerFast``): ids, text and rendered chats must be equal.
"""

from __future__ import annotations

import json
import pickle
from pathlib import Path
from types import SimpleNamespace

import pyarrow as pa
import pytest
from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers

from speed.chat import CHAT_TEMPLATE, ChatRenderer, render_chat, task_prompt
from speed.hf_tokenizer import (
    HFChatTemplate,
    HFTokenizer,
    SentinelsUnsupported,
    chat_renderer,
    load_tokenizer,
    prompt_ids,
)
from speed.tokenizer import TextTokenizer

transformers = pytest.importorskip("transformers")

CORPUS = [
    "A man in a blue shirt is standing on a ladder.",
    "Two dogs run through the snow, and one of them barks!",
    "Ein Mann in einem blauen Hemd steht auf einer Leiter.",
    "Zwei Hunde rennen durch den Schnee; einer bellt.",
    "What is 12 + 30? It's 42, isn't it?",
    "def add(a, b):\n    return a + b\n",
    "Ünïcödé straße café naïve — 東京 🙂",
] * 4

TEXTS = [
    "A man in a blue shirt.",
    "  leading spaces and trailing  ",
    "line one\nline two\n\n\ttabbed",
    "Zwei Hunde rennen, 12 + 30 = 42!",
    "unseen wørds: 東京 🙂 ñ",
    "<|im_start|>user\nhi<|im_end|>\n",  # special tokens written as text
    "<|begin_header|>Huginn<|end_header|>\n\nok<|end_turn|>",
    "",
]

# Qwen2's ChatML template (Qwen2-*-Instruct's tokenizer_config.json): a default system turn.
QWEN_CHATML = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}{% endif %}"
    "{{'<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n'}}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

# A multi-line ChatML template with whitespace control and indentation (trim_blocks / lstrip_blocks matter),
# a variable (enable_thinking), namespace, loop controls, tojson and raise_exception.
OURO_THINKING = """{# ChatML with enable_thinking. #}
{%- set ns = namespace(turns=0) -%}
{%- if messages[0]['role'] == 'system' -%}
    {{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}
{%- endif -%}
{%- for message in messages -%}
    {%- if message.role == 'system' and loop.first -%}
        {% continue %}
    {%- elif message.role not in ['user', 'assistant'] -%}
        {{ raise_exception('Unknown role: ' + message.role) }}
    {%- endif -%}
    {% set ns.turns = ns.turns + 1 %}
    {{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}
    {% if message.reasoning_content is defined %}<think>{{ message.reasoning_content }}</think>{% endif %}
    {% if message.tool_calls is defined %}TOOLS{% endif %}
    {% if message.meta is defined %}
        <meta>{{ message.meta | tojson }}</meta>
    {% endif %}
{%- endfor -%}
{%- if add_generation_prompt -%}
    {{- '<|im_start|>assistant\\n' }}
    {%- if enable_thinking is defined and enable_thinking is true -%}
        {{- '<think>\\n' }}
    {%- endif -%}
{%- endif -%}
"""

# Huginn-0125's template: the BOS opens the first turn, contents trimmed, the assistant is "Huginn".
HUGINN = (
    "{% set loop_messages = messages %}{% for message in loop_messages %}"
    "{% set content = '<|begin_header|>' + message['role'] + '<|end_header|>\\n\\n'+ message['content'] | trim "
    "+ '<|end_turn|>' %}{% if loop.index0 == 0 %}{% set content = bos_token + content %}{% endif %}{{ content }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|begin_header|>Huginn<|end_header|>\\n\\n' }}{% endif %}"
)

CHATS = [
    [{"role": "user", "content": "Translate to German: A dog runs."}],
    [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hi!"}],
    [
        {"role": "system", "content": "  Be kind.  "},
        {"role": "user", "content": "What is 12 + 30?"},
        {"role": "assistant", "content": "42."},
        {"role": "user", "content": "And 40 + 2?\n"},
    ],
    [{"role": "user", "content": "Ünïcödé <b>&</b> 🙂", "meta": {"lang": "de", "tags": ["<x>", "ü"]}}],
    [  # None values dropped (tool_calls), reasoning under every name (reasoning_content, thinking)
        {"role": "user", "content": "first"},
        {"role": "assistant", "content": "second", "reasoning": "hmm", "tool_calls": None},
        {"role": "user", "content": "third"},
    ],
]


def _special(content: str, special: bool = True) -> dict:
    return {"content": content, "lstrip": False, "normalized": False, "rstrip": False, "single_word": False,
            "special": special}  # fmt: skip


def _write(directory: Path, tokenizer: Tokenizer, **files: object) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(directory / "tokenizer.json"))
    for name, content in files.items():
        path = directory / name.replace("__", ".").replace("_DOT_", ".")
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(content if isinstance(content, str) else json.dumps(content, indent=2))
    return directory


def _qwen_like() -> Tokenizer:
    """Qwen2's pipeline (Qwen2Tokenizer rebuilds the same from vocab and merges), trained on CORPUS."""
    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    split = (  # Qwen2Tokenizer's PRETOKENIZE_REGEX
        r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"""
        r"""|\s*[\r\n]+|\s+(?!\S)|\s+"""
    )
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(split), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS, trainer)
    return tok


def _huginn_like() -> Tokenizer:
    tok = Tokenizer(models.BPE(unk_token="<unk>", byte_fallback=False))
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Metaspace()
    specials = ["<unk>", "<|begin_text|>", "<|end_text|>", "<|begin_header|>", "<|end_header|>", "<|end_turn|>"]
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=specials, show_progress=False)
    tok.train_from_iterator(CORPUS, trainer)
    tok.post_processor = processors.TemplateProcessing(
        single="<|begin_text|> $A", pair="<|begin_text|> $A $B", special_tokens=[("<|begin_text|>", 1)]
    )
    return tok


OURO_CONFIG = {
    "add_prefix_space": False,
    "added_tokens_decoder": {
        str(i): _special(t) for i, t in enumerate(["<|endoftext|>", "<|im_start|>", "<|im_end|>"])
    },
    "bos_token": "<|endoftext|>",
    "eos_token": "<|endoftext|>",
    "pad_token": "<|endoftext|>",
    "unk_token": "<|endoftext|>",
    "chat_template": QWEN_CHATML,
    "clean_up_tokenization_spaces": False,
    "model_max_length": 4096,
    "tokenizer_class": "Qwen2Tokenizer",
}


@pytest.fixture(scope="module")
def ouro_dir(tmp_path_factory) -> Path:
    return _write(
        tmp_path_factory.mktemp("ouro") / "Ouro-tiny",
        _qwen_like(),
        tokenizer_config__json=OURO_CONFIG,
        config__json={"model_type": "ouro", "bos_token_id": 0, "eos_token_id": 0, "pad_token_id": 0},
    )


@pytest.fixture(scope="module")
def huginn_dir(tmp_path_factory) -> Path:
    return _write(
        tmp_path_factory.mktemp("huginn") / "huginn-tiny",
        _huginn_like(),
        tokenizer_config__json={
            "bos_token": "<|begin_text|>",
            "eos_token": {"__type": "AddedToken", **_special("<|end_text|>")},
            "pad_token": "<|pad|>",  # not in tokenizer.json: added, as transformers adds it
            "chat_template": HUGINN,
            "tokenizer_class": "PreTrainedTokenizerFast",
        },
        generation_config__json={"bos_token_id": 1, "eos_token_id": [2, 5]},
    )


@pytest.fixture(scope="module", params=["ouro", "huginn"])
def pair(request, ouro_dir, huginn_dir) -> tuple[HFTokenizer, object]:
    directory = ouro_dir if request.param == "ouro" else huginn_dir
    return HFTokenizer.load(directory), transformers.AutoTokenizer.from_pretrained(str(directory))


def test_encode_decode_equal_transformers(pair):
    ours, theirs = pair
    assert ours.vocab_size == len(theirs)
    for text in TEXTS:
        ids = ours.encode(text, add_eos=False)
        assert ids == theirs.encode(text, add_special_tokens=False), text
        assert ours.encode(text, add_eos=False, add_special_tokens=True) == theirs.encode(text), text
        assert ours.encode(text) == ids + [ours.eos_id]
        assert ours.decode(ids) == theirs.decode(ids, skip_special_tokens=True), text
    with_specials = ours.encode(TEXTS[5] + TEXTS[0], add_special_tokens=True) + [ours.pad_id, -100]
    assert ours.decode(with_specials) == theirs.decode(with_specials[:-1], skip_special_tokens=True)
    assert ours.encode_batch(TEXTS, add_eos=False) == [theirs.encode(t, add_special_tokens=False) for t in TEXTS]
    assert ours.decode_batch(ours.encode_batch(TEXTS)) == theirs.batch_decode(
        ours.encode_batch(TEXTS), skip_special_tokens=True
    )


def test_the_file_as_written_equals_pretrained_tokenizer_fast(ouro_dir, huginn_dir):
    for directory in (ouro_dir, huginn_dir):
        ours = HFTokenizer.load(directory)
        fast = transformers.PreTrainedTokenizerFast(tokenizer_file=str(directory / "tokenizer.json"))
        for text in TEXTS:
            ids = fast.encode(text, add_special_tokens=False)
            assert ours.encode(text, add_eos=False) == ids
            assert ours.decode(ids) == fast.decode(ids, skip_special_tokens=True)


def test_special_tokens_and_stop_ids(ouro_dir, huginn_dir):
    ouro = HFTokenizer.load(ouro_dir)
    assert (ouro.bos_id, ouro.eos_id, ouro.pad_id) == (0, 0, 0)  # Ouro's configs: all <|endoftext|>
    assert ouro.backend.token_to_id("<|im_end|>") == 2
    assert ouro.stop_ids == {0, 2}  # EOS, and ChatML's end of turn: where a chat answer ends
    assert ouro.special_tokens == {
        "bos_token": "<|endoftext|>",
        "eos_token": "<|endoftext|>",
        "pad_token": "<|endoftext|>",
        "unk_token": "<|endoftext|>",
    }
    huginn = HFTokenizer.load(huginn_dir)
    theirs = transformers.AutoTokenizer.from_pretrained(str(huginn_dir))
    assert (huginn.bos_id, huginn.eos_id) == (theirs.bos_token_id, theirs.eos_token_id) == (1, 2)
    assert huginn.pad_id == theirs.pad_token_id == huginn.vocab_size - 1  # <|pad|> added at the end
    assert huginn.stop_ids == {2, 5}  # <|end_text|>, and <|end_turn|> from both the config and the template
    assert huginn.piece(5) == "<|end_turn|>" and huginn.piece(10_000) == "<id 10000>"
    assert [huginn.piece(i) for i in huginn.encode("A man in", add_eos=False)] == [" A", " man", " in"]  # as spm
    assert [ouro.piece(i) for i in ouro.encode("A man in", add_eos=False)] == ["A", " man", " in"]
    without_template = json.loads((ouro_dir / "tokenizer_config.json").read_text())
    del without_template["chat_template"]
    plain = _write(ouro_dir.parent / "no-chat", _qwen_like(), tokenizer_config__json=without_template)
    assert HFTokenizer.load(plain).stop_ids == {0}  # no template: no end-of-turn token
    lists = _write(
        ouro_dir.parent / "eos-list",
        _qwen_like(),
        tokenizer_config__json=OURO_CONFIG,
        generation_config__json={"eos_token_id": [2, 1]},
    )
    assert HFTokenizer.load(lists).stop_ids == {0, 1, 2}


def _render_both(directory: Path, messages: list[dict], **variables) -> tuple[str, str]:
    ours = HFTokenizer.load(directory)
    theirs = transformers.AutoTokenizer.from_pretrained(str(directory))
    expected = theirs.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, **variables)
    return ours.render_chat(messages, **variables), expected


@pytest.mark.parametrize("template", ["qwen", "ouro", "huginn"])
def test_chat_equals_apply_chat_template(template, ouro_dir, huginn_dir, tmp_path):
    if template == "huginn":
        directory = huginn_dir
    else:
        config = {**OURO_CONFIG, "chat_template": QWEN_CHATML if template == "qwen" else OURO_THINKING}
        directory = _write(tmp_path / template, _qwen_like(), tokenizer_config__json=config)
    ours = HFTokenizer.load(directory)
    theirs = transformers.AutoTokenizer.from_pretrained(str(directory))
    for messages in CHATS:
        for variables in ({}, {"enable_thinking": True}):
            expected = theirs.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, **variables)
            assert ours.render_chat(messages, **variables) == expected, (template, messages)
        assert ours.encode_chat(messages) == theirs.apply_chat_template(
            messages, tokenize=True, add_generation_prompt=True, return_dict=False
        )
        assert ours.template().render(messages, add_generation_prompt=False) == theirs.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=False
        )
    assert render_chat(CHATS[1], ours.template()) == ours.render_chat(CHATS[1])  # the platform's entry point
    assert task_prompt("Translate to German: ", "A dog runs.", ours.template()) == ours.render_chat(CHATS[0])


def test_template_errors_are_value_errors(tmp_path):
    config = {**OURO_CONFIG, "chat_template": OURO_THINKING}
    directory = _write(tmp_path / "ouro", _qwen_like(), tokenizer_config__json=config)
    ours = HFTokenizer.load(directory)
    theirs = transformers.AutoTokenizer.from_pretrained(str(directory))
    bad = [{"role": "tool", "content": "x"}]
    with pytest.raises(Exception, match="Unknown role: tool"):
        theirs.apply_chat_template(bad, tokenize=False, add_generation_prompt=True)
    with pytest.raises(ValueError, match="Unknown role: tool"):
        ours.render_chat(bad)
    with pytest.raises(ValueError, match="has no attribute 'content'"):  # the template's own undefined error
        ours.render_chat([{"role": "user", "content": None}])
    with pytest.raises(ValueError, match="at least one message"):
        ours.render_chat([])
    with pytest.raises(ValueError, match="message 0: must be a mapping"):
        ours.render_chat(["hello"])


def test_chat_template_files_and_named_templates(tmp_path):
    named = [{"name": "default", "template": QWEN_CHATML}, {"name": "thinking", "template": OURO_THINKING}]
    listed = _write(tmp_path / "listed", _qwen_like(), tokenizer_config__json={**OURO_CONFIG, "chat_template": named})
    ours = HFTokenizer.load(listed)
    assert sorted(ours.chat_templates) == ["default", "thinking"] and ours.chat_template.source == QWEN_CHATML
    theirs = transformers.AutoTokenizer.from_pretrained(str(listed))
    assert ours.template("thinking").render(CHATS[2]) == theirs.apply_chat_template(
        CHATS[2], chat_template="thinking", tokenize=False, add_generation_prompt=True
    )
    with pytest.raises(ValueError, match="no chat template named 'nope'"):
        ours.template("nope")
    # chat_template.jinja (newer repositories) takes priority over the config's template, as in transformers
    jinja = _write(tmp_path / "jinja", _qwen_like(), tokenizer_config__json=OURO_CONFIG, chat_template__jinja=HUGINN)
    ours, theirs = HFTokenizer.load(jinja), transformers.AutoTokenizer.from_pretrained(str(jinja))
    assert ours.chat_template.source == HUGINN
    assert ours.render_chat(CHATS[1]) == theirs.apply_chat_template(
        CHATS[1], tokenize=False, add_generation_prompt=True
    )
    nameless = _write(
        tmp_path / "nameless", _qwen_like(), tokenizer_config__json={**OURO_CONFIG, "chat_template": named[1:]}
    )
    with pytest.raises(ValueError, match="no chat template named 'default'; it has \\['thinking'\\]"):
        HFTokenizer.load(nameless).render_chat(CHATS[0])


def test_one_line_errors(tmp_path, ouro_dir):
    with pytest.raises(FileNotFoundError, match="no model directory"):
        HFTokenizer.load(tmp_path / "absent")
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="no tokenizer.json in"):
        HFTokenizer.load(tmp_path / "empty")
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "tokenizer.json").write_text('{"model": 3}')
    with pytest.raises(ValueError, match="is not a tokenizers-library file"):
        HFTokenizer.load(broken)
    cases = {
        "config-not-json": {"tokenizer_config__json": "{nope"},
        "config-a-list": {"tokenizer_config__json": "[1, 2]"},
        "eos-a-string": {"tokenizer_config__json": OURO_CONFIG, "generation_config__json": {"eos_token_id": "2"}},
        "template-a-number": {"tokenizer_config__json": {**OURO_CONFIG, "chat_template": 3}},
        "template-syntax": {"tokenizer_config__json": {**OURO_CONFIG, "chat_template": "{% for %}"}},
        "no-eos": {"tokenizer_config__json": {"chat_template": QWEN_CHATML}},
        "eos-outside": {"tokenizer_config__json": OURO_CONFIG, "generation_config__json": {"eos_token_id": 10**6}},
    }
    messages = {
        "config-not-json": "tokenizer_config.json is not JSON",
        "config-a-list": "must hold a JSON object, got list",
        "eos-a-string": "eos_token_id must be an int or a list of ints",
        "template-a-number": "chat_template must be a string or a list",
        "template-syntax": "chat template 'default' does not compile",
        "no-eos": "no EOS token",
        "eos-outside": "outside the vocabulary",
    }
    for name, files in cases.items():
        directory = _write(tmp_path / name, _qwen_like(), **files)
        with pytest.raises(ValueError, match=messages[name]) as caught:
            HFTokenizer.load(directory)
        assert "\n" not in str(caught.value), name
    ours = HFTokenizer.load(ouro_dir)
    with pytest.raises(ValueError, match=r"token id 400 outside the vocabulary \[0, 400\)"):
        ours.decode([5, 400])
    with pytest.raises(TypeError, match="encode expects a str"):
        ours.encode(["a"])


def test_one_interface_and_sentinels_stay_sentencepiece(ouro_dir):
    ours = load_tokenizer(ouro_dir)  # a directory: the imported model's tokenizer
    assert isinstance(ours, HFTokenizer) and isinstance(ours, TextTokenizer)
    assert isinstance(ours.template(), ChatRenderer) and isinstance(CHAT_TEMPLATE, ChatRenderer)
    with pytest.raises(SentinelsUnsupported, match="span-corruption pretraining needs T5 sentinels"):
        ours.sentinel_id(0)
    with pytest.raises(SentinelsUnsupported, match="SentencePiece"):
        _ = ours.num_extra
    again = pickle.loads(pickle.dumps(ours))  # datasets.map and Ray ship it to workers
    assert again.encode(TEXTS[0]) == ours.encode(TEXTS[0]) and again.render_chat(CHATS[1]) == ours.render_chat(CHATS[1])
    assert again.stop_ids == ours.stop_ids and again.vocab_size == ours.vocab_size


def test_chat_template_class_alone():
    template = HFChatTemplate(HUGINN, {"bos_token": "<s>"})
    text = template.render([{"role": "user", "content": "  hi  "}])
    assert text == "<s><|begin_header|>user<|end_header|>\n\nhi<|end_turn|><|begin_header|>Huginn<|end_header|>\n\n"
    assert template.render([{"role": "user", "content": "hi"}], bos_token="").startswith("<|begin_header|>")


def test_raw_text_starts_as_the_published_tokenizer_starts_it(pair):
    """``prompt_ids``: raw text as ``tokenizer(text)`` (Huginn's BOS first, Ouro's nothing); a chat rendered by the
    model's own template as ``apply_chat_template(tokenize=True)``: one BOS, the template's."""
    ours, theirs = pair
    assert prompt_ids(ours, TEXTS) == [theirs.encode(text) for text in TEXTS]
    for messages in CHATS:
        ids = prompt_ids(ours, [ours.render_chat(messages)], ours.template())[0]
        assert ids == theirs.apply_chat_template(messages, tokenize=True, add_generation_prompt=True, return_dict=False)
        assert ids[: len(ours.text_prefix) + 1].count(ours.bos_id) <= 1  # never a second BOS
    assert prompt_ids(ours, ["x"], CHAT_TEMPLATE)[0] == theirs.encode("x")  # the platform's template: raw text


def test_the_text_prefix_of_each_tokenizer(ouro_dir, huginn_dir):
    assert HFTokenizer.load(ouro_dir).text_prefix == ()  # Qwen's byte-level post-processor adds nothing
    assert HFTokenizer.load(huginn_dir).text_prefix == (1,)  # <|begin_text|>, as Huginn's 65504


@pytest.mark.parametrize(
    "post_processor, flags",
    [
        (True, {"add_bos_token": False}),  # transformers 5 drops the flags beside a tokenizer.json: its post-processor
        (True, {"add_eos_token": True}),
        (False, {"add_bos_token": True, "add_eos_token": True}),
        (False, {}),
    ],
)
def test_the_post_processor_decides_as_in_transformers(tmp_path, post_processor, flags):
    tokenizer = _huginn_like()
    if not post_processor:
        tokenizer = Tokenizer.from_str(json.dumps({**json.loads(tokenizer.to_str()), "post_processor": None}))
    config = {"bos_token": "<|begin_text|>", "eos_token": "<|end_text|>", "chat_template": HUGINN, **flags}
    directory = _write(tmp_path / "flags", tokenizer, tokenizer_config__json=config)
    ours, theirs = HFTokenizer.load(directory), transformers.AutoTokenizer.from_pretrained(str(directory))
    for text in TEXTS:
        assert ours.encode(text, add_eos=False, add_special_tokens=True) == theirs.encode(text), text
    assert ours.text_prefix == ((1,) if post_processor else ())
    plain = [theirs.encode(text, add_special_tokens=False) for text in TEXTS]
    assert prompt_ids(ours, TEXTS) == [list(ours.text_prefix) + ids for ids in plain]


def test_the_looped_lm_family_encodes_as_published(huginn_dir):
    """Where the platform turns text into a looped LM's input: a completion's raw prompt, a served chat, an
    evaluation source (the model's own template) and a training document all start as transformers starts them."""
    from speed.data.encoders import RowsEncoder
    from speed.models.family import get_family

    ours, theirs = HFTokenizer.load(huginn_dir), transformers.AutoTokenizer.from_pretrained(str(huginn_dir))
    lm, template = get_family("lm"), chat_renderer(ours)
    assert lm.served_prompts(TEXTS, None, ours, template) == [theirs.encode(text) for text in TEXTS]
    chat = theirs.apply_chat_template(CHATS[2], tokenize=True, add_generation_prompt=True, return_dict=False)
    assert lm.served_chat(CHATS[2], 3, None, ours, template) == chat
    assert chat.count(ours.bos_id) == 1
    source = [{"role": "user", "content": "A dog runs."}]
    assert lm.encode_sources(["A dog runs."], ours, 512, template) == [
        theirs.apply_chat_template(source, tokenize=True, add_generation_prompt=True, return_dict=False)
    ]
    documents = pa.table({"text": TEXTS[:3]})
    rows = RowsEncoder(SimpleNamespace(pack=False, max_source_len=1000), ours).encode(documents)["input_ids"]
    assert rows == [theirs.encode(text) + [ours.eos_id] for text in TEXTS[:3]]  # BOS first, EOS last
