"""What an evaluation's summary says of its decoding (``summary.json``'s "decode" part): each method's counters
and rates, SPEED's steps and rows per token beside the oracle's and its speed-up over sequential decoding, the exit
gate's agreement with SPEED; and ``format_summary``, the summary as text."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

import pyarrow as pa

from speed.engine import DecodeStats, ExitRule
from speed.engine.trace import flip_costs
from speed.eval import metrics


@dataclass
class Decoded:
    """All batches of one decoding method."""

    tokens: list[list[int]]
    stats: DecodeStats
    seconds: float
    trace: pa.Table | None  # EVAL_TRACE_SCHEMA
    stopped: list[bool] = field(default_factory=list)  # per example: it ended at a stop token


@dataclass(frozen=True)
class Mismatch:
    """The first position where SPEED's output differs from sequential decoding's, for one example."""

    example: int
    position: int
    speed_token: int | None  # None: that output had already ended
    sequential_token: int | None
    top2_gap: float | None  # sequential decoding's last-loop top-2 logit gap at that position


def gate_summary(gated: Decoded, speed: Decoded, rule: ExitRule) -> dict[str, Any]:
    """The exit gate's decoding beside SPEED's (whose tokens are sequential decoding's): its counts, the group
    passes per token it ran, the mean exit loop its gate asked for, and how much of SPEED's output it reproduced
    (``prefix_agreement``: the share of SPEED's tokens before each example's first difference)."""
    st = gated.stats
    same = sum(_common_prefix(a, b) for a, b in zip(gated.tokens, speed.tokens))
    wanted = sum(len(t) for t in speed.tokens)
    return {
        "rule": dataclasses.asdict(rule),
        **_decoded_summary(gated),
        "mean_exit_loop": st.mean_exit_loop,
        "identical_examples": sum(a == b for a, b in zip(gated.tokens, speed.tokens)),
        "prefix_agreement": same / wanted if wanted else 0.0,
    }


def _common_prefix(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def _decoded_summary(d: Decoded) -> dict[str, Any]:
    """One method's counters, with its rates per group pass and per second."""
    counts = {f.name: getattr(d.stats, f.name) for f in dataclasses.fields(DecodeStats) if f.name != "row_cost"}
    return {
        **counts,
        **({} if d.stats.row_cost is None else d.stats.row_cost.summary()),  # the cost model's curve, its time
        "tokens_per_pass": d.stats.tokens_per_pass,
        "group_passes_per_token": d.stats.group_passes / d.stats.tokens if d.stats.tokens else 0.0,
        "seconds": d.seconds,
        "tokens_per_s": d.stats.tokens / d.seconds if d.seconds else 0.0,
    }


def speed_summary(
    speed: Decoded,
    sequential: Decoded | None,
    oracle: Decoded | None,
    mismatches: list[Mismatch],
    bitwise: bool,
    near_tie: float,
) -> dict[str, Any]:
    one = _decoded_summary

    def per_token(n: int) -> float:
        return n / speed.stats.tokens if speed.stats.tokens else 0.0

    costs = flip_costs(speed.trace) if speed.trace is not None else []
    summary: dict[str, Any] = {
        "speed": one(speed),
        "steps_per_token": per_token(speed.stats.steps),
        "rows_per_token": per_token(speed.stats.rows),
        "wasted_rows_per_token": per_token(speed.stats.wasted_rows),
        "flip_cost": sum(costs),  # speed.engine.trace.flip_costs: steps per token that flips cost without branches
        "flip_cost_per_loop": costs,
    }
    if oracle is not None:
        summary["oracle_steps_per_token"] = per_token(oracle.stats.steps)
        summary["oracle_rows_per_token"] = per_token(oracle.stats.rows)
        steps = speed.stats.steps
        summary["own_over_oracle"] = oracle.stats.steps / steps if steps else 0.0  # 1: every early exit agreed
    if sequential is not None:
        summary["sequential"] = one(sequential)
        summary["identical"] = not mismatches
        summary["mismatches"] = [dataclasses.asdict(m) for m in mismatches]
        summary["check"] = {"bitwise": bitwise, "near_tie": near_tie, "timing": "interleaved per batch"}
        summary["speedup"] = sequential.seconds / speed.seconds if speed.seconds else 0.0
    return summary


def _why_slower(speedup: float, flip_rates: list[dict[str, Any]]) -> str:
    """Why SPEED ran slower than sequential decoding, where it did: its early exits disagreed with the last loop."""
    if speedup >= 1 or not flip_rates:
        return ""
    first = flip_rates[0]["flip_rate_final"]
    return (
        f" (below 1: loop 1's exit disagrees with the last loop's on {100 * first:.0f} % of tokens, so SPEED's "
        "speculation is mostly flushed; random or untrained weights flip at every loop)"
    )


def format_summary(summary: dict[str, Any]) -> str:
    """A few human-readable lines: metrics with signatures, flip rate per loop, decode speed."""
    lines = [f"{summary['task']} / {summary['split']}: {summary['examples']} examples from {summary['source']}"]
    for name, result in summary["metrics"].items():
        scores = {k: v for k, v in result.items() if k in ("score", *metrics.ROUGE_TYPES)}
        shown = ", ".join(f"{k} {v:.2f}" for k, v in scores.items())
        lines.append(f"  {name}: {shown}   [{result['signature']}]")
    for name, r in summary.get("intervals", {}).items():
        lines.append(f"  {name} {r['score']:.2f}, 95% bootstrap interval [{r['low']:.2f}, {r['high']:.2f}]")
    if summary.get("perplexity"):
        ppl = ", ".join(f"{i + 1}: {x:.2f}" for i, x in enumerate(summary["perplexity"]["perplexity"]))
        lines.append(f"  perplexity of the references, per loop: {ppl}")
    flips = ", ".join(f"{r['loop']}: {r['flip_rate_final']:.3f}" for r in summary["flip_rates"])
    lines.append(f"  flip rate vs final token, per loop: {flips}")
    decode = summary["decode"]
    speed = decode["speed"]
    lines.append(
        f"  SPEED: {speed['tokens_per_s']:.1f} tokens/s, {speed['tokens_per_pass']:.3f} tokens per group pass, "
        f"{speed['flushes']} flushes, {speed.get('promotions', 0)} branch promotions"
    )
    if "steps_per_token" in decode:
        oracle = (
            f" (oracle {decode['oracle_steps_per_token']:.3f}: own/oracle {decode['own_over_oracle']:.3f})"
            if "oracle_steps_per_token" in decode
            else ""
        )
        lines.append(
            f"  steps per token {decode['steps_per_token']:.3f}{oracle}, rows per token "
            f"{decode['rows_per_token']:.3f}, flip cost {decode['flip_cost']:.3f} steps per token"
        )
    if "sequential" in decode:
        same = "identical output" if decode["identical"] else f"{len(decode['mismatches'])} example(s) differ"
        lines.append(
            f"  sequential: {decode['sequential']['tokens_per_s']:.1f} tokens/s; {same}; "
            f"SPEED speed-up {decode['speedup']:.2f}x{_why_slower(decode['speedup'], summary['flip_rates'])}"
        )
    speed = decode.get("speed", {})
    if "row_cost_ms" in speed:
        shown = ", ".join(f"{n}: {ms:.2f}" for n, ms in speed["row_cost_ms"].items())
        lines.append(
            f"  cost model ({speed['row_cost_key']}, measured in {speed['row_cost_measure_s']:.2f} s): group pass "
            f"ms by rows {shown}; {speed['closed_steps']} steps as sequential decoding"
        )
    if "exit_gate" in decode:
        gate = decode["exit_gate"]
        shown = ", ".join(f"{name} {r['score']:.2f}" for name, r in gate["metrics"].items() if "score" in r)
        lines.append(
            f"  exit gate ({gate['rule']['kind']}, lossy): {shown}; {gate['group_passes_per_token']:.3f} group passes "
            f"per token (SPEED {decode['speed']['group_passes_per_token']:.3f}), mean exit loop "
            f"{gate['mean_exit_loop']:.2f}, {gate['prefix_agreement']:.3f} of SPEED's tokens agree"
        )
    return "\n".join(lines)
