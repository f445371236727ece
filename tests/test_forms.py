"""``speed.models.form``: the registry of published Hugging Face forms. A fifth form is one ``Form`` and one
registry entry: a test-only form (a Llama layout under its own ``model_type``) registered here loads, exports and
reads back through the ordinary entry points, with nothing else changed."""

from __future__ import annotations

import json

import pytest
import torch
from imported_helpers import assert_cached_equals_forward, assert_speed_exact
from looped_refs import write_huginn_checkpoint, write_ouro_checkpoint
from test_convert_huginn import SMALL
from test_convert_ouro import SCALE

import speed
from speed.config import lm_preset
from speed.hf_files import ModelFilesError
from speed.models.convert_llama import LlamaForm
from speed.models.export import ExportError, export
from speed.models.form import FORMS, export_forms, form_of, get_form
from speed.models.looped_lm import LoopedLM
from speed.models.pretrained import check_load, load_pretrained, model_source

# the published looped forms' tiny checkpoints (``tests/looped_refs.py``), as their converters' tests write them
PUBLISHED_LOOPED = {
    "ouro": lambda directory: write_ouro_checkpoint(directory, total_ut_steps=3, seed=1, scale=SCALE),
    "huginn": lambda directory: write_huginn_checkpoint(directory, **SMALL),
}
IDS = torch.randint(0, 128, (2, 9), generator=torch.Generator().manual_seed(0))


class TinyLoopForm(LlamaForm):
    """A test-only form: Llama's layout published under ``model_type: "tiny_loop"``."""

    name = "tinyloop"
    model_type = "tiny_loop"

    def config(self, hf, n_loops=None):
        return super().config({**hf, "model_type": "llama"}, n_loops)

    def files(self, model):
        config, weights = super().files(model)
        return config | {"model_type": self.model_type, "architectures": ["TinyLoopForCausalLM"]}, weights


@pytest.fixture
def tiny_loop(monkeypatch):
    monkeypatch.setitem(FORMS, TinyLoopForm.name, TinyLoopForm())  # the one registry line a new form adds


def test_the_registry_holds_the_four_published_forms():
    assert {name: form.model_type for name, form in FORMS.items()} == {
        "t5": "t5", "llama": "llama", "ouro": "ouro", "huginn": "huginn_raven"
    }  # fmt: skip
    assert export_forms() == ("t5", "llama", "ouro")
    assert all(get_form(name).name == name for name in FORMS)
    with pytest.raises(ValueError, match="unknown Hugging Face form 'qwen'"):
        get_form("qwen")


def test_a_registered_form_loads_and_exports_through_the_ordinary_entry_points(tmp_path, tiny_loop):
    torch.manual_seed(0)
    model = LoopedLM(lm_preset("tiny", pattern="2x1", n_kv_heads=1)).eval()
    done = export(model, tmp_path / "out", form="tinyloop")
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert done.form == "tinyloop" and config["model_type"] == "tiny_loop"
    assert form_of(config).name == "tinyloop" and model_source(tmp_path / "out") == "tinyloop"
    check_load(tmp_path / "out")  # its config read from config.json alone
    loaded = load_pretrained(tmp_path / "out")
    assert loaded.config["hf"] == {"form": "tinyloop"}
    back = loaded.model
    assert back.config.replace(eos_id=model.config.eos_id) == model.config
    with torch.no_grad():
        ours, theirs = model(IDS, return_logits=True).loop_logits, back(IDS, return_logits=True).loop_logits
        assert torch.equal(ours[-1], theirs[-1])
    again = export(tmp_path / "out", tmp_path / "again", form="tinyloop")  # a directory of it exports again
    assert again.form == "tinyloop"
    assert speed.from_pretrained(tmp_path / "again").config == back.config


def test_an_unregistered_form_is_one_line(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "tiny_loop"}))
    with pytest.raises(ModelFilesError, match="model_type 'tiny_loop' is not one the platform loads"):
        model_source(tmp_path)
    with pytest.raises(ExportError, match="form 'tinyloop': choose one of t5, llama, ouro"):
        export(LoopedLM(lm_preset("tiny", pattern="2x1")), tmp_path / "out", form="tinyloop")


@pytest.fixture(scope="module", params=sorted(PUBLISHED_LOOPED))
def published_looped(request, tmp_path_factory):
    """A published looped LM loaded through its form: Ouro's and Huginn's tiny checkpoints."""
    directory = tmp_path_factory.mktemp(request.param)
    PUBLISHED_LOOPED[request.param](directory)
    return get_form(request.param).load(directory, dtype=torch.float32)


def test_a_published_looped_lms_cached_path_equals_its_forward(published_looped):
    assert_cached_equals_forward(published_looped, seed=3)


@pytest.mark.slow
def test_a_published_looped_lm_decodes_speed_equal_to_sequential_bit_for_bit(published_looped):
    assert assert_speed_exact(published_looped, seed=4) > 0
