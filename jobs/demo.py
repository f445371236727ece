"""The whole SPEED story on this machine (`make demo`): pretrain, finetune, evaluate SPEED against sequential.

1. pretrain a small shared decoder (2 unique layers x 6 loops, d_model 128) on pretrain_text;
2. finetune it on Multi30k EN-DE (multi30k_en_de);
3. decode the test split with SPEED and sequentially (identical output required) and print
   BLEU, the flip rate of every loop's early exit, and SPEED's decode speed-up.

`make demo` runs the T5 encoder-decoder (span corruption, then translation); `make demo-lm`
(--model lm) a decoder-only looped LM (next-token pretraining on packed rows, then
translation as chat prompts with the loss on the answer only).

Uses the same library calls as jobs/pretrain.py and jobs/finetune.py, with the YAML
configs in jobs/configs/demo_*.yaml (demo_lm_*.yaml for the LM), on a local Ray. Each training
part stops at its wall-clock budget with a final checkpoint. Runs live in runs/demo/ (runs/demo-lm/)
under deterministic names, so a second `make demo` continues them where they stopped; --fresh starts over.
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "platform"))  # this checkout's speed, not an installed one

from speed.cli import JobParser, user_errors
from speed.eval.summary import format_summary
from speed.paths import repo_root
from speed.storage import locate
from speed.train.config import job_from_layers
from speed.train.launch import check_inputs, run_job

CONFIGS = repo_root() / "jobs" / "configs"


@dataclass(frozen=True)
class Demo:
    """One family's demo: its configs (``<configs>_pretrain.yaml``, ``_finetune.yaml``) and runs folder."""

    configs: str
    folder: str
    objective: str


DEMOS = {
    "t5": Demo("demo", "demo", "span corruption"),
    "lm": Demo("demo_lm", "demo-lm", "next-token prediction on packed rows"),
}


def main(argv: list[str] | None = None) -> int:
    """Run pretrain -> finetune -> evaluate and print the results; returns the exit status."""
    parser = JobParser(prog="demo.py", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", choices=sorted(DEMOS), default="t5", help="model family: t5 or lm")
    parser.add_argument("--storage-path", default=None, help="where the runs go (default: runs/demo, runs/demo-lm)")
    parser.add_argument("--fresh", action="store_true", help="delete earlier demo runs first")
    args = parser.parse_args(argv)
    demo = DEMOS[args.model]
    args.storage_path = args.storage_path or str(repo_root() / "runs" / demo.folder)
    if args.fresh:
        locate(args.storage_path).delete()  # a local folder or a prefix on object storage
    started = time.time()
    where = {"run.storage_path": args.storage_path}

    with user_errors():  # e.g. the local corpora are missing
        pretrain = job_from_layers("pretrain", CONFIGS / f"{demo.configs}_pretrain.yaml", [], where)
        check_inputs(pretrain)
    print(f"== 1/3 pretraining ({demo.objective} on pretrain_text) ==", flush=True)
    pretrained = run_job(pretrain)

    print("== 2/3 finetuning on Multi30k EN-DE, then 3/3 evaluation ==", flush=True)
    finetune = job_from_layers(
        "finetune", CONFIGS / f"{demo.configs}_finetune.yaml", [], {**where, "init_from": pretrained.checkpoint}
    )
    finetuned = run_job(finetune)

    summary = finetuned.evaluation
    assert summary is not None, "the finetune config enables evaluation"
    print("\n== SPEED demo results ==")
    model, steps = finetuned.job.model, f"{pretrained.step} pretraining + {finetuned.step} finetuning steps"
    print(f"model {model.pattern}, d_model {model.d_model}, {steps}")
    print(format_summary(summary))
    print(f"total {((time.time() - started) / 60):.1f} min; runs in {args.storage_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
