"""What every finished trial measures on the validation split, with no clock involved.

Accuracy (BLEU or ROUGE of SPEED's output, checked identical to sequential
decoding), the flip rate of every loop's early exit, and SPEED's pipeline steps
per token for every launch loop 1..M under both invalidation policies, and for
each of the sweep's lever settings (runner-up branches, branch depth,
confidence gate: ``lever_settings``) the model's loops allow. The
steps are counted by the decoding engine (``DecodeStats``) one sequence at a
time, so they are a property of the model and the data, not of the hardware
or of the batch a sequence shared.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from speed.data import pad_inputs
from speed.decode.generate import DecodeOptions, DecodeStats, generate
from speed.engine import INVALIDATIONS, Speculation
from speed.eval.evaluate import EvalConfig, evaluate
from speed.models.family import Family
from speed.models.looped_lm import LoopedLM
from speed.models.t5 import SpeedT5
from speed.sweep.results import layer_steps
from speed.sweep.space import SWEPT_LEVERS
from speed.tokenizer import Tokenizer

PLAIN = Speculation()  # SPEED without branches or confidence gate


@dataclass(frozen=True)
class Measurement:
    """One trial's validation measurements (plain data: it travels as JSON in the trial's Tune checkpoint)."""

    accuracy_metric: str  # bleu | rougeL
    accuracy: float
    scores: dict[str, float]  # bleu, chrf | rouge1, rouge2, rougeL
    flip_rate_prev: list[float]  # per loop
    flip_rate_final: list[float]  # per loop
    costs: list[dict[str, Any]]  # speed.sweep.results.COST_TYPE rows
    examples: int

    def best_cost(self) -> dict[str, Any]:
        """The cheapest setting: fewest layer steps per token (ties: fewer rows per token, the lower launch loop,
        eager first, fewer branches, the lower confidence gate). A measurement from before the levers has only
        plain settings."""

        def key(c: dict[str, Any]) -> tuple:
            levers = [c.get(name, getattr(PLAIN, name)) for name in SWEPT_LEVERS]
            return (c["layer_steps_per_token"], c.get("rows_per_token", 0.0), c["launch_loop"], c["invalidation"],
                    *levers)  # fmt: skip

        return min(self.costs, key=key)

    def to_dict(self) -> dict[str, Any]:
        """Plain data (``Measurement(**d)`` parses it back)."""
        return asdict(self)


def measure(
    model: SpeedT5 | LoopedLM,
    family: Family,
    tokenizer: Tokenizer,
    task: str,
    source: str | None,
    limit: int,
    cost_limit: int,
    max_source_len: int,
    max_new_tokens: int,
    out_dir: str | Path,
    levers: Sequence[Speculation] = (PLAIN,),
) -> Measurement:
    """Evaluate ``model`` (of ``family``) on the first ``limit`` validation examples; the evaluation files go to
    ``out_dir``.

    SPEED's steps per token are counted on the first ``cost_limit`` of them, each decoded alone for every
    launch loop 1..M, both policies and every lever setting (2*M*len(levers) decodes per example: the slowest
    part for deep patterns).
    """
    config = EvalConfig(
        task=task,
        split="validation",
        source=source,
        limit=limit,
        max_new_tokens=max_new_tokens,
        max_source_len=max_source_len,
        check_sequential=True,  # SPEED's output must be the sequential output: the measurement fails otherwise
    )
    evaluation = evaluate(model, family, tokenizer, config, out_dir, progress=False)
    summary = evaluation.summary
    scores = _scores(summary["metrics"])
    primary = "bleu" if "bleu" in scores else "rougeL"
    flips = sorted(summary["flip_rates"], key=lambda r: r["loop"])
    return Measurement(
        accuracy_metric=primary,
        accuracy=scores[primary],
        scores=scores,
        flip_rate_prev=[r["flip_rate_prev"] for r in flips],
        flip_rate_final=[r["flip_rate_final"] for r in flips],
        costs=speed_costs(model, evaluation.inputs[:cost_limit], max_new_tokens, levers),
        examples=summary["examples"],
    )


def lever_settings(levers: dict[str, Sequence], n_loops: int) -> list[Speculation]:
    """Every combination of the lever values (``SweepConfig.levers``; a lever left out: plain), for a model of
    ``n_loops`` loops: branches and branch depth capped at ``n_loops`` (without branches the depth is moot), in
    the order given, without repeats."""
    values = {name: levers.get(name, (getattr(PLAIN, name),)) for name in SWEPT_LEVERS}
    settings = []
    for b in values["branches"]:
        for d in values["branch_depth"]:
            for c in values["min_confidence"]:
                b_, d_ = min(b, n_loops), min(d, n_loops)
                setting = Speculation(branches=b_, branch_depth=d_ if b_ else 1, min_confidence=float(c))
                if setting not in settings:
                    settings.append(setting)
    return settings


def speed_costs(
    model: SpeedT5 | LoopedLM, inputs: list[list[int]], max_new_tokens: int, levers: Sequence[Speculation] = (PLAIN,)
) -> list[dict[str, Any]]:
    """SPEED's steps and rows per token for launch loops 1..M, both policies and every lever setting
    (``SWEPT_LEVERS`` of each), decoding each input alone."""
    pattern = model.config.sharing
    costs = []
    for setting in levers:
        for launch_loop in range(1, model.n_loops + 1):
            for policy in INVALIDATIONS:
                speculation = replace(setting, launch_loop=launch_loop, invalidation=policy)
                total = DecodeStats()
                for ids in inputs:
                    input_ids, mask = pad_inputs([ids])  # (1, S), (1, S)
                    result = generate(
                        model,
                        input_ids,
                        mask,
                        DecodeOptions(
                            method="speed", max_new_tokens=max_new_tokens, speculation=speculation, trace=False
                        ),
                    )
                    total += result.stats
                costs.append(
                    {
                        "launch_loop": launch_loop,
                        "invalidation": policy,
                        **{name: getattr(setting, name) for name in SWEPT_LEVERS},
                        "steps_per_token": total.steps / total.tokens,
                        "layer_steps_per_token": layer_steps(pattern, total.steps / total.tokens),
                        "rows_per_token": total.rows / total.tokens,
                        "flushes_per_token": total.flushes / total.tokens,
                        "wasted_rows_per_token": total.wasted_rows / total.tokens,
                    }
                )
    return costs


def _scores(metrics: dict[str, Any]) -> dict[str, float]:
    scores = {}
    for name in ("bleu", "chrf"):
        if name in metrics:
            scores[name] = metrics[name]["score"]
    if "rouge" in metrics:
        scores |= {k: metrics["rouge"][k] for k in ("rouge1", "rouge2", "rougeL")}
    return scores
