"""One loader for every model the platform computes: ``from_pretrained(path)``.

A Hugging Face directory (config.json and safetensors), its form read from config.json
(``speed.models.form.form_of``: a T5 v1.1, a Llama, Ouro or Huginn-0125, each converted by its ``Form``); or a
platform checkpoint (``model.pt`` beside a config.json with a ``model`` section, or a run directory of them;
``speed.models.checkpoint.load_model``).
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

from speed.config import LMConfig, ModelConfig, to_dict
from speed.engine.memory import MemoryNeed, check_choice
from speed.engine.types import EngineConfig
from speed.hf_files import read_config
from speed.hf_tokenizer import TOKENIZER_FILE
from speed.models.checkpoint import (
    MODEL_FILE,
    SHARDED_DIR,
    LoadedModel,
    checkpoint_family,
    latest_checkpoint,
    load_model,
    read_checkpoint_config,
)
from speed.models.family import build_model, config_from_dict, family_of
from speed.models.form import Form, form_of
from speed.models.hf_import import no_loop_option
from speed.models.looped_lm import InitialState, LoopedLM
from speed.models.precision import DTYPES, dtype_named, with_dtype
from speed.models.t5 import SpeedT5
from speed.storage import absolute, locate


def from_pretrained(
    path: str | Path,
    *,
    dtype: torch.dtype = torch.float32,
    n_loops: int | None = None,
    capacity: EngineConfig | None = None,
    initial_state_seed: int | None = None,
) -> SpeedT5 | LoopedLM:
    """The model at ``path`` (a Hugging Face directory or a platform checkpoint), in eval mode, as ``dtype``
    (``torch.bfloat16``: bf16 weights, the linear weights bfloat16 and the rest float32; ``speed.models.precision``).

    ``n_loops``: the recurrences of a published looped LM (Ouro's ``total_ut_steps``, Huginn's ``num_steps``), by
    default the checkpoint's own; other models loop as their pattern says, and refuse it. ``initial_state_seed``:
    Huginn's published random initial state, drawn under this seed (``convert_huginn.huginn_initial_state``); None,
    the default, is the zero state; other forms refuse it (a platform checkpoint keeps the state it was saved with).
    The model is checked first (``check_load``, from config.json alone): its weights, and an engine of ``capacity``
    when given, must fit the memory available, else one ``MemoryBudgetError`` line says what would; then a Hugging
    Face directory is allocated once and read into.
    """
    if _is_platform_checkpoint(path):
        _no_pretrained_options(n_loops, initial_state_seed, "a platform checkpoint")
        check_load(path, dtype=dtype, capacity=capacity)
        return with_dtype(load_model(str(path)).model, dtype)
    where = locate(path)
    if not where.local:  # safetensors are read from local files: the directory comes here first
        with tempfile.TemporaryDirectory(prefix="speed-pretrained-") as local:
            where.download(local)
            return from_pretrained(
                local, dtype=dtype, n_loops=n_loops, capacity=capacity, initial_state_seed=initial_state_seed
            )
    form = form_of(read_config(path))
    state = _initial_state(path, form, initial_state_seed)  # a refusal before the memory check
    check_load(path, dtype=dtype, n_loops=n_loops, capacity=capacity)
    model = form.load(path, dtype=dtype, n_loops=n_loops)
    if state is not None:
        model.initial_state = state
    return model


def check_load(
    path: str | Path,
    *,
    dtype: torch.dtype = torch.float32,
    n_loops: int | None = None,
    capacity: EngineConfig | None = None,
) -> MemoryNeed:
    """What loading the model at ``path`` (a local Hugging Face directory, or a platform checkpoint or run: a path
    or a URI) as ``dtype`` needs, and an engine of ``capacity`` beside it, from config.json alone, if it fits the
    host's available memory (``SPEED_MEMORY_LIMIT`` bytes when set: ``speed.engine.memory.available_bytes``); else
    ``MemoryBudgetError``, one line naming the dtypes that fit (``speed.engine.memory.check_choice``).

    The engine counts as the engine allocates it: side entries with ``branches``, and a key/value pool of
    ``kv_blocks`` blocks, or, without them, of one request at its longest (``max_prompt_len + max_target_len``
    positions), since an engine caps its default pool by what is available down to that (``check_memory``)."""
    config = _stored_config(path) if _is_platform_checkpoint(path) else converted_config(path, n_loops)
    needs = {name: _need(config, dtype_named(name), capacity) for name in DTYPES}
    asked = str(dtype).removeprefix("torch.")
    if asked not in needs:
        needs[asked] = _need(config, dtype, capacity)
    return check_choice(Path(path).name or str(path), needs, asked, torch.device("cpu"))


def converted_config(path: str | Path, n_loops: int | None = None) -> ModelConfig | LMConfig:
    """The config ``from_pretrained`` gives the Hugging Face directory ``path`` (local), from its config.json alone."""
    hf = read_config(path)
    return form_of(hf).config(hf, n_loops)


def load_pretrained(
    path: str | Path,
    map_location: str | torch.device = "cpu",
    exits: bool = True,
    n_loops: int | None = None,
    dtype: torch.dtype = torch.float32,
    capacity: EngineConfig | None = None,
    initial_state_seed: int | None = None,
) -> LoadedModel:
    """The model at ``path`` as the jobs read it, as ``dtype`` (``with_dtype``), after its memory check with an
    engine of ``capacity`` (``check_load``): a platform checkpoint or run (``load_model``, its exit adapters
    attached with ``exits``), or a Hugging Face directory (``from_pretrained``, read straight into ``dtype``, with
    Huginn's ``initial_state_seed``; detected by its config.json) with its tokenizer's location (the directory,
    where it holds tokenizer.json) and a config whose ``model`` and ``family`` sections are the converted model's.
    A directory the platform cannot read is a one-line ``ValueError`` or ``FileNotFoundError`` before anything is
    written."""
    if _is_platform_checkpoint(path):
        _no_pretrained_options(n_loops, initial_state_seed, "a platform checkpoint")
        check_load(path, dtype=dtype, capacity=capacity)
        loaded = load_model(str(path), map_location=map_location, exits=exits)
        with_dtype(loaded.model, dtype)  # in place
        return loaded
    model = from_pretrained(
        path, n_loops=n_loops, dtype=dtype, capacity=capacity, initial_state_seed=initial_state_seed
    ).to(map_location)
    where = locate(absolute(str(path)))
    form = form_of(json.loads((where / "config.json").read_text())).name
    config = {"model": to_dict(model.config), "family": family_of(model).name, "hf": {"form": form}}
    tokenizer = where.uri if (where / TOKENIZER_FILE).is_file() else None
    return LoadedModel(model, tokenizer, config, where.uri)


def pretrained_config(path: str | Path) -> LMConfig:
    """The ``LMConfig`` that ``from_pretrained`` gives an imported LM directory (Ouro, Huginn, Llama; a local path),
    read from its config.json alone (no weights): what a job that finetunes it resolves on its driver."""
    config = converted_config(path)
    if not isinstance(config, LMConfig):
        form = form_of(read_config(path)).name
        raise ValueError(f"{path} is a Hugging Face {form} directory, not an imported looped LM (Ouro, Huginn, Llama)")
    return config


def model_source(path: str | Path) -> str:
    """What ``load_pretrained(path)`` would read, checked without reading weights: ``platform`` (a checkpoint, or a
    run with a complete one) or a Hugging Face form's name (``speed.models.form.FORMS``); a one-line ``ValueError`` or
    ``FileNotFoundError`` for a directory the platform cannot read. A job checks it before starting anything."""
    if _is_platform_checkpoint(path):
        read_checkpoint_config(latest_checkpoint(absolute(str(path))))  # a missing or empty folder: its error
        return "platform"
    return form_of(json.loads((locate(path) / "config.json").read_text())).name


def _is_platform_checkpoint(path: str | Path) -> bool:
    """A folder (local or a URI) with the platform's ``model.pt`` or an FSDP run's ``sharded/`` state, or one without
    config.json (a training run's folder)."""
    where = locate(path)
    stored = (where / MODEL_FILE).is_file() or (where / SHARDED_DIR / ".metadata").is_file()
    return stored or not (where / "config.json").is_file()


def _no_pretrained_options(n_loops: int | None, initial_state_seed: int | None, what: str) -> None:
    """A platform checkpoint's refusal of the published models' options."""
    no_loop_option(n_loops, what)
    if initial_state_seed is not None:
        raise ValueError(
            f"initial_state_seed={initial_state_seed}: {what} keeps the initial state it was saved with "
            "(config.json's initial_state); initial_state_seed is for Huginn directories"
        )


def _initial_state(path: str | Path, form: Form, seed: int | None) -> InitialState | None:
    """The initial state ``initial_state_seed`` asks of the ``form`` directory at ``path``: None (zero) without a
    seed; the form's seeded draw (Huginn's); a one-line ``ValueError`` for a form without injection."""
    if seed is None:
        return None
    if type(seed) is not int or seed < 0:
        raise ValueError(f"initial_state_seed must be an integer >= 0, got {seed!r}")
    state = form.initial_state(path, seed)
    if state is None:
        raise ValueError(
            f"initial_state_seed={seed}: the {form.name} form has no injected initial state (Huginn's has)"
        )
    return state


def _stored_config(path: str | Path) -> ModelConfig | LMConfig:
    """The model config of a platform checkpoint (or a run's newest), from its config.json alone."""
    config = read_checkpoint_config(latest_checkpoint(absolute(str(path))))
    if "model" not in config:
        raise ValueError(f"checkpoint {path} has no 'model' section in its config.json")
    return config_from_dict(config["model"], checkpoint_family(config))


def _need(config: ModelConfig | LMConfig, dtype: torch.dtype, capacity: EngineConfig | None) -> MemoryNeed:
    """What a model of ``config`` as ``dtype`` needs (built on the meta device: nothing allocated), with an engine of
    ``capacity`` when given."""
    with torch.device("meta"):
        stepper = with_dtype(build_model(config), dtype).stepper()
    if capacity is None:
        return MemoryNeed(stepper.weights_bytes(), 0, 0, 0)
    c = capacity
    blocks = c.kv_blocks
    if blocks is None:  # the engine caps its default pool by what is available, down to one request at its longest
        blocks = stepper.memory_need(1, c.max_prompt_len, c.max_target_len, side=False).blocks
    return stepper.memory_need(c.max_active, c.max_prompt_len, c.max_target_len, side=c.branches, blocks=blocks)
