"""speed.hf_files: config.json and safetensors weights of a Hugging Face model directory, with one-line errors; the
form a config.json names (``speed.models.form.form_of``)."""

from __future__ import annotations

import json
import sys

import pytest
import torch
from looped_refs import huginn_shapes, ouro_shapes, write_huginn_checkpoint, write_ouro_checkpoint
from safetensors.torch import save_file

from speed import hf_files
from speed.hf_files import ModelFilesError, WeightsError
from speed.models.form import FORMS, form_of

pytestmark = pytest.mark.filterwarnings("error")

TENSORS = {
    "a.weight": torch.arange(12, dtype=torch.float32).reshape(3, 4) / 7,
    "a.bias": torch.tensor([1.5, -2.25, 3.0]),
    "b.weight": torch.linspace(-1, 1, 10).reshape(2, 5),
    "steps": torch.tensor([1, 2, 3], dtype=torch.int64),
}
SHAPES = {name: tuple(t.shape) for name, t in TENSORS.items()}


def one_line(error: pytest.ExceptionInfo) -> str:
    text = str(error.value)
    assert "\n" not in text, text
    return text


def write_single(directory, tensors=TENSORS, dtype=None):
    directory.mkdir(parents=True, exist_ok=True)
    stored = {n: t.to(dtype) if dtype is not None and t.is_floating_point() else t for n, t in tensors.items()}
    save_file(stored, str(directory / "model.safetensors"), metadata={"format": "pt"})
    return directory


def write_sharded(directory, tensors=TENSORS, dtype=None):
    directory.mkdir(parents=True, exist_ok=True)
    names = list(tensors)
    groups = {"model-00001-of-00002.safetensors": names[:2], "model-00002-of-00002.safetensors": names[2:]}
    weight_map = {}
    for file, group in groups.items():
        part = {n: tensors[n].to(dtype) if dtype and tensors[n].is_floating_point() else tensors[n] for n in group}
        save_file(part, str(directory / file), metadata={"format": "pt"})
        weight_map |= dict.fromkeys(group, file)
    (directory / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return directory


# ------------------------------------------------------------------------------------------------ config.json


def test_read_config_and_forms(tmp_path):
    cases = {
        "t5": {"model_type": "t5", "feed_forward_proj": "gated-gelu"},
        "llama": {"model_type": "llama"},
        "ouro": {"model_type": "ouro", "architectures": ["OuroForCausalLM"]},
        "huginn": {"model_type": "huginn_raven", "architectures": ["RavenForCausalLM"]},
    }
    for form, config in cases.items():
        (tmp_path / "config.json").write_text(json.dumps(config))
        assert hf_files.read_config(tmp_path) == config
        assert form_of(hf_files.read_config(tmp_path)).name == form
    assert tuple(FORMS) == ("t5", "llama", "ouro", "huginn")


def test_published_tiny_configs_are_known_forms(tmp_path):
    write_ouro_checkpoint(tmp_path / "ouro")
    write_huginn_checkpoint(tmp_path / "huginn")
    assert form_of(hf_files.read_config(tmp_path / "ouro")).name == "ouro"
    assert form_of(hf_files.read_config(tmp_path / "huginn")).name == "huginn"
    assert hf_files.remote_code(hf_files.read_config(tmp_path / "huginn")) == {
        "AutoConfig": "raven_config_minimal.RavenConfig",
        "AutoModelForCausalLM": "raven_modeling_minimal.RavenForCausalLM",
    }
    assert hf_files.remote_code({"model_type": "llama"}) == {}


def test_config_errors_are_one_line(tmp_path):
    with pytest.raises(ModelFilesError) as error:
        hf_files.read_config(tmp_path)
    assert "config.json: no such file" in one_line(error)
    (tmp_path / "config.json").write_text('{"model_type": "llama",\n')
    with pytest.raises(ModelFilesError) as error:
        hf_files.read_config(tmp_path)
    assert "config.json: not valid JSON (" in one_line(error)
    (tmp_path / "config.json").write_text("[1, 2]")
    with pytest.raises(ModelFilesError, match="a JSON list, not an object"):
        hf_files.read_config(tmp_path)


def test_model_form_refusals_name_the_problem():
    with pytest.raises(ModelFilesError) as error:
        form_of({"model_type": "gpt2"})
    assert one_line(error) == (
        "config.json: model_type 'gpt2' is not one the platform loads (known: t5, llama, ouro, huginn_raven)"
    )
    with pytest.raises(ModelFilesError, match="has no model_type"):
        form_of({})
    with pytest.raises(ModelFilesError, match=r"feed_forward_proj 'relu'; only T5 v1.1 \('gated-gelu'\)"):
        form_of({"model_type": "t5"})  # T5Config's default: the original T5


def test_auto_map_is_reported_never_imported(tmp_path):
    # A config naming remote code beside it: the module must not be imported while reading or classifying.
    (tmp_path / "evil.py").write_text("raise SystemExit('imported')\n")
    config = {"model_type": "ouro", "auto_map": {"AutoModelForCausalLM": "evil.Model", "AutoTokenizer": ["a", None]}}
    (tmp_path / "config.json").write_text(json.dumps(config))
    read = hf_files.read_config(tmp_path)
    assert form_of(read).name == "ouro"
    assert hf_files.remote_code(read) == {"AutoModelForCausalLM": "evil.Model", "AutoTokenizer": "['a', None]"}
    assert "evil" not in sys.modules


# ------------------------------------------------------------------------------------------------ weights


@pytest.mark.parametrize("layout", [write_single, write_sharded])
@pytest.mark.parametrize("stored", [torch.float32, torch.bfloat16, torch.float16])
def test_read_weights_exact_values_and_dtype(tmp_path, layout, stored):
    directory = layout(tmp_path / "m", dtype=stored)
    weights = hf_files.read_weights(directory, expected=SHAPES)
    assert set(weights) == set(TENSORS)
    for name, tensor in TENSORS.items():
        got = weights[name]
        want = tensor.to(stored).to(torch.float32) if tensor.is_floating_point() else tensor
        assert got.dtype == want.dtype and torch.equal(got, want), name
    assert weights["steps"].dtype == torch.int64  # integers are left as they are
    as_stored = hf_files.read_weights(directory, dtype=None)
    assert as_stored["a.weight"].dtype == stored
    half = hf_files.read_weights(directory, dtype=torch.bfloat16)
    assert half["b.weight"].dtype == torch.bfloat16
    shapes = hf_files.tensor_shapes(directory)
    assert {n: s for n, (s, _) in shapes.items()} == SHAPES
    assert shapes["steps"][1] == "I64"


def test_single_file_wins_over_an_index(tmp_path):
    # transformers looks for model.safetensors first: an index beside it is not read.
    directory = write_single(tmp_path)
    (tmp_path / "model.safetensors.index.json").write_text("not json")
    assert set(hf_files.read_weights(directory)) == set(TENSORS)


def test_expected_mismatches_are_one_line(tmp_path):
    directory = write_single(tmp_path)
    expected = dict(SHAPES) | {f"missing.{i}": (1,) for i in range(7)}
    with pytest.raises(WeightsError) as error:
        hf_files.read_weights(directory, expected=expected)
    assert one_line(error) == (
        f"{directory}: 7 expected tensors missing: missing.0, missing.1, missing.2, missing.3, missing.4 (+2 more)"
    )
    expected = {n: s for n, s in SHAPES.items() if n != "steps"}
    with pytest.raises(WeightsError) as error:
        hf_files.read_weights(directory, expected=expected)
    assert one_line(error) == f"{directory}: 1 unexpected tensor: steps"
    expected = dict(SHAPES) | {"a.weight": (4, 3), "b.weight": (10,)}
    with pytest.raises(WeightsError) as error:
        hf_files.read_weights(directory, expected=expected)
    assert one_line(error) == f"{directory}: a.weight has shape (3, 4), expected (4, 3) (+1 more of the wrong shape)"
    # Several problems at once: all named, still one line.
    expected = {n: s for n, s in SHAPES.items() if n != "steps"} | {"c": (2,), "a.bias": (2,)}
    with pytest.raises(WeightsError) as error:
        hf_files.read_weights(directory, expected=expected)
    assert one_line(error) == (
        f"{directory}: 1 expected tensor missing: c; 1 unexpected tensor: steps; a.bias has shape (3,), expected (2,)"
    )


def test_optional_names_may_be_absent(tmp_path):
    # A tied head: lm_head.weight is expected but optional, and the checkpoint leaves it out.
    directory = write_single(tmp_path)
    expected = dict(SHAPES) | {"lm_head.weight": (3, 4)}
    weights = hf_files.read_weights(directory, expected=expected, optional={"lm_head.weight"})
    assert "lm_head.weight" not in weights
    with pytest.raises(WeightsError, match="1 expected tensor missing: lm_head.weight"):
        hf_files.read_weights(directory, expected=expected)


def test_weight_file_errors_are_one_line(tmp_path):
    with pytest.raises(WeightsError) as error:
        hf_files.read_weights(tmp_path)
    assert one_line(error) == (
        f"{tmp_path}: no weights (model.safetensors, or model.safetensors.index.json with its shards)"
    )
    (tmp_path / "pytorch_model.bin").write_bytes(b"pickle")
    with pytest.raises(WeightsError) as error:
        hf_files.read_weights(tmp_path)
    assert "only pytorch_model.bin, and only safetensors are read" in one_line(error)
    (tmp_path / "model.safetensors").write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00not json")
    with pytest.raises(WeightsError) as error:
        hf_files.read_weights(tmp_path)
    assert "model.safetensors: not a readable safetensors file (" in one_line(error)


def test_index_errors_are_one_line(tmp_path):
    directory = write_sharded(tmp_path)
    index = directory / "model.safetensors.index.json"
    weight_map = json.loads(index.read_text())["weight_map"]
    index.write_text(json.dumps({"weight_map": weight_map | {"ghost": "model-00001-of-00002.safetensors"}}))
    with pytest.raises(WeightsError) as error:
        hf_files.read_weights(directory)
    assert one_line(error).endswith("model-00001-of-00002.safetensors: lacks 1 tensor the index puts there: ghost")
    index.write_text(json.dumps({"weight_map": {n: f for n, f in weight_map.items() if n != "a.bias"}}))
    with pytest.raises(WeightsError, match="holds 1 tensor the index does not name: a.bias"):
        hf_files.read_weights(directory)
    (directory / "model-00002-of-00002.safetensors").unlink()
    index.write_text(json.dumps({"weight_map": weight_map}))
    with pytest.raises(WeightsError, match=r"shard model-00002-of-00002.safetensors \(holding 2 tensors\) is missing"):
        hf_files.read_weights(directory)
    index.write_text("{}")
    with pytest.raises(WeightsError, match="not a safetensors index with a weight_map"):
        hf_files.read_weights(directory)


def test_weights_bytes():
    assert hf_files.weights_bytes(SHAPES) == (12 + 3 + 10 + 3) * 4
    assert hf_files.weights_bytes(SHAPES, torch.bfloat16) == (12 + 3 + 10 + 3) * 2
    assert hf_files.weights_bytes({}) == 0


@pytest.mark.parametrize("shards", [1, 3])
def test_published_layouts_read_with_their_expected_shapes(tmp_path, shards):
    ouro = write_ouro_checkpoint(tmp_path / "ouro", dtype=torch.bfloat16, shards=shards)
    weights = hf_files.read_weights(tmp_path / "ouro", expected=ouro_shapes(ouro))
    assert len(weights) == len(ouro_shapes(ouro)) and weights["lm_head.weight"].dtype == torch.float32
    huginn = write_huginn_checkpoint(tmp_path / "huginn", shards=shards)
    expected = huginn_shapes(huginn, lm_head=True)
    weights = hf_files.read_weights(tmp_path / "huginn", expected=expected, optional={"lm_head.weight"})
    assert set(weights) == set(expected) - {"lm_head.weight"}
    assert hf_files.weights_bytes(expected) > hf_files.weights_bytes(huginn_shapes(huginn))
