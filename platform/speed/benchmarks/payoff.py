"""The payoff map: what SPEED earns at a published model's real shape (random weights, ``speed.benchmarks.shapes``)
when its early exits agree as a trained model's do (``speed.benchmarks.replay``), against sequential decoding, at
several batches, with the cost model on and off. A prediction from replayed flips, not a trained model's own run.

For each dtype (one model at a time) and batch, the same random prompts are decoded sequentially once for their
final tokens; then, in every round and in a rotating order, sequential decoding and SPEED replaying each pattern with
the cost model off and on, each run timed after its batch's first tokens (``GenerateResult.decode_s``: its own split
of its time, so no prefill is timed apart and taken off). A pattern is a loop-1 agreement (the later loops'
following ``agreement_profile``, the trained demo T5's profile by depth) or a recorded trace (``trace.parquet`` of an
evaluation, a replica's traces). Reported per cell:

- ``speedup``: sequential's time per token over this variant's, taken within each round, the median of the rounds
  (the round-paired median, as ``jobs/bench_shapes.py`` pairs: the machine's bandwidth moves between rounds);
- ``steps_per_token``: engine steps per committed token, the batch's together (sequential: M / batch);
- ``overhead``: the time per token over the schedule's, the schedule's being the group passes the run made after
  its first tokens, each at the measured cost of a pass of its rows (``speed.engine.cost.RowCost``: the pass without
  exit logits, plus the exits of its scored rows): 1.0 is an engine that costs nothing beyond its passes. The pass
  cost is measured again in every round, as one more variant of the rotation, and each round's time is read against
  that round's cost (the machine's speed drifts between rounds: measured once before the runs, sequential
  decoding's own overhead read 0.74x-1.44x); the median of the rounds;
- ``host_overhead``: each run's time over its own passes' (their spans as the replaying stepper saw them): the
  engine's time beside its passes, read within one run, which the machine's drift does not reach; the median.
  ``overhead`` over ``host_overhead`` is then what the passes cost against their price.
"""

from __future__ import annotations

import gc
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, fields
from typing import Any

import numpy as np
import pyarrow as pa
import torch

from speed.benchmarks.decode import interleave, machine_name
from speed.benchmarks.replay import FlipPattern, ReplayStepper, agreement_profile
from speed.benchmarks.shapes import ShapeBenchConfig, check_fits, empty_model, random_weights
from speed.config import LMConfig, ModelConfig
from speed.decode.generate import DecodeOptions, GenerateResult, generate
from speed.engine.cost import RowCost, measure_row_cost, row_cost
from speed.models.precision import DTYPES

PAYOFF_SCHEMA = pa.schema(
    [
        pa.field("shape", pa.string()),
        pa.field("dtype", pa.string()),
        pa.field("batch", pa.int64()),
        pa.field("pattern", pa.string()),  # "agree=0.70" (a loop-1 agreement on the profile) or a trace's name
        pa.field("source", pa.string()),  # where the pattern came from, with its loop mapping when remapped
        pa.field("agreement", pa.list_(pa.float64())),  # per loop: the replayed tokens' share agreeing with the final
        pa.field("loop1_agreement", pa.float64()),  # its first entry
        pa.field("cost_model", pa.bool_()),
        pa.field("new_tokens", pa.int64()),
        pa.field("prompt_len", pa.int64()),
        pa.field("rounds", pa.int64()),
        pa.field("ms_per_token", pa.float64()),  # the median round's, after the first token (each run's own split)
        pa.field("sequential_ms_per_token", pa.float64()),  # sequential decoding's, the same batch and dtype
        pa.field("speedup", pa.float64()),  # the round-paired median of sequential's time over this one's
        pa.field("speedup_min", pa.float64()),  # the least round's
        pa.field("steps_per_token", pa.float64()),  # engine steps per committed token, the batch's together
        pa.field("sequential_steps_per_token", pa.float64()),
        pa.field("rows_per_token", pa.float64()),
        pa.field("flushes_per_token", pa.float64()),
        pa.field("closed_steps", pa.int64()),  # steps the cost model ran as sequential decoding
        pa.field("schedule_ms_per_token", pa.float64()),  # its passes at the pass cost by rows, each round's, median
        pa.field("overhead", pa.float64()),  # per round, its time per token over its schedule's then; the median
        pa.field("schedule_speedup", pa.float64()),  # sequential's schedule over this one's: the speed-up an engine
        # without overhead would have (the pass costs' clock: on one thread CPU time, which others' load spares)
        pa.field("sequential_overhead", pa.float64()),  # the same of sequential decoding
        pa.field("host_overhead", pa.float64()),  # per run, its time over its group passes' own (the engine's host
        # time beside its passes, read within one run: the machine's drift does not reach it); the median; NaN on CUDA
        pa.field("sequential_host_overhead", pa.float64()),  # the same of sequential decoding
        pa.field("identical", pa.bool_()),  # its output equals sequential decoding's
        pa.field("threads", pa.int64()),
        pa.field("machine", pa.string()),
    ]
)

AGREEMENTS = (0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95)  # loop-1 agreements of the map


@dataclass(frozen=True)
class TracePattern:
    """A recorded trace to replay: its name in the rows, the table, the recorded model's stop tokens."""

    name: str
    trace: pa.Table
    stop_ids: frozenset[int] = frozenset()


@dataclass(frozen=True)
class PayoffConfig:
    """One payoff map: a shape (its name and resolved config), the dtypes (each model built, timed and freed in
    turn), batches, loop-1 agreements and traces to replay, the cost model off and/or on, lengths and rounds."""

    shape: str
    model: ModelConfig | LMConfig
    dtypes: tuple[str, ...] = ("float32", "bfloat16")
    batches: tuple[int, ...] = (1, 4, 8, 16)
    agreements: tuple[float, ...] = AGREEMENTS
    traces: tuple[TracePattern, ...] = ()
    cost_models: tuple[bool, ...] = (False, True)
    prompt_len: int = 32
    new_tokens: int = 32
    rounds: int = 3
    seed: int = 0
    device: str = "cpu"

    def __post_init__(self) -> None:
        if self.new_tokens < 2 or self.rounds < 1 or not self.batches or not self.dtypes or not self.cost_models:
            raise ValueError("a payoff map needs at least 2 new tokens, 1 round, a batch, a dtype and a cost setting")
        if not self.agreements and not self.traces:
            raise ValueError("a payoff map needs a loop-1 agreement or a trace to replay")
        if not set(self.dtypes) <= set(DTYPES) or len(set(self.dtypes)) != len(self.dtypes):
            raise ValueError(f"dtypes {list(self.dtypes)}: name each of {', '.join(DTYPES)} at most once")
        if any(not 0.0 <= a <= 1.0 for a in self.agreements):
            raise ValueError(f"loop-1 agreements must be in [0, 1], got {list(self.agreements)}")

    def cells(self) -> int:
        """The (dtype, batch, pattern, cost model) cells of the map."""
        return len(self.dtypes) * len(self.batches) * (len(self.agreements) + len(self.traces)) * len(self.cost_models)


def schedule_seconds(cost: RowCost, passes: Sequence[tuple[int, int]]) -> float:
    """What group passes of (rows, rows scored) cost at the measured pass cost: each pass without exit logits,
    plus its scored rows' exits."""
    return sum(cost(rows, with_logits=False) + cost.exits(scored) for rows, scored in passes)


def patterns(cfg: PayoffConfig, batch: int) -> dict[str, FlipPattern]:
    """The patterns one batch replays, by name: each loop-1 agreement on the trained profile (drawn for the batch's
    sequences, seeded), then each trace mapped onto the shape's loops."""
    M, n = cfg.model.sharing.n_loops, cfg.new_tokens
    out = {
        f"agree={a:.2f}": FlipPattern.from_rates(agreement_profile(a, M), batch, n, cfg.seed + batch, f"agree={a:.2f}")
        for a in cfg.agreements
    }
    for t in cfg.traces:
        out[t.name] = FlipPattern.from_trace(t.trace, M, t.stop_ids, t.name)
    return out


def replayed_agreement(pattern: FlipPattern, batch: int, length: int) -> list[float]:
    """Per loop: the share of the tokens a batch replays (its sequences' first ``length`` positions) that agree."""
    codes = np.concatenate([pattern.sequence(i, length) for i in range(batch)])
    return (codes == 0).mean(axis=0).tolist()


def run_payoff_map(cfg: PayoffConfig, progress: Callable[[str], None] = print) -> pa.Table:
    """Every cell of the map (``PAYOFF_SCHEMA`` rows), one dtype's model at a time; ``progress`` gets a line per
    batch and round with the time spent and an estimate of the time left."""
    rows: list[dict[str, Any]] = []
    started, done_units = time.perf_counter(), 0
    total_units = len(cfg.dtypes) * sum(cfg.batches)  # a batch's work grows about with its size
    for dtype in cfg.dtypes:
        shell = empty_model(cfg.model, getattr(torch, dtype))
        fits = ShapeBenchConfig(cfg.shape, cfg.model, cfg.batches, cfg.prompt_len, cfg.new_tokens, dtypes=(dtype,),
                                bandwidth_bytes=0, device=cfg.device)  # fmt: skip
        check_fits(fits, [shell])
        begin = time.perf_counter()
        model = random_weights(shell, cfg.seed, cfg.device, cfg.model.eos_id)
        packed = model.pack_for_decoding()
        with torch.inference_mode():
            cost = row_cost(model.stepper())  # once per process and shape: measured before anything is timed
        progress(
            f"payoff map: {cfg.shape} {cfg.model.pattern} {dtype} (built in {time.perf_counter() - begin:.1f} s, "
            f"{packed} weights packed), pass cost by rows (ms) "
            + ", ".join(f"{r}: {s * 1e3:.1f}" for r, s in enumerate(cost.seconds, start=1))
            + f", measured in {cost.measure_s:.1f} s"
        )
        for batch in cfg.batches:
            rows += _batch_rows(cfg, model, cost, dtype, batch, progress)
            done_units += batch
            spent = time.perf_counter() - started
            progress(
                f" {dtype} batch {batch} done: {spent / 60:.1f} min so far, about "
                f"{spent / done_units * (total_units - done_units) / 60:.1f} min left"
            )
        del model, shell
        gc.collect()
    return pa.Table.from_pylist(rows, schema=PAYOFF_SCHEMA)


def _batch_rows(
    cfg: PayoffConfig, model: torch.nn.Module, cost: RowCost, dtype: str, batch: int, progress: Callable[[str], None]
) -> list[dict[str, Any]]:
    """One (dtype, batch)'s cells: every pattern with the cost model off and on, timed in the same rounds as
    sequential decoding."""
    torch.manual_seed(cfg.seed + batch)
    ids = torch.randint(3, cfg.model.vocab_size, (batch, cfg.prompt_len))  # no special token below 3
    n = cfg.new_tokens
    reference = generate(model, ids, options=DecodeOptions(method="sequential", max_new_tokens=n, trace=False))
    finals = {tuple(row): out for row, out in zip(ids.tolist(), reference.tokens)}
    chosen = patterns(cfg, batch)
    results: dict[str, tuple[GenerateResult, list[tuple[int, int]]]] = {}
    decode: dict[str, list[tuple[float, float]]] = {}  # per run: its time after the first tokens, its passes' then

    def run(name: str, pattern: FlipPattern | None, **kw: Any) -> Callable[[], int]:
        def go() -> int:
            stepper = ReplayStepper(model, finals, pattern)
            called = time.perf_counter()  # generate counts the first token's time from (just after) its call
            result = generate(stepper, ids, options=DecodeOptions(max_new_tokens=n, trace=False, **kw))
            first = called + result.first_token_s
            after = [(p, s) for p, s in zip(stepper.passes, stepper.spans) if s[0] >= first]
            results[name] = (result, [p for p, _ in after])
            decode.setdefault(name, []).append((result.decode_s, sum(e - b for _, (b, e) in after)))
            return 1

        return go

    round_costs: list[RowCost] = []

    def measure() -> int:  # the pass cost again in every round, beside the runs it prices (the machine drifts)
        round_costs.append(measure_row_cost(model.stepper(), repeats=2))
        return 1

    variants = {"sequential": run("sequential", None, method="sequential"), "pass cost": measure}
    for name, pattern in chosen.items():
        for on in cfg.cost_models:
            variants[_name(name, on)] = run(_name(name, on), pattern, method="speed", cost_model=on)
    progress(f" {dtype} batch {batch}: {len(variants)} runs a round, {cfg.rounds} rounds")
    interleave(variants, cfg.rounds, cfg.device, unit="ms a run (its prefill included)")
    timed = {k: v[-cfg.rounds :] for k, v in decode.items()}  # the timed rounds' (after the untimed one)
    per_token = {k: [t * 1e3 / (batch * (n - 1)) for t, _ in v] for k, v in timed.items()}
    costs = round_costs[-cfg.rounds :]  # the timed rounds' (the untimed round measured one too)
    cuda = torch.device(cfg.device).type == "cuda"

    def schedule_ms(name: str, at: RowCost) -> float:
        return schedule_seconds(at, results[name][1]) * 1e3 / (batch * (n - 1))

    def overhead(name: str) -> float:
        """The round-paired median of the time per token over the schedule's at that round's pass cost."""
        return statistics.median(t / schedule_ms(name, c) for t, c in zip(per_token[name], costs))

    def host(name: str) -> float:
        """The median of the runs' time after the first tokens over their passes' own then (NaN on CUDA, where a
        pass's span is the host's queueing it)."""
        return float("nan") if cuda else statistics.median(t / max(p, 1e-12) for t, p in timed[name])

    seq_ms = statistics.median(per_token["sequential"])
    seq_stats = results["sequential"][0].stats  # generate counts its steps as positions: its passes are its steps
    shared = {
        "shape": cfg.shape, "dtype": dtype, "batch": batch, "new_tokens": n, "prompt_len": cfg.prompt_len,
        "rounds": cfg.rounds, "sequential_ms_per_token": seq_ms,
        "sequential_steps_per_token": seq_stats.group_passes / seq_stats.tokens,
        "sequential_overhead": overhead("sequential"), "sequential_host_overhead": host("sequential"),
        "threads": torch.get_num_threads(), "machine": machine_name(cfg.device),
    }  # fmt: skip
    rows = []
    for name, pattern in chosen.items():
        agreement = replayed_agreement(pattern, batch, n)
        for on in cfg.cost_models:
            key = _name(name, on)
            result, _ = results[key]
            st, ms = result.stats, statistics.median(per_token[key])
            paired = [s / v for s, v in zip(per_token["sequential"], per_token[key])]
            rows.append(shared | {
                "pattern": name, "source": pattern.source, "agreement": agreement, "loop1_agreement": agreement[0],
                "cost_model": on, "ms_per_token": ms, "speedup": statistics.median(paired),
                "speedup_min": min(paired), "steps_per_token": st.steps / st.tokens,
                "rows_per_token": st.rows / st.tokens, "flushes_per_token": st.flushes / st.tokens,
                "closed_steps": st.closed_steps, "overhead": overhead(key), "host_overhead": host(key),
                "schedule_ms_per_token": statistics.median(schedule_ms(key, c) for c in costs),
                "schedule_speedup": schedule_ms("sequential", cost) / schedule_ms(key, cost),
                "identical": result.tokens == reference.tokens,
            })  # fmt: skip
    return rows


def _name(pattern: str, cost_model: bool) -> str:
    return f"{pattern}/{'cost' if cost_model else 'all'}"


def format_payoff_table(table: pa.Table) -> str:
    """A Markdown table of the map: per dtype, batch and pattern, SPEED's speed-up over sequential decoding (timed,
    and by the schedules), steps per token, overhead against its schedule and beside its own passes (host), the cost
    model off and on side by side."""
    rows = table.to_pylist()
    cells = {(r["dtype"], r["batch"], r["pattern"], r["cost_model"]): r for r in rows}
    keys = list(dict.fromkeys((r["dtype"], r["batch"], r["pattern"]) for r in rows))
    lines = [
        "| dtype | batch | pattern | loop-1 agreement | speed-up, all rows | speed-up, cost model | schedule's: all "
        "rows, cost model | steps/token (sequential) | overhead: speed, cost model, sequential | host: speed, cost "
        "model, sequential | identical |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for dtype, batch, pattern in keys:
        off, on = cells.get((dtype, batch, pattern, False)), cells.get((dtype, batch, pattern, True))
        any_row = off or on
        lines.append(
            f"| {dtype} | {batch} | {pattern} | {any_row['loop1_agreement']:.2f} | {_x(off, 'speedup')} | "
            f"{_x(on, 'speedup')} | {_x(off, 'schedule_speedup')}, {_x(on, 'schedule_speedup')} | "
            f"{_f(off or on, 'steps_per_token')} ({any_row['sequential_steps_per_token']:.2f}) | "
            f"{_x(off, 'overhead')}, {_x(on, 'overhead')}, {any_row['sequential_overhead']:.2f}x | "
            f"{_x(off, 'host_overhead')}, {_x(on, 'host_overhead')}, {any_row['sequential_host_overhead']:.2f}x | "
            f"{'yes' if all(r['identical'] for r in (off, on) if r) else 'NO'} |"
        )
    return "\n".join(lines)


def _x(row: dict | None, key: str) -> str:
    return "" if row is None else f"{row[key]:.2f}x"


def _f(row: dict | None, key: str) -> str:
    return "" if row is None else f"{row[key]:.2f}"


def never_slower(table: pa.Table, keep: float = 0.9) -> list[str]:
    """The cells that miss the cost model's goals, one line each: with it on, a round-paired median below 1.0x
    sequential decoding; where plain SPEED pays (above 1.0x), the cost model keeping less than ``keep`` of its
    gain over sequential (``(on - 1) / (off - 1)``)."""
    rows = table.to_pylist()
    off = {(r["dtype"], r["batch"], r["pattern"]): r for r in rows if not r["cost_model"]}
    misses = []
    for r in (r for r in rows if r["cost_model"]):
        where = f"{r['dtype']} batch {r['batch']} {r['pattern']}"
        if r["speedup"] < 1.0:
            misses.append(f"{where}: cost model {r['speedup']:.2f}x sequential")
        plain = off.get((r["dtype"], r["batch"], r["pattern"]))
        if plain is not None and plain["speedup"] > 1.0 and r["speedup"] - 1 < keep * (plain["speedup"] - 1):
            misses.append(f"{where}: cost model {r['speedup']:.2f}x against plain SPEED's {plain['speedup']:.2f}x")
    return misses


def add_map_flags(parser: Any) -> None:
    """The flags that pick a subset of the map (``PayoffConfig``), shared by ``jobs/bench_payoff.py`` and
    ``jobs/predict_payoff.py``."""
    from speed.benchmarks.shapes import SHAPES

    d = {f.name: f.default for f in fields(PayoffConfig)}
    parser.add_argument("--shape", choices=sorted(SHAPES), default="ouro-1.4b", help="the published shape")
    parser.add_argument("--recurrence", type=int, default=None, help="loops (default: the shape's)")
    parser.add_argument("--dtypes", default=",".join(d["dtypes"]), help="comma-separated: float32, bfloat16")
    parser.add_argument("--batches", type=int, nargs="+", default=list(d["batches"]))
    parser.add_argument("--cost-model", choices=("off", "on", "both"), default="both")
    parser.add_argument("--new-tokens", type=int, default=d["new_tokens"])
    parser.add_argument("--prompt-len", type=int, default=d["prompt_len"])
    parser.add_argument("--rounds", type=int, default=d["rounds"], help="timed rounds (after one untimed)")
    parser.add_argument("--seed", type=int, default=d["seed"])


def map_config(args: Any, agreements: Sequence[float], traces: Sequence[TracePattern]) -> PayoffConfig:
    """The ``PayoffConfig`` of ``add_map_flags``' flags, the loop-1 agreements and the traces."""
    from speed.benchmarks.shapes import SHAPES

    costs = {"off": (False,), "on": (True,), "both": (False, True)}[args.cost_model]
    return PayoffConfig(
        args.shape, SHAPES[args.shape].resolve(args.recurrence), tuple(args.dtypes.split(",")), tuple(args.batches),
        tuple(agreements), tuple(traces), costs, args.prompt_len, args.new_tokens, args.rounds, args.seed,
    )  # fmt: skip


@dataclass(frozen=True)
class OwnTrace:
    """A checkpoint's own greedy SPEED on its held-out inputs: the trace to replay and what it ran at its shape."""

    pattern: TracePattern
    loops: int
    tokens: int
    steps_per_token: float  # its SPEED's engine steps per committed token, batch 1 (its oracle's beside)
    oracle_steps_per_token: float
    agreement: list[float]  # per loop: its tokens' share agreeing with the final token


def checkpoint_trace(
    checkpoint: str, split: str = "test", limit: int = 64, max_new_tokens: int = 48, task: str | None = None
) -> OwnTrace:
    """Decode ``limit`` held-out inputs of ``checkpoint``'s task (or ``task``) one at a time with plain greedy SPEED
    (its tokenizer's stop ids) and keep the flip trace (``TRACE_SCHEMA`` rows, ``sequence`` the input's index)."""
    from speed.benchmarks.heldout import held_out

    held = held_out(checkpoint, split, limit, task)
    model, stops = held.model.eval(), frozenset(held.tokenizer.stop_ids)
    tables, steps, oracle_steps, tokens = [], 0, 0, 0
    for i, source in enumerate(held.inputs):
        ids = torch.tensor([source])
        own = generate(model, ids, options=DecodeOptions(method="speed", max_new_tokens=max_new_tokens, stop_ids=stops))
        oracle = generate(
            model,
            ids,
            options=DecodeOptions(method="speed", max_new_tokens=max_new_tokens, stop_ids=stops, trace=False),
            oracle=own.tokens,
        )
        steps, oracle_steps = steps + own.stats.steps, oracle_steps + oracle.stats.steps
        tokens += len(own.tokens[0])
        tables.append(own.trace.set_column(0, "sequence", pa.array([i] * len(own.trace), pa.int32())))
    trace = pa.concat_tables(tables)
    loops = model.n_loops
    agreement = (~trace["flipped_final"].to_numpy(zero_copy_only=False)).reshape(-1, loops).mean(axis=0).tolist()
    name = f"own:{checkpoint.rstrip('/').rsplit('/', 1)[-1]}"
    return OwnTrace(TracePattern(name, trace, stops), loops, tokens, steps / tokens, oracle_steps / tokens, agreement)
