"""Run the notebooks in ``analysis/`` headless on a results folder (needs the ``analysis`` extra).

The notebooks read ``$SPEED_RESULTS``. All of them run in one kernel (a kernel
start and the imports cost seconds each), each from a cleared namespace
(``%reset -f``), so none leans on another's variables.
"""

from __future__ import annotations

from pathlib import Path

import nbformat
from jupyter_client import KernelManager
from nbclient import NotebookClient

from speed.paths import checkout_env, repo_root

RESULTS_ENV = "SPEED_RESULTS"


def notebook_paths() -> list[Path]:
    """Every notebook in ``analysis/``, sorted."""
    return sorted((repo_root() / "analysis").glob("*.ipynb"))


def run_notebooks(
    results: str | Path, paths: list[Path] | None = None, timeout: int = 600
) -> list[nbformat.NotebookNode]:
    """Execute ``paths`` (default: every notebook) on ``results``; returns them with their outputs.

    Raises ``nbclient.exceptions.CellExecutionError`` at the first failing cell.
    """
    paths = notebook_paths() if paths is None else paths
    env = checkout_env()  # the kernel imports this checkout's speed
    env[RESULTS_ENV] = str(Path(results).resolve())
    env["MPLBACKEND"] = "Agg"  # headless: figures are saved, not shown
    kernel = KernelManager(kernel_name="python3")
    kernel.start_kernel(cwd=str(repo_root() / "analysis"), env=env)
    executed = []
    try:
        for path in paths:
            notebook = nbformat.read(path, as_version=4)
            notebook.cells.insert(0, nbformat.v4.new_code_cell("%reset -f"))
            NotebookClient(notebook, km=kernel, timeout=timeout).execute()
            notebook.cells.pop(0)
            executed.append(notebook)
    finally:
        kernel.shutdown_kernel(now=True)
    return executed
