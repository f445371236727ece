"""bf16 weights' token agreement with float32's on a trained looped LM (speed.benchmarks.precision).

    python jobs/bench_agreement.py --checkpoint runs/demo-lm/<pretrain run>/checkpoint_<n>
    python jobs/bench_agreement.py --checkpoint CKPT --agreement-prompts 64 --prompt-len 32 --new-tokens 64 --json

The checkpoint's greedy tokens in bf16 weights (speed.models.precision: the linear weights bfloat16, the rest
float32) against float32's, on --agreement-prompts validation documents' first --prompt-len tokens, --new-tokens
each: teacher-forced (both read float32's greedy outputs; each position's argmax compared at every loop) and
free-running (each decodes on its own). Prints one line, or with --json one JSON object.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "platform"))  # this checkout's speed, not an installed one

from speed.benchmarks.precision import corpus_prompts, precision_agreement
from speed.cli import JobParser, user_errors
from speed.hf_tokenizer import load_tokenizer
from speed.models.pretrained import load_pretrained


def main(argv: list[str] | None = None) -> int:
    p = JobParser(prog="bench_agreement.py", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--checkpoint", required=True, help="a looped LM checkpoint with its tokenizer")
    p.add_argument("--agreement-prompts", type=int, default=16, help="validation documents' prompts")
    p.add_argument("--prompt-len", type=int, default=64, help="each prompt's tokens")
    p.add_argument("--new-tokens", type=int, default=64, help="tokens decoded after each prompt")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of the line")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    with user_errors():  # a missing checkpoint or tokenizer: one line, status 2
        loaded = load_pretrained(args.checkpoint, exits=False)
        prompts = corpus_prompts(load_tokenizer(loaded.tokenizer_path), args.agreement_prompts, args.prompt_len)
    agreement = precision_agreement(loaded.model, prompts, args.new_tokens)
    print(json.dumps(asdict(agreement)) if args.json else agreement.describe())
    return 0


if __name__ == "__main__":
    sys.exit(main())
