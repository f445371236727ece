"""The SentencePiece tokenizer: T5 ids, sentinels at the top, round trips, loading, training speed."""

from __future__ import annotations

import gzip
import io
import json
import pickle

import pytest
import sentencepiece as spm

from speed.chat import CHAT_TEMPLATE, ChatRenderer, render_chat
from speed.hf_tokenizer import load_tokenizer
from speed.paths import data_dir
from speed.tokenizer import TextTokenizer, Tokenizer, train_tokenizer


def _multi30k(split: str, n: int) -> list[str]:
    with gzip.open(data_dir() / "multi30k_en_de" / f"{split}.jsonl.gz", "rt") as f:
        records = [json.loads(line)["translation"] for _, line in zip(range(n), f)]
    return [r["en"] for r in records] + [r["de"] for r in records]


@pytest.fixture(scope="module")
def tok(tmp_path_factory) -> Tokenizer:
    return train_tokenizer(_multi30k("validation", 500), tmp_path_factory.mktemp("tok") / "spm.model", 300, 20)


def _plain_spm(**ids: int) -> bytes:
    """A SentencePiece model trained without our sentinels."""
    model = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(_multi30k("validation", 200)), model_writer=model, vocab_size=150, minloglevel=2, **ids
    )
    return model.getvalue()


def test_t5_ids_and_sentinels_at_the_top(tok):
    sp = spm.SentencePieceProcessor(model_file=str(tok.path))  # the file alone, read by SentencePiece itself
    assert [sp.id_to_piece(i) for i in range(3)] == ["<pad>", "</s>", "<unk>"]
    assert (tok.pad_id, tok.eos_id, tok.unk_id) == (0, 1, 2)
    assert tok.vocab_size == sp.get_piece_size() == 300 + 20
    assert tok.num_extra == 20 and tok.num_pieces == 300
    assert tok.sentinel_id(0) == 319 and sp.id_to_piece(319) == "<extra_id_0>"
    assert tok.sentinel_id(19) == 300 and sp.id_to_piece(300) == "<extra_id_19>"
    with pytest.raises(IndexError, match="sentinel 20"):
        tok.sentinel_id(20)


def test_encode_decode_round_trip(tok):
    text = "A man in a blue shirt is standing on a ladder."
    ids = tok.encode(text)
    assert ids[-1] == tok.eos_id and tok.eos_id not in ids[:-1]
    assert tok.encode(text, add_eos=False) == ids[:-1]
    assert tok.decode(ids) == text
    assert tok.encode_batch([text, "Ein Hund."]) == [ids, tok.encode("Ein Hund.")]


def test_decode_stops_at_eos_drops_padding_and_shows_sentinels(tok):
    dog = tok.encode("A dog", add_eos=False)
    ids = [tok.pad_id, *dog, tok.sentinel_id(0), -100, tok.eos_id, *tok.encode("never shown")]
    assert tok.decode(ids) == "A dog<extra_id_0>"
    assert tok.encode("A dog<extra_id_3>", add_eos=False) == [*dog, tok.sentinel_id(3)]
    with pytest.raises(ValueError, match="outside the vocabulary"):
        tok.decode([5, tok.vocab_size])


def test_load_by_path_and_pickle(tok):
    again = Tokenizer.load(tok.path)
    text = "Zwei Hunde spielen im Schnee."
    assert again.encode(text) == tok.encode(text) and again.vocab_size == tok.vocab_size
    copy = pickle.loads(pickle.dumps(tok))  # what datasets.map sends to its worker processes
    assert copy.encode(text) == tok.encode(text) and copy.path == tok.path


def test_satisfies_the_one_tokenizer_interface(tok):
    """Decoding, evaluation and serving take any TextTokenizer: this one, or an imported model's HFTokenizer."""
    assert isinstance(tok, TextTokenizer)
    members = {"path", "vocab_size", "eos_id", "pad_id", "stop_ids", "encode", "encode_batch", "decode"}
    assert members | {"decode_batch", "piece"} <= set(dir(TextTokenizer))
    assert tok.stop_ids == {tok.eos_id}  # generation ends at EOS
    assert isinstance(load_tokenizer(tok.path), Tokenizer)  # a .model file: SentencePiece
    assert isinstance(CHAT_TEMPLATE, ChatRenderer)  # the platform's own LMs' chat: render(messages) as before
    chat = [{"role": "user", "content": "Hi"}]
    assert CHAT_TEMPLATE.render(chat) == render_chat(chat) == "<user> Hi\n<assistant>"


def test_plain_sentencepiece_model_gets_t5_sentinels(tmp_path):
    path = tmp_path / "plain.model"
    path.write_bytes(_plain_spm(pad_id=0, eos_id=1, unk_id=2, bos_id=-1))
    t5 = Tokenizer.load(path)
    assert (t5.num_pieces, t5.num_extra, t5.vocab_size) == (150, 100, 250)
    assert t5.sentinel_id(0) == 249 and t5.decode([t5.sentinel_id(7)]) == "<extra_id_7>"
    assert Tokenizer.load(path, num_extra=4).vocab_size == 154


def test_refuses_other_id_conventions_and_sentinel_mismatch(tmp_path, tok):
    path = tmp_path / "default_ids.model"
    path.write_bytes(_plain_spm())  # SentencePiece's defaults: unk 0, bos 1, eos 2
    with pytest.raises(ValueError, match="pad=0, eos=1, unk=2"):
        Tokenizer.load(path)
    with pytest.raises(ValueError, match="holds 20 sentinels but num_extra=100"):
        Tokenizer.load(tok.path, num_extra=100)
    with pytest.raises(FileNotFoundError, match="no SentencePiece model"):
        Tokenizer.load(tmp_path / "missing.model")


def test_training_errors_are_clear(tmp_path):
    with pytest.raises(ValueError, match="every text was empty"):
        train_tokenizer(["", "   ", "\n"], tmp_path / "a.model", vocab_size=50)
    with pytest.raises(ValueError, match="Vocabulary size too high"):
        train_tokenizer(["tiny corpus."] * 3, tmp_path / "b.model", vocab_size=5000)


def test_trains_on_the_whole_pretraining_corpus(tmp_path):
    # Its time is bounded by sampling (max_sentences / max_chars), not asserted here: no timed tests.
    with gzip.open(data_dir() / "pretrain_text" / "train.jsonl.gz", "rt") as f:
        texts = (json.loads(line)["text"] for line in f)
        tok = train_tokenizer(texts, tmp_path / "spm.model", vocab_size=8000)
    assert tok.vocab_size == 8100 and tok.sentinel_id(0) == 8099
    text = "The President addressed the Congress on the state of the Union."
    assert tok.decode(tok.encode(text)) == text
    assert len(tok.encode(text)) < 20  # whole words, not characters
