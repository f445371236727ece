"""Compare two evaluations of the same examples: BLEU and ROUGE-L differences with paired-bootstrap intervals.

    python jobs/compare.py --baseline runs/a/eval/translate_en_de-test --system runs/b/eval/translate_en_de-test

Both folders are ``jobs/evaluate.py`` outputs over the same examples. Prints
system minus baseline with a 95% interval (the same resampled examples for both
metrics) and each side's SPEED steps per token and flip cost; ``--out`` writes it as JSON.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "platform"))  # this checkout's speed, not an installed one

from speed.cli import JobParser, user_errors
from speed.eval.compare import compare_evaluations, format_comparison
from speed.storage import locate


def main(argv: list[str] | None = None) -> int:
    """Print (and with --out write) the comparison of two evaluation folders."""
    p = JobParser(prog="compare.py", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--baseline", required=True, help="evaluation folder (a local path or a URI) of today's recipe")
    p.add_argument("--system", required=True, help="evaluation folder (path or URI) of the system compared with it")
    p.add_argument("--samples", type=int, default=1000, help="bootstrap resamples")
    p.add_argument("--seed", type=int, default=12345, help="seed of the resampled indices (sacrebleu's default)")
    p.add_argument("--out", default=None, help="write the comparison to this JSON file (a local path or a URI)")
    args = p.parse_args(argv)
    with user_errors():
        for folder in (args.baseline, args.system):
            if not locate(folder).is_dir():
                raise FileNotFoundError(f"no evaluation folder at {folder}")
        comparison = compare_evaluations(args.baseline, args.system, args.samples, args.seed)
    print(format_comparison(comparison))
    if args.out:
        locate(args.out).write_text(json.dumps(comparison, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
