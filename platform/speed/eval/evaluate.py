"""Evaluate a model on a task split with the SPEED decoder.

Writes three files into ``out_dir`` (a local path or a URI): ``predictions.parquet``
(``PREDICTIONS_SCHEMA``), ``trace.parquet`` (``EVAL_TRACE_SCHEMA``: the
per-token flip trace plus the example index, joinable with the predictions)
and ``summary.json`` (metrics, flip rate per loop, decode speed, SPEED's steps
and rows per token beside the oracle's, the flip cost, the metrics' bootstrap
intervals, every loop's teacher-forced perplexity of the references and, with
``check_sequential``, the speed-up over sequential decoding, whose output
must be identical). Both model families: a ``LoopedLM`` reads each source as
its finetuning prompt. With ``check_sequential`` both decoders run on every
batch, timed interleaved (alternating which goes first), so that a busy
machine slows both alike; a mismatch is recorded in the summary (example,
position, both tokens, top-2 logit gap), the files are still written, and
only then does the evaluation fail (``DecodingMismatch``).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
from torch import Tensor

from speed.config import to_dict
from speed.data import get_task, pad_inputs, read_records, truncate
from speed.decode.exactness import LogitRecorder, top2_gap
from speed.decode.generate import DecodeOptions, DecodeStats, GenerateResult, generate
from speed.engine import EngineConfig, ExitKind, ExitRule, Speculation, SpeculationFields
from speed.engine.matmuls import packed_while
from speed.engine.sampling import Sampling
from speed.engine.trace import TRACE_SCHEMA, flip_rates
from speed.eval import metrics
from speed.eval.metrics import bootstrap
from speed.eval.summary import Decoded, Mismatch, gate_summary, speed_summary
from speed.eval.validation import validate_batches
from speed.hf_tokenizer import chat_renderer, load_tokenizer
from speed.models.family import Family, family_of
from speed.models.looped_lm import LoopedLM
from speed.models.t5 import SpeedT5
from speed.progress import ProgressBar
from speed.storage import locate
from speed.tokenizer import TextTokenizer

PREDICTIONS_FILE = "predictions.parquet"
TRACE_FILE = "trace.parquet"
SUMMARY_FILE = "summary.json"

PREDICTIONS_SCHEMA = pa.schema(
    [
        pa.field("example", pa.int32(), nullable=False),  # index in the evaluated records
        pa.field("source", pa.string(), nullable=False),  # model input text, task prefix included
        pa.field("reference", pa.string(), nullable=False),
        pa.field("hypothesis", pa.string(), nullable=False),
        pa.field("output_tokens", pa.int32(), nullable=False),  # decoded tokens, EOS included when produced
        pa.field("finished", pa.bool_(), nullable=False),  # EOS produced within max_new_tokens
    ]
)
# The decoder's flip trace, one row per (example, position, loop); ``sequence`` is the index within its batch.
EVAL_TRACE_SCHEMA = pa.schema([pa.field("example", pa.int32(), nullable=False), *TRACE_SCHEMA])
METRICS = {"bleu": metrics.bleu, "chrf": metrics.chrf, "rouge": metrics.rouge}  # the names tasks list


@dataclass(frozen=True)
class EvalConfig(SpeculationFields):
    """What to evaluate and how to decode it: the one evaluation config.

    ``jobs/evaluate.py``'s flags and a finetuning job's ``eval`` section both
    fill it (``speed.config.from_dict`` coerces and checks the values). ``task``,
    ``source`` and ``max_source_len`` left at None follow the training data (the
    finetuning job's ``data`` section, or the evaluated checkpoint's): see
    ``following``. SPEED's settings are its ``SpeculationFields`` (``launch_loop``
    .. ``min_confidence``, keyword-only; ``speculation`` makes them one).
    """

    task: str | None = None  # a source/target task; None: the training task
    split: str = "test"
    source: str | None = None  # corpus folder, files or hub name; None: the training data's (its local corpus)
    limit: int | None = None  # first N usable records; None: the whole split
    batch_size: int = 16
    max_new_tokens: int = 64
    max_source_len: int | None = None  # encoder inputs are truncated to this many tokens; None: the training data's
    row_budget: int | None = None  # SPEED's rows per step at most (speed.engine.EngineConfig); None: all in flight
    cost_model: bool = True  # SPEED runs the speculative rows this device's measured pass cost says pay (False:
    # every in-flight row, or the row budget's)
    oracle: bool = True  # also decode (untimed) with oracle speculation: the steps SPEED needs if every exit agreed
    check_sequential: bool = True  # also decode sequentially, require identical output, report the speed-up
    bitwise: bool = True  # with check_sequential: any difference fails (else only differences beyond near_tie)
    near_tie: float = 1e-5  # top-2 logit gap under which a difference counts as a near-tie (bitwise off)
    temperature: float = 0.0  # 0: greedy; else seeded sampling, the same for both methods (speed.engine.sampling)
    top_k: int = 0  # 0: off
    top_p: float = 1.0  # 1: off
    seed: int = 0  # every sequence samples with this seed: its draws depend on (seed, output position) only
    bootstrap_samples: int = 1000  # resamples of the metrics' intervals (speed.eval.metrics.bootstrap); 0: none
    perplexity: bool = True  # every loop's teacher-forced perplexity of the references (cut to max_new_tokens)
    # "exit_gate": also decode with Ouro's exit gate (the rule below, speed.engine.ExitRule), reported beside SPEED's
    # and sequential's on the same text (quality, group passes per token, mean exit loop); lossy, never checked
    method: Literal["speed", "exit_gate"] = "speed"
    exit_kind: ExitKind = "threshold"
    exit_threshold: float = 1.0
    exit_step: int = 0  # 0-based, as Ouro's exit_at_step

    def __post_init__(self) -> None:
        super().__post_init__()  # SPEED's settings
        if self.method not in ("speed", "exit_gate"):
            raise ValueError(f"EvalConfig.method must be 'speed' or 'exit_gate', got {self.method!r}")
        try:
            _ = ExitRule(self.exit_kind, self.exit_threshold, self.exit_step)
        except ValueError as err:
            raise ValueError(f"EvalConfig: {err}") from None
        if self.task is not None and get_task(self.task).is_pretrain:
            raise ValueError(f"task {self.task!r} has no references to score; evaluate a source/target task")
        for name in ("batch_size", "max_new_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"EvalConfig.{name} must be at least 1, got {getattr(self, name)}")
        if self.bootstrap_samples < 0:
            raise ValueError(f"EvalConfig.bootstrap_samples must be 0 (none) or more, got {self.bootstrap_samples}")
        if self.row_budget is not None and self.row_budget < 1:
            raise ValueError(f"EvalConfig.row_budget must be at least 1 or None, got {self.row_budget}")
        if self.max_source_len is not None and self.max_source_len < 2:
            raise ValueError(f"EvalConfig.max_source_len must be at least 2, got {self.max_source_len}")
        if self.limit is not None and self.limit < 1:
            raise ValueError(f"EvalConfig.limit must be positive or None, got {self.limit}")
        try:
            _ = self.sampling  # Sampling checks its settings
        except ValueError as err:
            raise ValueError(f"EvalConfig: {err}") from None

    @property
    def exit_rule(self) -> ExitRule | None:
        """The exit gate's rule the ``exit_gate`` decoding uses (None: method ``speed``, no gated decoding)."""
        return ExitRule(self.exit_kind, self.exit_threshold, self.exit_step) if self.method == "exit_gate" else None

    @property
    def sampling(self) -> Sampling:
        """How both methods turn logits into tokens."""
        return Sampling(temperature=self.temperature, top_k=self.top_k, top_p=self.top_p, seed=self.seed)

    def following(self, task: str | None, source: str | None, max_source_len: int | None) -> EvalConfig:
        """This config with its unset ``task``, ``source`` and ``max_source_len`` taken from the training data."""
        return dataclasses.replace(
            self,
            task=self.task if self.task is not None else task,
            source=self.source if self.source is not None else source,
            max_source_len=self.max_source_len if self.max_source_len is not None else max_source_len,
        )

    def engine_capacity(self) -> EngineConfig:
        """The largest engine a batch builds (``generate``'s): ``batch_size`` requests of ``max_source_len`` prompt
        tokens and ``max_new_tokens`` outputs, with side entries where SPEED's branches run; what the load's memory
        check counts (``speed.models.pretrained.check_load``). Needs ``max_source_len`` (after ``following``)."""
        if self.max_source_len is None:
            raise ValueError("EvalConfig.engine_capacity needs max_source_len (none given, no training data)")
        return EngineConfig(
            max_active=self.batch_size,
            max_prompt_len=self.max_source_len,
            max_target_len=self.max_new_tokens,
            branches=self.branches > 0,
        )

    def check_complete(self) -> None:
        """Raise unless the task and the input length are known (after ``following``)."""
        missing = [name for name in ("task", "max_source_len") if getattr(self, name) is None]
        if missing:
            raise ValueError(f"evaluation needs {' and '.join(missing)}: none given and no training data to follow")


class DecodingMismatch(RuntimeError):
    """SPEED and sequential decoding differed where they must not (raised after the files are written)."""


@dataclass(frozen=True)
class Evaluation:
    """What ``evaluate`` returns: the summary (as written to summary.json) and the decoder's inputs."""

    summary: dict[str, Any]
    inputs: list[list[int]]  # per evaluated example: the decoder's input, as its family read the source


def run_evaluation(
    model: SpeedT5 | LoopedLM,
    tokenizer: TextTokenizer | str | Path,
    config: EvalConfig,
    out_dir: str | Path,
    *,
    progress: bool = True,
) -> dict[str, Any]:
    """Decode a task split with SPEED, score it, write the three files; returns the summary (``evaluate`` for
    the model's family, ``speed.models.family.family_of``)."""
    return evaluate(model, family_of(model), tokenizer, config, out_dir, progress=progress).summary


def evaluate(
    model: SpeedT5 | LoopedLM,
    family: Family,
    tokenizer: TextTokenizer | str | Path,
    config: EvalConfig,
    out_dir: str | Path,
    *,
    progress: bool = True,
) -> Evaluation:
    """Decode a task split with SPEED, score it, write the three files; returns the summary and the inputs.

    ``family`` is the model's: a ``LoopedLM`` decodes each source as its finetuning prompt
    (``speed.data.batching.encode_prompts``), one user turn of the tokenizer's chat template where it has one (an
    imported model's, ``speed.hf_tokenizer.chat_renderer``). ``tokenizer`` (a ``TextTokenizer``, or where one is:
    a SentencePiece model, an imported model's directory) also says where outputs end (its ``stop_ids``).

    A looped LM decodes on its weights packed for the native kernel (``packed_while``: bf16 weights, and float32
    ones of 8 MiB or more), restored bit for bit before the perplexity runs its forward.

    ``config`` must name its task and input length (``EvalConfig.following``).
    ``progress`` shows one progress bar on stderr. With ``config.check_sequential``
    any difference from sequential decoding fails the evaluation after the files
    are written; with ``config.bitwise`` off, only one whose top-2 logit gap is
    at least ``config.near_tie`` (kernels that round differently may flip a
    near-tie; ours do not, see ``speed.engine.kernels``).
    """
    config.check_complete()
    tok = load_tokenizer(tokenizer) if isinstance(tokenizer, (str, Path)) else tokenizer
    if tok.vocab_size > model.config.vocab_size:
        raise ValueError(f"tokenizer has {tok.vocab_size} ids but the model only {model.config.vocab_size}")
    records = read_records(family.read_task(get_task(config.task)), config.split, config.source, config.limit)
    columns = records.dataset.to_dict()
    sources, references = columns["source"], columns["target"]
    # an LM's: prompts in its chat template
    inputs = family.encode_sources(sources, tok, config.max_source_len, chat_renderer(tok))

    with packed_while(model):  # a looped LM decodes on packed weights; the perplexity below runs its forward
        _warm_up(model, inputs[0], _methods(config), config.exit_rule)
        decoded, sequential, oracle, mismatches, gated = _decode(model, inputs, config, progress, tok.stop_ids)
    hypotheses = tok.decode_batch(decoded.tokens)
    scores = {name: METRICS[name] for name in get_task(config.task).metrics}

    out = locate(out_dir)
    out.makedirs()
    predictions = {
        "example": list(range(len(sources))),
        "source": sources,
        "reference": references,
        "hypothesis": hypotheses,
        "output_tokens": [len(t) for t in decoded.tokens],
        "finished": decoded.stopped,
    }
    table = pa.Table.from_pydict(predictions, schema=PREDICTIONS_SCHEMA)
    pq.write_table(table, (out / PREDICTIONS_FILE).path, filesystem=out.fs)
    pq.write_table(decoded.trace, (out / TRACE_FILE).path, filesystem=out.fs)
    perplexity = _perplexity(model, family, inputs, tok.encode_batch(references), config) if config.perplexity else None
    summary = {
        "task": config.task,
        "split": config.split,
        "source": str(records.source),
        "examples": len(sources),
        "skipped_records": records.skipped,
        "config": dataclasses.asdict(config),
        "family": family.name,
        "model": to_dict(model.config),
        "exit_adapters": _exits_summary(model),
        "tokenizer": str(tok.path),
        "metrics": {name: score(hypotheses, references) for name, score in scores.items()},
        "intervals": bootstrap(hypotheses, references, config.bootstrap_samples) if config.bootstrap_samples else {},
        "perplexity": perplexity,
        "flip_rates": flip_rates(decoded.trace).to_pylist(),
        "decode": speed_summary(decoded, sequential, oracle, mismatches, config.bitwise, config.near_tie),
        "files": {name: (out / f).uri for name, f in _FILES.items()},
    }
    if gated is not None:
        gated_hypotheses = tok.decode_batch(gated.tokens)
        summary["decode"]["exit_gate"] = gate_summary(gated, decoded, config.exit_rule) | {
            "metrics": {name: score(gated_hypotheses, references) for name, score in scores.items()}
        }
    (out / SUMMARY_FILE).write_text(json.dumps(summary, indent=2))
    _fail_on_mismatch(mismatches, config.bitwise, config.near_tie, (out / SUMMARY_FILE).uri)
    return Evaluation(summary, inputs)


_FILES = {"predictions": PREDICTIONS_FILE, "trace": TRACE_FILE, "summary": SUMMARY_FILE}


def _perplexity(
    model: SpeedT5 | LoopedLM,
    family: Family,
    inputs: list[list[int]],
    references: list[list[int]],
    config: EvalConfig,
) -> dict[str, Any]:
    """Every loop's mean token cross-entropy and perplexity of the references given the inputs (teacher
    forcing, the family's training batches: a ``LoopedLM`` scores the answer after its prompt), each reference
    cut to ``max_new_tokens`` with EOS last (as training cuts targets); with the same pass's teacher-forced flip
    rates."""
    labels = [truncate(ids, config.max_new_tokens) for ids in references]
    size = config.batch_size
    batches = ({"input_ids": inputs[s : s + size], "labels": labels[s : s + size]} for s in range(0, len(inputs), size))
    v = validate_batches(model, family, batches)
    return {
        "loss": v.losses,
        "perplexity": v.perplexities,
        "flip_rate_prev": v.flip_rate_prev,
        "flip_cost": v.flip_cost,
        "tokens": v.tokens,
    }


def _exits_summary(model: SpeedT5 | LoopedLM) -> dict[str, Any] | None:
    """The exit adapters the early exits were decoded with (``speed.models.exits.ExitConfig``, as JSON has it); None."""
    if model.exit_adapters is None:
        return None
    config = to_dict(model.exit_adapters.config)
    return config | {"loops": list(config["loops"])}


def _methods(config: EvalConfig) -> tuple[str, ...]:
    """The methods an evaluation decodes with, timed: SPEED, sequential decoding if checked, the exit gate if asked."""
    return (
        "speed",
        *(("sequential",) if config.check_sequential else ()),
        *(("exit_gate",) if config.exit_rule else ()),
    )


def _warm_up(model: SpeedT5, example: list[int], methods: tuple[str, ...], exit_rule: ExitRule | None) -> None:
    """One short untimed call per method, so that one-off start-up costs stay out of the timings."""
    input_ids, attention_mask = pad_inputs([example])  # (1, S), (1, S)
    device = next(model.parameters()).device
    for method in methods:
        rule = exit_rule if method == "exit_gate" else None
        ids, mask = input_ids.to(device), attention_mask.to(device)
        generate(model, ids, mask, DecodeOptions(method=method, max_new_tokens=2, trace=False, exit_rule=rule))


def _decode(
    model: SpeedT5, inputs: list[list[int]], config: EvalConfig, progress: bool, stop_ids: frozenset[int]
) -> tuple[Decoded, Decoded | None, Decoded | None, list[Mismatch], Decoded | None]:
    """Decode ``inputs`` in batches with SPEED (with its trace), if checked sequentially, and with the exit gate
    if asked (``config.exit_rule``: returned last; None: not asked), each output ending at any of ``stop_ids``.

    The two methods run batch by batch, alternating which goes first, each
    timed on its own. With ``config.oracle`` each batch is decoded once more,
    untimed, with SPEED speculating its own final tokens (same launch loop and
    invalidation, no branches): returned third, its steps are the oracle's.
    """
    device = next(model.parameters()).device
    methods = _methods(config)
    runs = {m: Decoded([], DecodeStats(), 0.0, None) for m in methods}
    traces: list[pa.Table] = []
    mismatches: list[Mismatch] = []
    bar = ProgressBar(len(inputs), f"evaluate {'+'.join(methods)}", "examples") if progress else None
    # every batch decoded as the config says, untraced SPEED; each method's run changes what is its own
    options = DecodeOptions(
        max_new_tokens=config.max_new_tokens,
        speculation=config.speculation,
        sampling=config.sampling,
        trace=False,
        stop_ids=stop_ids,
    )
    for b, start in enumerate(range(0, len(inputs), config.batch_size)):
        input_ids, attention_mask = pad_inputs(inputs[start : start + config.batch_size])  # (B, S), (B, S)
        input_ids, attention_mask = input_ids.to(device), attention_mask.to(device)
        decode = functools.partial(generate, model, input_ids, attention_mask)  # this batch
        results: dict[str, GenerateResult] = {}
        for method in methods if b % 2 == 0 else methods[::-1]:
            begin = time.perf_counter()
            timed = options.replace(method=method)
            if method == "speed":
                timed = timed.replace(trace=True, row_budget=config.row_budget, cost_model=config.cost_model)
            if method == "exit_gate":  # pipelined as SPEED is, its row budget too
                timed = timed.replace(row_budget=config.row_budget, exit_rule=config.exit_rule)
            results[method] = decode(timed)
            runs[method].seconds += time.perf_counter() - begin
        if config.oracle:  # untimed: SPEED speculating its own final tokens (its launch loop, no branches)
            plain = Speculation(config.launch_loop, config.invalidation)
            results["oracle"] = decode(options.replace(speculation=plain), oracle=results["speed"].tokens)
        for method, result in results.items():
            run = runs.setdefault(method, Decoded([], DecodeStats(), 0.0, None))
            run.tokens.extend(result.tokens)
            run.stopped.extend(result.stopped)
            run.stats += result.stats
        trace = results["speed"].trace
        example = pc.add(trace.column("sequence"), pa.scalar(start, pa.int32()))
        traces.append(pa.Table.from_arrays([example, *trace.columns], schema=EVAL_TRACE_SCHEMA))
        if "sequential" in results and results["speed"].tokens != results["sequential"].tokens:
            mismatches.extend(
                _mismatches(
                    model, input_ids, attention_mask, config, start, results["speed"], results["sequential"], stop_ids
                )  # fmt: skip
            )
        if bar is not None:
            rates = ", ".join(f"{m} {r.stats.tokens / r.seconds:.0f}" for m, r in runs.items() if r.seconds)
            bar.update(len(results["speed"].tokens), f"tokens/s {rates}")  # the oracle run is untimed
    runs["speed"].trace = pa.concat_tables(traces) if traces else None
    return runs["speed"], runs.get("sequential"), runs.get("oracle"), mismatches, runs.get("exit_gate")


def _mismatches(
    model: SpeedT5,
    input_ids: Tensor,
    attention_mask: Tensor,
    config: EvalConfig,
    start: int,
    speed: GenerateResult,
    sequential: GenerateResult,
    stop_ids: frozenset[int],
) -> list[Mismatch]:
    """The first differing position of each differing example of a batch, with the reference's top-2 gap.

    The gap comes from decoding the batch sequentially once more (untimed)
    while recording every loop's logits.
    """
    recorder = LogitRecorder(model)
    generate(
        recorder,
        input_ids,
        attention_mask,
        DecodeOptions(
            method="sequential",
            max_new_tokens=config.max_new_tokens,
            trace=True,
            sampling=config.sampling,
            stop_ids=stop_ids,
        ),
    )
    found = []
    for b, (a, r) in enumerate(zip(speed.tokens, sequential.tokens)):
        if a == r:
            continue
        pos = next((i for i, (x, y) in enumerate(zip(a, r)) if x != y), min(len(a), len(r)))
        logits = recorder.logits.get((b, model.n_loops - 1, pos))
        found.append(
            Mismatch(
                example=start + b,
                position=pos,
                speed_token=a[pos] if pos < len(a) else None,
                sequential_token=r[pos] if pos < len(r) else None,
                top2_gap=None if logits is None else top2_gap(logits),
            )
        )
    return found


def _is_near_tie(m: Mismatch, near_tie: float) -> bool:
    return m.top2_gap is not None and m.top2_gap < near_tie


def _fail_on_mismatch(mismatches: list[Mismatch], bitwise: bool, near_tie: float, summary: str) -> None:
    """Raise ``DecodingMismatch`` if a recorded mismatch is not allowed (any, in bitwise mode)."""
    bad = mismatches if bitwise else [m for m in mismatches if not _is_near_tie(m, near_tie)]
    if not bad:
        return
    m = bad[0]
    gap = "unknown" if m.top2_gap is None else f"{m.top2_gap:.3g}"
    rule = "bitwise mode allows none" if bitwise else f"not a near-tie (top-2 gap >= {near_tie:g})"
    raise DecodingMismatch(
        f"SPEED and sequential decoding differ on {len(bad)} example(s) ({rule}); first: example {m.example}, "
        f"position {m.position}: SPEED {m.speed_token} vs sequential {m.sequential_token}, top-2 gap {gap}. "
        f"Predictions, trace and {summary} (all mismatches) were written."
    )
