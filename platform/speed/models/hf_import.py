"""What the converters of published forms share (``convert_t5``, ``convert_llama``, ``convert_ouro``,
``convert_huginn``): config.json's fields read with one-line errors, the names of a state dict checked, an empty
model that the weights are read into, a refused ``n_loops``, and the dtype an exporter writes.

A field the platform cannot honour (a sliding window, scaled rotary embeddings, test-time noise, ...) is an
``UnsupportedConfig`` naming it; the weights' names and shapes are checked (``speed.hf_files.check_shapes``)
before any is read, then each is read into its place in a model allocated once (``empty_model``,
``row_destinations``, ``speed.hf_files.read_into``).
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping
from pathlib import Path
from typing import Any, TypeVar

import torch
from torch import Tensor, nn

from speed.config import LMConfig, ModelConfig
from speed.hf_files import ModelFilesError, WeightsError
from speed.models.family import build_model
from speed.models.looped_lm import LoopedLM
from speed.models.precision import with_dtype
from speed.models.t5 import SpeedT5

_REQUIRED = object()
M = TypeVar("M", bound=nn.Module)


class UnsupportedConfig(ModelFilesError):
    """config.json holds a field the platform's model cannot compute, or lacks one it needs (one line)."""


def field(config: Mapping[str, Any], name: str, default: Any = _REQUIRED) -> Any:
    """``config[name]``; ``default`` when absent (or null), an ``UnsupportedConfig`` when absent and required."""
    value = config.get(name)
    if value is None:
        if default is _REQUIRED:
            raise UnsupportedConfig(f"config.json lacks {name}")
        return default
    return value


def expect(config: Mapping[str, Any], name: str, allowed: Any, why: str) -> None:
    """An ``UnsupportedConfig`` unless ``config[name]`` (when present) equals ``allowed``; ``why`` says what the
    platform computes instead."""
    value = config.get(name, allowed)
    if value != allowed:
        raise UnsupportedConfig(f"config.json: {name}={value!r}, but {why} ({name}={allowed!r})")


def rope_theta(config: Mapping[str, Any], name: str = "rope_theta", default: float | None = None) -> float:
    """The rotary base: ``rope_parameters.rope_theta`` (transformers >= 5 keeps it there, beside ``rope_type``) or
    the top-level ``name`` (before; Huginn's ``rope_base``), else ``default``. Scaled rotary embeddings (a
    ``rope_type`` other than ``default``, in ``rope_parameters`` or ``rope_scaling``) are an ``UnsupportedConfig``:
    LoopedLM's are unscaled, and would otherwise compute another model without a word."""
    params = config.get("rope_parameters") or {}
    if "rope_type" not in params and isinstance(params.get("full_attention"), Mapping):
        params = params["full_attention"]  # one entry per attention kind; LoopedLM has full attention only
    scaling = config.get("rope_scaling") or {}
    kind = params.get("rope_type", scaling.get("rope_type", scaling.get("type", "default")))
    if kind != "default":
        raise UnsupportedConfig(f"config.json: rope_type={kind!r}, but LoopedLM's rotary embeddings are unscaled "
                                "(rope_type='default')")  # fmt: skip
    theta = params.get("rope_theta", config.get(name, default))
    if theta is None:
        raise UnsupportedConfig(f"config.json lacks {name} (or rope_parameters.rope_theta)")
    return float(theta)


def single_eos(config: Mapping[str, Any]) -> int:
    """config.json's one end-of-sequence token id (``eos_token_id``: a number, or a list of one)."""
    eos = field(config, "eos_token_id")
    if isinstance(eos, list) and len(eos) == 1:
        eos = eos[0]
    if not isinstance(eos, int) or isinstance(eos, bool):
        raise UnsupportedConfig(f"config.json: eos_token_id={eos!r}, but LoopedLM needs exactly one EOS token")
    return eos


def loop_count(n_loops: int | None, default: int, option: str) -> int:
    """The recurrences to run: ``n_loops`` (``option``, as the published model names it) or the checkpoint's
    ``default``; a ``ValueError`` unless it is a positive integer."""
    count = default if n_loops is None else n_loops
    if not isinstance(count, int) or isinstance(count, bool) or count < 1:
        raise ValueError(f"n_loops ({option}) must be a positive integer, got {count!r}")
    return count


def no_loop_option(n_loops: int | None, what: str) -> None:
    """Refuse ``n_loops`` for ``what``, which loops as its pattern says (a form that is not ``looped``)."""
    if n_loops is not None:
        raise ValueError(f"n_loops={n_loops}: {what} loops as its pattern says; n_loops is for Ouro and Huginn")


def weights_dtype(model: nn.Module) -> torch.dtype:
    """The dtype the model's weights are in (and exported in)."""
    return next(model.parameters()).dtype


def empty_model(config: ModelConfig | LMConfig, dtype: torch.dtype) -> SpeedT5 | LoopedLM:
    """A model of ``config`` in the mode ``dtype`` names (``speed.models.precision.with_dtype``), its parameters
    allocated and not initialised (built on the meta device): what a loader fills with ``read_into``, the model's
    memory allocated once and touched once. A tied head is the embedding."""
    with torch.device("meta"):
        model = build_model(config)
    model = with_dtype(model, dtype).to_empty(device="cpu")
    if getattr(config, "tie_embeddings", False):  # to_empty gives each module its own tensor: one parameter again
        model.lm_head.weight = model.embed_tokens.weight
    return model


def row_destinations(
    where: str | Path,
    model: nn.Module,
    sources: Mapping[str, tuple[str, ...]],
    shapes: Mapping[str, tuple[int, ...]],
    copied: Collection[str] = (),
) -> dict[str, Tensor]:
    """Published tensor name -> the rows of ``model``'s parameter it fills, where ``sources[ours]`` are the published
    tensors concatenated along dim 0 into our parameter ``ours`` (``q;k;v``) and ``shapes`` their stored shapes: so
    that loading writes each parameter in place and concatenates nothing. A ``WeightsError`` line (prefixed
    ``where``) where a parameter has no source (but those ``copied`` from another by the caller) or its sources'
    shapes do not make it."""
    parameters = dict(model.named_parameters())
    unfilled = sorted(set(parameters) - set(sources) - set(copied))
    if unfilled:
        raise WeightsError(f"{where}: nothing loads {len(unfilled)} parameter(s) of the model: {unfilled[:5]}")
    found: dict[str, Tensor] = {}
    for ours, names in sources.items():
        parameter, row = parameters[ours], 0
        fits = all(tuple(shapes[name][1:]) == tuple(parameter.shape[1:]) for name in names)
        for name in names:
            rows = shapes[name][0] if shapes[name] else 1
            found[name] = parameter[row : row + rows]
            row += rows
        if not fits or row != parameter.shape[0] or (len(names) == 1 and len(shapes[names[0]]) != parameter.dim()):
            stored = " + ".join(f"{name} {tuple(shapes[name])}" for name in names)
            raise WeightsError(f"{where}: {stored} cannot make {ours} of shape {tuple(parameter.shape)}")
    return found


def check_names(state_dict: dict[str, Tensor], used: set[str], skipped: Callable[[str], bool]) -> None:
    """Refuse (``KeyError``) a state dict that lacks a tensor in ``used`` or holds one neither used nor ``skipped``."""
    missing = sorted(hf for hf in used if hf not in state_dict)
    if missing:
        raise KeyError(f"HF state dict lacks {len(missing)} tensor(s) the conversion needs: {missing}")
    unexpected = sorted(k for k in state_dict if k not in used and not skipped(k))
    if unexpected:
        raise KeyError(f"HF state dict has {len(unexpected)} tensor(s) this conversion does not know: {unexpected}")


def fill_parameters(model: M, values: dict[str, tuple[Tensor, str]]) -> M:
    """``model`` with every parameter copied from ``values[name] = (tensor, the HF tensors it came from)``.

    A parameter without a value, or a value of another shape, is an error.
    """
    params = dict(model.named_parameters())
    unfilled = sorted(set(params) - set(values))
    if unfilled:
        raise RuntimeError(f"conversion plan leaves {type(model).__name__} parameter(s) unfilled: {unfilled}")
    with torch.no_grad():
        for name, (value, origin) in values.items():
            if value.shape != params[name].shape:
                raise ValueError(
                    f"{name} expects shape {tuple(params[name].shape)}, HF {origin} give {tuple(value.shape)}"
                )
            params[name].copy_(value)
    return model
