"""Export a platform checkpoint or an imported directory as a Hugging Face directory (speed.models.export).

    .venv/bin/python jobs/export.py --checkpoint runs/pretrain_lm/checkpoint_000100 --out exported/lm
    .venv/bin/python jobs/export.py --checkpoint runs/finetune/checkpoint --out exported/t5 --form t5
    .venv/bin/python jobs/export.py --checkpoint ouro-1.4b --out exported/ouro      # an imported directory

--form: ouro (a looped LM in Ouro's options, every loop kept), llama (a pre-norm looped LM unrolled into a
plain Llama: the last loop's logits kept, the sharing lost) or t5 (a SpeedT5 as T5 v1.1, its decoder unrolled);
by default t5 for a T5, ouro where the options allow, else llama. A form that would change the model's outputs
is refused in one line naming the option, status 2, as is a directory the platform does not read (the model_type
error evaluate gives). The checkpoint's tokenizer comes along (its SentencePiece model and an LM's chat template,
or an imported model's own files); docs/models.md, "Export", says what each form keeps and loses. --out must not
exist (or be empty): the directory is written beside it and renamed, so it appears whole or not at all.
--checkpoint names a checkpoint, a run (its newest complete checkpoint) or a Hugging Face directory (Ouro, Llama,
T5 v1.1, Huginn), a local path or a URI; an FSDP run's sharded checkpoint (sharded/,
speed.train.sharding) is read whole in this one process (load_model).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "platform"))  # this checkout's speed, not an installed one

from speed.cli import JobParser, user_errors
from speed.models.export import Exported, export
from speed.models.form import export_forms


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = JobParser(prog="export.py", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--checkpoint", required=True, help="checkpoint, run or Hugging Face directory, a local path or a URI"
    )
    p.add_argument("--out", required=True, help="the new Hugging Face directory (a local path)")
    p.add_argument(
        "--form", choices=export_forms(), default=None, help="default: t5 for a T5, else ouro where it fits, else llama"
    )
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> Exported:
    """Export the checkpoint the flags name; returns what was written."""
    with user_errors():  # a bad path, or a form that would change the outputs: one line, status 2
        args = parse_args(argv)
        exported = export(args.checkpoint, args.out, form=args.form)
    print(f"wrote {exported.form} to {exported.directory}: {', '.join(exported.files)}")
    if exported.tokenizer is None:
        print("no tokenizer written: the checkpoint holds none (evaluate the export with --tokenizer)")
    return exported


if __name__ == "__main__":
    main(sys.argv[1:])
