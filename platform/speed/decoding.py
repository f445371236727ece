"""Greedy decoding of a looped (NxM) decoder: sequential reference and SPEED pipeline.

The engines never import the model. They drive any ``Stepper``: an object that
encodes a request once (``prepare``), embeds tokens, and runs ONE pass of its
shared N-layer group over a set of rows, each row a token at its own loop
depth, reading and writing an engine-owned ``KVCache``.

SPEED (speculative pipelined execution): a token is launched from its
predecessor's early-exit prediction after ``launch_loop`` loops, so one step
advances up to M in-flight tokens of a sequence by one loop each, reading the
shared weights once. When a later loop's prediction differs from the token a
successor was launched with, the successor and everything after it are
flushed (``eager``: at once; ``final``: only when the predecessor finishes its
last loop) and relaunched from the new prediction. Committed tokens are always
the last loop's predictions, so the output equals sequential greedy decoding.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

import pyarrow as pa
import torch
from torch import Tensor

from speed.cache import KVCache, Rows
from speed.trace import TraceBuilder

Method = Literal["sequential", "speed"]
Invalidation = Literal["eager", "final"]


class Stepper(Protocol):
    """What the decoding engines need from a looped decoder model."""

    n_loops: int
    eos_id: int
    start_id: int

    def cache(self, batch: int, max_len: int) -> KVCache: ...

    def prepare(self, input_ids: Tensor, attention_mask: Tensor | None, max_len: int) -> Any: ...

    def embed(self, tokens: list[int]) -> Tensor: ...  # (R,) ids -> (R, d), on the model's device

    def step(
        self, memory: Any, cache: KVCache, rows: Rows, hidden: Tensor, with_logits: bool = True
    ) -> tuple[Tensor, Tensor | None]: ...


@dataclass
class DecodeStats:
    """Counters of one decoding run (all sequences together)."""

    tokens: int = 0  # committed output tokens
    steps: int = 0  # engine iterations (SPEED: pipeline steps; sequential: token positions)
    group_passes: int = 0  # runs of the shared N-layer group, each reading its weights once
    rows: int = 0  # token-loops computed (a row = one token through one loop)
    flushes: int = 0  # misprediction flushes (each may drop several in-flight tokens)
    wasted_rows: int = 0  # rows spent on tokens that were flushed or fell past EOS

    @property
    def tokens_per_pass(self) -> float:
        """Committed tokens per group pass: for one sequence 1/M sequential, up to 1 SPEED (x batch size)."""
        return self.tokens / self.group_passes if self.group_passes else 0.0


@dataclass
class GenerateResult:
    """Output of ``generate``: tokens per sequence (EOS included when produced), counters, trace."""

    tokens: list[list[int]]
    stats: DecodeStats
    trace: pa.Table | None  # speed.trace.TRACE_SCHEMA, when asked for


# ----- policies: small pure functions ------------------------------------------------------


def should_launch(depth: int, launch_loop: int) -> bool:
    """A token with ``depth`` finished loops may launch its successor from its latest prediction."""
    return depth >= launch_loop


def should_flush(invalidation: Invalidation, depth: int, n_loops: int) -> bool:
    """Whether a prediction at ``depth`` that disagrees with the launched successor flushes it."""
    return invalidation == "eager" or depth == n_loops


# ----- engine state ----------------------------------------------------------------------


@dataclass
class Slot:
    """A token in flight at decoder position ``pos`` with input ``token``."""

    pos: int
    token: int
    hidden: Tensor | None = None  # (d,) input to its next loop; None until embedded
    preds: list[int] = field(default_factory=list)  # early-exit prediction after each finished loop


@dataclass
class Sequence:
    """One request's state. Sequences are independent, so one can join or leave a running batch."""

    index: int  # position in the request batch (trace ``sequence``)
    row: int  # row in the KV cache and the encoder memory
    max_new_tokens: int
    out: list[int] = field(default_factory=list)  # committed tokens
    slots: list[Slot] = field(default_factory=list)  # in flight, oldest first; slot i+1 launched from slot i
    oracle: list[int] | None = None  # forced speculation (benchmarks): the known final tokens
    done: bool = False

    def speculation(self, slot: Slot) -> int:
        """The prediction to speculate from: the oracle's token if forced, else the latest exit."""
        if self.oracle is not None and slot.pos < len(self.oracle):
            return self.oracle[slot.pos]
        return slot.preds[-1]


# ----- public entry point -------------------------------------------------------------------


def generate(
    model: Stepper,
    input_ids: Tensor,
    attention_mask: Tensor | None = None,
    *,
    method: Method = "speed",
    max_new_tokens: int = 64,
    launch_loop: int = 1,
    invalidation: Invalidation = "eager",
    trace: bool = True,
    oracle: list[list[int]] | None = None,
) -> GenerateResult:
    """Greedy-decode a batch of encoder inputs (B, S) with a looped decoder.

    ``method="sequential"`` runs all M loops of a token before the next (the
    reference; with ``trace`` it also evaluates every loop's early exit).
    ``method="speed"`` pipelines: successors launch after ``launch_loop``
    loops (1..M) and are invalidated per ``invalidation``. ``oracle`` (SPEED
    only) forces speculation to the given final tokens, isolating the
    engine's own overhead. Both return identical tokens.
    """
    if method not in ("sequential", "speed"):
        raise ValueError(f"method must be 'sequential' or 'speed', got {method!r}")
    if invalidation not in ("eager", "final"):
        raise ValueError(f"invalidation must be 'eager' or 'final', got {invalidation!r}")
    if not 1 <= launch_loop <= model.n_loops:
        raise ValueError(f"launch_loop must be in 1..{model.n_loops} (the model's loops), got {launch_loop}")
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be at least 1, got {max_new_tokens}")
    if input_ids.dim() != 2 or input_ids.shape[0] == 0:
        raise ValueError(f"input_ids must be (batch, length) with batch >= 1, got shape {tuple(input_ids.shape)}")
    if attention_mask is not None and attention_mask.shape != input_ids.shape:
        raise ValueError(
            f"attention_mask shape {tuple(attention_mask.shape)} != input_ids shape {tuple(input_ids.shape)}"
        )
    if oracle is not None and (method != "speed" or len(oracle) != input_ids.shape[0]):
        raise ValueError("oracle needs method='speed' and one token list per sequence")

    batch = input_ids.shape[0]
    was_training = getattr(model, "training", False)
    if was_training:
        model.eval()  # type: ignore[attr-defined]
    try:
        with torch.inference_mode():
            memory = model.prepare(input_ids, attention_mask, max_new_tokens)
            cache = model.cache(batch, max_new_tokens)
            stats, builder = DecodeStats(), TraceBuilder() if trace else None
            seqs = [
                Sequence(i, i, max_new_tokens, oracle=None if oracle is None else list(oracle[i])) for i in range(batch)
            ]
            if method == "sequential":
                _run_sequential(model, memory, cache, seqs, stats, builder)
            else:
                _run_speed(model, memory, cache, seqs, stats, builder, launch_loop, invalidation)
    finally:
        if was_training:
            model.train()  # type: ignore[attr-defined]
    return GenerateResult([s.out for s in seqs], stats, builder.table() if builder else None)


# ----- sequential reference -----------------------------------------------------------------


def _run_sequential(
    model: Stepper, memory: Any, cache: KVCache, seqs: list[Sequence], stats: DecodeStats, trace: TraceBuilder | None
) -> None:
    """Every token runs all M loops before the next token starts."""
    M = model.n_loops
    active = list(seqs)
    pos = 0
    while active:
        stats.steps += 1
        R = len(active)
        inputs = [s.out[-1] if s.out else model.start_id for s in active]
        hidden = model.embed(inputs)
        per_loop: list[list[int]] = []
        for loop in range(M):
            rows = Rows.build([s.row for s in active], [loop] * R, [pos] * R)
            need_exit = trace is not None or loop == M - 1
            hidden, logits = model.step(memory, cache, rows, hidden, with_logits=need_exit)
            stats.group_passes += 1
            stats.rows += R
            if need_exit:
                per_loop.append(logits.argmax(-1).tolist())
        for i, s in enumerate(active):
            s.out.append(per_loop[-1][i])
            if trace is not None:
                trace.add_token(s.index, pos, [p[i] for p in per_loop])
        stats.tokens += R
        pos += 1
        for s in active:
            s.done = s.out[-1] == model.eos_id or len(s.out) >= s.max_new_tokens
        active = [s for s in active if not s.done]


# ----- SPEED pipeline ----------------------------------------------------------------------


def _run_speed(
    model: Stepper,
    memory: Any,
    cache: KVCache,
    seqs: list[Sequence],
    stats: DecodeStats,
    trace: TraceBuilder | None,
    launch_loop: int,
    invalidation: Invalidation,
) -> None:
    """Each step runs one group pass over every in-flight token of every sequence."""
    for s in seqs:
        s.slots.append(Slot(0, model.start_id))
    while True:
        flat = [(s, slot) for s in seqs if not s.done for slot in s.slots]
        if not flat:
            return
        fresh = [slot for _, slot in flat if slot.hidden is None]
        if fresh:
            for slot, h in zip(fresh, model.embed([slot.token for slot in fresh])):
                slot.hidden = h
        rows = Rows.build(
            [s.row for s, _ in flat], [len(slot.preds) for _, slot in flat], [slot.pos for _, slot in flat]
        )
        hidden, logits = model.step(memory, cache, rows, torch.stack([slot.hidden for _, slot in flat]))
        stats.steps += 1
        stats.group_passes += 1
        stats.rows += len(flat)
        for (_, slot), h, pred in zip(flat, hidden, logits.argmax(-1).tolist()):
            slot.hidden = h
            slot.preds.append(pred)
        for s in seqs:
            if not s.done:
                _schedule(s, model, cache, stats, trace, launch_loop, invalidation)


def _schedule(
    seq: Sequence,
    model: Stepper,
    cache: KVCache,
    stats: DecodeStats,
    trace: TraceBuilder | None,
    launch_loop: int,
    invalidation: Invalidation,
) -> None:
    """After a step: commit a finished token, flush mispredicted successors, launch new ones."""
    M = model.n_loops
    i = 0
    while i < len(seq.slots):
        slot = seq.slots[i]
        depth = len(slot.preds)
        if depth == 0:  # launched in this pass
            return
        succ = seq.slots[i + 1] if i + 1 < len(seq.slots) else None
        if depth == M:  # the oldest token finished its last loop: commit it
            token = slot.preds[-1]
            seq.slots.pop(0)
            seq.out.append(token)
            stats.tokens += 1
            if trace is not None:
                trace.add_token(seq.index, slot.pos, slot.preds)
            if token == model.eos_id or len(seq.out) >= seq.max_new_tokens:
                _flush(seq, 0, cache, stats, mispredicted=False)
                seq.done = True
                return
            if succ is not None and succ.token != token:
                _flush(seq, 0, cache, stats, mispredicted=True)
                succ = None
            if succ is None:
                seq.slots.append(Slot(slot.pos + 1, token))
            continue  # the successor is now the oldest, at index 0
        guess = seq.speculation(slot)
        if succ is not None and succ.token != guess and should_flush(invalidation, depth, M):
            _flush(seq, i + 1, cache, stats, mispredicted=True)
            succ = None
        if (
            succ is None
            and should_launch(depth, launch_loop)
            and guess != model.eos_id
            and slot.pos + 1 < seq.max_new_tokens
        ):
            seq.slots.append(Slot(slot.pos + 1, guess))
        i += 1


def _flush(seq: Sequence, start: int, cache: KVCache, stats: DecodeStats, mispredicted: bool) -> None:
    """Drop in-flight slots from index ``start`` on and invalidate their cache entries."""
    dropped = seq.slots[start:]
    if not dropped:
        return
    del seq.slots[start:]
    cache.invalidate(seq.row, dropped[0].pos)
    stats.wasted_rows += sum(len(s.preds) for s in dropped)
    stats.flushes += int(mispredicted)
