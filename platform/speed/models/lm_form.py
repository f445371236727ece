"""What the published decoder-only forms share (``speed.models.form.Form``: Llama, Ouro, Huginn), as a base class."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from speed.hf_tokenizer import TOKENIZER_FILE, load_tokenizer
from speed.models.looped_lm import InitialState


class LMForm:
    """What the published decoder-only forms share (``speed.models.form.Form``; Llama, Ouro, Huginn): their tokenizer
    is their folder's ``tokenizer.json`` with its chat template, and their config reader refuses, naming the field,
    what does not convert (no check before it). A form with an injected initial state overrides ``initial_state``."""

    tokenizer_file = TOKENIZER_FILE
    job_pattern = False
    chat = True
    prompt_eos = False  # a decoder-only LM continues its prompt
    seeded_state = False

    def check(self, hf: Mapping[str, Any]) -> None:
        return None

    def tokenizer(self, directory: Path) -> Path:
        load_tokenizer(directory)  # no tokenizer.json, or a broken one: its line
        return directory

    def initial_state(self, path: str | Path, seed: int) -> InitialState | None:
        return None
