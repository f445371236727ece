"""The two model families side by side: a T5 and a looped LM of equal size, trained on the same examples and
evaluated on the same held-out examples (``jobs/compare_families.py``).

``compare_families`` finetunes the T5, sizes the LM's FFN to the T5's parameter count
(``speed.models.family.match_parameters``) and finetunes it with the T5's tokenizer, evaluates both at batch 1
(``speed.eval.evaluate``: SPEED checked against sequential decoding) and writes ``families.parquet``
(``FAMILIES_SCHEMA``, one ``family_row`` per model) beside the two evaluation folders; ``speed.analysis.families``
reads it back. Importing this module starts no Ray (the analysis reads the schema): only ``compare_families`` does.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from speed.eval.evaluate import EvalConfig, run_evaluation
from speed.eval.summary import format_summary
from speed.models.checkpoint import load_model
from speed.models.family import match_parameters, parameter_count
from speed.paths import TRAIN_LOG_FILE
from speed.train.config import JobConfig

FAMILIES_FILE = "families.parquet"

FAMILIES_SCHEMA = pa.schema(
    [
        pa.field("family", pa.string(), nullable=False),  # t5 | lm (speed.models.family)
        pa.field("pattern", pa.string(), nullable=False),
        pa.field("parameters", pa.int64(), nullable=False),  # the whole model's, embeddings included
        pa.field("d_ff", pa.int32(), nullable=False),  # the width speed.models.family.match_parameters chose
        pa.field("train_steps", pa.int64(), nullable=False),
        pa.field("train_examples", pa.int64(), nullable=False),  # steps x batch size
        pa.field("train_tokens", pa.int64(), nullable=False),  # tokens the model read (the train log's)
        pa.field("train_seconds", pa.float64(), nullable=False),  # wall clock of the training steps
        pa.field("task", pa.string(), nullable=False),
        pa.field("examples", pa.int32(), nullable=False),  # held-out examples evaluated
        pa.field("accuracy_metric", pa.string(), nullable=False),  # bleu (translation) | rougeL (summarization)
        pa.field("accuracy", pa.float64(), nullable=False),
        pa.field("accuracy_low", pa.float64()),  # its 95% bootstrap interval (speed.eval.metrics.bootstrap)
        pa.field("accuracy_high", pa.float64()),
        pa.field("flip_rate_prev", pa.list_(pa.float64()), nullable=False),  # per loop, of the decoded tokens
        pa.field("flip_rate_final", pa.list_(pa.float64()), nullable=False),
        pa.field("perplexity", pa.list_(pa.float64())),  # per loop, teacher-forced on the references
        pa.field("steps_per_token", pa.float64(), nullable=False),  # SPEED's own pipeline steps per token
        pa.field("oracle_steps_per_token", pa.float64()),  # ... were every early exit right
        pa.field("speed_ms_per_token", pa.float64(), nullable=False),  # decode wall clock, interleaved batches
        pa.field("sequential_ms_per_token", pa.float64(), nullable=False),
        pa.field("speedup", pa.float64(), nullable=False),  # sequential time / SPEED time, identical output
        pa.field("identical", pa.bool_(), nullable=False),
        pa.field("evaluation", pa.string(), nullable=False),  # the evaluation folder, relative to the file
    ]
)


@dataclass(frozen=True)
class FamiliesConfig:
    """A comparison: the two finetuning jobs (the LM's FFN width and tokenizer follow the trained T5's, whatever
    it says), the held-out examples both are evaluated on, and where the results go."""

    t5: JobConfig
    lm: JobConfig
    eval_limit: int = 100  # held-out (test split) examples evaluated
    max_new_tokens: int = 32  # output tokens per example at most
    out: str = "results/families"  # families.parquet and the two evaluation folders

    def __post_init__(self) -> None:
        from speed.data import get_task

        task = self.t5.data.task
        if get_task(task).is_pretrain:
            raise ValueError(f"task {task!r} has no references to compare on: choose a source/target task")
        for family, job in (("t5", self.t5), ("lm", self.lm)):
            if job.family.name != family or job.kind != "finetune":
                raise ValueError(
                    f"FamiliesConfig.{family} must be a {family} finetuning job, got a {job.family.name} {job.kind}"
                )
        if self.lm.data.task != task:
            raise ValueError(f"both families train on one task, got {task} and {self.lm.data.task}")


def compare_families(cfg: FamiliesConfig) -> Path:
    """Train, size-match and evaluate both families (each summary printed); returns the folder holding
    ``families.parquet``. Runs live under their jobs' deterministic names: a second call continues them."""
    from speed.train.launch import run_job  # Ray: only the comparison itself needs it

    t5 = run_job(cfg.t5)
    t5_model = load_model(t5.checkpoint)
    matched = match_parameters(cfg.lm.model.replace(vocab_size=t5.job.model.vocab_size), parameter_count(t5.job.model))
    lm_job = replace(
        cfg.lm,
        model=cfg.lm.model.replace(d_ff=matched.d_ff),
        data=replace(cfg.lm.data, tokenizer=t5_model.tokenizer_path),
    )
    lm = run_job(lm_job)
    out, rows = Path(cfg.out), []
    for family, outcome, loaded in (("t5", t5, t5_model), ("lm", lm, load_model(lm.checkpoint))):
        config = EvalConfig(
            outcome.job.data.task,
            "test",
            limit=cfg.eval_limit,
            batch_size=1,  # the latency SPEED targets
            max_new_tokens=cfg.max_new_tokens,
            max_source_len=outcome.job.data.max_source_len,
        )
        folder = f"{family}-{outcome.job.model.pattern}"
        summary = run_evaluation(loaded.model.eval(), loaded.tokenizer_path, config, out / folder)
        print(f"\n{family} {outcome.job.model.pattern}:\n{format_summary(summary)}", flush=True)
        rows.append(family_row(family, summary, folder, parameter_count(outcome.job.model), _training(outcome)))
    pq.write_table(pa.Table.from_pylist(rows, schema=FAMILIES_SCHEMA), out / FAMILIES_FILE)
    return out


def _training(outcome: Any) -> dict[str, Any]:
    """Steps, examples, tokens read and seconds of a finished run (a ``TrainOutcome``), from its train log."""
    log = pq.read_table(f"{outcome.checkpoint}/{TRAIN_LOG_FILE}").to_pydict()
    return {
        "train_steps": outcome.step,
        "train_examples": outcome.step * outcome.job.train.batch_size,
        "train_tokens": sum(log["tokens"]),
        "train_seconds": sum(log["step_time_s"]),
    }


def family_row(
    family: str, summary: dict[str, Any], evaluation: str, parameters: int, train: dict[str, Any]
) -> dict[str, Any]:
    """One ``FAMILIES_SCHEMA`` row from an evaluation summary (``speed.eval.evaluate``, checked against sequential
    decoding) and the training's ``train_steps``, ``train_examples``, ``train_tokens``, ``train_seconds``."""
    decode = summary["decode"]
    if "sequential" not in decode:
        raise ValueError("the evaluation was not checked against sequential decoding: no speed-up to compare")
    metric = "bleu" if "bleu" in summary["metrics"] else "rougeL"
    score = summary["metrics"]["bleu"]["score"] if metric == "bleu" else summary["metrics"]["rouge"]["rougeL"]
    interval = summary.get("intervals", {}).get(metric, {})
    flips = sorted(summary["flip_rates"], key=lambda r: r["loop"])
    return {
        "family": family,
        "pattern": summary["model"]["pattern"],
        "parameters": parameters,
        "d_ff": summary["model"]["d_ff"],
        **{k: train[k] for k in ("train_steps", "train_examples", "train_tokens", "train_seconds")},
        "task": summary["task"],
        "examples": summary["examples"],
        "accuracy_metric": metric,
        "accuracy": score,
        "accuracy_low": interval.get("low"),
        "accuracy_high": interval.get("high"),
        "flip_rate_prev": [r["flip_rate_prev"] for r in flips],
        "flip_rate_final": [r["flip_rate_final"] for r in flips],
        "perplexity": (summary.get("perplexity") or {}).get("perplexity"),
        "steps_per_token": decode["steps_per_token"],
        "oracle_steps_per_token": decode.get("oracle_steps_per_token"),
        "speed_ms_per_token": _ms_per_token(decode["speed"]),
        "sequential_ms_per_token": _ms_per_token(decode["sequential"]),
        "speedup": decode["speedup"],
        "identical": decode["identical"],
        "evaluation": evaluation,
    }


def _ms_per_token(run: dict[str, Any]) -> float:
    return 1000.0 * run["seconds"] / run["tokens"] if run["tokens"] else float("nan")
