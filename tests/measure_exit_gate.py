"""The exit gate against SPEED and sequential decoding on a tiny random Ouro: the table in docs/models.md
("Ouro's exit gate: a lossy baseline"). Not a test; counts only, no timings.

    .venv/bin/python tests/measure_exit_gate.py /tmp/gate-ouro   # writes the checkpoint there, prints the table
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the test helpers beside this file

from looped_refs import write_ouro_checkpoint  # noqa: E402

import speed  # noqa: E402
from speed.decode.generate import DecodeOptions, generate  # noqa: E402
from speed.engine import DecodeStats, ExitRule  # noqa: E402

RULES = {
    "exit_gate threshold 0.15": ExitRule("threshold", 0.15),
    "exit_gate threshold 0.5": ExitRule("threshold", 0.5),
    "exit_gate threshold 1.0": ExitRule("threshold", 1.0),
    "exit_gate step 0": ExitRule("step", step=0),
    "exit_gate step 2": ExitRule("step", step=2),
    "exit_gate mix": ExitRule("mix"),
}


def main(directory: str, new_tokens: int = 16) -> None:
    torch.set_num_threads(1)
    write_ouro_checkpoint(directory, total_ut_steps=4, seed=1, scale=2.0)
    model = speed.from_pretrained(directory)
    ids = torch.randint(1, 97, (8, 6), generator=torch.Generator().manual_seed(7))

    def alone(**kw) -> tuple[list[list[int]], DecodeStats]:  # each prompt decoded alone, counters summed
        tokens, stats = [], DecodeStats()
        for prompt in ids:
            one = generate(model, prompt[None], options=DecodeOptions(max_new_tokens=new_tokens, **kw))
            tokens += one.tokens
            stats += one.stats
        return tokens, stats

    reference, _ = alone(method="sequential")
    total = sum(map(len, reference))

    def agreeing(tokens: list[list[int]]) -> int:  # tokens before each output's first difference from sequential's
        return sum(
            next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
            for a, b in zip(tokens, reference)
        )

    print("| method | agreeing with sequential | group passes per token | mean exit loop |\n| --- | --- | --- | --- |")
    runs = {"sequential": {"method": "sequential"}, "speed": {"method": "speed"}}
    runs |= {name: {"method": "exit_gate", "exit_rule": rule} for name, rule in RULES.items()}
    for name, kw in runs.items():
        tokens, stats = alone(**kw)
        exit_loop = f"{stats.mean_exit_loop:.2f}" if stats.gated_tokens else "-"
        print(f"| {name} | {agreeing(tokens)}/{total} | {stats.group_passes / stats.tokens:.3f} | {exit_loop} |")


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    main(sys.argv[1])
