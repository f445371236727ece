"""How often bf16 weights' greedy tokens agree with float32's, on one looped LM (``speed.models.precision``).

Two measures on the same prompts: free-running, each precision decodes greedily on its own (sequences identical,
and the first output position where one differs); teacher-forced, both read float32's outputs and each position's
argmax is compared, for every loop's exit (a difference does not carry on into the next positions).
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from speed.data import load_records
from speed.decode.generate import DecodeOptions, generate
from speed.hf_tokenizer import prompt_ids
from speed.models.looped_lm import LoopedLM
from speed.models.precision import bf16_weights
from speed.tokenizer import TextTokenizer


@dataclass(frozen=True)
class Agreement:
    """bf16 weights against float32 on ``sequences`` prompts of ``new_tokens`` greedy tokens each."""

    sequences: int
    new_tokens: int
    identical: int  # free-running sequences bf16 decodes exactly as float32
    first_difference: int | None  # the earliest output position (0-based) where a free-running sequence differs
    positions: int  # teacher-forced positions compared (float32's outputs, every sequence)
    agreeing: tuple[int, ...]  # per loop: positions whose bf16 argmax equals float32's

    def describe(self) -> str:
        """One line: the last loop's teacher-forced agreement, every loop's, and the free-running outcome."""
        share = [100 * a / self.positions for a in self.agreeing]
        loops = ", ".join(f"{s:.1f}" for s in share)
        first = "none" if self.first_difference is None else f"output position {self.first_difference}"
        return (
            f"token agreement: {share[-1]:.1f} % of {self.positions} tokens at the last loop (per loop: {loops} %); "
            f"free-running: {self.identical} of {self.sequences} sequences identical over {self.new_tokens} tokens, "
            f"first difference at {first}"
        )


def corpus_prompts(tokenizer: TextTokenizer, count: int, length: int) -> list[list[int]]:
    """The first ``length`` tokens of the first ``count`` pretraining validation documents at least that long."""
    prompts = []
    for record in load_records("pretrain", "validation"):
        ids = prompt_ids(tokenizer, [record["text"]])[0]
        if len(ids) >= length:
            prompts.append(ids[:length])
        if len(prompts) == count:
            return prompts
    raise ValueError(f"fewer than {count} validation documents of {length} tokens")


@torch.no_grad()
def precision_agreement(model: LoopedLM, prompts: Sequence[Sequence[int]], new_tokens: int) -> Agreement:
    """``model`` (float32, left as it is) against a bf16-weights copy of it, on ``prompts`` (one batch each)."""
    half = bf16_weights(copy.deepcopy(model)).eval()
    model = model.eval()
    identical, first, positions, agreeing = 0, None, 0, torch.zeros(model.n_loops, dtype=torch.long)
    for prompt in prompts:
        ids = torch.tensor([list(prompt)])
        full = generate(
            model, ids, options=DecodeOptions(method="sequential", max_new_tokens=new_tokens, trace=False)
        ).tokens[0]
        other = generate(
            half, ids, options=DecodeOptions(method="sequential", max_new_tokens=new_tokens, trace=False)
        ).tokens[0]
        identical += full == other
        differ = next((i for i, (a, b) in enumerate(zip(full, other)) if a != b), None)
        if differ is None and len(full) != len(other):
            differ = min(len(full), len(other))
        if differ is not None:
            first = differ if first is None else min(first, differ)
        text = torch.tensor([[*prompt, *full]])
        span = slice(len(prompt) - 1, text.shape[1] - 1)  # the positions that predict float32's outputs
        pairs = zip(model(text, return_logits=True).loop_logits, half(text, return_logits=True).loop_logits)
        for loop, (a, b) in enumerate(pairs):  # each (1, T, V)
            agreeing[loop] += int((a[0, span].argmax(-1) == b[0, span].argmax(-1)).sum())
        positions += len(full)
    return Agreement(len(prompts), new_tokens, identical, first, positions, tuple(agreeing.tolist()))
