"""``speed.models.export`` and ``jobs/export.py``: a platform model as a Hugging Face directory, read back by
``speed.from_pretrained`` (bit for bit) and by ``transformers`` (to 1e-4), or refused in one line."""

from __future__ import annotations

import json
import runpy
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch
from imported_helpers import one_line
from transformers import AutoTokenizer, LlamaForCausalLM, T5ForConditionalGeneration

import speed
from speed.chat import CHAT_TEMPLATE, render_chat
from speed.config import PRESETS, lm_preset
from speed.models.checkpoint import save_model
from speed.models.export import ExportError, export
from speed.models.looped_lm import LoopedLM
from speed.models.t5 import SpeedT5
from speed.paths import repo_root
from speed.tokenizer import Tokenizer

OURO = {"norm": "sandwich", "loop_norm": True, "exit_gate": True}
IDS = torch.randint(0, 128, (2, 9), generator=torch.Generator().manual_seed(0))


def looped(pattern: str = "2x3", seed: int = 0, **options) -> LoopedLM:
    torch.manual_seed(seed)
    return LoopedLM(lm_preset("tiny", pattern=pattern, n_kv_heads=1, **options)).eval()


def loop_logits(model, *inputs) -> list[torch.Tensor]:
    with torch.no_grad():
        return model(*inputs, return_logits=True).loop_logits


@pytest.mark.parametrize("tied", [False, True])
def test_ouro_layout_reads_back_bit_for_bit(tmp_path, tied):
    model = looped(**OURO, tie_embeddings=tied)
    done = export(model, tmp_path / "out")
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert done.form == "ouro" and config["model_type"] == "ouro" and config["total_ut_steps"] == 3
    assert config["auto_map"]["AutoModelForCausalLM"] == "modeling_ouro.OuroForCausalLM"
    back = speed.from_pretrained(tmp_path / "out")
    assert back.config.replace(eos_id=model.config.eos_id) == model.config
    assert all(torch.equal(a, b) for a, b in zip(loop_logits(model, IDS), loop_logits(back, IDS), strict=True))
    with torch.no_grad():
        assert torch.equal(model.exit_lambdas(IDS), back.exit_lambdas(IDS))


@pytest.mark.parametrize(("pattern", "tied"), [("1+2x3+1", False), ("2x2", True)])
def test_unrolled_llama_keeps_the_last_loop(tmp_path, pattern, tied):
    model = looped(pattern, tie_embeddings=tied)
    done = export(model, tmp_path / "out")
    s = model.sharing
    assert done.form == "llama" and done.n_layers == s.prelude + s.n_unique * s.n_loops + s.coda
    want = loop_logits(model, IDS)[-1]
    hf = LlamaForCausalLM.from_pretrained(tmp_path / "out").eval()
    with torch.no_grad():
        torch.testing.assert_close(hf(IDS).logits, want, atol=1e-4, rtol=0)
    back = speed.from_pretrained(tmp_path / "out")
    assert back.config.pattern == f"{done.n_layers}x1" and torch.equal(loop_logits(back, IDS)[-1], want)


def test_t5_decoder_unrolled(tmp_path):
    torch.manual_seed(0)
    model = SpeedT5(PRESETS["tiny"].replace(pattern="2x3")).eval()
    done = export(model, tmp_path / "out")
    assert done.form == "t5" and done.n_layers == 6
    decoder_ids = IDS[:, :5]
    want = loop_logits(model, IDS, decoder_ids)[-1]
    hf = T5ForConditionalGeneration.from_pretrained(tmp_path / "out").eval()
    with torch.no_grad():
        torch.testing.assert_close(hf(input_ids=IDS, decoder_input_ids=decoder_ids).logits, want, atol=1e-4, rtol=0)
    assert torch.equal(loop_logits(speed.from_pretrained(tmp_path / "out"), IDS, decoder_ids)[-1], want)


@pytest.mark.parametrize(
    ("options", "form", "message"),
    [
        ({"injection": True}, None, "no exported form keeps this model's outputs: ouro: norm='pre'"),
        ({"loop_norm": True}, "llama", "cannot export as llama: loop_norm: it normalises between loops"),
        ({"norm": "sandwich"}, "llama", "cannot export as llama: norm='sandwich': a Llama layer is pre-norm only"),
        ({**OURO, "pattern": "1+2x3"}, "ouro", "cannot export as ouro: pattern 1+2x3: Ouro loops all of its layers"),
        ({"rope_layout": "pairs"}, "llama", "rope_layout='pairs': a Llama rotates halves"),
        ({}, "t5", "form t5 is for a SpeedT5"),
    ],
)
def test_a_form_that_would_change_the_outputs_is_one_line(tmp_path, options, form, message):
    with pytest.raises(ExportError) as error:
        export(looped(**options), tmp_path / "out", form=form)
    assert message in one_line(error)
    assert not (tmp_path / "out").exists() and not list(tmp_path.iterdir())


def test_a_checkpoint_brings_its_tokenizer_and_chat_template(tmp_path, tiny_tokenizer):
    tokenizer = Tokenizer.load(tiny_tokenizer)
    torch.manual_seed(0)
    model = LoopedLM(lm_preset("tiny", vocab_size=tokenizer.vocab_size, pattern="2x2")).eval()
    save_model(tmp_path / "lm", model, tiny_tokenizer)
    done = export(tmp_path / "lm", tmp_path / "out")
    assert {"spiece.model", "tokenizer_config.json"} <= set(done.files)
    hf = AutoTokenizer.from_pretrained(tmp_path / "out")
    text = "The quick brown fox."
    assert hf(text)["input_ids"] == tokenizer.encode(text)
    chat = [{"role": "user", "content": "Translate to German: A dog runs."}]
    assert hf.apply_chat_template(chat, tokenize=False, add_generation_prompt=True) == render_chat(chat, CHAT_TEMPLATE)

    t5 = SpeedT5(PRESETS["tiny"].replace(vocab_size=tokenizer.vocab_size))
    save_model(tmp_path / "t5", t5, tiny_tokenizer)
    assert "spiece.model" in export(tmp_path / "t5", tmp_path / "t5-out").files
    hf = AutoTokenizer.from_pretrained(tmp_path / "t5-out")
    assert hf(text)["input_ids"] == tokenizer.encode(text) and len(hf) == tokenizer.vocab_size
    assert "chat_template" not in json.loads((tmp_path / "t5-out" / "tokenizer_config.json").read_text())


def _job():
    return SimpleNamespace(**runpy.run_path(str(repo_root() / "jobs" / "export.py")))


def test_the_job(tmp_path, capsys):
    save_model(tmp_path / "ckpt", looped("2x2"))
    done = _job().main(["--checkpoint", str(tmp_path / "ckpt"), "--out", str(tmp_path / "out")])
    assert done.form == "llama" and "wrote llama" in capsys.readouterr().out
    with pytest.raises(SystemExit) as exit_:
        _job().main(["--checkpoint", str(tmp_path / "ckpt"), "--out", str(tmp_path / "other"), "--form", "ouro"])
    assert exit_.value.code == 2 and "error: cannot export as ouro: norm='pre'" in capsys.readouterr().err
    assert not (tmp_path / "other").exists() and sorted(p.name for p in tmp_path.iterdir()) == ["ckpt", "out"]


def test_the_job_on_a_bad_checkpoint_path_exits_2(tmp_path):
    done = subprocess.run(
        [sys.executable, str(repo_root() / "jobs" / "export.py"), "--checkpoint", str(tmp_path / "nothing"),
         "--out", str(tmp_path / "out")],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 2 and done.stderr.startswith("error: ") and done.stderr.count("\n") == 1
    assert not (tmp_path / "out").exists()


def test_a_checkpoint_of_an_imported_model_exports_with_its_own_tokenizer(tmp_path):
    """A checkpoint finetuned from a Hugging Face directory keeps the directory's tokenizer in tokenizer/; export
    writes those files (not the platform's SentencePiece), and the exported Ouro reads back with the same tokenizer
    and the same logits."""
    from imported_helpers import write_chat_ouro

    from speed.hf_tokenizer import load_tokenizer

    source = write_chat_ouro(tmp_path / "Ouro-tiny")
    model = speed.from_pretrained(source)
    save_model(tmp_path / "ckpt", model, source)  # as a finetuning run saves it: the tokenizer in tokenizer/
    done = export(tmp_path / "ckpt", tmp_path / "out")
    assert "tokenizer.json" in done.files and "spiece.model" not in done.files
    assert json.loads((tmp_path / "out" / "config.json").read_text())["model_type"] == "ouro"
    ours, theirs = load_tokenizer(tmp_path / "out"), load_tokenizer(source)
    chat = [{"role": "user", "content": "Translate to German: A dog runs."}]
    assert ours.encode_chat(chat) == theirs.encode_chat(chat) and ours.stop_ids == theirs.stop_ids
    ids = torch.tensor([theirs.encode_chat(chat)])
    with torch.no_grad():
        got = speed.from_pretrained(tmp_path / "out")(ids, return_logits=True).loop_logits
        want = model(ids, return_logits=True).loop_logits
    assert all(torch.equal(a, b) for a, b in zip(got, want))


def test_the_job_exports_an_imported_directory_and_python_keeps_the_same_tokenizer_rule(tmp_path, capsys):
    """A new user's route: ``jobs/export.py --checkpoint <an Ouro directory>`` exports it, its tokenizer with it
    (the path brings its own); ``export(speed.from_pretrained(dir), out)`` writes none and says so
    (``Exported.tokenizer`` None), ``tokenizer=dir`` writes the same files the job writes."""
    from imported_helpers import write_chat_ouro

    from speed.hf_tokenizer import load_tokenizer

    source = write_chat_ouro(tmp_path / "Ouro-tiny")
    done = _job().main(["--checkpoint", str(source), "--out", str(tmp_path / "job")])
    assert done.form == "ouro" and done.tokenizer == str(source) and "tokenizer.json" in done.files
    assert "no tokenizer written" not in capsys.readouterr().out
    chat = [{"role": "user", "content": "A dog runs."}]
    assert load_tokenizer(tmp_path / "job").encode_chat(chat) == load_tokenizer(source).encode_chat(chat)
    ids = torch.tensor([load_tokenizer(source).encode_chat(chat)])
    want = loop_logits(speed.from_pretrained(source), ids)
    assert all(torch.equal(a, b) for a, b in zip(loop_logits(speed.from_pretrained(tmp_path / "job"), ids), want))
    bare = export(speed.from_pretrained(source), tmp_path / "bare")
    assert bare.tokenizer is None and bare.files == ("config.json", "model.safetensors")
    named = export(speed.from_pretrained(source), tmp_path / "named", tokenizer=source)
    assert named.files == done.files and named.tokenizer == str(source)
    for name in named.files:
        assert (tmp_path / "named" / name).read_bytes() == (tmp_path / "job" / name).read_bytes(), name


def test_the_job_on_a_directory_it_cannot_read_says_what_evaluate_says(tmp_path):
    """A gpt2 directory: the model_type error evaluate gives, one line, status 2, nothing written."""
    (tmp_path / "gpt2").mkdir()
    (tmp_path / "gpt2" / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
    said = {}
    for job, extra in (("export.py", ["--out", str(tmp_path / "out")]), ("evaluate.py", ["--limit", "1"])):
        done = subprocess.run(
            [sys.executable, str(repo_root() / "jobs" / job), "--checkpoint", str(tmp_path / "gpt2"), *extra],
            capture_output=True, text=True, timeout=300,
        )  # fmt: skip
        assert done.returncode == 2 and done.stderr.count("\n") == 1, done.stderr
        said[job] = done.stderr
    assert "model_type 'gpt2' is not one the platform loads" in said["export.py"]
    assert said["export.py"] == said["evaluate.py"] and not (tmp_path / "out").exists()
