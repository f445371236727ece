"""What the importers of published looped LMs share (``convert_ouro``, ``convert_huginn``): config.json's
fields read with one-line errors, and a ``LoopedLM`` assembled from converted tensors.

A field the platform cannot honour (a sliding window, scaled rotary embeddings, test-time noise, ...) is an
``UnsupportedConfig`` naming it; the weights' names and shapes are checked by ``speed.hf_files.read_weights``
before any is read.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor

from speed.config import LMConfig
from speed.hf_files import ModelFilesError, WeightsError
from speed.models.looped_lm import LoopedLM

_REQUIRED = object()


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


def check_tied(where: str, weights: Mapping[str, Tensor], head: str, embedding: str) -> None:
    """A ``WeightsError`` when a tied checkpoint stores its LM head and it differs from the embedding."""
    if head in weights and not torch.equal(weights[head], weights[embedding]):
        raise WeightsError(f"{where}: tied checkpoint, but {head} differs from {embedding}")


def assemble(config: LMConfig, values: Mapping[str, Tensor]) -> LoopedLM:
    """A ``LoopedLM`` of ``config`` (eval mode) holding ``values`` (our parameter name -> tensor) as its
    parameters, not copies: built on the meta device, so no random weights are made first."""
    with torch.device("meta"):
        model = LoopedLM(config)
    values = dict(values)
    if config.tie_embeddings:
        values["lm_head.weight"] = values["embed_tokens.weight"]
    model.load_state_dict(values, strict=True, assign=True)
    if config.tie_embeddings:  # assign made two parameters of one tensor: one parameter again
        model.lm_head.weight = model.embed_tokens.weight
    return model.eval()
