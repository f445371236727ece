"""SentencePiece tokenizer with T5's conventions: pad 0, EOS 1, UNK 2, sentinels at the top.

The ``.model`` file is self-describing: after the SentencePiece pieces 0..n-1
it holds ``num_extra`` sentinel pieces ``<extra_id_{num_extra-1}>`` ...
``<extra_id_0>`` (user-defined pieces), so ``<extra_id_0>`` is the highest id,
exactly T5's layout, and the file alone restores the tokenizer. A plain T5
``spiece.model`` without sentinels gets T5's 100 appended on load.

``TextTokenizer`` is the one interface decoding, evaluation and serving use: this ``Tokenizer`` and an
imported model's ``speed.hf_tokenizer.HFTokenizer`` (its ``tokenizer.json``) both satisfy it, and
``speed.hf_tokenizer.load_tokenizer`` opens either. Training with span corruption also needs sentinels (``sentinel_id``,
``num_extra``): that stays SentencePiece-only.
"""

from __future__ import annotations

import io
import logging
import os
import random
import re
import time
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import Protocol, runtime_checkable

import sentencepiece as spm
from sentencepiece import sentencepiece_model_pb2 as spm_pb

from speed.storage import locate

log = logging.getLogger(__name__)

PAD_ID, EOS_ID, UNK_ID = 0, 1, 2
LABEL_PAD = -100  # label padding (ignored by the loss); decode drops it like pad
T5_NUM_EXTRA = 100
SENTINEL = "<extra_id_{}>"

# Sentence ends and line breaks: SentencePiece trains on sentences and skips overlong ones.
_SENTENCE_BREAK = re.compile(r"(?<=[.!?])\s+|\n+")
_MAX_SENTENCE_BYTES = 8192


@runtime_checkable
class TextTokenizer(Protocol):
    """What decoding, evaluation and serving ask of a tokenizer: the members they use, no more.

    ``encode`` appends ``eos_id`` unless ``add_eos=False`` (T5's encoder inputs end in EOS; an LM's prompt
    does not); ``decode`` drops padding, label padding (-100) and the end of sequence, and raises
    ``ValueError`` for an id outside ``[0, vocab_size)``; ``piece`` is one token's text for log-probability
    listings; ``stop_ids`` are the ids at which a generation ends (SentencePiece: EOS; an imported chat
    model: its EOS ids and end-of-turn token); ``text_prefix`` are the ids a raw text starts with as the model
    reads it (an imported model's BOS, where its published tokenizer adds one: ``speed.hf_tokenizer.prompt_ids``);
    ``path`` says where it was read from.
    """

    @property
    def path(self) -> str: ...

    @property
    def vocab_size(self) -> int: ...

    @property
    def eos_id(self) -> int: ...

    @property
    def pad_id(self) -> int: ...

    @property
    def stop_ids(self) -> frozenset[int]: ...

    @property
    def text_prefix(self) -> tuple[int, ...]: ...

    def encode(self, text: str, add_eos: bool = True) -> list[int]: ...

    def encode_batch(self, texts: Sequence[str], add_eos: bool = True) -> list[list[int]]: ...

    def decode(self, ids: Iterable[int]) -> str: ...

    def decode_batch(self, batch: Iterable[Iterable[int]]) -> list[str]: ...

    def piece(self, i: int) -> str: ...


class Tokenizer:
    """A SentencePiece model plus T5 sentinels. ``vocab_size`` = pieces + sentinels."""

    pad_id = PAD_ID
    eos_id = EOS_ID
    unk_id = UNK_ID
    stop_ids = frozenset({EOS_ID})  # TextTokenizer: generation ends at EOS
    text_prefix: tuple[int, ...] = ()  # TextTokenizer: T5's texts start with no BOS

    def __init__(self, model_proto: bytes, path: str) -> None:
        self._proto = model_proto
        self.path = path
        self._sp = spm.SentencePieceProcessor(model_proto=model_proto)
        self.vocab_size: int = self._sp.get_piece_size()
        self.num_extra: int = _count_sentinels(self._sp)
        self.num_pieces: int = self.vocab_size - self.num_extra  # SentencePiece pieces below the sentinels

    @classmethod
    def load(cls, path: str | Path, num_extra: int | None = None) -> Tokenizer:
        """Load a ``.model`` file (a local path or a URI); a file without sentinels gets ``num_extra`` (default
        T5's 100). ``path`` becomes the file's location: a local path made absolute, or the URI."""
        where = locate(path)
        if not where.is_file():
            raise FileNotFoundError(f"no SentencePiece model at {where.uri}")
        path = where.uri
        proto = spm_pb.ModelProto()
        proto.ParseFromString(where.read_bytes())
        plain = spm.SentencePieceProcessor(model_proto=proto.SerializeToString())
        _check_t5_conventions(plain, path)
        present = _count_sentinels(plain)
        if present == 0:
            _append_sentinels(proto, T5_NUM_EXTRA if num_extra is None else num_extra)
        elif num_extra is not None and num_extra != present:
            raise ValueError(f"{path} holds {present} sentinels but num_extra={num_extra} was asked for")
        return cls(proto.SerializeToString(), path)

    def sentinel_id(self, i: int) -> int:
        """The id of ``<extra_id_i>``: ``vocab_size - 1 - i`` (``<extra_id_0>`` is the highest id)."""
        if not 0 <= i < self.num_extra:
            raise IndexError(f"sentinel {i} outside the tokenizer's {self.num_extra} sentinels")
        return self.vocab_size - 1 - i

    def encode(self, text: str, add_eos: bool = True) -> list[int]:
        """Token ids of ``text``, EOS-terminated unless ``add_eos=False``."""
        if not isinstance(text, str):
            raise TypeError(f"encode expects a str, got {type(text).__name__}")
        return self._sp.encode(text, add_eos=add_eos)

    def encode_batch(self, texts: Sequence[str], add_eos: bool = True) -> list[list[int]]:
        """``encode`` of many texts at once (SentencePiece's own threads)."""
        texts = list(texts)
        bad = next((i for i, t in enumerate(texts) if not isinstance(t, str)), None)
        if bad is not None:
            raise TypeError(f"encode_batch expects strings, item {bad} is {type(texts[bad]).__name__}")
        return self._sp.encode(texts, add_eos=add_eos, num_threads=min(4, os.cpu_count() or 1))

    def decode(self, ids: Iterable[int]) -> str:
        """Text of ``ids`` up to the first EOS; pad and -100 dropped; sentinels as ``<extra_id_i>``."""
        ids = [int(i) for i in ids]  # accepts lists, tensors and arrays
        if EOS_ID in ids:
            ids = ids[: ids.index(EOS_ID)]
        ids = [i for i in ids if i not in (PAD_ID, LABEL_PAD)]
        bad = next((i for i in ids if not 0 <= i < self.vocab_size), None)
        if bad is not None:
            raise ValueError(f"token id {bad} outside the vocabulary [0, {self.vocab_size})")
        return self._sp.decode(ids)

    def piece(self, i: int) -> str:
        """The text of one token as a piece (``▁`` as a space: `` the``), for log-probability listings;
        an id outside the vocabulary (a model's padding rows) as ``<id N>``."""
        return self._sp.id_to_piece(i).replace("\u2581", " ") if 0 <= i < self.vocab_size else f"<id {i}>"

    def decode_batch(self, batch: Iterable[Iterable[int]]) -> list[str]:
        """``decode`` of each sequence."""
        return [self.decode(ids) for ids in batch]

    def __getstate__(self) -> dict:
        # datasets.map pickles the tokenizer into its worker processes.
        return {"model_proto": self._proto, "path": self.path}

    def __setstate__(self, state: dict) -> None:
        self.__init__(state["model_proto"], state["path"])

    def __repr__(self) -> str:
        return f"Tokenizer({str(self.path)!r}, pieces={self.num_pieces}, sentinels={self.num_extra})"


def train_tokenizer(
    texts: Iterable[str],
    out_path: str | Path,
    vocab_size: int = 8000,
    num_extra: int = T5_NUM_EXTRA,
    max_sentences: int = 200_000,
    *,
    max_chars: int = 3_000_000,
    character_coverage: float = 0.9995,
    seed: int = 0,
) -> Tokenizer:
    """Train a unigram SentencePiece model on ``texts``; write it, with sentinels, to ``out_path``.

    ``vocab_size`` counts SentencePiece pieces (pad, EOS and UNK included); the
    ``num_extra`` sentinels come on top, as in T5 (32000 + 100). Texts are cut
    into sentences, and a uniform random sample of at most ``max_sentences``
    sentences and ``max_chars`` characters trains the model: enough for a
    vocabulary of a few thousand pieces, and seconds instead of minutes.
    """
    if vocab_size < 4:
        raise ValueError(f"vocab_size must leave room for pieces beyond pad/EOS/UNK, got {vocab_size}")
    if num_extra < 0:
        raise ValueError(f"num_extra must be >= 0, got {num_extra}")
    start = time.perf_counter()
    sample, seen = _sample_sentences(texts, max_sentences, max_chars, seed)
    if not sample:
        raise ValueError("no text to train a tokenizer on: every text was empty or whitespace")
    model = io.BytesIO()
    try:
        spm.SentencePieceTrainer.train(
            sentence_iterator=iter(sample),
            model_writer=model,
            model_type="unigram",
            vocab_size=vocab_size,
            pad_id=PAD_ID,
            eos_id=EOS_ID,
            unk_id=UNK_ID,
            bos_id=-1,  # T5 has no BOS
            character_coverage=character_coverage,
            input_sentence_size=0,  # already sampled above
            max_sentence_length=_MAX_SENTENCE_BYTES,
            num_threads=os.cpu_count() or 1,
            minloglevel=2,
        )
    except RuntimeError as err:
        raise ValueError(f"SentencePiece training on {len(sample)} sentences failed: {err}") from err
    proto = spm_pb.ModelProto()
    proto.ParseFromString(model.getvalue())
    _append_sentinels(proto, num_extra)
    out_path = Path(out_path)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    out_path.write_bytes(proto.SerializeToString())
    log.info(
        "trained a %d-piece tokenizer (+%d sentinels) on %d of %d sentences in %.1f s -> %s",
        vocab_size,
        num_extra,
        len(sample),
        seen,
        time.perf_counter() - start,
        out_path,
    )
    return Tokenizer.load(out_path)


def _sentences(texts: Iterable[str]) -> Iterator[str]:
    for text in texts:
        for sentence in _SENTENCE_BREAK.split(text):
            if sentence.strip():
                yield sentence


def _sample_sentences(texts: Iterable[str], max_sentences: int, max_chars: int, seed: int) -> tuple[list[str], int]:
    """A uniform sample of the texts' sentences within both budgets, and how many there were."""
    if max_sentences < 1 or max_chars < 1:
        raise ValueError(f"max_sentences and max_chars must be positive, got {max_sentences}, {max_chars}")
    rng = random.Random(seed)
    reservoir: list[str] = []
    seen = 0
    for seen, sentence in enumerate(_sentences(texts), start=1):  # reservoir sampling (Algorithm R)
        if len(reservoir) < max_sentences:
            reservoir.append(sentence)
        else:
            j = rng.randrange(seen)
            if j < max_sentences:
                reservoir[j] = sentence
    rng.shuffle(reservoir)
    sample, chars = [], 0
    for sentence in reservoir:
        if sample and chars + len(sentence) > max_chars:
            break
        sample.append(sentence)
        chars += len(sentence)
    return sample, seen


def _append_sentinels(proto: spm_pb.ModelProto, num_extra: int) -> None:
    """Append ``<extra_id_{num_extra-1}>`` ... ``<extra_id_0>`` as user-defined pieces."""
    for i in reversed(range(num_extra)):
        piece = proto.pieces.add()
        piece.piece = SENTINEL.format(i)
        piece.score = 0.0
        piece.type = spm_pb.ModelProto.SentencePiece.USER_DEFINED


def _count_sentinels(sp: spm.SentencePieceProcessor) -> int:
    """How many of the top pieces are ``<extra_id_0>``, ``<extra_id_1>``, ... counting down from the top."""
    n, size = 0, sp.get_piece_size()
    while n < size and sp.id_to_piece(size - 1 - n) == SENTINEL.format(n):
        n += 1
    return n


def _check_t5_conventions(sp: spm.SentencePieceProcessor, path: str) -> None:
    found = {"pad": sp.pad_id(), "eos": sp.eos_id(), "unk": sp.unk_id()}
    if found != {"pad": PAD_ID, "eos": EOS_ID, "unk": UNK_ID}:
        raise ValueError(f"{path} does not follow T5's conventions pad=0, eos=1, unk=2: it has {found}")
