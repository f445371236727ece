"""Decoding (greedy or seeded sampling) of a batch with a looped (NxM) decoder: sequential reference and SPEED pipeline.

``generate`` decodes one fixed batch to completion as a thin loop over
``speed.engine.Engine`` (see there for how SPEED schedules tokens): every
sequence of the batch is one request, admitted at once and decoded until it
ends, so the engine's exactness tests and generate's are the same.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import pyarrow as pa
import torch
from torch import Tensor

from speed.engine import (
    METHODS,
    DecodeStats,
    Engine,
    EngineConfig,
    ExitRule,
    Finished,
    Method,
    Request,
    Speculation,
    Stepper,
)
from speed.engine.sampling import Sampling

__all__ = ["DecodeOptions", "DecodeStats", "Decoder", "GenerateResult", "Method", "Speculation", "Stepper", "generate"]


@dataclass
class GenerateResult:
    """Output of ``generate``: tokens per sequence (the stop token included when produced), counters, trace."""

    tokens: list[list[int]]
    stats: DecodeStats
    trace: pa.Table | None  # speed.engine.trace.TRACE_SCHEMA, when asked for
    stopped: list[bool] = field(default_factory=list)  # per sequence: it ended at a stop token (else at the limit)
    # seconds from the call until every sequence had its first token (the engine built, every prompt admitted), and
    # from then to the end: one run's split of its time, so a time per token after the first is never negative
    first_token_s: float = float("nan")
    decode_s: float = float("nan")


@dataclass(frozen=True)
class DecodeOptions:
    """How ``generate`` (and a ``Decoder``) decodes: the one definition of its options, with their defaults.

    ``method="sequential"`` runs all M loops of a token before the next (the reference; with ``trace`` it also
    evaluates every loop's early exit). ``method="speed"`` pipelines as ``speculation`` says
    (``speed.engine.Speculation``; None: ``Speculation()``, launch after loop 1, eager invalidation, no branches,
    no confidence gate); sequential decoding ignores it. ``row_budget`` caps the rows of a step, ``cost_model``
    runs the speculative rows this device's measured pass cost says pay (``speed.engine.EngineConfig``); both
    return identical tokens. ``method="exit_gate"`` (a model with Ouro's exit gate) commits what ``exit_rule``
    picks from the gate (``speed.engine.ExitRule``), pipelined as ``speculation`` says: a lossy baseline, not
    sequential's tokens; ``stats.mean_exit_loop`` is the loop passes per token the gate asks for. ``sampling``
    (None: greedy) applies to every sequence with its one seed: the noise depends on (seed, output position) only,
    so two sequences of the batch with the same input draw the same tokens. ``stop_ids``: the tokens a sequence
    ends at (an imported chat model's ``HFTokenizer.stop_ids``); None: the model's EOS. ``graphs``: the group pass
    in row-count buckets (``EngineConfig.graphs``; None: on a CUDA device, for a stepper whose pass can be
    captured).
    """

    method: Method = "speed"
    max_new_tokens: int = 64
    speculation: Speculation = Speculation()  # None given: this default
    sampling: Sampling = Sampling()  # None given: greedy, this default
    trace: bool = True  # per-sequence flip traces (``speed.engine.trace.TRACE_SCHEMA``) in the result
    row_budget: int | None = None
    cost_model: bool = False
    stop_ids: frozenset[int] | None = None  # any collection given: its frozenset
    exit_rule: ExitRule | None = None
    graphs: bool | None = None

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"method must be one of {METHODS}, got {self.method!r}")
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be at least 1, got {self.max_new_tokens}")
        if self.speculation is None:
            object.__setattr__(self, "speculation", Speculation())
        if self.sampling is None:
            object.__setattr__(self, "sampling", Sampling())
        if self.stop_ids is not None:
            object.__setattr__(self, "stop_ids", frozenset(self.stop_ids))

    def replace(self, **changes: Any) -> DecodeOptions:
        """A copy with some fields changed (unknown fields are an error), checked again."""
        return dataclasses.replace(self, **changes)


def generate(
    model: Stepper | Any,
    input_ids: Tensor,
    attention_mask: Tensor | None = None,
    options: DecodeOptions = DecodeOptions(),
    *,
    oracle: list[list[int]] | None = None,
) -> GenerateResult:
    """Decode a batch of prompts (B, S) with a looped decoder, as ``options`` say (``DecodeOptions``: the method,
    the token limit, SPEED's settings, sampling, ...): a model (``SpeedT5``'s encoder inputs, ``LoopedLM``'s
    contexts) or any ``speed.engine.Stepper``.

    Sequence b decodes the tokens where ``attention_mask[b]`` is 1, encoded (or prefilled) on their own.
    ``oracle`` (method ``speed`` only; one token list per sequence) forces speculation to the given final tokens,
    isolating the engine's own overhead.
    """
    if input_ids.dim() != 2 or input_ids.shape[0] == 0:
        raise ValueError(f"input_ids must be (batch, length) with batch >= 1, got shape {tuple(input_ids.shape)}")
    decoder = Decoder(model, *input_ids.shape, options)
    return decoder(input_ids, attention_mask, oracle, since=decoder.built)


class Decoder:
    """``generate`` with its engine kept: the engine (its cache, its memory, its buckets' buffers and CUDA graphs,
    captured at their first passes) built once for batches of up to ``batch`` prompts of up to ``length`` tokens,
    each call then decoding one batch with it as ``options`` say. What a benchmark times: after an untimed first
    call, a call decodes only, never builds nor captures. Each call's tokens, stats and trace are what
    ``generate`` returns for its batch (the engine is idle between calls: every slot and block given back)."""

    def __init__(self, model: Stepper | Any, batch: int, length: int, options: DecodeOptions = DecodeOptions()) -> None:
        if batch < 1:
            raise ValueError(f"a batch holds at least one prompt, got {batch}")
        called = time.perf_counter()
        self.model, self.options = model, options
        config = EngineConfig(
            max_active=batch,
            max_prompt_len=length,
            max_target_len=options.max_new_tokens,
            row_budget=options.row_budget,
            cost_model=options.cost_model,
            trace=options.trace,
            # side entries only for branches; a speculation that is none is the engine's add to refuse
            branches=options.method != "sequential"
            and isinstance(options.speculation, Speculation)
            and options.speculation.branches > 0,
            graphs=options.graphs,
        )
        with _eval(model):
            self.engine = Engine(model, config)
        self.built = called  # when the engine began to be built (``generate`` counts it in the first token's time)

    def __call__(
        self,
        input_ids: Tensor,
        attention_mask: Tensor | None = None,
        oracle: list[list[int]] | None = None,
        since: float | None = None,
    ) -> GenerateResult:
        """Decode a batch (B, S) of at most the engine's prompts and tokens, as ``generate`` would (``oracle`` as
        there); the first token's time counted from ``since`` (a ``time.perf_counter``; None: this call)."""
        called = time.perf_counter() if since is None else since
        c = self.engine.config
        if input_ids.dim() != 2 or not 1 <= input_ids.shape[0] <= c.max_active or input_ids.shape[1] > c.max_prompt_len:
            raise ValueError(
                f"input_ids must be (batch, length) with 1 <= batch <= {c.max_active} and length <= "
                f"{c.max_prompt_len}, got shape {tuple(input_ids.shape)}"
            )
        if attention_mask is not None and attention_mask.shape != input_ids.shape:
            raise ValueError(
                f"attention_mask shape {tuple(attention_mask.shape)} != input_ids shape {tuple(input_ids.shape)}"
            )
        options = self.options
        if oracle is not None and (options.method != "speed" or len(oracle) != input_ids.shape[0]):
            raise ValueError("oracle needs method='speed' and one token list per sequence")
        sources = input_ids.tolist()
        if attention_mask is not None:
            sources = [[t for t, m in zip(ids, mask) if m] for ids, mask in zip(sources, attention_mask.tolist())]
        requests = [
            Request(
                ids,
                options.max_new_tokens,
                options.method,
                options.speculation,
                None if oracle is None else list(oracle[b]),
                options.sampling,
                stop_ids=options.stop_ids,
                exit_rule=options.exit_rule,
            )
            for b, ids in enumerate(sources)
        ]  # fmt: skip
        engine = self.engine
        before = dataclasses.replace(engine.stats)
        with _eval(self.model):
            ids = [engine.add(r) for r in requests]  # validates the speculation against the model, the ids
            done: dict[int, Finished] = {}
            waiting, first = set(ids), float("nan")  # the sequences without a first token yet; when the last got one
            with torch.inference_mode():
                while engine.has_work:
                    result = engine.step()
                    if waiting:
                        waiting.difference_update(c.id for c in result.committed)
                        first = time.perf_counter() if not waiting else first
                    for f in result.finished:
                        done[f.id] = f
            end = time.perf_counter()
        stats = engine.stats.since(before)
        table = None
        if options.trace:  # each sequence's rows under its index in the batch (the engine's request ids go on)
            parts = [_renumbered(done[i].trace, b) for b, i in enumerate(ids)]
            table = pa.concat_tables(parts).combine_chunks()
        stopped = [done[i].stopped for i in ids]
        return GenerateResult([done[i].tokens for i in ids], stats, table, stopped, first - called, end - first)


def _renumbered(trace: pa.Table, sequence: int) -> pa.Table:
    """A request's trace rows (``TRACE_SCHEMA``) as sequence ``sequence``'s."""
    at = trace.schema.get_field_index("sequence")
    column = pa.array([sequence] * trace.num_rows, type=trace.schema.field(at).type)
    return trace.set_column(at, trace.schema.field(at), column)


@contextmanager
def _eval(model: Any) -> Iterator[None]:
    """The model in eval mode for the block (the engine decodes in eval mode), back in training mode after if it
    was."""
    was_training = getattr(model, "training", False)
    if was_training:
        model.eval()  # type: ignore[attr-defined]
    try:
        yield
    finally:
        if was_training:
            model.train()  # type: ignore[attr-defined]
