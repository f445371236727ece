"""The published Hugging Face forms, behind one seam: T5 v1.1 (``t5``), Llama (``llama``), Ouro (``ouro``) and
Huginn-0125 (``huginn``).

A ``Form`` is the one place that knows a published layout: its name in config.json (``model_type``), its
config reader (config.json -> the platform's ``ModelConfig`` or ``LMConfig``), its loader (a directory read
straight into the platform's model), its exporter (the platform's model -> config.json and tensors under the
published names; None where the platform writes no such directory) and its tokenizer files. Each form lives
in its own converter module (``convert_t5``, ``convert_llama``, ``convert_ouro``, ``convert_huginn``); the
loader (``speed.models.pretrained``), the exporter (``speed.models.export``) and training's imports
(``speed.train.origin``, ``speed.train.exits``) ask this registry and compare no form's name. The decoder-only
forms share ``speed.models.lm_form.LMForm``. A fifth form is one new module with its ``Form`` and one entry in
``FORMS`` (``tests/test_forms.py`` registers one).
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any, Protocol

import torch

from speed.config import LMConfig, ModelConfig
from speed.hf_files import ModelFilesError
from speed.models.convert_huginn import HuginnForm
from speed.models.convert_llama import LlamaForm
from speed.models.convert_ouro import OuroForm
from speed.models.convert_t5 import T5Form
from speed.models.looped_lm import InitialState, LoopedLM
from speed.models.t5 import SpeedT5


class Form(Protocol):
    """What the platform needs to know of a published Hugging Face layout."""

    name: str  # the platform's name: export's ``--form``, ``model_source``'s answer, a loaded model's ``hf.form``
    model_type: str  # config.json's ``model_type``
    tokenizer_file: str  # the tokenizer file a directory of it holds (``tokenizer`` reads it)
    looped: bool  # published with a loop count, which ``n_loops`` replaces (Ouro's total_ut_steps, Huginn's num_steps)
    job_pattern: bool  # ``--init-from`` converts it into the job's own sharing pattern (``hub_config``, ``hub_model``)
    chat: bool  # an exported tokenizer of it carries the platform's chat template (a decoder-only LM's prompts)
    prompt_eos: bool  # a prompt is encoded ending in EOS (T5's encoder input); False: the decoder continues it
    seeded_state: bool  # published with a random initial state drawn under a seed (``initial_state``: Huginn's)
    exports: type | None  # the model class its exporter writes; None: the platform writes no directory of it

    def check(self, hf: Mapping[str, Any]) -> None:
        """A one-line ``ModelFilesError`` for a config.json of this ``model_type`` in a variant the platform lacks."""

    def config(self, hf: Mapping[str, Any], n_loops: int | None = None) -> ModelConfig | LMConfig:
        """The platform's config of config.json ``hf`` (``n_loops``: a looped form's recurrences; others refuse it)."""

    def load(self, path: str | Path, *, dtype: torch.dtype, n_loops: int | None = None) -> SpeedT5 | LoopedLM:
        """The model of the local directory ``path`` as ``dtype``, in eval mode, its memory allocated once."""

    def tokenizer(self, directory: Path) -> Path:
        """What tokenizes for a local directory of this form (its ``tokenizer_file``, or the folder holding it);
        a ``FileNotFoundError`` line when it lacks it."""

    def initial_state(self, path: str | Path, seed: int) -> InitialState | None:
        """The published random initial state drawn under ``seed``; None: the form has no injected state."""

    # the exporter, of a form whose ``exports`` is a class:
    # obstacle(model) -> the option that keeps ``model`` (an ``exports`` instance) out of the layout, None: it fits;
    # files(model) -> config.json and the tensors (published names) of ``model``: the inverse of ``load``.
    # Of a ``job_pattern`` form, whose ``hf:<name>`` may be a hub name:
    # hub_config(name, pattern) -> its config in a job's ``pattern``; hub_model(name, pattern) -> its model so.
    # Of a form the full-size writer (``speed.benchmarks.checkpoints``) writes at random:
    # shapes(hf) -> the tensors a directory of config.json ``hf`` stores (a tied head's copy included), in the
    # published order, and their shapes.


FORMS: dict[str, Form] = {form.name: form for form in (T5Form(), LlamaForm(), OuroForm(), HuginnForm())}


def get_form(name: str) -> Form:
    """The form ``name``; an unknown name is an error listing them."""
    if name not in FORMS:
        raise ValueError(f"unknown Hugging Face form {name!r}; choose one of {', '.join(FORMS)}")
    return FORMS[name]


def form_of(config: Mapping[str, Any]) -> Form:
    """The form config.json ``config`` describes (by its ``model_type``, then the form's own ``check``); a one-line
    ``ModelFilesError`` for any other model."""
    known = ", ".join(form.model_type for form in FORMS.values())
    model_type = config.get("model_type")
    if model_type is None:
        raise ModelFilesError(f"config.json has no model_type (known: {known})")
    form = next((form for form in FORMS.values() if form.model_type == model_type), None)
    if form is None:
        raise ModelFilesError(f"config.json: model_type {model_type!r} is not one the platform loads (known: {known})")
    form.check(config)
    return form


def export_forms() -> tuple[str, ...]:
    """The forms the platform writes (``speed.models.export``)."""
    return tuple(name for name, form in FORMS.items() if form.exports is not None)
