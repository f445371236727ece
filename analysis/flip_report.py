# %% [markdown]
# # Flip statistics and decode speed from result files
#
# A notebook in percent format (open it with Jupyter + jupytext, or run it as a script):
# it only reads Parquet/JSON written by `jobs/evaluate.py` and `jobs/bench_decode.py`
# and calls tested library functions; no number is typed in by hand.
#
#     python analysis/flip_report.py --eval runs/quality/eval-2x6-test --bench results/bench_decode.parquet

# %%
from __future__ import annotations

import argparse
import json
from pathlib import Path

import pyarrow.compute as pc
import pyarrow.parquet as pq

from speed.bench import format_table
from speed.trace import flip_rates


def report(eval_dir: Path | None, bench: Path | None) -> str:
    """Flip rate per loop and per position bucket of an evaluation, plus a benchmark table."""
    parts = []
    if eval_dir is not None:
        trace = pq.read_table(eval_dir / "trace.parquet")
        summary = json.loads((eval_dir / "summary.json").read_text())
        parts.append(f"{summary['task']} / {summary['split']}: pattern {summary['model']['pattern']}")
        parts.append(flip_rates(trace).to_pandas().to_string(index=False))
        # Early positions vs later ones: does speculation get easier along the sequence?
        early = trace.filter(pc.less(trace["position"], 5))
        late = trace.filter(pc.greater_equal(trace["position"], 5))
        for name, part in (("positions 0-4", early), ("positions 5+", late)):
            if part.num_rows:
                rates = flip_rates(part).column("flip_rate_final").to_pylist()
                parts.append(f"{name}: flip rate vs final per loop " + " ".join(f"{r:.3f}" for r in rates))
    if bench is not None:
        parts.append(format_table(pq.read_table(bench)))
    return "\n\n".join(parts)


# %%
if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="Flip statistics and decode speed from result files")
    parser.add_argument("--eval", type=Path, help="an evaluation folder (trace.parquet, summary.json)")
    parser.add_argument("--bench", type=Path, help="a bench_decode Parquet file")
    args = parser.parse_args()
    print(report(args.eval, args.bench))
