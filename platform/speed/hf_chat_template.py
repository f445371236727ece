"""The chat template of an imported Hugging Face model, rendered as transformers renders it.

``HFChatTemplate.render(messages)`` is ``apply_chat_template(messages, tokenize=False,
add_generation_prompt=True)``: the same sandboxed Jinja environment (``ImmutableSandboxedEnvironment``,
``trim_blocks``, ``lstrip_blocks``, ``loopcontrols``; ``raise_exception``, ``strftime_now``, ``dict``,
``namespace`` and a ``tojson`` that does not escape HTML), the same variables (``messages``, ``tools``,
``documents``, ``add_generation_prompt`` and the named special tokens as strings) and the same message
clean-up (keys whose value is None dropped, reasoning aliases filled in).

``speed.hf_tokenizer.HFTokenizer`` reads the templates of a directory and holds them by name.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from functools import lru_cache
from typing import Any

import numpy as np

_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")


class HFChatTemplate:
    """One Jinja chat template, rendered as transformers' ``apply_chat_template(..., tokenize=False)`` does."""

    def __init__(self, source: str, special_tokens: Mapping[str, str], name: str = "default") -> None:
        if not isinstance(source, str):
            raise ValueError(f"chat template {name!r} must be a string, got {type(source).__name__}")
        self.source, self.name = source, name
        self.special_tokens = dict(special_tokens)  # bos_token, eos_token, ... as strings: template variables
        try:
            _compile(source)
        except Exception as err:  # jinja2.TemplateSyntaxError and the like: say which template, on one line
            raise ValueError(f"chat template {name!r} does not compile: {one_line(err)}") from None

    def render(
        self,
        messages: Sequence[Mapping[str, Any]],
        add_generation_prompt: bool = True,
        *,
        tools: Sequence[Mapping[str, Any]] | None = None,
        documents: Sequence[Mapping[str, Any]] | None = None,
        **variables: Any,
    ) -> str:
        """The prompt text of ``messages``: the template rendered with ``messages``, ``add_generation_prompt``,
        ``tools``, ``documents``, the named special tokens and ``variables`` (e.g. ``enable_thinking=True``;
        they override special tokens of the same name). An empty chat, a message that is not a mapping, or the
        template's own ``raise_exception`` (a role it does not take, ...) is a ``ValueError``."""
        import jinja2

        if isinstance(messages, (str, bytes)) or not messages:
            raise ValueError("a chat needs at least one message")
        chat = []
        for i, message in enumerate(messages):
            if not isinstance(message, Mapping):
                raise ValueError(f"message {i}: must be a mapping (role, content), got {type(message).__name__}")
            chat.append(_with_reasoning_aliases({k: v for k, v in _plain(message).items() if v is not None}))
        if tools is not None and any(not isinstance(t, Mapping) for t in tools):
            raise ValueError("tools must be JSON schemas (mappings)")
        if documents is not None and any(not isinstance(d, Mapping) for d in documents):
            raise ValueError("documents must be mappings ('title', 'text')")
        context = _plain({**self.special_tokens, **variables})
        try:
            return _compile(self.source).render(
                messages=chat,
                tools=_plain(tools),
                documents=_plain(documents),
                add_generation_prompt=add_generation_prompt,
                **context,
            )
        except jinja2.TemplateError as err:  # raise_exception, or an undefined value the template calls
            raise ValueError(f"chat template {self.name!r}: {one_line(err)}") from None

    def __repr__(self) -> str:
        return f"HFChatTemplate({self.name!r}, {len(self.source)} chars)"


def one_line(err: BaseException) -> str:
    """An error's text on one line (its type's name when it has none)."""
    return " ".join(str(err).split()) or type(err).__name__


# The Jinja environment: transformers' (chat_template_utils._cached_compile_jinja_template), less its
# {% generation %} tracker, which only marks assistant spans for training masks and renders its body as is.


@lru_cache(maxsize=32)
def _compile(source: str) -> Any:
    import jinja2
    import jinja2.ext
    import jinja2.nodes
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class Generation(jinja2.ext.Extension):
        """``{% generation %}...{% endgeneration %}`` renders its body unchanged."""

        tags = {"generation"}

        def parse(self, parser: Any) -> Any:
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

        def _body(self, caller: Any) -> str:
            return caller()

    def raise_exception(message: str) -> None:
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x: Any, ensure_ascii: bool = False, indent: Any = None, separators: Any = None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    def strftime_now(format: str) -> str:
        return datetime.now().strftime(format)

    class TemplateDict:
        def __call__(self, *args: Any, **kwargs: Any) -> dict:
            return dict(*args, **kwargs)

        def fromkeys(self, *args: Any, **kwargs: Any) -> dict:
            return dict.fromkeys(*args, **kwargs)

    class TemplateNamespace(jinja2.utils.Namespace):
        def __init__(*args: Any, **kwargs: Any) -> None:
            self, args = args[0], args[1:]
            attrs = dict(*args, **kwargs)
            for name in attrs:
                TemplateNamespace._check_name(name)
            jinja2.utils.Namespace.__init__(self, attrs)

        def __setitem__(self, name: str, value: Any) -> None:
            TemplateNamespace._check_name(name)
            jinja2.utils.Namespace.__setitem__(self, name, value)

        @staticmethod
        def _check_name(name: Any) -> None:
            if isinstance(name, str) and name.startswith("_"):
                raise jinja2.exceptions.SecurityError(f"a chat template cannot set {name!r} on a namespace")

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[Generation, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    env.globals["dict"] = TemplateDict()
    env.globals["namespace"] = TemplateNamespace
    return env.from_string(source)


def _plain(value: Any) -> Any:
    """What a template may see, rebuilt from plain JSON types (transformers' ``_plain_template_data``)."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    if isinstance(value, str):
        return str.__str__(value)
    if isinstance(value, int):
        return int.__int__(value)
    if isinstance(value, float):
        return float.__float__(value)
    if isinstance(value, Mapping):
        return {_plain(k): _plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_plain(v) for v in value]
    if isinstance(value, tuple):
        return tuple(_plain(v) for v in value)
    if isinstance(value, np.generic):
        return _plain(value.item())
    if callable(getattr(value, "model_dump", None)):  # pydantic models
        return _plain(value.model_dump())
    return f"<{type(value).__name__}>"


def _with_reasoning_aliases(message: dict) -> dict:
    """transformers' ``_alias_reasoning_fields``: a message's reasoning under every name templates read."""
    reasoning = next((message[key] for key in _REASONING_FIELDS if message.get(key) is not None), None)
    return message if reasoning is None else {"thinking": reasoning, **message, "reasoning_content": reasoning}
