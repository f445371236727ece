"""Export a platform model as a Hugging Face directory: ``export(model_or_checkpoint, out_dir, form=None)``.

The forms of the registry that write a model (``speed.models.form.FORMS``, those with an ``exports`` class; each
``Form.files`` lives in its converter module), each the exact inverse of its loader, so ``speed.from_pretrained``
reads the directory back:

- ``ouro``: a ``LoopedLM`` whose options are exactly Ouro's (``convert_ouro``: ``Lx{M}``, no prelude or coda,
  sandwich norms, loop norm, exit gate, rotary halves, no injection, query/key bias, embedding scale or coda
  norm) as Ouro's published layout: config.json with Ouro's fields (``model_type: "ouro"``, ``total_ut_steps``,
  an ``auto_map`` naming the public remote code, ``configuration_ouro.py`` and ``modeling_ouro.py``, which are
  not copied: fetch them from ByteDance/Ouro-1.4B to run it under ``transformers``) and the published
  tensor names. Nothing is lost: every loop's logits and exit gate are kept.
- ``llama``: a pre-norm ``LoopedLM`` (``P+NxM+C``) unrolled into a plain ``LlamaForCausalLM``: prelude, the
  core M times, coda, final norm, head; P + N*M + C layers, each virtual layer's weights copied. A Llama has
  one exit, at the end, so only the last loop's logits are kept (the coda runs once, after the last loop);
  the sharing and the earlier exits are lost.
- ``t5``: a ``SpeedT5`` as a T5 v1.1 ``T5ForConditionalGeneration``: the encoder as it is, the ``NxM`` decoder
  unrolled into N*M layers (HF decoder block ``i*N + j`` holds shared layer j; the relative position bias in
  block 0, as HF keeps it). Last loop's logits kept, sharing and earlier exits lost.

Forms that would change the outputs are refused (``ExportError``, one line naming the option that prevents
it). Exit adapters (``speed.models.exits``) are not exported: a checkpoint is read without them, a model
holding them is refused. The weights keep the model's dtype, in ``model.safetensors``.

The tokenizer comes along from where the model came from, one rule for the function and the job: a path
(``source`` a platform checkpoint or run, or an imported Hugging Face directory) brings its own tokenizer; a model
object brings none unless ``tokenizer=`` names one (a SentencePiece ``.model`` file or a tokenizer directory);
``Exported.tokenizer`` says what was written from (None: no tokenizer, and the export is then evaluated with
``--tokenizer``). An imported model's tokenizer (a Hugging Face directory, or a checkpoint finetuned from one,
which keeps it in tokenizer/) is written as its own files, ``tokenizer.json`` among them. A SentencePiece model
is written as ``spiece.model`` and a ``tokenizer_config.json`` for ``T5Tokenizer``, whatever the form, since the
platform's tokenizer is T5's conventions (a unigram SentencePiece model; pad 0, EOS 1, UNK 2, no BOS, EOS appended
as ``Tokenizer.encode`` appends it; ``extra_ids``: the sentinels the platform adds to a model without them),
plus, for an LM whose checkpoint has one, the platform's chat template as Jinja (``chat_template``); no
``tokenizer.json`` then (the fast pipeline, which ``transformers`` builds from ``spiece.model``) and no
generation config.

The directory appears whole or not at all: it is written into a temporary sibling, then renamed.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from torch import Tensor

from speed.chat import ChatTemplate
from speed.config import from_dict
from speed.models.convert_llama import MAX_POSITIONS
from speed.models.form import FORMS, Form, export_forms
from speed.models.looped_lm import LoopedLM
from speed.models.pretrained import load_pretrained
from speed.models.t5 import SpeedT5
from speed.storage import locate

WEIGHTS = "model.safetensors"
Writer = Callable[[Any], tuple[dict[str, Any], dict[str, Tensor]]]


class ExportError(ValueError):
    """The model cannot be written in the form asked for without changing its outputs (one line)."""


@dataclass(frozen=True)
class Exported:
    """What ``export`` wrote: the directory, its form (``export_forms()``), its files, and the HF layers of an unrolled
    stack (the decoder's for T5; Ouro's physical layers)."""

    directory: Path
    form: str
    files: tuple[str, ...]
    n_layers: int
    tokenizer: str | None = None  # where the written tokenizer came from; None: none was written


def export(
    source: SpeedT5 | LoopedLM | str | Path,
    out_dir: str | Path,
    *,
    form: str | None = None,
    tokenizer: str | Path | None = None,
    chat_template: ChatTemplate | None = None,
) -> Exported:
    """Write ``source`` (a model; or a path, as ``speed.models.pretrained.load_pretrained`` reads it: a platform
    checkpoint or run, or an imported Hugging Face directory, whose tokenizer and chat template come with it) into
    the new directory ``out_dir`` as ``form`` (default: ``t5`` for a T5, ``ouro`` for a looped LM in Ouro's
    options, else ``llama``); an ``ExportError`` (one line) when that form would change its outputs."""
    if form is not None and form not in export_forms():
        raise ExportError(f"form {form!r}: choose one of {', '.join(export_forms())}")
    if isinstance(source, (SpeedT5, LoopedLM)):
        model = source
        if model.exit_adapters is not None:
            raise ExportError("the model holds exit adapters, which no exported form keeps; export it without them")
    else:
        loaded = load_pretrained(str(source), exits=False)
        model, tokenizer = loaded.model, tokenizer or loaded.tokenizer_path
        stored = loaded.config.get("chat_template")
        if chat_template is None and stored is not None:
            chat_template = from_dict(ChatTemplate, stored, "chat_template")
    form = form or _default_form(model)
    writer = _writer(model, form)
    out = Path(out_dir)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ExportError(f"{out} exists and is not an empty folder; export writes a new one")
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        config, weights = writer(model)
        _write_weights(staging, weights)
        (staging / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
        if tokenizer is not None:
            _write_tokenizer(staging, str(tokenizer), form, chat_template)
        files = tuple(sorted(p.name for p in staging.iterdir()))
        if out.exists():
            out.rmdir()  # empty (checked above)
        staging.rename(out)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    layers = config.get("num_hidden_layers", config.get("num_decoder_layers", 0))
    return Exported(out, form, files, layers, None if tokenizer is None else str(tokenizer))


# ----- which form ---------------------------------------------------------------------------------------


def _default_form(model: SpeedT5 | LoopedLM) -> str:
    """The first form that writes ``model`` unchanged, a looped one (which keeps every loop's exit) first."""
    fitting = sorted(_forms_of(model), key=lambda form: not form.looped)
    obstacles = {form.name: form.obstacle(model) for form in fitting}
    chosen = next((name for name, obstacle in obstacles.items() if obstacle is None), None)
    if chosen is None:
        why = "; ".join(f"{name}: {obstacle}" for name, obstacle in obstacles.items())
        raise ExportError(f"no exported form keeps this model's outputs: {why}")
    return chosen


def _writer(model: SpeedT5 | LoopedLM, name: str) -> Writer:
    """The writer of form ``name`` for ``model``; an ``ExportError`` naming what prevents it."""
    form = FORMS[name]
    if not isinstance(model, form.exports):
        others = " or ".join(f.name for f in _forms_of(model))
        raise ExportError(f"form {name} is for a {form.exports.__name__}; a {type(model).__name__} exports as {others}")
    obstacle = form.obstacle(model)
    if obstacle is not None:
        raise ExportError(f"cannot export as {name}: {obstacle}")
    return form.files


def _forms_of(model: SpeedT5 | LoopedLM) -> list[Form]:
    """The exported forms that write a model of ``model``'s class."""
    return [form for form in FORMS.values() if form.exports is not None and isinstance(model, form.exports)]


# ----- files --------------------------------------------------------------------------------------------


def _write_weights(directory: Path, weights: Mapping[str, Tensor]) -> None:
    """One ``model.safetensors``; every tensor its own contiguous copy (safetensors refuses shared storage)."""
    from safetensors.torch import save_file

    tensors = {name: t.detach().cpu().contiguous().clone() for name, t in weights.items()}
    save_file(tensors, str(directory / WEIGHTS), metadata={"format": "pt"})


def _write_tokenizer(directory: Path, path: str, form: str, chat_template: ChatTemplate | None) -> None:
    """The SentencePiece model and a ``tokenizer_config.json`` (see the module doc); an imported model's tokenizer
    (a checkpoint's tokenizer/ folder, finetuned from a Hugging Face directory) as its own files."""
    import sentencepiece as spm

    from speed.hf_tokenizer import tokenizer_files
    from speed.tokenizer import Tokenizer

    if locate(path).is_dir():
        for name, data in tokenizer_files(path).items():
            if name != "config.json":  # the model's: the exported one describes the model
                (directory / name).parent.mkdir(parents=True, exist_ok=True)
                (directory / name).write_bytes(data)
        return
    raw = locate(path).read_bytes()
    plain = spm.SentencePieceProcessor(model_proto=raw)
    specials = {
        "pad_token": plain.id_to_piece(Tokenizer.pad_id),
        "eos_token": plain.id_to_piece(Tokenizer.eos_id),
        "unk_token": plain.id_to_piece(Tokenizer.unk_id),
    }
    (directory / "spiece.model").write_bytes(raw)
    extra = Tokenizer.load(path).vocab_size - plain.get_piece_size()  # sentinels the platform appends
    config = {"tokenizer_class": "T5Tokenizer", "extra_ids": extra, **specials}
    if FORMS[form].chat and chat_template is not None:
        config["chat_template"] = jinja_template(chat_template)
    config["model_max_length"] = MAX_POSITIONS
    (directory / "tokenizer_config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


def jinja_template(template: ChatTemplate) -> str:
    """``template`` as the Jinja chat template transformers renders (``apply_chat_template``) to the same text."""
    turn = template.turn.replace("{role}", "{{ message['role'] }}").replace("{content}", "{{ message['content'] }}")
    return (
        "{% for message in messages %}"
        + turn
        + "{% endfor %}{% if add_generation_prompt %}"
        + template.cue
        + "{% endif %}"
    )
