"""One loader for every model the platform computes: ``from_pretrained(path)``.

A Hugging Face directory (config.json and safetensors), its form read from config.json
(``speed.hf_files.model_form``): a T5 v1.1 (``convert_t5``), a Llama (``convert_llama``), Ouro
(``convert_ouro``) or Huginn-0125 (``convert_huginn``); or a platform checkpoint (``model.pt`` beside a
config.json with a ``model`` section, or a run directory of them; ``speed.models.checkpoint.load_model``).
Either may be a local path or a URI (``s3://...``); a Hugging Face directory on object storage is copied to a
temporary local folder first, since safetensors are read from a local file.
Code in the directory (config.json's ``auto_map``) is never imported or run: the weights are read from
safetensors alone, the configs as data.

``load_pretrained(path)`` is the same as a ``LoadedModel``, what every job that reads a model takes
(``--checkpoint``, ``--init-from``): a Hugging Face directory's tokenizer is the directory itself
(``speed.hf_tokenizer.load_tokenizer`` reads it as an ``HFTokenizer``, its stop ids and chat template with it).
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

import torch

from speed.config import LMConfig, to_dict
from speed.hf_files import model_form, read_config, read_weights
from speed.hf_tokenizer import TOKENIZER_FILE
from speed.models.checkpoint import MODEL_FILE, LoadedModel, latest_checkpoint, load_model, read_checkpoint_config
from speed.models.convert_huginn import config_from_huginn, load_huginn
from speed.models.convert_ouro import config_from_ouro, load_ouro
from speed.models.family import family_of
from speed.models.looped_lm import LoopedLM
from speed.models.precision import with_dtype
from speed.models.t5 import SpeedT5
from speed.storage import absolute, locate

LOOPED = {"ouro": load_ouro, "huginn": load_huginn}  # form -> loader taking n_loops


def from_pretrained(
    path: str | Path, *, dtype: torch.dtype = torch.float32, n_loops: int | None = None
) -> SpeedT5 | LoopedLM:
    """The model at ``path`` (a Hugging Face directory or a platform checkpoint), in eval mode, as ``dtype``
    (``torch.bfloat16``: bf16 weights, the linear weights bfloat16 and the rest float32; ``speed.models.precision``).

    ``n_loops``: the recurrences of a published looped LM (Ouro's ``total_ut_steps``, Huginn's
    ``num_steps``), by default the checkpoint's own; other models loop as their pattern says, and refuse it.
    """
    if _is_platform_checkpoint(path):
        _no_loop_option(n_loops, "a platform checkpoint")
        return with_dtype(load_model(str(path)).model, dtype)
    where = locate(path)
    if not where.local:  # safetensors are read from local files: the directory comes here first
        with tempfile.TemporaryDirectory(prefix="speed-pretrained-") as local:
            where.download(local)
            return from_pretrained(local, dtype=dtype, n_loops=n_loops)
    form = model_form(read_config(path))
    if form in LOOPED:
        return LOOPED[form](path, dtype=dtype, n_loops=n_loops)
    _no_loop_option(n_loops, f"a {form} checkpoint")
    return with_dtype((_load_t5 if form == "t5" else _load_llama)(path), dtype).eval()


def load_pretrained(
    path: str | Path, map_location: str | torch.device = "cpu", exits: bool = True, n_loops: int | None = None
) -> LoadedModel:
    """The model at ``path`` as the jobs read it: a platform checkpoint or run (``load_model``, its exit adapters
    attached with ``exits``), or a Hugging Face directory (``from_pretrained``, float32; detected by its
    config.json) with its tokenizer's location (the directory, where it holds tokenizer.json) and a config whose
    ``model`` and ``family`` sections are the converted model's. A directory the platform cannot read is a
    one-line ``ValueError`` or ``FileNotFoundError`` before anything is written."""
    if _is_platform_checkpoint(path):
        _no_loop_option(n_loops, "a platform checkpoint")
        return load_model(str(path), map_location=map_location, exits=exits)
    model = from_pretrained(path, n_loops=n_loops).to(map_location)
    where = locate(absolute(str(path)))
    form = model_form(json.loads((where / "config.json").read_text()))
    config = {"model": to_dict(model.config), "family": family_of(model).name, "hf": {"form": form}}
    tokenizer = where.uri if (where / TOKENIZER_FILE).is_file() else None
    return LoadedModel(model, tokenizer, config, where.uri)


def pretrained_config(path: str | Path) -> LMConfig:
    """The ``LMConfig`` that ``from_pretrained`` gives an imported LM directory (Ouro, Huginn, Llama; a local path),
    read from its config.json alone (no weights): what a job that finetunes it resolves on its driver."""
    hf = read_config(path)
    form = model_form(hf)
    if form == "llama":
        from transformers import LlamaConfig

        from speed.models.convert_llama import config_from_llama

        return config_from_llama(LlamaConfig.from_dict(hf))
    if form not in LOOPED:
        raise ValueError(f"{path} is a Hugging Face {form} directory, not an imported looped LM (Ouro, Huginn, Llama)")
    return (config_from_ouro if form == "ouro" else config_from_huginn)(hf)


def model_source(path: str | Path) -> str:
    """What ``load_pretrained(path)`` would read, checked without reading weights: ``platform`` (a checkpoint, or a
    run with a complete one) or a Hugging Face form (``speed.hf_files.FORMS``); a one-line ``ValueError`` or
    ``FileNotFoundError`` for a directory the platform cannot read. A job checks it before starting anything."""
    if _is_platform_checkpoint(path):
        read_checkpoint_config(latest_checkpoint(absolute(str(path))))  # a missing or empty folder: its error
        return "platform"
    return model_form(json.loads((locate(path) / "config.json").read_text()))


def _is_platform_checkpoint(path: str | Path) -> bool:
    """A folder (local or a URI) with the platform's ``model.pt``, or one without config.json (a training run's
    folder)."""
    where = locate(path)
    return (where / MODEL_FILE).is_file() or not (where / "config.json").is_file()


def _no_loop_option(n_loops: int | None, what: str) -> None:
    if n_loops is not None:
        raise ValueError(f"n_loops={n_loops}: {what} loops as its pattern says; n_loops is for Ouro and Huginn")


def _load_t5(path: str | Path) -> SpeedT5:
    """A T5 v1.1 directory through ``convert_t5``, its weights read from safetensors."""
    from transformers import T5Config

    from speed.models.convert_t5 import config_from_hf, from_hf_state_dict, hf_decoder_depth

    hf = T5Config.from_dict(read_config(path))
    weights = read_weights(path)
    if hf.tie_word_embeddings:  # saved without the head, which transformers ties to ``shared`` when loading
        weights.setdefault("lm_head.weight", weights["shared.weight"])
    return from_hf_state_dict(weights, config_from_hf(hf), hf_decoder_depth(hf))


def _load_llama(path: str | Path) -> LoopedLM:
    """A Llama directory through ``convert_llama`` (the plain stack, ``{layers}x1``), from safetensors."""
    from transformers import LlamaConfig

    from speed.models.convert_llama import config_from_llama, from_llama_state_dict

    hf = LlamaConfig.from_dict(read_config(path))
    return from_llama_state_dict(read_weights(path), config_from_llama(hf), hf.num_hidden_layers)
