"""Evaluation: a model decoded on a task's held-out examples and scored (``evaluate``), two evaluations
compared (``compare``), the exit-budget curve (``budget``), the scores (``metrics``), training's validation."""
