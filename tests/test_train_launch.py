"""The driver's stages without Ray: the tokenizer stage completes the job, the data stage prepares its splits."""

from speed.data.corpus import open_corpus
from speed.tokenizer import Tokenizer
from speed.train.config import job_from_args
from speed.train.launch import data_stage, run_directory, tokenizer_stage


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


def test_finetuning_refuses_a_directory_it_cannot_tokenize_or_read_in_one_line(tmp_path, capsys):
    """An Ouro directory (tokenizer.json, which the data preparation does not take), with or without hf:, and a
    directory the platform cannot read: one line, status 2, no run folder."""
    import json

    from imported_helpers import write_chat_ouro
    from test_cli import _error_line

    ouro = write_chat_ouro(tmp_path / "Ouro-tiny")
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
    runs = tmp_path / "runs"
    for origin, message in [
        (str(ouro), "a Hugging Face ouro directory; finetuning tokenizes its data with a SentencePiece model"),
        (f"hf:{ouro}", "a Hugging Face ouro directory; finetuning tokenizes its data with a SentencePiece model"),
        (str(bad), "model_type 'gpt2' is not one the platform loads"),
    ]:
        argv = ["--init-from", origin, "--storage-path", str(runs), "--no-tracking"]
        line = _error_line(capsys, "finetune", argv)
        assert message in line, line
    assert not runs.exists()
