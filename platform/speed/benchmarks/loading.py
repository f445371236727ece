"""Loading at real sizes: the time ``speed.from_pretrained`` takes and the memory it holds while it loads, beside
what its memory check said it would need.

``measure_load`` runs in a fresh process, so that its peak resident set is the load's alone: the code paths are
first warmed on a tiny model of the same form when one is given (their pages are not the load's), then the peak is
read after loading. The weights should be held once: the peak over the resident set before the load is at most a
little above the weights' bytes (a chunk of ``speed.hf_files.CHUNK_BYTES`` or two; the goal is 1.15x).

    python -m speed.benchmarks.loading DIR [--dtypes float32 bfloat16] [--warm TINY_DIR]

prints one JSON ``LoadReport`` a dtype (each in its own process) and a table row each: seconds, the weights, the
check's figure, the peak and its ratio. A dtype the memory check refuses prints the check's one line instead (and
no process is started for it).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import psutil
import torch

from speed.engine.memory import MemoryBudgetError, size
from speed.models.precision import DTYPES, dtype_named
from speed.models.pretrained import check_load, from_pretrained


@dataclass(frozen=True)
class LoadReport:
    """One load of a Hugging Face directory: its seconds, the loaded weights' bytes, and the resident set the load
    added at its peak (bytes over what the process held before it)."""

    seconds: float
    weights_bytes: int
    peak_extra_bytes: int
    checked_bytes: int = 0  # what the memory check (``check_load``) said the load needs, before it started
    peak_bytes: int = 0  # the process's peak resident set (torch and Python included)

    @property
    def peak_over_weights(self) -> float:
        """The load's peak extra resident set over the weights: 1.0 holds the model exactly once."""
        return self.peak_extra_bytes / self.weights_bytes


def peak_rss() -> int:
    """This process's peak resident set in bytes: Linux's VmHWM (``ru_maxrss`` would keep the high-water mark of
    the process that started this one: it survives ``exec``), elsewhere ``ru_maxrss``."""
    status = Path("/proc/self/status")
    if status.is_file():
        for line in status.read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024  # kB
    scale = 1 if sys.platform == "darwin" else 1024  # macOS reports bytes, Linux KiB
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * scale


def load_here(path: str | Path, dtype: torch.dtype, warm: str | Path | None = None) -> LoadReport:
    """Load ``path`` as ``dtype`` in this process (``warm``: a tiny directory of the same form loaded first);
    the peak is the process's, so call it in a fresh one (``measure_load``)."""
    if warm is not None:
        from_pretrained(warm, dtype=dtype)
    before = psutil.Process().memory_info().rss
    start = time.perf_counter()
    checked = check_load(path, dtype=dtype).total
    model = from_pretrained(path, dtype=dtype)
    seconds = time.perf_counter() - start
    peak = peak_rss()
    weights = sum(t.numel() * t.element_size() for t in {p.data_ptr(): p for p in model.parameters()}.values())
    return LoadReport(seconds, weights, peak - before, checked, peak)


def measure_load(path: str | Path, dtype: torch.dtype = torch.float32, warm: str | Path | None = None) -> LoadReport:
    """``load_here`` in a fresh Python process (this checkout's ``speed``); its report."""
    platform = str(Path(__file__).resolve().parents[2])
    args = [sys.executable, "-m", "speed.benchmarks.loading", str(path), "--here", str(dtype).removeprefix("torch.")]
    out = subprocess.run(
        [*args, *(["--warm", str(warm)] if warm else [])], capture_output=True, text=True, check=False,
        env={**os.environ, "PYTHONPATH": platform},
    )  # fmt: skip
    if out.returncode:
        raise RuntimeError(f"loading {path} failed: {out.stderr.strip().splitlines()[-1:]}")
    return LoadReport(**json.loads(out.stdout.strip().splitlines()[-1]))


def main(argv: list[str]) -> None:
    """``DIR [--dtypes ...] [--warm TINY]``: each dtype loaded in a fresh process (``--here DTYPE``: in this one)."""
    parser = argparse.ArgumentParser(prog="python -m speed.benchmarks.loading", description=main.__doc__)
    parser.add_argument("directory")
    parser.add_argument("--dtypes", nargs="+", choices=DTYPES, default=list(DTYPES))
    parser.add_argument("--warm", help="a tiny directory of the same form, loaded first (its pages are not the load's)")
    parser.add_argument("--here", choices=DTYPES, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.here:
        print(json.dumps(asdict(load_here(args.directory, dtype_named(args.here), args.warm))))
        return
    rows = []
    for name in args.dtypes:
        try:
            check_load(args.directory, dtype=dtype_named(name))
        except MemoryBudgetError as refused:
            rows.append(f"| {name} | refused: {refused} | | | | |")
            continue
        r = measure_load(args.directory, dtype_named(name), args.warm)
        print(json.dumps({"dtype": name, **asdict(r)}))
        rows.append(f"| {name} | {r.seconds:.1f} | {size(r.weights_bytes)} | {size(r.checked_bytes)} | "
                    f"{size(r.peak_bytes)} | {r.peak_over_weights:.3f}x |")  # fmt: skip
    print("| dtype | seconds | weights | memory check | peak RSS (process) | load's peak over the weights |")
    print("|---|---|---|---|---|---|")
    print("\n".join(rows))

if __name__ == "__main__":
    main(sys.argv[1:])
