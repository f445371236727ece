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
