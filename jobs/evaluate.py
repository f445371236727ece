"""Evaluate a checkpoint: decode a task split with SPEED, score it, write predictions, trace and summary.

    .venv/bin/python jobs/evaluate.py --checkpoint runs/finetune/checkpoint --split test --limit 200
    .venv/bin/python jobs/evaluate.py --checkpoint s3://bucket/speed/<run> --task translate_en_de --limit 50

The settings are speed.eval.evaluate.EvalConfig's, with its defaults: the task, source
and input length the checkpoint was trained with unless given; SPEED output is
checked against sequential decoding unless --no-check-sequential, greedy or,
with --temperature (and --top-k, --top-p, --seed), seeded sampling. With --method exit_gate (and --exit-kind,
--exit-threshold, --exit-step) a model with Ouro's exit gate is also decoded by its gate, a lossy baseline
reported beside SPEED's. Writes
predictions.parquet, trace.parquet and summary.json to --out (default
<checkpoint>/eval/<task>-<split>, -no-exit-adapters appended when the checkpoint's exit adapters went unused)
and prints the metrics with their signatures. A checkpoint with exit adapters (jobs/train_exits.py) drafts with
them with --exit-adapters, by default on a GPU, not on a CPU (speed.engine.defaults); the output is the same
either way, the steps per token and the time not.
--checkpoint names a checkpoint or a run (its newest complete checkpoint), or a Hugging Face model directory
(Ouro, Huginn, Llama, T5 v1.1: docs/models.md, "Bring your own looped LM"; its own tokenizer, chat template and
stop tokens), a local path or a URI (s3://, gs://: docs/training.md, "Storage").
--dtype bfloat16 evaluates it in bf16 weights (its linear weights bfloat16, everything else float32; SPEED still
equals sequential decoding bit for bit: docs/decoding.md). --initial-state-seed N decodes a Huginn directory from
its published random initial state drawn under seed N (default: zero; docs/models.md).
Before the model is read, its weights (and on a CPU the largest engine a batch builds: --batch-size requests of
the input length and --max-new-tokens outputs) are checked against the memory available: one line if they do not fit.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "platform"))  # this checkout's speed, not an installed one

from speed.cli import JobParser, add_weight_flags, user_errors
from speed.config import from_dict
from speed.data import TASKS, get_task, resolve_source
from speed.engine import INVALIDATIONS
from speed.engine.defaults import device_exit_adapters, device_levers
from speed.engine.memory import MemoryBudgetError
from speed.eval.evaluate import EvalConfig, run_evaluation
from speed.eval.summary import format_summary
from speed.hf_tokenizer import load_tokenizer
from speed.models.checkpoint import latest_checkpoint, read_checkpoint_config
from speed.models.exits import EXITS_CONFIG_FILE
from speed.models.precision import DTYPES, dtype_named
from speed.models.pretrained import load_pretrained, model_source
from speed.storage import absolute, locate

# EvalConfig field -> help; each is the flag --<field-name>, left out = EvalConfig's default.
EVAL_TASKS = sorted(name for name, task in TASKS.items() if not task.is_pretrain)
SETTINGS = {
    "task": f"one of {', '.join(EVAL_TASKS)} (default: the training task)",
    "split": "split to decode (default: test)",
    "source": "'hub', a hub name[:config], or files/glob (default: the training data's, else the local corpus)",
    "limit": "first N records (default: the whole split)",
    "batch_size": "sequences decoded together",
    "max_new_tokens": "output tokens per sequence at most",
    "max_source_len": "encoder tokens per input (default: the training data's, else 512)",
    "launch_loop": "SPEED launches a successor after this many loops",
    "invalidation": " or ".join(INVALIDATIONS),
    "branches": "SPEED's runner-up branches in flight per sequence (0: none; up to the model's loops)",
    "branch_depth": "tokens a branch's lane may hold (1: the branch launches no successor)",
    "row_budget": "SPEED's rows per step at most (default: all in flight)",
    "cost_model": "SPEED runs the speculative rows this device's measured group-pass cost says pay (default; "
    "--no-cost-model: every in-flight row, or --row-budget's)",
    "branch_below": "a token carries a branch only while its exit's top-1 probability is below this",
    "min_confidence": "a successor launches only from an exit whose top-1 probability is at least this",
    "oracle": "also decode with oracle speculation (untimed): the summary's oracle_steps_per_token",
    "check_sequential": "also decode sequentially: outputs must be identical; reports the speed-up",
    "bitwise": "with the check, fail on any difference (else only on one that is not a near-tie)",
    "near_tie": "top-2 logit gap below which a difference is a near-tie (with --no-bitwise)",
    "temperature": "0: greedy (default); else seeded sampling, the same for SPEED and sequential decoding",
    "top_k": "sample among the k most likely tokens (0: off)",
    "top_p": "sample among the most likely tokens holding this probability (1: off)",
    "seed": "sampling seed: every sequence's draws depend on (seed, output position) only",
    "bootstrap_samples": "resamples of BLEU's and ROUGE-L's 95%% bootstrap intervals (0: none)",
    "perplexity": "also score every loop's teacher-forced perplexity of the references",
    "method": "speed (default), or exit_gate: also decode with Ouro's exit gate (a model with one), reported beside "
    "SPEED's and sequential's: quality, group passes per token, mean exit loop (lossy, never checked)",
    "exit_kind": "the exit gate's rule: threshold (Ouro's exit_threshold), step (exit_at_step) or mix (weighted)",
    "exit_threshold": "kind threshold: the cumulative exit probability to reach, in (0, 1] (default 1.0)",
    "exit_step": "kind step: the 0-based loop whose logits decide (default 0)",
}
UNTRAINED_MAX_SOURCE_LEN = 512  # a checkpoint without a training job (converted weights): T5's input length


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = JobParser(prog="evaluate.py", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--checkpoint", required=True, help="checkpoint, run or Hugging Face model directory, a local path or a URI"
    )
    settings = p.add_argument_group("evaluation (speed.eval.evaluate.EvalConfig)")
    for name, help_ in SETTINGS.items():
        flag = f"--{name.replace('_', '-')}"
        if name in ("check_sequential", "bitwise", "oracle", "perplexity", "cost_model"):
            settings.add_argument(flag, action=argparse.BooleanOptionalAction, default=argparse.SUPPRESS, help=help_)
        else:
            settings.add_argument(flag, dest=name, default=argparse.SUPPRESS, metavar=name.upper(), help=help_)
    p.add_argument(
        "--exit-adapters",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="draft with the checkpoint's exit adapters when it has them (speed.models.exits; output unchanged); "
        "default: on a GPU yes, on a CPU no (speed.engine.defaults)",
    )
    p.add_argument(
        "--tokenizer",
        default=None,
        help="SentencePiece model or tokenizer.json directory (default: the checkpoint's spm.model, the directory's)",
    )
    p.add_argument("--out", default=None, help="output folder or URI (default: <checkpoint>/eval/<task>-<split>)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")
    add_weight_flags(p, DTYPES)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Run the evaluation the flags describe; returns its summary."""
    with user_errors():  # a mistake in the flags or the files they name: one line, status 2
        args = parse_args(argv)
        given = {name: getattr(args, name) for name in SETTINGS if hasattr(args, name)}
        config = from_dict(EvalConfig, given)  # flag strings coerced by the field types, checked
        exits = device_exit_adapters(args.device) if args.exit_adapters is None else args.exit_adapters
        recorded = _training_data(args.checkpoint)  # read before the model: the memory check's input length
        planned = config.following(recorded.get("task"), recorded.get("source"), recorded.get("max_source_len"))
        planned = planned.following(None, None, UNTRAINED_MAX_SOURCE_LEN)
        loaded = load_pretrained(
            args.checkpoint,
            map_location=args.device,
            exits=exits,
            dtype=dtype_named(args.dtype),
            capacity=planned.engine_capacity() if args.device == "cpu" else None,  # a GPU's cache is not the host's
            initial_state_seed=args.initial_state_seed,
        )
        # SPEED's settings left unset take the device's defaults (speed.engine.defaults: branches with lanes on a GPU)
        config = from_dict(EvalConfig, device_levers(args.device, loaded.model.n_loops) | given)
        data = loaded.config.get("job", {}).get("data", {})
        config = config.following(data.get("task"), data.get("source"), data.get("max_source_len"))
        config = config.following(None, None, UNTRAINED_MAX_SOURCE_LEN)
        if config.task is None:
            raise ValueError(f"checkpoint {loaded.checkpoint} records no training task; pass --task")
        resolve_source(get_task(config.task), config.split, config.source)  # the split exists
        tokenizer_path = args.tokenizer or loaded.tokenizer_path
        if tokenizer_path is None:
            raise FileNotFoundError(f"{loaded.checkpoint} holds no spm.model nor tokenizer.json; pass --tokenizer")
        tokenizer = load_tokenizer(tokenizer_path)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    unused = not exits and (locate(loaded.checkpoint) / EXITS_CONFIG_FILE).is_file()
    plain = "-no-exit-adapters" if unused else ""  # beside the evaluation with them, not over it
    out = args.out or f"{loaded.checkpoint}/eval/{config.task}-{config.split}{plain}"
    model = loaded.model.to(args.device)  # the loader fills a CPU-built model (as --dtype): move it where it decodes
    with user_errors((MemoryBudgetError,)):  # a batch the device cannot hold: one line saying what fits, status 2
        summary = run_evaluation(model, tokenizer, config, out)
    print(format_summary(summary))
    print(f"wrote {', '.join(summary['files'].values())}")
    return summary


def _training_data(checkpoint: str) -> dict[str, Any]:
    """The training data section a platform checkpoint records (its task, source, input length); {} for a Hugging
    Face directory, which records none."""
    if model_source(checkpoint) != "platform":
        return {}
    return read_checkpoint_config(latest_checkpoint(absolute(checkpoint))).get("job", {}).get("data", {})


if __name__ == "__main__":
    main(sys.argv[1:])
