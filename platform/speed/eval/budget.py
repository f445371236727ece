"""The budget curve: one training run's checkpoints, each evaluated on the same held-out examples.

``budget_curve(run, config, out)`` evaluates every chosen complete ``checkpoint_<step>`` of a run
directory (a local path or a URI) with one ``speed.eval.evaluate.EvalConfig`` (in-process, one after
another), each into ``<out>/checkpoint_<step>`` (an evaluation folder that already holds a summary of
the same settings is read, not redone), compares each budget's quality with the previous budget's on the
same examples (``speed.eval.compare``: paired bootstrap) and writes ``<out>/budget.parquet``
(``BUDGET_SCHEMA``, one row per budget: ``budget_row``). A better-trained model may flip more at its
early loops, so SPEED's steps per token can rise with the budget: the curve shows it per run.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable, Sequence
from typing import Any

import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.parquet as pq

from speed.eval.compare import compare_evaluations
from speed.eval.evaluate import PREDICTIONS_FILE, SUMMARY_FILE, EvalConfig, run_evaluation
from speed.hf_tokenizer import load_tokenizer
from speed.models.checkpoint import CHECKPOINT_PREFIX, COMPLETE_FILE, load_model, read_checkpoint_config
from speed.paths import TRAIN_LOG_FILE
from speed.storage import locate

BUDGET_FILE = "budget.parquet"

BUDGET_SCHEMA = pa.schema(
    [
        pa.field("run", pa.string(), nullable=False),  # the run directory, as given
        pa.field("family", pa.string(), nullable=False),  # t5 | lm (speed.models.family)
        pa.field("pattern", pa.string(), nullable=False),
        pa.field("task", pa.string(), nullable=False),
        pa.field("split", pa.string(), nullable=False),
        pa.field("examples", pa.int32(), nullable=False),  # held-out examples evaluated (the same at every budget)
        pa.field("step", pa.int64(), nullable=False),  # optimizer steps the checkpoint was trained for
        pa.field("train_tokens", pa.int64()),  # tokens read up to that step (its train log's); None: unknown
        pa.field("metric", pa.string(), nullable=False),  # bleu (translation) | rougeL (summarization)
        pa.field("score", pa.float64(), nullable=False),
        pa.field("score_low", pa.float64()),  # its 95% bootstrap interval (speed.eval.metrics.bootstrap)
        pa.field("score_high", pa.float64()),
        pa.field("delta", pa.float64()),  # score minus the previous budget's (None at the first budget) ...
        pa.field("delta_low", pa.float64()),  # ... with its 95% paired-bootstrap interval (speed.eval.compare)
        pa.field("delta_high", pa.float64()),
        pa.field("flip_rate_prev", pa.list_(pa.float64()), nullable=False),  # per loop, of the decoded tokens
        pa.field("flip_rate_final", pa.list_(pa.float64()), nullable=False),
        pa.field("steps_per_token", pa.float64(), nullable=False),  # SPEED's own pipeline steps per token
        pa.field("oracle_steps_per_token", pa.float64()),  # ... were every early exit right; None: not decoded
        pa.field("perplexity", pa.list_(pa.float64())),  # per loop, teacher-forced on the references
        pa.field("evaluation", pa.string(), nullable=False),  # the evaluation folder, relative to budget.parquet
    ]
)


@dataclasses.dataclass(frozen=True)
class Budget:
    """One complete checkpoint of a run: its step and where it is."""

    step: int
    checkpoint: str  # a local path or a URI


def checkpoint_steps(run: str) -> list[Budget]:
    """Every complete ``checkpoint_<step>`` of a run directory, by step (its config.json's ``step``)."""
    where = locate(run)
    if not where.is_dir():
        raise FileNotFoundError(f"no run directory at {run}")
    names = sorted(
        i.base_name
        for i in where.entries()
        if i.type == pafs.FileType.Directory and i.base_name.startswith(CHECKPOINT_PREFIX)
    )
    found = []
    for name in names:
        if (where / name / COMPLETE_FILE).is_file():
            checkpoint = f"{run.rstrip('/')}/{name}"
            found.append(Budget(int(read_checkpoint_config(checkpoint)["step"]), checkpoint))
    return sorted(found, key=lambda b: b.step)


def choose_budgets(run: str, steps: Sequence[int] | None) -> tuple[list[Budget], list[int]]:
    """The budgets to evaluate (``steps``, default every complete checkpoint) and the steps the run should hold
    but does not (every ``train.checkpoint_every`` up to its newest: ``train.keep_checkpoints`` deleted them).

    Raises when the run holds no complete checkpoint or lacks one of ``steps``.
    """
    found = checkpoint_steps(run)
    if not found:
        raise FileNotFoundError(f"{run} holds no complete {CHECKPOINT_PREFIX}* directory: no budget to evaluate")
    by_step = {b.step: b for b in found}
    train = read_checkpoint_config(found[-1].checkpoint).get("job", {}).get("train", {})
    every = train.get("checkpoint_every")
    expected = range(every, found[-1].step + 1, every) if every else []
    missing = [s for s in expected if s not in by_step]
    if steps is None:
        return found, missing
    absent = [s for s in steps if s not in by_step]
    if absent:
        kept = f" (train.keep_checkpoints={train['keep_checkpoints']})" if "keep_checkpoints" in train else ""
        raise FileNotFoundError(
            f"{run} holds no complete checkpoint at step(s) {', '.join(map(str, absent))}{kept}; "
            f"it holds {', '.join(str(b.step) for b in found)}"
        )
    return [by_step[s] for s in sorted(set(steps))], missing


def train_tokens(checkpoint: str, step: int) -> int | None:
    """Tokens the run read in steps 1..``step``, from the checkpoint's train log; None when it has none or it
    does not cover every step."""
    log = locate(checkpoint) / TRAIN_LOG_FILE
    if not log.is_file():
        return None
    table = pq.read_table(log.path, filesystem=log.fs, columns=["step", "tokens"]).to_pydict()
    tokens = {s: t for s, t in zip(table["step"], table["tokens"]) if s <= step}
    return sum(tokens.values()) if set(tokens) == set(range(1, step + 1)) else None


def accuracy_metric(summary: dict[str, Any]) -> tuple[str, float]:
    """An evaluation's headline metric (BLEU for translation, else ROUGE-L) and its score."""
    if "bleu" in summary["metrics"]:
        return "bleu", summary["metrics"]["bleu"]["score"]
    return "rougeL", summary["metrics"]["rouge"]["rougeL"]


def budget_row(
    run: str,
    budget: Budget,
    tokens: int | None,
    summary: dict[str, Any],
    evaluation: str,
    delta: dict[str, float] | None,
) -> dict[str, Any]:
    """One ``BUDGET_SCHEMA`` row from a checkpoint's evaluation summary (``speed.eval.evaluate``) and, but at the
    first budget, its paired difference from the previous one (``speed.eval.metrics.paired_bootstrap``'s entry for
    the metric)."""
    metric, score = accuracy_metric(summary)
    interval = summary.get("intervals", {}).get(metric, {})
    flips = sorted(summary["flip_rates"], key=lambda r: r["loop"])
    decode = summary["decode"]
    return {
        "run": run,
        "family": summary["family"],
        "pattern": summary["model"]["pattern"],
        "task": summary["task"],
        "split": summary["split"],
        "examples": summary["examples"],
        "step": budget.step,
        "train_tokens": tokens,
        "metric": metric,
        "score": score,
        "score_low": interval.get("low"),
        "score_high": interval.get("high"),
        "delta": None if delta is None else delta["delta"],
        "delta_low": None if delta is None else delta["low"],
        "delta_high": None if delta is None else delta["high"],
        "flip_rate_prev": [r["flip_rate_prev"] for r in flips],
        "flip_rate_final": [r["flip_rate_final"] for r in flips],
        "steps_per_token": decode["steps_per_token"],
        "oracle_steps_per_token": decode.get("oracle_steps_per_token"),
        "perplexity": (summary.get("perplexity") or {}).get("perplexity"),
        "evaluation": evaluation,
    }


def evaluate_budget(budget: Budget, config: EvalConfig, out: str, device: str = "cpu") -> tuple[dict[str, Any], bool]:
    """The checkpoint's evaluation in ``out``: read when ``out`` already holds one of the same settings, else run
    (the task and input length follow the checkpoint's training data). Returns the summary and whether it was
    reused; an evaluation of other settings there is an error (it would mix settings in one curve)."""
    loaded = load_model(budget.checkpoint, map_location=device)
    data = loaded.config.get("job", {}).get("data", {})
    config = config.following(data.get("task"), data.get("source"), data.get("max_source_len"))
    folder = locate(out)
    if (folder / SUMMARY_FILE).is_file() and (folder / PREDICTIONS_FILE).is_file():
        summary = json.loads((folder / SUMMARY_FILE).read_text())
        if summary["config"] != json.loads(json.dumps(dataclasses.asdict(config))):
            raise ValueError(f"{folder.uri} holds an evaluation with other settings; pass another --out")
        return summary, True
    if loaded.tokenizer_path is None:
        raise FileNotFoundError(f"checkpoint {budget.checkpoint} holds no spm.model")
    summary = run_evaluation(loaded.model.to(device), load_tokenizer(loaded.tokenizer_path), config, out)
    return summary, False


def budget_curve(
    run: str,
    config: EvalConfig,
    out: str,
    steps: Sequence[int] | None = None,
    *,
    device: str = "cpu",
    samples: int = 1000,
    seed: int = 12345,
    log: Callable[[str], None] = print,
) -> pa.Table:
    """Evaluate the chosen budgets of ``run`` (see the module docstring), write ``<out>/budget.parquet``;
    returns its table. ``samples`` and ``seed``: the paired bootstrap's against the previous budget."""
    budgets, missing = choose_budgets(run, steps)
    if missing:
        log(f"note: {run} lacks the checkpoint(s) of step(s) {', '.join(map(str, missing))} (not kept by the run)")
    root = locate(out)
    rows, previous = [], None
    for i, budget in enumerate(budgets):
        name = budget.checkpoint.rstrip("/").rsplit("/", 1)[-1]
        folder = (root / name).uri
        summary, reused = evaluate_budget(budget, config, folder, device)
        tokens = train_tokens(budget.checkpoint, budget.step)
        metric, _ = accuracy_metric(summary)
        delta = None if previous is None else compare_evaluations(previous, folder, samples, seed)["accuracy"][metric]
        rows.append(budget_row(run, budget, tokens, summary, name, delta))
        r = rows[-1]
        log(
            f"budget {i + 1}/{len(budgets)}: step {budget.step} ({'reused' if reused else 'evaluated'}): "
            f"{metric} {r['score']:.2f}, flip rate per loop {_rates(r['flip_rate_final'])}, "
            f"steps/token {r['steps_per_token']:.3f}"
        )
        previous = folder
    table = pa.Table.from_pylist(rows, schema=BUDGET_SCHEMA)
    root.makedirs()
    file = root / BUDGET_FILE
    pq.write_table(table, file.path, filesystem=file.fs)
    return table


def _rates(values: list[float]) -> str:
    return " ".join(f"{v:.3f}" for v in values)
