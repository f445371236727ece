"""The serving benchmark: one request at a time vs continuous batching, sequential vs SPEED, over HTTP.

Three variants of the same checkpoint behind Ray Serve on this machine:

    a  one request at a time, sequential decoding   (engine capacity 1)
    b  continuous batching, sequential decoding     (capacity ``max_active``)
    c  continuous batching, SPEED                   (capacity ``max_active``, ``row_budget``)

Two applications run side by side (capacity 1 and capacity ``max_active``);
the decoding method is the request's ``method`` field. For every round, every
concurrency and every variant (interleaved, so that drift in the machine's
load hits all variants alike) a closed-loop load sends the same prompts;
the answers of all three variants must be identical. Reported per variant and
concurrency: tokens per second (all rounds' tokens over their wall time),
p50/p99 latency and p50 time to first token over all requests. With
``temperature`` > 0 every request samples with the same ``seed``, so the
answers must still be identical across variants (sampling is a function of the
seed and the position, never of the batch or the method).
"""

from __future__ import annotations

import os
import socket
import statistics
from dataclasses import dataclass, field
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc

from speed.serve.loadgen import LoadConfig, run_load, summarize, task_prompts
from speed.serve.stats import BENCH_SERVE_SCHEMA

VARIANTS = {
    "a": "one request at a time, sequential",
    "b": "continuous batching, sequential",
    "c": "continuous batching, SPEED",
}


@dataclass(frozen=True)
class ServeBenchConfig:
    """What the serving benchmark runs."""

    checkpoint: str
    task: str = "translate_en_de"
    split: str = "test"
    concurrency: tuple[int, ...] = (1, 4, 16)
    rounds: int = 2
    requests_per_client: int = 4  # a run sends max(min_requests, this x concurrency) requests
    min_requests: int = 12
    max_tokens: int = 48
    max_active: int = 16
    row_budget: int | None = None  # variant c's rows per step
    launch_loop: int = 1
    temperature: float = 0.0  # > 0: every request samples at this temperature with ``seed``
    seed: int = 0
    threads: int = 1  # torch threads of each replica (one: spinning OpenMP threads stall on a busy machine)
    warmup: int = 4  # untimed requests per variant first
    stats_path: str | None = None  # where the replicas write their statistics (None: a temporary folder)

    def requests_at(self, concurrency: int) -> int:
        return max(self.min_requests, self.requests_per_client * concurrency)


@dataclass
class ServeBenchResult:
    """Rows per (variant, concurrency, round), the pooled summary per (variant, concurrency), requests."""

    runs: pa.Table  # BENCH_SERVE_SCHEMA
    summary: dict[tuple[str, int], dict[str, Any]]
    requests: pa.Table  # LOADGEN_SCHEMA rows of every timed request, ``run`` = "<variant>-c<C>-r<round>"
    mismatches: int  # prompts whose answer differed between variants (must be 0)
    ratios: dict[str, float] = field(default_factory=dict)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _load_1m() -> float:
    return os.getloadavg()[0]


def run_serve_bench(config: ServeBenchConfig) -> ServeBenchResult:
    """Deploy the two applications on the connected Ray, run every round, return the rows and ratios."""
    import tempfile

    from ray import serve

    from speed.serve.app import start_app

    stats_path = config.stats_path or tempfile.mkdtemp(prefix="speed-bench-serve-")
    port = _free_port()
    common = {"task": config.task, "max_tokens": config.max_tokens, "threads": config.threads, "trace": False}
    common |= {"max_target_len": max(config.max_tokens, 64)}
    deploy = {"port": port, "stats_path": stats_path, "device": "cpu", "num_cpus": 0}
    biggest = max(config.concurrency)
    deploy |= {"max_ongoing_requests": biggest + 4, "max_queued_requests": 4 * biggest}
    urls = {
        "one": start_app(config.checkpoint, settings={**common, "max_active": 1}, name="one", route_prefix="/one",
                         **deploy),
        "batch": start_app(
            config.checkpoint,
            settings={**common, "max_active": config.max_active, "row_budget": config.row_budget},
            name="batch",
            route_prefix="/batch",
            **deploy,
        ),
    }  # fmt: skip
    variants = {
        "a": (urls["one"], "sequential", 1, None),
        "b": (urls["batch"], "sequential", config.max_active, config.row_budget),
        "c": (urls["batch"], "speed", config.max_active, config.row_budget),
    }
    prompts = task_prompts(config.task, config.split)
    try:
        sampling = {"temperature": config.temperature, "seed": config.seed}
        for url, method, _, _ in variants.values():
            body = {"method": method, "launch_loop": config.launch_loop, **sampling}
            warm = LoadConfig(url=url, requests=config.warmup, max_tokens=config.max_tokens, body=body, label="warmup")
            run_load(warm, prompts)
        runs, tables, texts = [], [], {}
        offset = 0
        for rnd in range(config.rounds):
            for c in config.concurrency:
                n = config.requests_at(c)
                batch = prompts[offset : offset + n]
                offset = (offset + n) % max(1, len(prompts) - n)
                for name, (url, method, max_active, budget) in variants.items():
                    label = f"{name}-c{c}-r{rnd}"
                    load = LoadConfig(
                        url=url,
                        concurrency=c,
                        requests=n,
                        max_tokens=config.max_tokens,
                        body={"method": method, "launch_loop": config.launch_loop, **sampling},
                        label=label,
                    )
                    result = run_load(load, batch)
                    s = result.summary()
                    runs.append(
                        {
                            "variant": name,
                            "description": VARIANTS[name],
                            "method": method,
                            "max_active": max_active,
                            "row_budget": budget,
                            "concurrency": c,
                            "round": rnd,
                            "requests": s["requests"],
                            "errors": s["errors"],
                            "tokens": s["tokens"],
                            "seconds": s["seconds"],
                            "tokens_per_s": s["tokens_per_s"],
                            "p50_ms": s["p50_ms"] or 0.0,
                            "p99_ms": s["p99_ms"] or 0.0,
                            "ttft_p50_ms": s["ttft_p50_ms"],
                            "temperature": float(config.temperature),
                            "load_1m": _load_1m(),
                            "checkpoint": config.checkpoint,
                        }
                    )
                    tables.append(result.table)
                    for row in result.table.to_pylist():
                        texts.setdefault((rnd, c, row["request"]), {})[name] = row["text"]
                    print(
                        f"[bench_serve] round {rnd} c={c:<2} {name}: {s['tokens_per_s']:7.1f} tokens/s, "
                        f"p50 {s['p50_ms'] or 0:7.0f} ms, errors {s['errors']}, load {_load_1m():.1f}",
                        flush=True,
                    )
    finally:
        for app in ("one", "batch"):
            serve.delete(app)
    requests = pa.concat_tables(tables)
    mismatches = sum(len(set(v.values())) != 1 or len(v) != len(variants) for v in texts.values())
    summary = _pooled(requests, runs)
    return ServeBenchResult(pa.Table.from_pylist(runs, schema=BENCH_SERVE_SCHEMA), summary, requests, mismatches,
                            ratios(summary))  # fmt: skip


def _pooled(requests: pa.Table, runs: list[dict[str, Any]]) -> dict[tuple[str, int], dict[str, Any]]:
    """Per (variant, concurrency): every round's requests pooled; tokens/s over the rounds' summed wall time."""
    out = {}
    for key in sorted({(r["variant"], r["concurrency"]) for r in runs}):
        mine = [r for r in runs if (r["variant"], r["concurrency"]) == key]
        labels = {f"{r['variant']}-c{r['concurrency']}-r{r['round']}" for r in mine}
        rows = requests.filter(pc.is_in(requests["run"], pa.array(sorted(labels))))
        s = summarize(rows, sum(r["seconds"] for r in mine))
        s["load_1m"] = statistics.mean(r["load_1m"] for r in mine)
        out[key] = s
    return out


def ratios(summary: dict[tuple[str, int], dict[str, Any]]) -> dict[str, float]:
    """The issue's bars as measured ratios: (c)/(a) tokens/s at the highest concurrency, (c)/(b) tokens/s at
    each concurrency, (c)/(b) p50 latency at the lowest."""
    conc = sorted({c for _, c in summary})
    lo, hi = conc[0], conc[-1]
    out = {f"c_over_a_tokens_per_s_at_{hi}": summary["c", hi]["tokens_per_s"] / summary["a", hi]["tokens_per_s"]}
    for c in conc:
        out[f"c_over_b_tokens_per_s_at_{c}"] = summary["c", c]["tokens_per_s"] / summary["b", c]["tokens_per_s"]
    out[f"c_over_b_p50_at_{lo}"] = summary["c", lo]["p50_ms"] / summary["b", lo]["p50_ms"]
    return out


BARS = {
    "c_over_a_tokens_per_s_at_": (">=", 3.0),
    "c_over_b_tokens_per_s_at_": (">=", 0.95),
    "c_over_b_p50_at_": ("<=", 0.6),
}


def format_table(result: ServeBenchResult) -> str:
    """A Markdown table per variant and concurrency, then the ratios against the issue's bars."""
    lines = [
        "| variant | concurrency | tokens/s | p50 ms | p99 ms | ttft p50 ms | requests | errors |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for (variant, c), s in sorted(result.summary.items(), key=lambda kv: (kv[0][1], kv[0][0])):
        ttft = f"{s['ttft_p50_ms']:.0f}" if s["ttft_p50_ms"] is not None else ""
        lines.append(
            f"| ({variant}) {VARIANTS[variant]} | {c} | {s['tokens_per_s']:.1f} | {s['p50_ms']:.0f} | "
            f"{s['p99_ms']:.0f} | {ttft} | {s['requests']} | {s['errors']} |"
        )
    lines.append("")
    for name, value in result.ratios.items():
        op, bar = next(v for k, v in BARS.items() if name.startswith(k))
        ok = value >= bar if op == ">=" else value <= bar
        lines.append(f"- {name} = {value:.2f} (bar {op} {bar}: {'met' if ok else 'NOT met'})")
    lines.append(f"- answers identical across variants: {'yes' if result.mismatches == 0 else 'NO'} "
                 f"({result.mismatches} prompts differ)")  # fmt: skip
    return "\n".join(lines)
