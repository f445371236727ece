"""Frozen, typed configuration: the sharing pattern and the model dimensions (T5 and the looped LM).

Configs are plain frozen dataclasses. Dicts (from YAML, flags or a checkpoint)
become configs only through ``from_dict``, which rejects unknown keys by name
and coerces values by the field types.
"""

from __future__ import annotations

import dataclasses
import re
import types
import typing
from dataclasses import dataclass
from typing import Any, Literal, TypeVar

T = TypeVar("T")

_CORE = re.compile(r"^\s*(\d+)\s*x\s*(\d+)\s*$")
_COUNT = re.compile(r"^\s*(\d+)\s*$")


@dataclass(frozen=True)
class SharingPattern:
    """``P+NxM+C``: a prelude of P layers run once, N unique layers applied M times in CYCLE order (1,2,1,2,...),
    a coda of C layers; ``NxM`` alone has neither prelude nor coda (P = C = 0).

    Virtual layers (``depth``, ``physical_layer``, ``loop_of``) count the looped core only: the prelude runs
    once per token, and where the coda runs (after every loop, as the looped LM's exit) is the model's to say.
    """

    n_unique: int
    n_loops: int
    prelude: int = 0
    coda: int = 0

    def __post_init__(self) -> None:
        if self.n_unique < 1:
            raise ValueError(f"sharing pattern needs at least 1 unique layer, got N={self.n_unique}")
        if self.n_loops < 1:
            raise ValueError(f"sharing pattern needs at least 1 loop, got M={self.n_loops}")
        if self.prelude < 0 or self.coda < 0:
            raise ValueError(f"sharing pattern needs P, C >= 0, got P={self.prelude}, C={self.coda}")

    @classmethod
    def parse(cls, text: str) -> SharingPattern:
        """Parse ``"2x6"``, ``"1+2x6+1"``, ``"1+2x6"`` or ``"2x6+1"``; ``"2x0"``, ``"x6"``, ``"12"``, ``"0+2x6"`` or
        ``"1+2x6+1+1"`` raise ``ValueError`` naming the problem."""
        if not isinstance(text, str):
            raise TypeError(f"sharing pattern must be a string like '2x6', got {type(text).__name__}")
        parts = text.lower().split("+")
        cores = [i for i, part in enumerate(parts) if "x" in part]
        if not cores:
            raise ValueError(f"sharing pattern {text!r} has no 'x': write N unique layers x M loops, e.g. '2x6'")
        if len(cores) > 1:
            raise ValueError(f"sharing pattern {text!r} has {len(cores)} looped parts NxM; write one, e.g. '1+2x6+1'")
        core = cores[0]
        if core > 1 or len(parts) - core > 2:
            raise ValueError(
                f"sharing pattern {text!r} has too many '+' parts: write P+NxM+C (prelude, core, coda), "
                f"each of P+ and +C optional, e.g. '1+2x6+1'"
            )
        n, m = cls._core(parts[core], text)
        prelude = cls._count(parts[0], "P (prelude layers)", "before", text) if core == 1 else 0
        coda = cls._count(parts[core + 1], "C (coda layers)", "after", text) if len(parts) > core + 1 else 0
        return cls(n, m, prelude, coda)

    @staticmethod
    def _core(core: str, text: str) -> tuple[int, int]:
        """N and M of the looped part ``core`` of the pattern ``text`` (named in the errors)."""
        left, _, right = core.partition("x")
        if not left.strip():
            raise ValueError(f"sharing pattern {text!r} is missing N (unique layers) before the 'x', e.g. '2x6'")
        if not right.strip():
            raise ValueError(f"sharing pattern {text!r} is missing M (loops) after the 'x', e.g. '2x6'")
        match = _CORE.match(core)
        if match is None:
            raise ValueError(f"sharing pattern {text!r} is not of the form NxM with positive integers, e.g. '2x6'")
        n, m = int(match.group(1)), int(match.group(2))
        if n == 0:
            raise ValueError(f"sharing pattern {text!r}: N (unique layers) must be at least 1")
        if m == 0:
            raise ValueError(f"sharing pattern {text!r}: M (loops) must be at least 1")
        return n, m

    @staticmethod
    def _count(part: str, name: str, side: str, text: str) -> int:
        """The prelude or coda layer count (``name``) written in ``part``, on ``side`` of the core."""
        match = _COUNT.match(part)
        if match is None:
            raise ValueError(
                f"sharing pattern {text!r} needs {name} {side} the core as a positive integer, e.g. '1+2x6+1'"
            )
        if int(match.group(1)) == 0:
            raise ValueError(f"sharing pattern {text!r}: {name} must be at least 1 (omit it for none)")
        return int(match.group(1))

    @property
    def depth(self) -> int:
        """Number of virtual layers of the looped core (its layer runs per token): N * M."""
        return self.n_unique * self.n_loops

    def one_loop(self) -> SharingPattern:
        """The same layers looped once, the shallow decoder SPEED is measured against: ``2x6`` -> ``2x1``,
        ``1+2x6+1`` -> ``1+2x1+1``."""
        return dataclasses.replace(self, n_loops=1)

    def physical_layer(self, virtual_layer: int) -> int:
        """The unique layer that runs as ``virtual_layer`` (0..depth-1, CYCLE order)."""
        if not 0 <= virtual_layer < self.depth:
            raise IndexError(f"virtual layer {virtual_layer} outside [0, {self.depth}) for pattern {self}")
        return virtual_layer % self.n_unique

    def loop_of(self, virtual_layer: int) -> int:
        """The loop (0-based) that ``virtual_layer`` belongs to."""
        if not 0 <= virtual_layer < self.depth:
            raise IndexError(f"virtual layer {virtual_layer} outside [0, {self.depth}) for pattern {self}")
        return virtual_layer // self.n_unique

    def __str__(self) -> str:
        prelude, coda = f"{self.prelude}+" if self.prelude else "", f"+{self.coda}" if self.coda else ""
        return f"{prelude}{self.n_unique}x{self.n_loops}{coda}"


def require_positive(config: Any, *names: str) -> None:
    """A config's check of its counts and sizes: ``ValueError`` for the first of the fields ``names`` below 1."""
    for name in names:
        value = getattr(config, name)
        if value < 1:
            raise ValueError(f"{type(config).__name__}.{name} must be positive, got {value}")


C = TypeVar("C", bound="PatternedConfig")


class PatternedConfig:
    """What both model configs (``ModelConfig``, ``LMConfig``) offer: their sharing pattern parsed, and a checked
    ``replace``."""

    pattern: str

    @property
    def sharing(self) -> SharingPattern:
        """The parsed sharing pattern."""
        return SharingPattern.parse(self.pattern)

    def replace(self: C, **changes: Any) -> C:
        """A copy with some fields changed (unknown fields are an error)."""
        return from_dict(type(self), {**to_dict(self), **changes})


@dataclass(frozen=True)
class ModelConfig(PatternedConfig):
    """A T5 v1.1 encoder with a parameter-shared, early-exit decoder.

    T5 v1.1 details: RMS norm without bias, relative position bias (computed by
    the first layer, shared by all layers of the stack), gated-GELU FFN, untied
    input embedding and LM head, no 1/sqrt(d) attention scaling.
    """

    vocab_size: int = 32128  # T5's SentencePiece vocabulary padded to a multiple of 128
    d_model: int = 768
    n_heads: int = 12
    d_kv: int = 64
    d_ff: int = 2048
    n_encoder_layers: int = 12
    pattern: str = "2x6"  # decoder sharing pattern NxM
    dropout: float = 0.1
    relative_buckets: int = 32
    relative_max_distance: int = 128
    layer_norm_eps: float = 1e-6
    pad_id: int = 0  # also T5's decoder start token
    eos_id: int = 1

    def __post_init__(self) -> None:
        sharing = SharingPattern.parse(self.pattern)  # validates
        if sharing.prelude or sharing.coda:
            raise ValueError(f"ModelConfig.pattern {self.pattern!r}: T5's decoder has no prelude or coda; write NxM")
        sizes = ("vocab_size", "d_model", "n_heads", "d_kv", "d_ff", "relative_buckets", "relative_max_distance")
        require_positive(self, *sizes, "n_encoder_layers")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"ModelConfig.dropout must be in [0, 1), got {self.dropout}")
        for name in ("pad_id", "eos_id"):
            if not 0 <= getattr(self, name) < self.vocab_size:
                raise ValueError(
                    f"ModelConfig.{name}={getattr(self, name)} outside the vocabulary [0, {self.vocab_size})"
                )


PRESETS: dict[str, ModelConfig] = {
    # T5 v1.1 Base dimensions (the paper's model).
    "base": ModelConfig(),
    # T5 v1.1 Small dimensions.
    "small": ModelConfig(d_model=512, n_heads=6, d_kv=64, d_ff=1024, n_encoder_layers=8),
    # A few-minute CPU model for demos and the default local jobs.
    "mini": ModelConfig(vocab_size=8192, d_model=256, n_heads=4, d_kv=64, d_ff=768, n_encoder_layers=4),
    # Tests: milliseconds per forward.
    "tiny": ModelConfig(vocab_size=128, d_model=32, n_heads=2, d_kv=16, d_ff=64, n_encoder_layers=2, dropout=0.0),
}


def preset(name: str, **overrides: Any) -> ModelConfig:
    """A named preset (``base``, ``small``, ``mini``, ``tiny``) with optional field overrides."""
    if name not in PRESETS:
        raise ValueError(f"unknown model preset {name!r}; choose one of {sorted(PRESETS)}")
    return PRESETS[name].replace(**overrides) if overrides else PRESETS[name]


Norm = Literal["pre", "sandwich", "residual"]  # where a block normalises (LMConfig's docstring)
NORMS: tuple[str, ...] = typing.get_args(Norm)
RopeLayout = Literal["halves", "pairs"]  # which dimensions rotary embeddings rotate together
ROPE_LAYOUTS: tuple[str, ...] = typing.get_args(RopeLayout)


@dataclass(frozen=True)
class LMConfig(PatternedConfig):
    """A decoder-only looped transformer (``speed.models.looped_lm.LoopedLM``) of Llama blocks, an exit after each loop.

    Blocks: RMS norm, rotary position embeddings, SwiGLU FFN, no biases, grouped-query attention when
    ``n_kv_heads < n_heads``. ``norm``: ``pre`` (Llama: a norm before each sublayer), ``sandwich`` (Ouro: also
    a norm on each sublayer's output, ``h + norm(f(norm(h)))``) or ``residual`` (Huginn: also a norm on each
    residual sum, ``norm(h + f(norm(h)))``). ``pattern``: ``P+NxM+C`` (``SharingPattern``). ``loop_norm``: the
    final norm's output, not the raw core output, feeds the next loop (Ouro). ``injection``: each loop's input
    is ``adapter([state, prelude output])`` (Huginn; the state is zero before the first loop).

    The options of the published looped LMs, each off by default: ``rope_layout`` ``halves`` (Llama: dimension
    i turns with i + D/2) or ``pairs`` (Huginn: 2i with 2i + 1); ``qk_bias``, a learned bias on queries and
    keys before the rotation (Huginn); ``embed_scale``, the embedding's factor (Huginn: sqrt(d_model));
    ``coda_norm``, the final norm also before the coda, the same weights (Huginn's ``ln_f`` twice);
    ``adapter_bias``, the injection adapter's bias; ``exit_gate``, a Linear(d, 1) on each exit's normed state
    whose sigmoid is that loop's exit probability lambda (Ouro's ``early_exit_gate``).
    """

    vocab_size: int = 32128  # T5's, so that the two families compare at equal embedding sizes
    d_model: int = 768
    n_heads: int = 12
    n_kv_heads: int = 12  # a divisor of n_heads; fewer than n_heads is grouped-query attention
    head_dim: int = 64  # even: rotary embeddings rotate pairs of dimensions
    d_ff: int = 2048
    pattern: str = "2x6"
    norm: Norm = "pre"
    loop_norm: bool = False
    injection: bool = False
    rope_theta: float = 10000.0
    rope_layout: RopeLayout = "halves"
    qk_bias: bool = False
    embed_scale: float = 1.0
    coda_norm: bool = False
    adapter_bias: bool = False
    exit_gate: bool = False
    norm_eps: float = 1e-6
    tie_embeddings: bool = False  # the LM head reuses the input embedding (SmolLM); untied as in T5 v1.1 and Ouro
    eos_id: int = 1

    def __post_init__(self) -> None:
        SharingPattern.parse(self.pattern)  # validates
        require_positive(self, "vocab_size", "d_model", "n_heads", "n_kv_heads", "head_dim", "d_ff")
        if self.n_heads % self.n_kv_heads:
            raise ValueError(f"LMConfig.n_heads={self.n_heads} is not a multiple of n_kv_heads={self.n_kv_heads}")
        if self.head_dim % 2:
            raise ValueError(f"LMConfig.head_dim must be even (rotary embeddings), got {self.head_dim}")
        if self.norm not in NORMS:
            raise ValueError(f"LMConfig.norm must be one of {list(NORMS)}, got {self.norm!r}")
        if self.rope_layout not in ROPE_LAYOUTS:
            raise ValueError(f"LMConfig.rope_layout must be one of {list(ROPE_LAYOUTS)}, got {self.rope_layout!r}")
        if self.adapter_bias and not self.injection:
            raise ValueError("LMConfig.adapter_bias needs injection (the adapter it biases)")
        for name in ("rope_theta", "norm_eps", "embed_scale"):
            if not getattr(self, name) > 0:
                raise ValueError(f"LMConfig.{name} must be positive, got {getattr(self, name)}")
        if not 0 <= self.eos_id < self.vocab_size:
            raise ValueError(f"LMConfig.eos_id={self.eos_id} outside the vocabulary [0, {self.vocab_size})")


# The T5 presets' layer sizes (d_model, heads x head size, FFN, vocabulary), so that a looped LM block has the
# parameters of a T5 encoder block and the two families compare layer for layer.
LM_PRESETS: dict[str, LMConfig] = {
    "base": LMConfig(),
    "small": LMConfig(d_model=512, n_heads=6, n_kv_heads=6, head_dim=64, d_ff=1024),
    "mini": LMConfig(vocab_size=8192, d_model=256, n_heads=4, n_kv_heads=4, head_dim=64, d_ff=768),
    "tiny": LMConfig(vocab_size=128, d_model=32, n_heads=2, n_kv_heads=2, head_dim=16, d_ff=64),
}


def lm_preset(name: str, **overrides: Any) -> LMConfig:
    """A named looped-LM preset (``base``, ``small``, ``mini``, ``tiny``) with optional field overrides."""
    if name not in LM_PRESETS:
        raise ValueError(f"unknown LM preset {name!r}; choose one of {sorted(LM_PRESETS)}")
    return LM_PRESETS[name].replace(**overrides) if overrides else LM_PRESETS[name]


def to_dict(config: Any) -> dict[str, Any]:
    """A frozen config as a plain dict (nested dataclasses become dicts)."""
    return dataclasses.asdict(config)


class ConfigError(ValueError):
    """A config value that does not fit its field, or a key that names no field."""


def from_dict(cls: type[T], data: dict[str, Any], where: str = "", built: dict[str, Any] | None = None) -> T:
    """Build the dataclass ``cls`` from ``data``; unknown keys and values of the wrong type are errors.

    Values are coerced by the field types (``int``, ``float``, ``bool``, ``str``,
    ``Literal``, optionals, tuples, nested dataclasses from nested dicts): YAML's
    ``1e-3`` (a string to YAML) becomes a float, while ``"maybe"`` for a ``bool``
    is a ``ConfigError`` naming the key (``where`` is the dotted prefix of this
    section in those messages, e.g. ``"train"``). ``built``: fields given as built values, taken as they are.
    """
    if not isinstance(data, dict):
        raise ConfigError(f"{where or cls.__name__} must be a mapping of keys to values, got {type(data).__name__}")
    fields = {f.name: f for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
    unknown = sorted(set(data) - set(fields))
    if unknown:
        raise ConfigError(f"unknown {cls.__name__} key(s) {unknown}; valid keys are {sorted(fields)}")
    hints = typing.get_type_hints(cls)
    kwargs = {key: coerce(value, hints[key], f"{where}.{key}" if where else key) for key, value in data.items()}
    return cls(**kwargs, **(built or {}))


_TRUE, _FALSE = ("true", "yes", "on"), ("false", "no", "off")


def coerce(value: Any, annotation: Any, key: str) -> Any:
    """``value`` as the type ``annotation`` names, or a ``ConfigError`` naming ``key``."""
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if annotation is Any:
        return value
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        options = [a for a in args if a is not type(None)]
        errors = []
        for option in options:
            try:
                return coerce(value, option, key)
            except ConfigError as err:
                errors.append(str(err))
        raise ConfigError(errors[0] if len(errors) == 1 else f"{key}: {value!r} fits none of {options}")
    if origin is typing.Literal:
        for choice in args:
            try:
                if coerce(value, type(choice), key) == choice:
                    return choice
            except ConfigError:
                continue
        raise ConfigError(f"{key}: expected one of {list(args)}, got {value!r}")
    if origin is tuple:
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{key}: expected a list, got {value!r}")
        if len(args) == 2 and args[1] is Ellipsis:
            return tuple(coerce(v, args[0], f"{key}[{i}]") for i, v in enumerate(value))
        if len(value) != len(args):
            raise ConfigError(f"{key}: expected {len(args)} values, got {len(value)}: {value!r}")
        return tuple(coerce(v, a, f"{key}[{i}]") for i, (v, a) in enumerate(zip(value, args)))
    if dataclasses.is_dataclass(annotation):
        return value if isinstance(value, annotation) else from_dict(annotation, value, key)
    if annotation is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.strip().lower() in _TRUE + _FALSE:
            return value.strip().lower() in _TRUE
        raise ConfigError(f"{key}: expected true or false, got {value!r}")
    if annotation is int:
        return _number(value, int, key)
    if annotation is float:
        return _number(value, float, key)
    if annotation is str:
        if isinstance(value, str):
            return value
        raise ConfigError(f"{key}: expected a string, got {value!r} (quote it in YAML)")
    return value


def _number(value: Any, kind: type, key: str) -> Any:
    """An int or float from a number or a numeric string; bools and fractional ints are refused."""
    number = value
    if isinstance(value, str):
        try:
            number = float(value) if kind is float or not value.strip().lstrip("+-").isdigit() else int(value)
        except ValueError:
            raise ConfigError(f"{key}: expected {'an integer' if kind is int else 'a number'}, got {value!r}") from None
    if isinstance(number, bool) or not isinstance(number, (int, float)):
        raise ConfigError(f"{key}: expected {'an integer' if kind is int else 'a number'}, got {value!r}")
    if kind is int:
        if isinstance(number, float) and not number.is_integer():
            raise ConfigError(f"{key}: expected an integer, got {value!r}")
        return int(number)
    return float(number)
