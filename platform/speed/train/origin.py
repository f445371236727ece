"""What ``--init-from`` names: a Hugging Face model converted into the job's own pattern (``hub_origin``), an
imported LM's directory with its own config and tokenizer (``imported_origin``), or a platform checkpoint or run,
whose family wins over ``--model`` (``origin_family``). Which is which is the form registry's
(``speed.models.form``): no form's name is compared here."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from speed.models.checkpoint import checkpoint_family, latest_checkpoint, read_checkpoint_config
from speed.models.family import DEFAULT_FAMILY
from speed.models.form import get_form
from speed.storage import absolute

HF_PREFIX = "hf:"  # ``--init-from hf:<name or path>``: a Hugging Face T5 v1.1 (a hub name, or a directory)
HUB_FORM = "t5"  # the form an ``hf:<hub name>`` names (``speed.models.form``): a T5 v1.1


@dataclass(frozen=True)
class HubOrigin:
    """A Hugging Face model that ``--init-from`` converts into the job's own pattern (a ``job_pattern`` form): its
    hub name or directory, and its form's name."""

    name: str
    form: str


def hub_origin(origin: str) -> HubOrigin | None:
    """The Hugging Face model in the job's pattern that ``--init-from`` names (``hf:<hub name>``: a T5 v1.1; or a
    directory whose form is a ``job_pattern`` one: ``speed.models.pretrained.model_source``), None for a platform
    checkpoint or run, or for an imported LM's directory (``imported_origin``); a directory the platform cannot
    read is a one-line ``ValueError``."""
    name = origin.removeprefix(HF_PREFIX)
    if _hub_name(origin):
        return HubOrigin(name, HUB_FORM)  # a hub name: the form reads it from the hub
    source = _source(name)
    return HubOrigin(name, source) if source != "platform" and get_form(source).job_pattern else None


def imported_origin(origin: str) -> str | None:
    """The form (ouro, huginn, llama: not a ``job_pattern`` one) of the Hugging Face LM directory ``--init-from``
    names, None for anything else. Its weights start the run, and its own tokenizer (tokenizer.json, chat template,
    EOS) tokenizes the data and goes into every checkpoint (``speed.models.checkpoint``)."""
    if _hub_name(origin):
        return None  # a hub name: a HUB_FORM's
    source = _source(origin.removeprefix(HF_PREFIX))
    return None if source == "platform" or get_form(source).job_pattern else source


def _hub_name(origin: str) -> bool:
    """Whether ``origin`` is ``hf:`` and a name that is no path nor URI (a hub name)."""
    name = origin.removeprefix(HF_PREFIX)
    return origin.startswith(HF_PREFIX) and "://" not in name and not Path(name).expanduser().exists()


def _source(path: str) -> str:
    from speed.models.pretrained import model_source

    return model_source(path)


def origin_family(user: dict[str, Any]) -> dict[str, Any]:
    """``user`` with the family of the platform checkpoint (or run) ``init_from`` names: the checkpoint's family
    wins, its model config replacing the job's anyway (``speed.train.tokenizer_stage``), with a note when
    ``--model`` said otherwise. A resumed run, a Hugging Face origin, or one that cannot be read (``check_inputs``
    names it) leaves ``user`` as it is."""
    origin = user.get("init_from")
    if not origin or user.get("resume") or origin.startswith(HF_PREFIX):
        return user
    try:
        if _source(origin) != "platform":
            return user
        family = checkpoint_family(read_checkpoint_config(latest_checkpoint(absolute(origin))))
    except (FileNotFoundError, ValueError):
        return user
    section = user.get("model") or {}
    asked = section.get("family", DEFAULT_FAMILY)
    if asked == family:
        return user
    if "family" in section:
        print(f"--model {asked} ignored: {origin} is a '{family}' checkpoint, and the checkpoint's family wins")
    return {**user, "model": {"family": family}}  # the rest of the section: the checkpoint's config replaces it
