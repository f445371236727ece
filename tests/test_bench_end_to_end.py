"""The end-to-end run per form (``speed.benchmarks.end_to_end``) on a tiny published-layout directory: memory check,
load, SPEED equal to sequential, two chats through Serve in bf16 weights, the figures side by side."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from write_tiny_models import write_tiny_models

pytestmark = [pytest.mark.slow, pytest.mark.ray]

PLATFORM = str(Path(__file__).resolve().parents[1] / "platform")


def test_a_tiny_huginn_end_to_end_in_a_fresh_process(tmp_path):
    """The module's command on Huginn's layout: its JSON line holds the check's figure over the weights, 16 greedy
    tokens (the run asserts SPEED's equal sequential's), two chat answers and the replica's resident set."""
    directory = write_tiny_models(tmp_path)["huginn-tiny"]
    out = subprocess.run(
        [sys.executable, "-m", "speed.benchmarks.end_to_end", str(directory), "--tokens", "16"],
        capture_output=True, text=True, timeout=600, env={**os.environ, "PYTHONPATH": PLATFORM},
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    lines = out.stdout.strip().splitlines()
    report = json.loads(next(line for line in lines if line.startswith("{")))
    assert (report["form"], report["dtype"]) == ("huginn", "bfloat16")
    assert report["checked_bytes"] > report["weights_bytes"] > 0  # the weights and the two requests' cache
    assert 1 <= len(report["tokens"]) <= 16 and len(report["chat_tokens"]) == 2
    assert all(n >= 1 for n in report["chat_tokens"]) and report["replica_rss"] > 0
    assert report["peak_after_decoding"] >= report["peak_after_load"] > 0
    assert lines[-1].startswith("| huginn-tiny | bfloat16 | ") and "| yes |" in lines[-1]
