"""The driver's stages without Ray: the tokenizer stage completes the job, the data stage prepares its splits."""

from speed.data.corpus import open_corpus
from speed.tokenizer import Tokenizer
from speed.train.config import job_from_args
from speed.train.launch import data_stage, run_directory
from speed.train.tokenizer_stage import tokenizer_stage


def test_tokenizer_and_data_stages_prepare_what_training_and_sweeps_read(tiny_tokenizer, tmp_path):
    flags = ["--preset", "tiny", "--task", "translate_en_de", "--limit", "12", "--tokenizer", str(tiny_tokenizer)]
    job = job_from_args("finetune", [*flags, "--storage-path", str(tmp_path / "runs"), "--name", "a-run"])
    resolved = tokenizer_stage(job, tmp_path / "scratch")
    assert resolved.tokenizer == tiny_tokenizer.read_bytes() and resolved.tokenizer_path == tiny_tokenizer
    assert resolved.job.model.vocab_size == Tokenizer.load(tiny_tokenizer).vocab_size != job.model.vocab_size
    assert run_directory(resolved.job) == f"{tmp_path}/runs/a-run"

    alone = data_stage(resolved.job, resolved.tokenizer_path)
    assert alone.validation is None and alone.train.startswith(f"{tmp_path}/runs/data/translate_en_de-train-")
    assert len(open_corpus(alone.train)) == 12
    both = data_stage(resolved.job, resolved.tokenizer_path, validation_limit=5)
    assert both.train == alone.train  # prepared once, found again
    assert len(open_corpus(both.validation)) == 5 and "-validation-" in both.validation


def test_a_trained_tokenizer_is_cached_whole_under_the_storage_path(tmp_path, capsys):
    flags = ["--preset", "tiny", "--limit", "40", "--vocab-size", "300", "--storage-path", str(tmp_path / "runs")]
    job = job_from_args("pretrain", flags)
    first = tokenizer_stage(job, tmp_path / "scratch")
    assert first.tokenizer_path.parent.parent == tmp_path / "runs" / "tokenizers"
    assert [p.name for p in first.tokenizer_path.parent.iterdir()] == ["spm.model"]  # no partial file left
    assert first.job.model.vocab_size == Tokenizer.load(first.tokenizer_path).vocab_size
    again = tokenizer_stage(job, tmp_path / "scratch")
    assert again == first and "tokenizer: reusing" in capsys.readouterr().out


def _t5_directory(directory, tokenizer):
    """A tiny random T5 v1.1 saved as transformers does, ``tokenizer`` beside it as its spiece.model."""
    import shutil

    import torch
    from transformers import T5Config, T5ForConditionalGeneration

    torch.manual_seed(0)
    vocab = Tokenizer.load(tokenizer).vocab_size
    config = T5Config(vocab_size=vocab, d_model=32, d_kv=8, d_ff=48, num_layers=2, num_heads=4,
                      feed_forward_proj="gated-gelu", tie_word_embeddings=False, decoder_start_token_id=0)  # fmt: skip
    hf = T5ForConditionalGeneration(config).eval()
    hf.save_pretrained(directory)
    shutil.copy(tokenizer, directory / "spiece.model")
    return hf


def test_finetuning_starts_from_a_t5_directory_named_with_or_without_hf(tiny_tokenizer, tmp_path):
    """``--init-from <T5 v1.1 directory>`` resolves as ``hf:<directory>`` does: the model config converted at the job's
    pattern, the directory's spiece.model, and the converted weights (``convert_t5.from_hf_model``), bit for bit."""
    import torch

    from speed.models.convert_t5 import from_hf_model
    from speed.train.launch import check_inputs
    from speed.train.loop import initial_model

    directory = tmp_path / "t5-tiny"
    hf = _t5_directory(directory, tiny_tokenizer)
    want = from_hf_model(hf, "2x2").state_dict()
    for origin in (str(directory), f"hf:{directory}"):
        job = job_from_args("finetune", ["--init-from", origin, "--pattern", "2x2", "--limit", "8", "--no-tracking"])
        check_inputs(job)
        resolved = tokenizer_stage(job, tmp_path)
        assert resolved.tokenizer_path == directory / "spiece.model" and resolved.job.model.pattern == "2x2"
        model = initial_model(resolved.job)
        assert model.state_dict().keys() == want.keys()
        assert all(torch.equal(a, want[k]) for k, a in model.state_dict().items())


def test_finetuning_refuses_what_a_hugging_face_directory_cannot_train_in_one_line(tmp_path, capsys):
    """An Ouro directory finetunes the looped LM (--model lm) with its own tokenizer; as a T5 (with or without hf:),
    or its tokenizer for T5's span corruption or T5 pairs, and a directory the platform cannot read: one line,
    status 2, no run folder."""
    import json

    from imported_helpers import write_chat_ouro
    from test_cli import _error_line

    ouro = write_chat_ouro(tmp_path / "Ouro-tiny")
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
    runs = tmp_path / "runs"
    for kind, argv, message in [
        ("finetune", ["--init-from", str(ouro)], "a Hugging Face ouro directory is a looped LM: --model lm"),
        ("finetune", ["--init-from", f"hf:{ouro}"], "a Hugging Face ouro directory is a looped LM: --model lm"),
        ("finetune", ["--init-from", f"hf:{ouro}", "--model", "lm"], "Hugging Face T5 weights need --model t5"),
        ("finetune", ["--init-from", str(bad)], "model_type 'gpt2' is not one the platform loads"),
        ("pretrain", ["--tokenizer", str(ouro)], "trains the looped LM only (--model lm); span corruption needs T5"),
        ("finetune", ["--tokenizer", str(ouro)], "trains the looped LM only (--model lm); T5 reads SentencePiece"),
        ("pretrain", ["--tokenizer", str(bad), "--model", "lm"], "no tokenizer.json in"),
    ]:
        line = _error_line(capsys, kind, [*argv, "--storage-path", str(runs), "--no-tracking"])
        assert message in line, line
    assert not runs.exists()


def test_an_ouro_directory_resolves_to_its_config_and_tokenizer_without_ray(tmp_path):
    """``--model lm --init-from <Ouro directory>``: the converted config (read from config.json alone) is the loaded
    model's, the tokenizer is the directory, shipped as its tokenizer files; the initial weights are the directory's
    bit for bit."""
    import torch
    from imported_helpers import write_chat_ouro

    from speed.hf_tokenizer import pack_tokenizer, tokenizer_files, unpack_tokenizer
    from speed.models.pretrained import load_pretrained
    from speed.train.launch import check_inputs
    from speed.train.loop import initial_model

    ouro = write_chat_ouro(tmp_path / "Ouro-tiny")
    job = job_from_args("finetune", ["--model", "lm", "--init-from", str(ouro), "--no-tracking", "--limit", "4"])
    check_inputs(job)
    resolved = tokenizer_stage(job, tmp_path / "scratch")
    want = load_pretrained(ouro).model
    assert resolved.tokenizer_path == ouro and resolved.job.model == want.config
    shipped = unpack_tokenizer(resolved.tokenizer, tmp_path / "worker", "spm.model")
    assert tokenizer_files(shipped) == tokenizer_files(ouro) and pack_tokenizer(shipped) == resolved.tokenizer
    model = initial_model(resolved.job)
    assert all(torch.equal(a, want.state_dict()[k]) for k, a in model.state_dict().items())
