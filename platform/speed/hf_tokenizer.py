"""The tokenizer and chat template of an imported Hugging Face model directory (Ouro, Huginn, ...).

``HFTokenizer.load(directory)`` reads what ``transformers.AutoTokenizer.from_pretrained(directory)`` reads,
without importing transformers:

* ``tokenizer.json``: the whole pipeline (normalizer, pre-tokenizer, model, post-processor, decoder, added
  tokens), run by the ``tokenizers`` library as written (padding and truncation off: the platform cuts its
  own inputs);
* ``tokenizer_config.json``: the named special tokens (``bos_token``, ``eos_token``, ``pad_token``, ... as a
  string or an ``AddedToken`` object), ``added_tokens_decoder``, ``split_special_tokens`` (not ``add_bos_token``
  nor ``add_eos_token``: beside a tokenizer.json transformers 5 drops them, its post-processor decides),
  ``clean_up_tokenization_spaces`` and ``chat_template`` (a string, or a list of named templates);
  ``special_tokens_map.json`` where the config has no ``added_tokens_decoder`` (transformers' legacy rule);
  ``chat_template.jinja`` and ``additional_chat_templates/*.jinja``, which take priority over the config's;
* ``generation_config.json`` (or, without one, ``config.json``): ``eos_token_id``, an int or a list.

Named special tokens and added tokens that ``tokenizer.json`` lacks are added to it, as transformers adds
them. ``stop_ids``, the ids at which a generation ends: the tokenizer's EOS, every ``eos_token_id`` of the
generation config, and the chat's end-of-turn token where the template writes one that is a special token
(``<|im_end|>`` of ChatML, as Ouro's and Qwen's; ``<|end_turn|>`` of Huginn; ``<|eot_id|>``,
``<end_of_turn>``, ``<|end|>``). Ouro's configs set bos, eos and pad all to ``<|endoftext|>`` (id 0) while
its chats end at ``<|im_end|>``: both stop.

``HFTokenizer`` satisfies ``speed.tokenizer.TextTokenizer``, so it stands wherever the platform's
SentencePiece ``Tokenizer`` does at decode, evaluation and serving time; ``decode`` is transformers'
``decode(ids, skip_special_tokens=True)``. Span-corruption pretraining needs T5 sentinels and stays
SentencePiece-only: ``sentinel_id`` and ``num_extra`` raise ``SentinelsUnsupported``.

Raw text reaches the model as the published tokenizer's ``tokenizer(text)`` gives it: ``text_prefix`` (what the
post-processor puts before a text: Huginn's BOS, nothing for Ouro's) first, wherever the platform encodes text
that no chat template of the model rendered (``prompt_ids``: a completion's prompt, a training document; an
imported model's own template writes its BOS itself, as ``apply_chat_template`` encodes it).

The chat templates are ``speed.hf_chat_template.HFChatTemplate`` (Jinja, rendered as transformers renders them).
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tokenizers import AddedToken
from tokenizers import Tokenizer as BackendTokenizer

from speed.chat import CHAT_TEMPLATE, ChatRenderer
from speed.hf_chat_template import HFChatTemplate, one_line
from speed.storage import Location, locate
from speed.tokenizer import LABEL_PAD, TextTokenizer, Tokenizer

TOKENIZER_FILE = "tokenizer.json"
CONFIG_FILE = "tokenizer_config.json"
SPECIAL_TOKENS_FILE = "special_tokens_map.json"
GENERATION_CONFIG_FILE = "generation_config.json"
MODEL_CONFIG_FILE = "config.json"
CHAT_TEMPLATE_FILE = "chat_template.jinja"
CHAT_TEMPLATE_DIR = "additional_chat_templates"

# transformers' SPECIAL_TOKENS_ATTRIBUTES: the named special tokens a chat template sees as variables.
SPECIAL_TOKEN_NAMES = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
# Tokens that end a chat turn, in the chat formats of the models we import (ChatML first).
END_OF_TURN_TOKENS = ("<|im_end|>", "<|end_turn|>", "<|eot_id|>", "<end_of_turn>", "<|end|>")
# transformers' names for a message's reasoning; the first is the one chat templates read.


class SentinelsUnsupported(TypeError):
    """Span-corruption pretraining asked an imported model's tokenizer for T5 sentinels it does not have."""


@dataclass
class HFTokenizer:
    """A ``tokenizers`` tokenizer with its directory's special tokens, stop ids and chat templates."""

    backend: BackendTokenizer
    path: str  # the directory: a local path made absolute, or a URI
    eos_id: int
    pad_id: int
    bos_id: int | None
    stop_ids: frozenset[int]  # generation ends at any of these
    special_tokens: dict[str, str]  # the named special tokens (bos_token, eos_token, ...) as strings
    chat_templates: dict[str, HFChatTemplate] = field(default_factory=dict)
    text_prefix: tuple[int, ...] = ()  # the post-processor's ids before a raw text (a BOS), as tokenizer(text)
    clean_up_spaces: bool = False  # transformers' clean_up_tokenization_spaces (never for a BPE model)
    vocab_size: int = field(init=False)  # one past the highest id, added tokens included

    def __post_init__(self) -> None:
        vocab = self.backend.get_vocab(with_added_tokens=True)
        self.vocab_size = max(vocab.values(), default=-1) + 1

    @classmethod
    def load(cls, directory: str | Path) -> HFTokenizer:
        """Read a model directory (a local path or a URI): see the module's docstring for what is read.

        A missing ``tokenizer.json``, a file that is not what its name says, or no EOS token anywhere is a
        one-line ``FileNotFoundError`` / ``ValueError`` naming the file."""
        where = locate(directory)
        if not where.is_dir():
            raise FileNotFoundError(f"no model directory at {where.uri}")
        if not (where / TOKENIZER_FILE).is_file():
            raise FileNotFoundError(
                f"no {TOKENIZER_FILE} in {where.uri}: an imported model's tokenizer is read from its "
                "tokenizers-library file (a directory with only a slow tokenizer, vocab.json or *.model, "
                "needs converting with transformers first)"
            )
        try:
            backend = BackendTokenizer.from_str((where / TOKENIZER_FILE).read_text())
        except Exception as err:  # the Rust side's parse error
            what = f"{where.uri}/{TOKENIZER_FILE}"
            raise ValueError(f"{what} is not a tokenizers-library file: {one_line(err)}") from None
        backend.no_truncation()
        backend.no_padding()
        config = _json_object(where, CONFIG_FILE) or {}
        named = _named_special_tokens(where, config)
        _add_missing_tokens(backend, config, named, where.uri)
        backend.encode_special_tokens = bool(config.get("split_special_tokens", False))

        def token_id(name: str) -> int | None:
            token = named.get(name)
            return None if token is None else backend.token_to_id(token.content)

        generation_eos = _generation_eos_ids(where)
        eos_id = token_id("eos_token")
        if eos_id is None:
            if not generation_eos:
                raise ValueError(
                    f"{where.uri}: no EOS token: neither {CONFIG_FILE} (eos_token) nor {GENERATION_CONFIG_FILE} / "
                    f"{MODEL_CONFIG_FILE} (eos_token_id) names one"
                )
            eos_id = generation_eos[0]
        pad_id = token_id("pad_token")
        special = {name: token.content for name, token in named.items()}
        templates = {
            name: HFChatTemplate(source, special, name) for name, source in _chat_templates(where, config).items()
        }
        stops = {eos_id, *generation_eos, *_end_of_turn_ids(backend, templates.values())}
        tokenizer = cls(
            backend=backend,
            path=where.uri,
            eos_id=eos_id,
            pad_id=eos_id if pad_id is None else pad_id,
            bos_id=token_id("bos_token"),
            stop_ids=frozenset(stops),
            special_tokens=special,
            chat_templates=templates,
            text_prefix=_text_prefix(backend),
            clean_up_spaces=bool(config.get("clean_up_tokenization_spaces", False))
            and type(backend.model).__name__ != "BPE",
        )
        bad = sorted(i for i in stops if not 0 <= i < tokenizer.vocab_size)
        if bad:
            raise ValueError(f"{where.uri}: stop token ids {bad} outside the vocabulary [0, {tokenizer.vocab_size})")
        return tokenizer

    # The chat.

    @property
    def chat_template(self) -> HFChatTemplate | None:
        """The template ``apply_chat_template`` uses without a name: the one named ``default`` (a config's single
        template, or ``chat_template.jinja``); None where there is none (pick a named one with ``template(name)``)."""
        return self.chat_templates.get("default")

    def template(self, name: str | None = None) -> HFChatTemplate:
        """The chat template called ``name`` (None: ``chat_template``); a clear ``ValueError`` where there is none."""
        found = self.chat_template if name is None else self.chat_templates.get(name)
        if found is None:
            have = sorted(self.chat_templates)
            raise ValueError(
                f"{self.path}: no chat template"
                + (f" named {name!r}" if name else " named 'default'" if have else "")
                + (f"; it has {have}" if have else "")
            )
        return found

    def render_chat(self, messages: Sequence[Mapping[str, Any]], **variables: Any) -> str:
        """``apply_chat_template(messages, tokenize=False, add_generation_prompt=True, **variables)``."""
        return self.template().render(messages, **variables)

    def encode_chat(self, messages: Sequence[Mapping[str, Any]], **variables: Any) -> list[int]:
        """``apply_chat_template(messages, tokenize=True, add_generation_prompt=True)``'s ids: the rendered text
        encoded without the post-processor's special tokens (the template writes its own)."""
        return self.encode(self.render_chat(messages, **variables), add_eos=False)

    # TextTokenizer.

    def encode(self, text: str, add_eos: bool = True, *, add_special_tokens: bool = False) -> list[int]:
        """Token ids of ``text``, EOS-terminated unless ``add_eos=False``; ``add_special_tokens=True`` also runs
        ``tokenizer.json``'s post-processor (a BOS, ...: transformers' ``encode(text)``)."""
        if not isinstance(text, str):
            raise TypeError(f"encode expects a str, got {type(text).__name__}")
        ids = self.backend.encode(text, add_special_tokens=add_special_tokens).ids
        return ids + [self.eos_id] if add_eos else ids

    def encode_batch(
        self, texts: Sequence[str], add_eos: bool = True, *, add_special_tokens: bool = False
    ) -> list[list[int]]:
        """``encode`` of many texts at once (the ``tokenizers`` library's threads)."""
        texts = list(texts)
        bad = next((i for i, t in enumerate(texts) if not isinstance(t, str)), None)
        if bad is not None:
            raise TypeError(f"encode_batch expects strings, item {bad} is {type(texts[bad]).__name__}")
        encoded = self.backend.encode_batch(texts, add_special_tokens=add_special_tokens)
        return [e.ids + [self.eos_id] if add_eos else e.ids for e in encoded]

    def decode(self, ids: Iterable[int]) -> str:
        """transformers' ``decode(ids, skip_special_tokens=True)``: special tokens (EOS, end of turn, pad, ...)
        dropped, not cut at; label padding (-100) dropped; an id outside the vocabulary is a ``ValueError``."""
        ids = [int(i) for i in ids if int(i) != LABEL_PAD]  # accepts lists, tensors and arrays
        bad = next((i for i in ids if not 0 <= i < self.vocab_size), None)
        if bad is not None:
            raise ValueError(f"token id {bad} outside the vocabulary [0, {self.vocab_size})")
        text = self.backend.decode(ids, skip_special_tokens=True)
        return _clean_up_tokenization(text) if self.clean_up_spaces else text

    def decode_batch(self, batch: Iterable[Iterable[int]]) -> list[str]:
        """``decode`` of each sequence."""
        return [self.decode(ids) for ids in batch]

    def piece(self, i: int) -> str:
        """The text of one token (special tokens as written; a word-initial SentencePiece-style ``▁`` as a space,
        which decoding a lone token drops), for log-probability listings; an id outside the vocabulary (a
        model's padding rows) as ``<id N>``."""
        if not 0 <= i < self.vocab_size:
            return f"<id {i}>"
        text = self.backend.decode([i], skip_special_tokens=False)
        token = self.backend.id_to_token(i) or ""
        return " " + text if token.startswith("\u2581") and not text.startswith(" ") else text

    # Training: SentencePiece-only.

    @property
    def num_extra(self) -> int:
        raise SentinelsUnsupported(_NO_SENTINELS.format(path=self.path))

    def sentinel_id(self, i: int) -> int:
        raise SentinelsUnsupported(_NO_SENTINELS.format(path=self.path))

    def __repr__(self) -> str:
        return (
            f"HFTokenizer({self.path!r}, vocab={self.vocab_size}, eos={self.eos_id}, "
            f"stops={sorted(self.stop_ids)}, chat_templates={sorted(self.chat_templates)})"
        )


_NO_SENTINELS = (
    "{path}: span-corruption pretraining needs T5 sentinels, which only the platform's SentencePiece tokenizer "
    "(speed.tokenizer.Tokenizer) has; an imported model's tokenizer decodes, evaluates and serves, and finetunes "
    "on chat, but does not span-corrupt"
)


# Reading the directory.


def _json_object(where: Location, name: str) -> dict | None:
    """A JSON file of the directory as a dict, None where it is absent; anything else a one-line ValueError."""
    file = where / name
    if not file.is_file():
        return None
    try:
        value = json.loads(file.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise ValueError(f"{file.uri} is not JSON: {one_line(err)}") from None
    if not isinstance(value, dict):
        raise ValueError(f"{file.uri} must hold a JSON object, got {type(value).__name__}")
    return value


def _added_token(value: Any, what: str, special: bool | None = None) -> AddedToken:
    """A special token's value: a string, or an AddedToken object (with or without transformers' ``__type``)."""
    if isinstance(value, str):
        return AddedToken(value, special=True if special is None else special)
    if isinstance(value, Mapping) and isinstance(value.get("content"), str):
        fields = {k: value[k] for k in ("single_word", "lstrip", "rstrip", "normalized", "special") if k in value}
        if special is not None:
            fields["special"] = special
        fields.setdefault("special", True)
        return AddedToken(value["content"], **fields)
    raise ValueError(f"{what} must be a string or an object with a string 'content', got {value!r}")


def _named_special_tokens(where: Location, config: dict) -> dict[str, AddedToken]:
    """bos_token, eos_token, ... and model-specific ``*_token`` keys, as transformers reads them."""
    merged = dict(config)
    legacy = _json_object(where, SPECIAL_TOKENS_FILE) if "added_tokens_decoder" not in config else None
    for key, value in (legacy or {}).items():
        merged[key] = value  # transformers: special_tokens_map.json overrides the config's, in its legacy path
    named = {}
    for key, value in merged.items():
        if value is None or not key.endswith("_token"):
            continue
        if key in SPECIAL_TOKEN_NAMES or isinstance(value, str):  # a model's own names (image_token, ...): strings
            named[key] = _added_token(value, f"{CONFIG_FILE}: {key}")
    extra = merged.get("extra_special_tokens")
    for key, value in extra.items() if isinstance(extra, Mapping) else ():
        named[key] = _added_token(value, f"{CONFIG_FILE}: extra_special_tokens.{key}")
    return named


def _add_missing_tokens(backend: BackendTokenizer, config: dict, named: dict[str, AddedToken], uri: str) -> None:
    """Add ``added_tokens_decoder``'s tokens and the named and extra special tokens that ``tokenizer.json`` lacks
    (transformers' ``TokenizersBackend.__init__``), so encoding, ids and skipped specials match it."""
    decoder = config.get("added_tokens_decoder", {})
    if not isinstance(decoder, Mapping):
        raise ValueError(f"{uri}/{CONFIG_FILE}: added_tokens_decoder must be an object of id: token")
    have = {token.content: token for token in backend.get_added_tokens_decoder().values()}
    to_add: list[AddedToken] = []
    for index, value in sorted(decoder.items(), key=lambda kv: _index(kv[0], uri)):
        token = _added_token(value, f"{CONFIG_FILE}: added_tokens_decoder[{index}]", special=None)
        if repr(have.get(token.content)) != repr(token):
            to_add.append(token)
    queued = {t.content for t in to_add} | set(have)
    extra = config.get("extra_special_tokens") or config.get("additional_special_tokens") or []
    extra = [] if isinstance(extra, Mapping) else list(extra)  # a mapping's are among the named tokens
    for token in [*named.values(), *(_added_token(v, f"{CONFIG_FILE}: extra_special_tokens") for v in extra)]:
        if token.content not in queued:
            to_add.append(AddedToken(token.content, **{**_token_fields(token), "special": True}))
            queued.add(token.content)
    if to_add:
        backend.add_tokens(to_add)


def _text_prefix(backend: BackendTokenizer) -> tuple[int, ...]:
    """The ids the post-processor puts before a single text (those before the text's first token)."""
    encoding = backend.encode("a", add_special_tokens=True)
    first = next((i for i, sequence in enumerate(encoding.sequence_ids) if sequence is not None), 0)
    return tuple(encoding.ids[:first])


def _index(key: Any, uri: str) -> int:
    try:
        return int(key)
    except (TypeError, ValueError):
        raise ValueError(f"{uri}/{CONFIG_FILE}: added_tokens_decoder key {key!r} is not a token id") from None


def _token_fields(token: AddedToken) -> dict[str, bool]:
    return {k: getattr(token, k) for k in ("single_word", "lstrip", "rstrip", "normalized")}


def _generation_eos_ids(where: Location) -> list[int]:
    """``eos_token_id`` of generation_config.json (or, without one, config.json): an int or a list of ints."""
    for name in (GENERATION_CONFIG_FILE, MODEL_CONFIG_FILE):
        config = _json_object(where, name)
        if config is None:
            continue
        value = config.get("eos_token_id")
        if name == MODEL_CONFIG_FILE and value is None:
            value = (config.get("text_config") or {}).get("eos_token_id")  # nested text configs
        values = [] if value is None else [value] if isinstance(value, int) else value
        if not isinstance(values, list) or any(isinstance(v, bool) or not isinstance(v, int) for v in values):
            raise ValueError(f"{where.uri}/{name}: eos_token_id must be an int or a list of ints, got {value!r}")
        return values
    return []


def _chat_templates(where: Location, config: dict) -> dict[str, str]:
    """The directory's chat templates by name, as transformers picks them: ``chat_template.jinja`` (``default``)
    and ``additional_chat_templates/*.jinja`` first; else the config's ``chat_template``, a string or a list
    of ``{"name", "template"}``."""
    files: dict[str, str] = {}
    if (where / CHAT_TEMPLATE_FILE).is_file():
        files["default"] = (where / CHAT_TEMPLATE_FILE).read_text()
    extra = where / CHAT_TEMPLATE_DIR
    if extra.is_dir():
        for info in sorted(extra.entries(), key=lambda i: i.base_name):
            if info.base_name.endswith(".jinja"):
                files[info.base_name.removesuffix(".jinja")] = (extra / info.base_name).read_text()
    if files:
        return files
    value = config.get("chat_template")
    if value is None:
        return {}
    if isinstance(value, str):
        return {"default": value}
    if isinstance(value, list) and all(
        isinstance(t, Mapping) and isinstance(t.get("name"), str) and isinstance(t.get("template"), str) for t in value
    ):
        return {t["name"]: t["template"] for t in value}
    raise ValueError(
        f"{where.uri}/{CONFIG_FILE}: chat_template must be a string or a list of {{'name', 'template'}} objects"
    )


def _end_of_turn_ids(backend: BackendTokenizer, templates: Iterable[HFChatTemplate]) -> set[int]:
    """The end-of-turn tokens the chat templates write that are special tokens of the tokenizer."""
    special = {t.content: i for i, t in backend.get_added_tokens_decoder().items() if t.special}
    sources = [t.source for t in templates]
    return {special[t] for t in END_OF_TURN_TOKENS if t in special and any(t in s for s in sources)}


def _clean_up_tokenization(text: str) -> str:
    """transformers' ``clean_up_tokenization`` (applied where the config asks and the model is not BPE)."""
    for before, after in ((" .", "."), (" ?", "?"), (" !", "!"), (" ,", ","), (" ' ", "'"), (" n't", "n't")):
        text = text.replace(before, after)
    for before, after in ((" 'm", "'m"), (" 's", "'s"), (" 've", "'ve"), (" 're", "'re")):
        text = text.replace(before, after)
    return text


# ----- a tokenizer as one blob of bytes (what training ships to its workers and hashes) ---------------------

_PACKED = b"speed-hf-tokenizer\n"  # opens a packed directory; a SentencePiece model (a protobuf) never does


def tokenizer_files(directory: str | Path) -> dict[str, bytes]:
    """The files of a model directory that ``HFTokenizer.load`` reads, by name relative to it: tokenizer.json,
    its configs and chat templates, and of config.json only ``eos_token_id`` (the rest describes the model)."""
    where = locate(directory)
    names = [TOKENIZER_FILE, CONFIG_FILE, SPECIAL_TOKENS_FILE, GENERATION_CONFIG_FILE, CHAT_TEMPLATE_FILE]
    if (where / CHAT_TEMPLATE_DIR).is_dir():
        extra = sorted(i.base_name for i in (where / CHAT_TEMPLATE_DIR).entries() if i.base_name.endswith(".jinja"))
        names += [f"{CHAT_TEMPLATE_DIR}/{name}" for name in extra]
    files = {name: (where / name).read_bytes() for name in names if (where / name).is_file()}
    if TOKENIZER_FILE not in files:
        HFTokenizer.load(directory)  # its one-line error
    if GENERATION_CONFIG_FILE not in files and (where / MODEL_CONFIG_FILE).is_file():  # read for eos_token_id only
        files[MODEL_CONFIG_FILE] = json.dumps({"eos_token_id": _generation_eos_ids(where)}).encode()
    return files


def pack_tokenizer(path: str | Path) -> bytes:
    """The tokenizer at ``path`` as bytes: a SentencePiece ``.model`` file's own bytes (unchanged, so the cache
    keys of prepared data stay what they were), or a directory's ``tokenizer_files`` behind a header.
    ``unpack_tokenizer`` writes either back; equal bytes mean the same tokenizer."""
    if not locate(path).is_dir():
        return locate(path).read_bytes()
    files = {name: data.hex() for name, data in sorted(tokenizer_files(path).items())}
    return _PACKED + json.dumps(files, sort_keys=True).encode()


def unpack_tokenizer(packed: bytes, directory: str | Path, spm_name: str) -> Path:
    """Write ``pack_tokenizer``'s bytes into ``directory``: a SentencePiece model as ``spm_name`` (that file is
    returned), a Hugging Face tokenizer's files into ``directory`` itself (returned: ``load_tokenizer`` reads
    it)."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    if not packed.startswith(_PACKED):
        (directory / spm_name).write_bytes(packed)
        return directory / spm_name
    for name, data in json.loads(packed[len(_PACKED) :]).items():
        (directory / name).parent.mkdir(parents=True, exist_ok=True)
        (directory / name).write_bytes(bytes.fromhex(data))
    return directory


def load_tokenizer(path: str | Path) -> TextTokenizer:
    """The tokenizer at ``path`` (a local path or a URI): a directory holding ``tokenizer.json`` (an imported
    model's, ``HFTokenizer``) or a SentencePiece ``.model`` file (``Tokenizer``)."""
    where = locate(path)
    if where.is_dir():
        return HFTokenizer.load(where.uri)
    return Tokenizer.load(where.uri)


def prompt_ids(tokenizer: TextTokenizer, texts: Sequence[str], template: ChatRenderer | None = None) -> list[list[int]]:
    """Prompt texts as the model's published tokenizer encodes them, no EOS: rendered by an imported model's own
    chat template (an ``HFChatTemplate``), as ``apply_chat_template(..., tokenize=True)``, the template writing
    its BOS itself; raw text (``template`` None) or the platform's template's text, as ``tokenizer(text)``: the
    tokenizer's ``text_prefix`` (Huginn's BOS; none for SentencePiece) first."""
    prefix = [] if isinstance(template, HFChatTemplate) else list(tokenizer.text_prefix)
    return [prefix + ids for ids in tokenizer.encode_batch(texts, add_eos=False)]


def chat_renderer(tokenizer: TextTokenizer, fallback: ChatRenderer = CHAT_TEMPLATE) -> ChatRenderer:
    """The chat template prompts to ``tokenizer``'s model are written in: an imported model's own (its
    ``HFTokenizer.chat_template``), else ``fallback`` (a platform LM's, which its checkpoint stores)."""
    own = tokenizer.chat_template if isinstance(tokenizer, HFTokenizer) else None
    return fallback if own is None else own
