"""The serving benchmark: one request at a time vs continuous batching, sequential vs SPEED, over HTTP.

Three or four variants of the same checkpoint behind Ray Serve on this machine:

    a  one request at a time, sequential decoding   (engine capacity 1)
    b  continuous batching, sequential decoding     (capacity ``max_active``)
    c  continuous batching, SPEED                   (capacity ``max_active``, ``row_budget``)
    d  c with runner-up branches or the confidence gate (``branches``, ``branch_depth``, ``min_confidence``;
       only when one of them is set)

Two applications run side by side (capacity 1 and capacity ``max_active``);
the decoding method and SPEED's levers are request fields. For every round, every
concurrency and every variant (interleaved, so that drift in the machine's
load hits all variants alike) a closed-loop load sends the same prompts;
the answers of all three variants must be identical. Reported per variant and
concurrency: tokens per second (all rounds' tokens over their wall time),
p50/p99 latency and p50 time to first token over all requests, and the
engine's steps and rows per committed token (summed over the replicas'
statistics rows of those requests: a request's steps are the engine steps
that computed one of its rows). With
``temperature`` > 0 every request samples with the same ``seed``, so the
answers must still be identical across variants (sampling is a function of the
seed and the position, never of the batch or the method).
"""

from __future__ import annotations

import os
import socket
import statistics
from dataclasses import dataclass, field
from functools import partial
from typing import TYPE_CHECKING, Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from speed.benchmarks.replay import ReplayModel
from speed.engine import LEVERS, Speculation
from speed.loadtest.loadgen import LoadConfig, run_load, summarize, task_prompts
from speed.serve.readers import read_requests
from speed.serve.schemas import BENCH_SERVE_SCHEMA

if TYPE_CHECKING:
    from speed.serve.settings import AppConfig

_ROW_LEVERS = tuple(name for name in LEVERS if name in BENCH_SERVE_SCHEMA.names)  # a row's (null: sequential)
VARIANTS = {
    "a": "one request at a time, sequential",
    "b": "continuous batching, sequential",
    "c": "continuous batching, SPEED",
    "d": "continuous batching, SPEED with branches",
}


@dataclass(frozen=True)
class ReplayServing:
    """What the replicas serve instead of the checkpoint's model (whose tokenizer and prompts they keep): a random
    model of a published shape (``model``, its resolved config, named ``shape``; ``dtype`` its weights') whose early
    exits replay ``pattern`` (``speed.benchmarks.replay``) on every prompt a replica has answered once, so that
    SPEED (variant c) decodes each prompt after sequential decoding (b) has taught the replica its final tokens."""

    shape: str
    model: Any  # ModelConfig | LMConfig, resolved in the driver (a replica has no driver's SHAPES)
    pattern: Any  # FlipPattern
    dtype: str = "bfloat16"
    seed: int = 0


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
    launch_loop: int = Speculation.launch_loop  # variants c and d (speed.engine.Speculation, its defaults)
    branches: int = Speculation.branches  # variant d's runner-up branches (d runs when this or min_confidence is set)
    branch_depth: int = Speculation.branch_depth  # variant d's branch lanes
    min_confidence: float = Speculation.min_confidence  # variant d's confidence gate
    temperature: float = 0.0  # > 0: every request samples at this temperature with ``seed``
    seed: int = 0
    threads: int = 1  # torch threads of each replica (one: spinning OpenMP threads stall on a busy machine)
    warmup: int = 4  # untimed requests per variant first
    stats_path: str | None = None  # where the replicas write their statistics (None: a temporary folder)
    cost_model: bool = True  # replicas pick speculative rows by the device's measured cost (Serve's default)
    time_limit_s: float = 600.0  # each load run's limit: requests still unanswered then are abandoned (errors)
    replay: ReplayServing | None = None  # serve a published shape's random model replaying flips instead (greedy)

    def requests_at(self, concurrency: int) -> int:
        return max(self.min_requests, self.requests_per_client * concurrency)

    def plain(self) -> Speculation:
        """Variant c's SPEED settings: the launch loop alone."""
        return Speculation(launch_loop=self.launch_loop)

    def levers(self) -> Speculation | None:
        """Variant d's SPEED settings: c's with the levers; None when no lever is set (no variant d)."""
        if (self.branches, self.min_confidence) == (Speculation.branches, Speculation.min_confidence):
            return None
        levers = {"branches": self.branches, "branch_depth": self.branch_depth, "min_confidence": self.min_confidence}
        return Speculation(self.launch_loop, **levers)


@dataclass
class ServeBenchResult:
    """Rows per (variant, concurrency, round), the pooled summary per (variant, concurrency), requests."""

    runs: pa.Table  # BENCH_SERVE_SCHEMA
    summary: dict[tuple[str, int], dict[str, Any]]
    requests: pa.Table  # LOADGEN_SCHEMA rows of every timed request, ``run`` = "<variant>-c<C>-r<round>"
    mismatches: int  # prompts answered by several variants whose answers differed (must be 0)
    unanswered: int = 0  # timed requests that got no answer (errors: a timeout, a refusal); not compared
    ratios: dict[str, float] = field(default_factory=dict)
    flip_rates: dict[str, list[float]] = field(default_factory=dict)  # per variant: mean flip rate by loop


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _load_1m() -> float:
    return os.getloadavg()[0]


@dataclass(frozen=True)
class ServeVariant:
    """One of the benchmark's variants (``VARIANTS``): which application it is sent to and how it decodes."""

    name: str  # a, b, c or d
    url: str
    method: str  # speed | sequential
    max_active: int
    row_budget: int | None
    speculation: Speculation | None  # None: sequential

    def body(self, sampling: dict[str, Any]) -> dict[str, Any]:
        """The request fields its load sends: the method, the sampling, and SPEED's settings, every one."""
        levers = {} if self.speculation is None else {n: getattr(self.speculation, n) for n in LEVERS}
        return {"method": self.method, **sampling, **levers}

    def row(self, config: ServeBenchConfig, concurrency: int, rnd: int, summary: dict[str, Any]) -> dict[str, Any]:
        """Its ``BENCH_SERVE_SCHEMA`` row for one load run (without the engine's counts, added afterwards)."""
        spec = self.speculation
        return {
            "variant": self.name,
            "description": VARIANTS[self.name],
            "method": self.method,
            "max_active": self.max_active,
            "row_budget": self.row_budget,
            **{n: None if spec is None else getattr(spec, n) for n in _ROW_LEVERS},
            "concurrency": concurrency,
            "round": rnd,
            **{k: summary[k] for k in ("requests", "errors", "tokens", "seconds", "tokens_per_s", "ttft_p50_ms")},
            "p50_ms": summary["p50_ms"] or 0.0,
            "p99_ms": summary["p99_ms"] or 0.0,
            "temperature": float(config.temperature),
            "load_1m": _load_1m(),
            "checkpoint": config.checkpoint,
        }


def _variants(config: ServeBenchConfig, urls: dict[str, str]) -> list[ServeVariant]:
    """(a) on the one-at-a-time application; (b), (c) and, with levers set, (d) on the batching one."""
    batch = (urls["batch"], config.max_active, config.row_budget)
    out = [
        ServeVariant("a", urls["one"], "sequential", 1, None, None),
        ServeVariant("b", batch[0], "sequential", batch[1], batch[2], None),
        ServeVariant("c", batch[0], "speed", batch[1], batch[2], config.plain()),
    ]
    if config.levers() is not None:
        out.append(ServeVariant("d", batch[0], "speed", batch[1], batch[2], config.levers()))
    return out


def _deploy(config: ServeBenchConfig, stats_path: str) -> dict[str, str]:
    """The two applications on the connected Ray: one answering one request at a time, one batching."""
    from speed.serve.app import start_app
    from speed.serve.settings import AppConfig

    common = {"task": config.task, "max_tokens": config.max_tokens, "threads": config.threads, "trace": False}
    common |= {"cost_model": config.cost_model}
    common |= {"max_target_len": max(config.max_tokens, 64)}
    deploy = {"port": _free_port(), "stats_path": stats_path, "device": "cpu", "num_cpus": 0}
    biggest = max(config.concurrency)
    deploy |= {"max_ongoing_requests": biggest + 4, "max_queued_requests": 4 * biggest}
    batching = {**common, "max_active": config.max_active, "row_budget": config.row_budget}
    batching["allow_branches"] = bool(config.levers() and config.levers().branches)  # variant d's side entries
    start = start_app if config.replay is None else partial(start_replay_app, replay=config.replay)
    return {
        "one": start(AppConfig(config.checkpoint, settings={**common, "max_active": 1}, name="one",
                               route_prefix="/one", **deploy)),
        "batch": start(AppConfig(config.checkpoint, settings=batching, name="batch", route_prefix="/batch",
                                 **deploy)),
    }  # fmt: skip


def replay_serving(
    shape: str,
    dtype: str = "bfloat16",
    agreement: float = 0.7,
    trace: pa.Table | None = None,
    stop_ids: frozenset[int] = frozenset(),
    length: int = 64,
    seed: int = 0,
) -> ReplayServing:
    """A ``ReplayServing`` of the published ``shape`` (``speed.benchmarks.shapes.SHAPES``): replaying ``trace`` (a
    recorded model's flips, its stop tokens ``stop_ids``), else loop-1 ``agreement`` on the trained profile (64
    sequences of ``length`` positions, seeded)."""
    from speed.benchmarks.replay import FlipPattern, agreement_profile
    from speed.benchmarks.shapes import SHAPES

    config = SHAPES[shape].resolve()
    M = config.sharing.n_loops
    if trace is not None:
        pattern = FlipPattern.from_trace(trace, M, stop_ids, "trace")
    else:
        pattern = FlipPattern.from_rates(agreement_profile(agreement, M), 64, length, seed, f"agree={agreement:.2f}")
    return ReplayServing(shape, config, pattern, dtype, seed)


def start_replay_app(config: AppConfig, replay: ReplayServing) -> str:
    """``speed.serve.app.start_app``'s application with each replica serving ``replay``'s model: ``SpeedServer``
    as it is, its model swapped once it has loaded the checkpoint's tokenizer; returns its URL."""
    from ray import serve

    from speed.serve.app import SpeedServer

    c = config
    serve.start(proxy_location=c.proxy_location, http_options={"host": c.host, "port": c.port})
    options: dict[str, Any] = {
        "func_or_class": _replay_server(SpeedServer.func_or_class, replay),
        "num_replicas": c.replicas,
        "user_config": dict(c.settings),
        "ray_actor_options": {"num_cpus": c.num_cpus, "num_gpus": c.num_gpus},
    }
    options |= {k: getattr(c, k) for k in ("max_ongoing_requests", "max_queued_requests") if getattr(c, k)}
    app = SpeedServer.options(**options).bind(
        c.checkpoint, c.stats_path, c.model_name, c.device, api_key=c.api_key, exit_adapters=c.exit_adapters,
        dtype=c.dtype,
    )  # fmt: skip
    serve.run(app, name=c.name, route_prefix=c.route_prefix)
    return f"http://{c.host}:{c.port}{c.route_prefix.rstrip('/')}"


def _replay_server(base: type, replay: ReplayServing) -> type:
    """A replica class serving ``replay``'s model with the checkpoint's tokenizer, prompts and statistics."""

    class ReplayServer(base):  # type: ignore[misc, valid-type]
        async def __init__(self, *args: Any, **kwargs: Any) -> None:  # the ingress's own __init__ is async
            import dataclasses

            from speed.serve.runner import EngineRunner

            await super().__init__(*args, **kwargs)
            self.model, packed = served_replay_model(replay, self.tokenizer, self.device)
            self.served = dataclasses.replace(self.served, model=self.model, packed_weights=packed)
            self.runner = EngineRunner(
                self.model, self.settings.engine_config(), self.recorder.finished, self.recorder.step
            )

    return ReplayServer


def served_replay_model(replay: ReplayServing, tokenizer: Any, device: str) -> tuple[ReplayModel, int]:
    """``replay``'s random model on ``device`` (its head's rows past ``tokenizer``'s vocabulary and at its stop
    tokens zeroed: answers the tokenizer reads, each to its length), packed for decoding, replaying the pattern on
    every prompt it has answered once; and its packed weights' count."""
    import torch

    from speed.benchmarks.shapes import empty_model, random_weights

    if tokenizer.vocab_size > replay.model.vocab_size:
        raise ValueError(f"{replay.shape}'s vocabulary is smaller than the tokenizer's ({tokenizer.vocab_size})")
    model = random_weights(empty_model(replay.model, getattr(torch, replay.dtype)), replay.seed, device,
                           replay.model.eos_id)  # fmt: skip
    with torch.no_grad():
        model.lm_head.weight[tokenizer.vocab_size :].zero_()
        model.lm_head.weight[sorted(tokenizer.stop_ids)] = 0
    packed = model.pack_for_decoding()
    return ReplayModel(model, replay.pattern), packed


def served_flip_rates(requests: pa.Table, served: pa.Table) -> dict[str, list[float]]:
    """Per variant: the mean flip rate by loop (each loop's exit against the committed token) over the replicas'
    statistics rows of its timed requests (``requests``: LOADGEN_SCHEMA; ``served``: REQUEST_SCHEMA)."""
    flips = dict(zip(served["request_id"].to_pylist(), served["flip_rate"].to_pylist()))  # (a list: no join)
    by: dict[str, list[list[float]]] = {}
    for run, request in zip(requests["run"].to_pylist(), requests["request_id"].to_pylist()):
        if flips.get(request):
            by.setdefault(run.split("-", 1)[0], []).append(flips[request])
    return {v: [statistics.mean(loop) for loop in zip(*rates)] for v, rates in sorted(by.items())}


def run_serve_bench(config: ServeBenchConfig) -> ServeBenchResult:
    """Deploy the two applications on the connected Ray, run every round, return the rows and ratios."""
    import tempfile

    from ray import serve

    stats_path = config.stats_path or tempfile.mkdtemp(prefix="speed-bench-serve-")
    variants = _variants(config, _deploy(config, stats_path))
    prompts = task_prompts(config.task, config.split)
    bodies = {v.name: v.body({"temperature": config.temperature, "seed": config.seed}) for v in variants}
    runs, tables, texts = [], [], {}
    try:
        for v in variants:
            warm = LoadConfig(url=v.url, requests=config.warmup, max_tokens=config.max_tokens, body=bodies[v.name],
                              label="warmup")  # fmt: skip
            run_load(warm, prompts)
        offset = 0
        for rnd in range(config.rounds):
            for c in config.concurrency:
                n = config.requests_at(c)
                batch = prompts[offset : offset + n]
                offset = (offset + n) % max(1, len(prompts) - n)
                for v in variants:
                    label = _label({"variant": v.name, "concurrency": c, "round": rnd})
                    load = LoadConfig(url=v.url, concurrency=c, requests=n, max_tokens=config.max_tokens,
                                      body=bodies[v.name], label=label, time_limit_s=config.time_limit_s)  # fmt: skip
                    result = run_load(load, batch)
                    s = result.summary()
                    runs.append(v.row(config, c, rnd, s))
                    tables.append(result.table)
                    for row in result.table.to_pylist():
                        texts.setdefault((rnd, c, row["request"]), {})[v.name] = None if row["error"] else row["text"]
                    print(
                        f"[bench_serve] round {rnd} c={c:<2} {v.name}: {s['tokens_per_s']:7.1f} tokens/s, "
                        f"p50 {s['p50_ms'] or 0:7.0f} ms, errors {s['errors']}, load {_load_1m():.1f}",
                        flush=True,
                    )
    finally:
        for app in ("one", "batch"):
            serve.delete(app)  # each replica drains and writes its statistics rows
    requests = pa.concat_tables(tables)
    served = read_requests(stats_path)
    counts = engine_counts(requests, served)
    for run in runs:
        run |= per_token([counts[_label(run)]])
    mismatches, unanswered = answer_mismatches(texts)
    summary = _pooled(requests, runs, counts)
    return ServeBenchResult(pa.Table.from_pylist(runs, schema=BENCH_SERVE_SCHEMA), summary, requests, mismatches,
                            unanswered, ratios(summary), served_flip_rates(requests, served))  # fmt: skip


def answer_mismatches(texts: dict[Any, dict[str, str | None]]) -> tuple[int, int]:
    """Per prompt (``texts``: each variant's answer, None where its request got none): the prompts whose answers
    differ between the variants that answered, and the requests that got no answer (an error is not a different
    answer: it is counted apart, and reported with its error)."""
    mismatches = sum(len({a for a in t.values() if a is not None}) > 1 for t in texts.values())
    return mismatches, sum(a is None for t in texts.values() for a in t.values())


def engine_counts(requests: pa.Table, served: pa.Table) -> dict[str, dict[str, int]]:
    """Per load run (``requests``' ``run``, LOADGEN_SCHEMA): the engine's steps, rows and committed tokens,
    summed over the replicas' statistics rows (``served``, REQUEST_SCHEMA) of the run's requests."""
    answered = requests.select(["run", "request_id"]).filter(pc.is_valid(requests["request_id"]))
    cols = ["steps", "rows", "completion_tokens"]
    joined = answered.join(served.select(["request_id", *cols]), "request_id", join_type="inner")
    out = {run: {"steps": 0, "rows": 0, "tokens": 0} for run in requests["run"].unique().to_pylist()}
    for r in joined.group_by("run").aggregate([(c, "sum") for c in cols]).to_pylist():
        out[r["run"]] = {"steps": r["steps_sum"], "rows": r["rows_sum"], "tokens": r["completion_tokens_sum"]}
    return out


def per_token(counts: list[dict[str, int]]) -> dict[str, float | None]:
    """Steps and rows per committed token of some runs' ``engine_counts`` together (None: no token)."""
    tokens = sum(c["tokens"] for c in counts)
    if not tokens:
        return {"steps_per_token": None, "rows_per_token": None}
    return {f"{k}_per_token": sum(c[k] for c in counts) / tokens for k in ("steps", "rows")}


def _label(run: dict[str, Any]) -> str:
    """A run's ``run`` label in the load generator's rows."""
    return f"{run['variant']}-c{run['concurrency']}-r{run['round']}"


def _pooled(
    requests: pa.Table, runs: list[dict[str, Any]], counts: dict[str, dict[str, int]]
) -> dict[tuple[str, int], dict[str, Any]]:
    """Per (variant, concurrency): every round's requests pooled; tokens/s over the rounds' summed wall time;
    steps and rows per token over the rounds' summed ``engine_counts``."""
    out = {}
    for key in sorted({(r["variant"], r["concurrency"]) for r in runs}):
        mine = [r for r in runs if (r["variant"], r["concurrency"]) == key]
        labels = sorted({_label(r) for r in mine})
        rows = requests.filter(pc.is_in(requests["run"], pa.array(labels)))
        s = summarize(rows, sum(r["seconds"] for r in mine)) | per_token_latency(rows)
        s["load_1m"] = statistics.mean(r["load_1m"] for r in mine)
        out[key] = s | per_token([counts[label] for label in labels])
    return out


def per_token_latency(requests: pa.Table) -> dict[str, float | None]:
    """The p50 and p99 over answered requests (LOADGEN_SCHEMA rows) of their time per output token after the
    first: (latency - TTFT) / (tokens - 1), where the answer streamed; else latency / tokens."""
    each = []
    for r in requests.to_pylist():
        n, ttft = r["completion_tokens"] or 0, r["ttft_ms"]
        if r["status"] == 200 and r["error"] is None and n:
            each.append((r["latency_ms"] - ttft) / (n - 1) if ttft is not None and n > 1 else r["latency_ms"] / n)
    pick = (lambda q: float(np.percentile(each, q))) if each else (lambda q: None)
    return {"tpot_p50_ms": pick(50), "tpot_p99_ms": pick(99)}


def ratios(summary: dict[tuple[str, int], dict[str, Any]]) -> dict[str, float]:
    """The ratios the serving targets (``BARS``) are read from: (c)/(a) tokens/s at the highest concurrency (what
    continuous batching with SPEED buys over one request at a time), (c)/(b) tokens/s at each concurrency (SPEED
    must not cost batched throughput) and (c)/(b) p50 latency at the lowest (SPEED's latency gain when the
    replica is not busy); with a variant (d), (d)/(c) tokens/s at each concurrency and p50 latency at the lowest
    (what branches add; no target)."""
    conc = sorted({c for _, c in summary})
    lo, hi = conc[0], conc[-1]
    out = {f"c_over_a_tokens_per_s_at_{hi}": summary["c", hi]["tokens_per_s"] / summary["a", hi]["tokens_per_s"]}
    for c in conc:
        out[f"c_over_b_tokens_per_s_at_{c}"] = summary["c", c]["tokens_per_s"] / summary["b", c]["tokens_per_s"]
    out[f"c_over_b_p50_at_{lo}"] = summary["c", lo]["p50_ms"] / summary["b", lo]["p50_ms"]
    if ("d", lo) in summary:
        for c in conc:
            out[f"d_over_c_tokens_per_s_at_{c}"] = summary["d", c]["tokens_per_s"] / summary["c", c]["tokens_per_s"]
        out[f"d_over_c_p50_at_{lo}"] = summary["d", lo]["p50_ms"] / summary["c", lo]["p50_ms"]
    return out


# The serving targets: batching with SPEED at least 3x one-at-a-time throughput under load, SPEED at least 0.95x
# batched sequential decoding's throughput, and at most 0.6x its median latency at the lowest concurrency.
BARS = {
    "c_over_a_tokens_per_s_at_": (">=", 3.0),
    "c_over_b_tokens_per_s_at_": (">=", 0.95),
    "c_over_b_p50_at_": ("<=", 0.6),
}


def format_table(result: ServeBenchResult) -> str:
    """A Markdown table per variant and concurrency, then the ratios against the serving targets (``BARS``)."""
    lines = [
        "| variant | concurrency | tokens/s | p50 ms | p99 ms | ttft p50 ms | per token p50 / p99 ms | requests "
        "| errors | steps/token | rows/token |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for (variant, c), s in sorted(result.summary.items(), key=lambda kv: (kv[0][1], kv[0][0])):
        ttft = f"{s['ttft_p50_ms']:.0f}" if s["ttft_p50_ms"] is not None else ""
        tpot = "" if s.get("tpot_p50_ms") is None else f"{_num(s['tpot_p50_ms'])} / {_num(s.get('tpot_p99_ms'))}"
        lines.append(
            f"| ({variant}) {VARIANTS[variant]} | {c} | {s['tokens_per_s']:.1f} | {s['p50_ms']:.0f} | "
            f"{s['p99_ms']:.0f} | {ttft} | {tpot} | "
            f"{s['requests']} | {s['errors']} | {_num(s.get('steps_per_token'))} | "
            f"{_num(s.get('rows_per_token'))} |"
        )
    lines.append("")
    for name, value in result.ratios.items():
        op, bar = next((v for k, v in BARS.items() if name.startswith(k)), (None, None))
        if op is None:
            lines.append(f"- {name} = {value:.2f}")
            continue
        ok = value >= bar if op == ">=" else value <= bar
        lines.append(f"- {name} = {value:.2f} (bar {op} {bar}: {'met' if ok else 'NOT met'})")
    for variant, rates in result.flip_rates.items():
        lines.append(f"- ({variant}) flip rate by loop: " + " ".join(f"{r:.3f}" for r in rates))
    lines.append(f"- answers identical across variants: {'yes' if result.mismatches == 0 else 'NO'} "
                 f"({result.mismatches} prompts differ)")  # fmt: skip
    if result.unanswered:
        lines.append(f"- {result.unanswered} requests unanswered (the errors column; not compared: raise "
                     "--time-limit-s where a run's requests outlast it)")  # fmt: skip
    return "\n".join(lines)


def _num(value: float | None) -> str:
    return "" if value is None else f"{value:.2f}"
