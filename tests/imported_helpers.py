"""What the tests of imported looped LMs (Ouro, Huginn) check of a loaded ``LoopedLM``: its forward against a
reference, its cached path against its forward, SPEED against sequential decoding bit for bit."""

from __future__ import annotations

import random
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from engine_helpers import speed_as_sequential
from safetensors.torch import save_file
from test_lm_decoding import prompts

from speed.decode.exactness import LogitRecorder
from speed.decode.generate import DecodeOptions, generate
from speed.engine import Speculation
from speed.engine.sampling import Sampling
from speed.hf_files import WeightsError

ATOL = 1e-4
VOCAB = 97  # the checkpoint writers' (looped_refs)


def token_ids(seed: int = 0, batch: int = 2, length: int = 11) -> torch.Tensor:
    """Random token ids (batch, length) of the writers' vocabulary."""
    return torch.randint(0, VOCAB, (batch, length), generator=torch.Generator().manual_seed(seed))


def one_line(error) -> str:
    """A raised error's text (``pytest.ExceptionInfo``), asserted to be one line."""
    text = str(error.value)
    assert "\n" not in text, text
    return text


def weights_refusal(directory: Path, weights: dict[str, torch.Tensor], load: Callable[[Path], object]) -> str:
    """``weights`` written as the directory's ``model.safetensors`` and the directory loaded with ``load``: the
    one-line ``WeightsError`` it must raise."""
    save_file(weights, str(directory / "model.safetensors"))
    with pytest.raises(WeightsError) as error:
        load(directory)
    return one_line(error)


def assert_loops_match(model, ids: torch.Tensor, want: list[torch.Tensor], atol: float = ATOL) -> None:
    """The model's forward gives ``want`` (each loop's logits (B, T, V)) to ``atol``, and its loops differ."""
    with torch.no_grad():
        got = model(ids, return_logits=True).loop_logits
    assert len(got) == len(want)
    for loop, (a, b) in enumerate(zip(got, want)):
        torch.testing.assert_close(a, b, atol=atol, rtol=0, msg=lambda m, i=loop: f"loop {i}: {m}")
    if len(want) > 1:
        assert (want[0] - want[-1]).abs().max() > 0.1, "the loops must change the output for the test to see them"


def assert_cached_equals_forward(model, seed: int, batch: int = 3, max_new: int = 6, atol: float = ATOL) -> None:
    """Sequential decoding (prefill + steps, every loop's exit recorded) gives, at every output position and
    loop, the logits of the forward over the prompt and the tokens decoded, to ``atol``."""
    ids, mask = prompts(random.Random(seed), batch, model.vocab_size)
    recorder = LogitRecorder(model)
    res = generate(recorder, ids, mask, DecodeOptions(method="sequential", max_new_tokens=max_new))
    for b, tokens in enumerate(res.tokens):
        prompt = ids[b, : int(mask[b].sum())].tolist()
        with torch.no_grad():
            loops = model(torch.tensor([prompt + tokens]), return_logits=True).loop_logits
        P = len(prompt)
        for pos in range(len(tokens)):
            for loop, logits in enumerate(loops):
                got = recorder.logits[(b, loop, pos)]
                torch.testing.assert_close(got, logits[0, P - 1 + pos], atol=atol, rtol=0)


def assert_speed_exact(model, seed: int) -> int:
    """SPEED equals sequential decoding bit for bit (tokens and every loop's logits), greedy and seeded
    sampling, batch 1 and 8, eager and final invalidation at launch loops 1 and M; returns SPEED's flushes."""
    rng = random.Random(seed)
    flushes = 0
    for batch in (1, 8):
        ids, mask = prompts(rng, batch, model.vocab_size)
        for sampling in (None, Sampling(temperature=rng.choice([0.7, 1.0]), top_k=5, seed=rng.randrange(2**63))):
            reference = LogitRecorder(model)
            ref = generate(
                reference, ids, mask, DecodeOptions(method="sequential", max_new_tokens=8, sampling=sampling)
            )
            for invalidation in ("eager", "final"):
                for launch in sorted({1, model.n_loops}):
                    got = speed_as_sequential(
                        model, reference, ref, ids, mask, 8, (seed, batch, sampling, invalidation, launch),
                        speculation=Speculation(launch, invalidation), sampling=sampling,
                    )  # fmt: skip
                    assert got.trace.equals(ref.trace)
                    flushes += got.stats.flushes
    return flushes


def write_chat_ouro(directory, end_of_turn_bias: float = 0.0, seed: int = 0, chat_template: str | None = None):
    """A tiny random Ouro in the published layout (``looped_refs``) with an Ouro-like tokenizer beside it
    (``test_hf_tokenizer``'s: byte-level BPE, ``<|endoftext|>`` ``<|im_start|>`` ``<|im_end|>`` at 0 1 2, eos 0,
    a ChatML template): what a downloaded chat model's directory holds. ``end_of_turn_bias`` is added to
    ``<|im_end|>``'s row of the head, so that chats end at it after a few tokens; ``chat_template`` replaces
    Qwen's ChatML. Returns the directory."""
    from pathlib import Path

    from looped_refs import write_ouro_checkpoint
    from safetensors.torch import load_file, save_file
    from test_hf_tokenizer import OURO_CONFIG, _qwen_like, _write

    directory = Path(directory)
    backend = _qwen_like()
    write_ouro_checkpoint(directory, vocab=backend.get_vocab_size(), total_ut_steps=3, seed=seed)
    if end_of_turn_bias:
        weights = load_file(str(directory / "model.safetensors"))
        head = weights["lm_head.weight"]  # (V, d)
        head[2] += end_of_turn_bias * weights["model.norm.weight"].sign()
        save_file(weights, str(directory / "model.safetensors"), metadata={"format": "pt"})
    config = OURO_CONFIG if chat_template is None else {**OURO_CONFIG, "chat_template": chat_template}
    _write(directory, backend, tokenizer_config__json=config)
    return directory
