"""Progress a person follows: durations as text and one status line for a long loop."""

from __future__ import annotations

import sys
import time
from typing import TextIO


def format_duration(seconds: float) -> str:
    """``3725`` -> ``'1h02m05s'``; ``65`` -> ``'1m05s'``; ``7.2`` -> ``'7s'``."""
    seconds = max(0, round(seconds))
    hours, rest = divmod(seconds, 3600)
    minutes, secs = divmod(rest, 60)
    if hours:
        return f"{hours}h{minutes:02d}m{secs:02d}s"
    return f"{minutes}m{secs:02d}s" if minutes else f"{secs}s"


class ProgressBar:
    """``[label] 120/1000 examples [##--------] 12% | 35.2 examples/s | ETA 25s | <note>``, one line.

    On a terminal the line is redrawn in place; elsewhere (a log file, Ray's
    forwarded output) a new line is printed at most every ``interval_s`` seconds
    and once at the end, so a long evaluation never prints one line per batch.
    """

    WIDTH = 20  # characters of the bar

    def __init__(
        self, total: int, label: str, unit: str = "items", stream: TextIO | None = None, interval_s: float = 30.0
    ) -> None:
        self.total, self.label, self.unit = total, label, unit
        self.stream = stream if stream is not None else sys.stderr
        self.interval_s = interval_s
        self.done = 0
        self._tty = self.stream.isatty()
        self._started = time.perf_counter()
        self._shown = -interval_s  # the first update is always shown

    def update(self, n: int, note: str = "") -> None:
        """``n`` more items are done; ``note`` is shown at the end of the line (e.g. ``"812 tokens/s"``)."""
        self.done += n
        now = time.perf_counter() - self._started
        if self._tty or self.done >= self.total or now - self._shown >= self.interval_s:
            self._shown = now
            line = self.line(now, note)
            self.stream.write(f"\r{line}\x1b[K" if self._tty else f"{line}\n")
            if self._tty and self.done >= self.total:
                self.stream.write("\n")
            self.stream.flush()

    def line(self, elapsed_s: float, note: str = "") -> str:
        """The status line after ``elapsed_s`` seconds."""
        share = self.done / self.total if self.total else 1.0
        filled = round(self.WIDTH * share)
        rate = self.done / elapsed_s if elapsed_s > 0 else 0.0
        eta = format_duration((self.total - self.done) / rate) if rate > 0 else "?"
        parts = [
            f"[{self.label}] {self.done}/{self.total} {self.unit} [{'#' * filled}{'-' * (self.WIDTH - filled)}] "
            f"{share:.0%}",
            f"{rate:.1f} {self.unit}/s",
            f"ETA {eta}",
        ]
        return " | ".join(parts + ([note] if note else []))
