"""Loading at real sizes: the time ``speed.from_pretrained`` takes and the memory it holds while it loads.

``measure_load`` runs in a fresh process (``python -m speed.benchmarks.loading DIR``), so that its peak resident
set is the load's alone: the code paths are first warmed on a tiny model of the same form (their pages are not
the load's), then the peak is read after loading. The weights should be held once: the peak over the resident
set before the load is at most a little above the weights' bytes (a transient tensor or two).
"""

from __future__ import annotations

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

from speed.models.pretrained import from_pretrained


@dataclass(frozen=True)
class LoadReport:
    """One load of a Hugging Face directory: its seconds, the loaded weights' bytes, and the resident set the load
    added at its peak (bytes over what the process held before it)."""

    seconds: float
    weights_bytes: int
    peak_extra_bytes: int

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
    model = from_pretrained(path, dtype=dtype)
    seconds = time.perf_counter() - start
    peak = peak_rss()
    weights = sum(t.numel() * t.element_size() for t in {p.data_ptr(): p for p in model.parameters()}.values())
    return LoadReport(seconds, weights, peak - before)


def measure_load(path: str | Path, dtype: torch.dtype = torch.float32, warm: str | Path | None = None) -> LoadReport:
    """``load_here`` in a fresh Python process (this checkout's ``speed``); its report."""
    platform = str(Path(__file__).resolve().parents[2])
    args = [sys.executable, "-m", "speed.benchmarks.loading", str(path), str(dtype).removeprefix("torch.")]
    out = subprocess.run(
        [*args, *([str(warm)] if warm else [])], capture_output=True, text=True, check=False,
        env={**os.environ, "PYTHONPATH": platform},
    )  # fmt: skip
    if out.returncode:
        raise RuntimeError(f"loading {path} failed: {out.stderr.strip().splitlines()[-1:]}")
    return LoadReport(**json.loads(out.stdout.strip().splitlines()[-1]))


def main(argv: list[str]) -> None:
    """``DIR DTYPE [WARM]``: one JSON line, the ``LoadReport``."""
    path, dtype = argv[0], getattr(torch, argv[1])
    print(json.dumps(asdict(load_here(path, dtype, argv[2] if len(argv) > 2 else None))))


if __name__ == "__main__":
    main(sys.argv[1:])
