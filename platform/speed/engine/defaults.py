"""SPEED's settings by kind of device: what evaluation and Serve use where a user sets none.

Measured side by side on a 2x6 T5 finetuned 1600 steps (docs/payoff.md): runner-up branches with lanes and exit
adapters cut the pipeline steps per token the most (1.65, against plain SPEED's 2.06), and a step is what a GPU
pays (at these sizes a step costs about the same with 1 or 20 rows); on a CPU every row costs: plain SPEED
without the adapters took the least time per token (the lanes' extra rows and the adapters' per-row matmuls cost
more than the steps they save). None of them changes the output.
"""

from __future__ import annotations

from typing import Any


def device_levers(device: str, n_loops: int) -> dict[str, Any]:
    """SPEED's settings (``Speculation`` fields by name) that won on ``device``'s kind for a model of ``n_loops``
    loops (M): on a GPU, M runner-up branches with lanes of M tokens; on a CPU, plain SPEED (none set)."""
    if str(device).split(":")[0] == "cuda":
        return {"branches": n_loops, "branch_depth": n_loops}
    return {}


def device_exit_adapters(device: str) -> bool:
    """Whether to draft with a checkpoint's exit adapters (``speed.models.exits``) on ``device``'s kind when the user
    says nothing: on a GPU yes (fewer steps), on a CPU no (their per-row cost outweighs the steps saved)."""
    return str(device).split(":")[0] == "cuda"
