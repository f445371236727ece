"""Speculation that replays a model's flips: a ``Stepper`` (``ReplayStepper``) whose early exits agree with the final
token exactly where a recorded model's did (``FlipPattern``), so that a model of any shape, random weights included,
decodes with that model's schedule of launches and flushes, and costs what its flips would cost at this shape.

SPEED's schedule (plain speculation: a launch loop, eager or final invalidation, no branches, no confidence gate,
greedy) depends only on which of a token's loop predictions equal its final token and which equal each other. A
pattern keeps exactly that: per token, one code per loop, 0 where the loop's prediction is the final token, ``STOP``
where it is a stop token (nothing launches from one), else k > 0 for the k-th distinct wrong prediction of that
token. The stepper knows each prompt's final tokens (a sequential decoding of it first, the oracle's) and rewrites
each early exit's logits so that its argmax is the final token where the code is 0, the stop token for ``STOP``, and
otherwise the recorded wrong prediction (a trace's, where it is a token of this model other than the final one) or
the k-th token of ``WRONG_FROM``, ``WRONG_FROM + 1``, ... that is not the final one. The last loop's logits are never
touched: the committed tokens are the model's own, and a wrong guess is flushed as any flip is, so the output equals
sequential decoding's. A token launched from a wrong guess keeps the model's own exits (a trace records committed
tokens only), so a model's own trace replayed on it reproduces its SPEED exactly: steps, flushes and rows.

Plain speculation only: runner-up branches would branch on the rewritten exits' runner-up, and a sampled exit draws
from the rewritten logits; the payoff map decodes greedily without branches.

A pattern comes from a trace (``TRACE_SCHEMA`` rows with any key columns beside them: ``trace.parquet`` of an
evaluation, a Serve replica's traces; ``from_trace``) or from per-loop agreement rates and a seed (``from_rates``;
``agreement_profile`` makes the rates from a loop-1 agreement). A trace of a model with another loop count is mapped
onto the stepper's loops by fraction of depth (``depth_map``), and the pattern's ``source`` says so.

A server knows no prompt's final tokens before it answers it: a learning stepper (``learn``) takes them from its
first decoding of each prompt and replays every later one; ``ReplayModel`` hands such a stepper to a Serve replica
(``speed.benchmarks.serving``, ``jobs/bench_serve.py --shape``).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import torch
from torch import Tensor

from speed.engine import Admitted, as_stepper
from speed.engine.cache import KVCache, Rows
from speed.engine.observer import StepObserver
from speed.engine.trace import TRACE_SCHEMA

STOP = -1  # a loop's code where the recorded prediction was a stop token
WRONG_FROM = 3  # wrong guesses are tokens from here on (below it: pad, EOS, unknown in the platform's vocabularies)

# The platform's most trained model's disagreement with its last loop, by loop, relative to loop 1's: the demo's
# 2x6 T5 finetuned 1600 steps on Multi30k (docs/payoff.md: loops 1..5 disagree .306 .204 .127 .070 .034), at depth
# fractions 1/6 .. 6/6. The 2x3 T5 and LM of docs/models.md fall in with it (loop 2 of 3: .41 and .44 of loop 1's).
TRAINED_PROFILE: tuple[tuple[float, float], ...] = (
    (1 / 6, 1.0), (2 / 6, 0.204 / 0.306), (3 / 6, 0.127 / 0.306), (4 / 6, 0.070 / 0.306), (5 / 6, 0.034 / 0.306),
    (1.0, 0.0),
)  # fmt: skip


def depth_map(source_loops: int, n_loops: int) -> tuple[int, ...]:
    """For each of ``n_loops`` loops (1-based, in order), the loop of a ``source_loops``-loop model at the nearest
    fraction of depth (l / n_loops against k / source_loops; a tie goes to the shallower, whose exits agree less);
    the last loop is always the last."""
    return tuple(max(1, int(np.ceil(loop * source_loops / n_loops - 0.5))) for loop in range(1, n_loops + 1))


def agreement_profile(
    loop1: float, n_loops: int, profile: Sequence[tuple[float, float]] = TRAINED_PROFILE
) -> list[float]:
    """Per loop 1..``n_loops``: the share of tokens whose prediction there is the final token, ``loop1`` at loop 1
    and 1 at the last; the disagreement in between falls as ``profile``'s (depth fraction, disagreement relative to
    its first point) does, interpolated linearly at l / ``n_loops`` and scaled so that loop 1 is ``1 - loop1``."""
    if not 0.0 <= loop1 <= 1.0:
        raise ValueError(f"loop-1 agreement must be in [0, 1], got {loop1}")
    xs, ys = zip(*profile)
    rel = np.interp([loop / n_loops for loop in range(1, n_loops + 1)], xs, ys)
    rel = rel / rel[0] if rel[0] > 0 else rel
    agree = [1.0 - (1.0 - loop1) * float(r) for r in rel]
    agree[-1] = 1.0
    return agree


@dataclass(frozen=True)
class FlipPattern:
    """Per sequence, per output position, one code per loop (see the module doc): what a replay reproduces.

    ``codes[s]`` is an int8 array (positions, n_loops); ``source`` says where it came from, with the loop mapping
    when the recorded model's loop count differs; ``loop_map`` the recorded loop behind each of ours (1-based)."""

    codes: tuple[np.ndarray, ...]
    n_loops: int
    source: str
    loop_map: tuple[int, ...]
    recorded: tuple[np.ndarray, ...] | None = None  # a trace's: each loop's recorded prediction, as ``codes``

    def __post_init__(self) -> None:
        if not self.codes or any(c.ndim != 2 or c.shape[1] != self.n_loops or not len(c) for c in self.codes):
            raise ValueError(f"a flip pattern needs sequences of positions x {self.n_loops} loop codes")

    def sequence(self, index: int, length: int) -> np.ndarray:
        """``length`` positions' codes for the ``index``-th prompt: sequence ``index`` (mod the count), continued
        into the following sequences where it is shorter."""
        return _cycle(self.codes, index, length)

    def predictions(self, index: int, length: int) -> np.ndarray | None:
        """The recorded predictions behind ``sequence(index, length)`` (None: drawn from rates, none recorded)."""
        return None if self.recorded is None else _cycle(self.recorded, index, length)

    def agreement(self) -> list[float]:
        """Per loop: the share of the pattern's tokens that agree with the final token there."""
        codes = np.concatenate(self.codes)
        return (codes == 0).mean(axis=0).tolist()

    @classmethod
    def from_trace(cls, trace: pa.Table, n_loops: int, stop_ids: frozenset[int] = frozenset(), name: str = "trace"):
        """The pattern of a recorded decoding: ``trace`` holds ``TRACE_SCHEMA``'s columns (and any key columns
        besides, e.g. an evaluation's ``example``, a replica's ``request_id``: a sequence is each distinct key),
        mapped onto ``n_loops`` loops by fraction of depth; ``stop_ids``: the recorded model's stop tokens."""
        missing = {"position", "loop", "prediction", "token"} - set(trace.column_names)
        if missing:
            raise ValueError(f"{name}: not a flip trace (no {', '.join(sorted(missing))} column)")
        source_loops = int(pc.max(trace["loop"]).as_py())
        keys = [c for c in trace.column_names if c not in TRACE_SCHEMA.names] + ["sequence"]
        keys = [k for k in dict.fromkeys(keys) if k in trace.column_names]
        trace = trace.sort_by([(k, "ascending") for k in keys] + [("position", "ascending"), ("loop", "ascending")])
        loops = trace["loop"].to_numpy()
        if len(trace) % source_loops or not (loops.reshape(-1, source_loops) == np.arange(1, source_loops + 1)).all():
            raise ValueError(f"{name}: every token needs a prediction at each of loops 1..{source_loops}")
        preds = trace["prediction"].to_numpy().reshape(-1, source_loops)
        final = trace["token"].to_numpy().reshape(-1, source_loops)[:, -1]
        codes = _codes(preds, final, stop_ids)
        where = depth_map(source_loops, n_loops)
        mapped_loops = [loop - 1 for loop in where]
        codes, preds = codes[:, mapped_loops], preds[:, mapped_loops]
        first = np.ones(len(preds), dtype=bool)  # each sequence's rows start where its key changes
        if keys:
            key_rows = [trace[k].to_numpy(zero_copy_only=False)[::source_loops] for k in keys]
            first[1:] = np.any([k[1:] != k[:-1] for k in key_rows], axis=0)
        starts = np.flatnonzero(first).tolist() + [len(preds)]
        seqs = tuple(codes[a:b] for a, b in zip(starts, starts[1:]))
        recorded = tuple(preds[a:b].astype(np.int64) for a, b in zip(starts, starts[1:]))
        mapped = "" if source_loops == n_loops else (
            f", its {source_loops} loops mapped onto {n_loops} by fraction of depth (loops {','.join(map(str, where))})"
        )  # fmt: skip
        return cls(seqs, n_loops, f"{name} ({len(seqs)} sequences, {len(preds)} tokens){mapped}", where, recorded)

    @classmethod
    def from_rates(cls, agreement: Sequence[float], sequences: int, length: int, seed: int, name: str = "rates"):
        """A pattern drawn from per-loop agreement rates (non-decreasing, the last 1): each token settles at a loop
        S, agrees from there on, and before it predicts a different wrong token at every loop (each early loop's
        flip flushes: the most rows a settling token can cost). The share of tokens with S <= l is
        ``agreement[l - 1]`` to the nearest token (a stratified draw: even a short run replays the rates), their
        places shuffled by ``seed``."""
        rates = np.asarray(agreement, dtype=float)
        if len(rates) < 2 or rates[-1] != 1.0 or (np.diff(rates) < 0).any() or rates[0] < 0:
            raise ValueError(f"agreement rates must rise to 1 at the last loop, got {list(agreement)}")
        n, total = len(rates), sequences * length
        counts = np.diff(np.round(np.concatenate([[0.0], rates]) * total).astype(np.int64))  # tokens settling there
        settle = np.random.default_rng(seed).permutation(np.repeat(np.arange(n), counts)).reshape(sequences, length)
        loop = np.arange(n)
        codes = np.where(loop < settle[..., None], loop + 1, 0).astype(np.int8)  # (sequences, length, n)
        label = ", ".join(f"{a:.3f}" for a in rates)
        return cls(tuple(codes), n, f"{name}: agreement by loop {label}, seed {seed}", tuple(range(1, n + 1)))


def _cycle(arrays: tuple[np.ndarray, ...], index: int, length: int) -> np.ndarray:
    """``length`` rows from ``arrays[index]`` (index mod their count) on, continued into the following arrays."""
    out, s = [], index % len(arrays)
    while sum(map(len, out)) < length:
        out.append(arrays[s])
        s = (s + 1) % len(arrays)
    return np.concatenate(out)[:length]


def _codes(preds: np.ndarray, final: np.ndarray, stop_ids: frozenset[int]) -> np.ndarray:
    """(tokens, loops) codes of predictions against each token's final one (see the module doc)."""
    codes = np.zeros(preds.shape, dtype=np.int8)
    for i, (row, tok) in enumerate(zip(preds.tolist(), final.tolist())):
        wrong: dict[int, int] = {}
        for loop, p in enumerate(row):
            if p != tok:
                codes[i, loop] = STOP if p in stop_ids else wrong.setdefault(p, len(wrong) + 1)
    return codes


@dataclass
class ReplayStepper(StepObserver):
    """A ``Stepper`` that forwards to ``model``'s and rewrites its early exits' logits to replay ``pattern`` on the
    prompts of ``finals`` (each prompt's final tokens, in order: the i-th prompt replays the pattern's i-th
    sequence). Only rows on the right path are rewritten: a token whose input, and every in-flight input before
    it, is the final token there (the stepper reads each row's input token off its embedding at its first loop);
    a token launched from a wrong guess keeps the model's own exits, as a recorded model's would be its own (a
    trace records committed tokens only). A prompt not in ``finals``, and positions past its final tokens, keep
    the model's own exits too.

    With ``learn``, a prompt's final tokens are learnt from any decoding of it (a last loop's row is always a
    committed token: loops finish in chain order), so a server replays the prompts it has answered once: its first
    answer is the model's own, every later one replays (each new prompt takes the pattern's next sequence).

    ``passes`` records every group pass after admission as (rows, rows scored): the schedule it ran, whose
    measured cost the payoff map sets its time against; ``spans`` each pass's (start, end) on ``time.perf_counter``
    (on a CUDA device the host's: a pass is queued, not run, when it returns)."""

    model: Any
    finals: dict[tuple[int, ...], list[int]]
    pattern: FlipPattern | None  # None: no rewriting (a sequential baseline's passes recorded alike)
    learn: bool = False
    passes: list[tuple[int, int]] = field(default_factory=list)
    spans: list[tuple[float, float]] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.model = as_stepper(self.model)
        if self.pattern is not None and self.pattern.n_loops != self.model.n_loops:
            raise ValueError(f"a pattern of {self.pattern.n_loops} loops replayed on {self.model.n_loops}")
        self.finals = {tuple(p): list(f) for p, f in self.finals.items()}
        self._index = {p: i for i, p in enumerate(self.finals)}
        self._slots: dict[int, _SlotReplay] = {}
        self._embedded: dict[bytes, int] = {}  # the last ``embed`` call's rows: their bytes -> token
        self._max_len = 0  # output positions per request (the engine's cache's)
        self._began = 0.0  # the running pass's start

    def cache(self, n_slots: int, max_prompt_len: int, max_len: int, side: bool = True, **pool: int) -> KVCache:
        self._max_len = max(self._max_len, max_len)
        return self.model.cache(n_slots, max_prompt_len, max_len, side, **pool)

    def embed(self, tokens: Tensor) -> Tensor:
        """The model's embedding of ``tokens``, each row remembered by its bytes: a row at its first loop is then
        known by its input token."""
        out = self.model.embed(tokens)
        self._embedded = {_key(row): t for row, t in zip(out, tokens.tolist())}
        return out

    def after_admit(self, slot: int, prompt: Tensor, admitted: Admitted) -> None:
        """The slot takes its prompt's replay, and a prefill's exits of output position 0 are rewritten (or learnt)
        as any step's."""
        self._slots[slot] = self._slot_replay(tuple(prompt.tolist()))
        if admitted.exits is not None:
            M = len(admitted.exits)
            self._replay(admitted.exits, [slot] * M, list(range(M)), [0] * M)

    def before_step(self, rows: Rows, hidden: Tensor) -> None:
        """Notes the pass's start, and each row's input token at a token's first loop (by its embedding's bytes)."""
        self._began = time.perf_counter()
        if self.pattern is not None:
            for r in np.flatnonzero(rows.loop == 0).tolist():
                replay = self._slots.get(int(rows.slot[r]))
                if replay is not None and rows.pos[r] < len(replay.inputs):
                    replay.inputs[rows.pos[r]] = self._embedded.get(_key(hidden[r]), -1)

    def after_step(self, rows: Rows, logits: Tensor | None, logit_rows: Sequence[int] | None) -> None:
        """Records the pass, rewrites its right-path early exits' logits to the pattern's guesses, and records its
        span (the rewriting in it: the replay's cost, not the engine's)."""
        self.passes.append((len(rows), 0 if logits is None else len(logits)))
        if logits is not None and self.pattern is not None:
            at = list(range(len(rows))) if logit_rows is None else list(logit_rows)
            self._replay(logits, rows.slot[at].tolist(), rows.loop[at].tolist(), rows.pos[at].tolist())
        self.spans.append((self._began, time.perf_counter()))  # the replay's own work inside: not the engine's

    def _slot_replay(self, prompt: tuple[int, ...]) -> _SlotReplay | None:
        """What a slot holding ``prompt`` replays (None: nothing, the model's own exits)."""
        if self.pattern is None or (prompt not in self.finals and not self.learn):
            return None
        final = self.finals.setdefault(prompt, [])
        i = self._index.setdefault(prompt, len(self._index))
        n = max(len(final), self._max_len)
        recorded = self.pattern.predictions(i, n)
        return _SlotReplay(
            self.pattern.sequence(i, n)[:, :-1].astype(np.int64),
            None if recorded is None else recorded[:, :-1],
            final,
            np.full(n, -1, dtype=np.int64),
        )

    def _replay(self, logits: Tensor, slots: list[int], loops: list[int], positions: list[int]) -> None:
        """Learn each last-loop row's token (``learn``), and make each right-path early-loop row's argmax its guess:
        that token's logit raised above the row's largest."""
        M, eos, vocab = self.model.n_loops, self.model.eos_id, self.model.vocab_size
        rows, tokens = [], []
        for r, (slot, loop, pos) in enumerate(zip(slots, loops, positions)):
            replay = self._slots.get(slot)
            if replay is None:
                continue
            if loop == M - 1:
                if self.learn and pos == len(replay.final):
                    replay.final.append(int(logits[r].argmax()))
            elif replay.right(pos):
                rows.append(r)
                tokens.append(replay.guess(pos, loop, eos, vocab))
        if not rows:
            return
        r, t = torch.tensor(rows, device=logits.device), torch.tensor(tokens, device=logits.device)
        top = logits[r].amax(dim=-1)
        logits[r, t] = top + top.abs().clamp_min(1.0)  # strictly above the row's largest, in any float dtype


@dataclass
class _SlotReplay:
    """One slot's replay: ``codes`` (positions, M - 1) each early loop's code, ``recorded`` the recorded predictions
    behind them (None: none), ``final`` the prompt's final tokens (known so far), ``inputs`` each position's latest
    input token (-1: not seen)."""

    codes: np.ndarray
    recorded: np.ndarray | None
    final: list[int]
    inputs: np.ndarray

    def right(self, pos: int) -> bool:
        """Whether the final token at ``pos`` is known and the token there, and every one before it, took the right
        input (position p's: the final token at p - 1; position 0's is whatever starts it)."""
        if pos >= len(self.final) or pos >= len(self.inputs):
            return False
        return all(self.inputs[p] == self.final[p - 1] for p in range(1, pos + 1))

    def guess(self, pos: int, loop: int, eos: int, vocab: int) -> int:
        """Loop ``loop``'s token at ``pos``: the final one where its code is 0, the stop token for ``STOP``, else
        the recorded wrong token where every wrong one at ``pos`` is a token of this model other than the final
        and the stop token, else the k-th token from ``WRONG_FROM`` that is not the final one."""
        code, final = int(self.codes[pos, loop]), self.final[pos]
        if code == 0:
            return final
        if code == STOP:
            return eos
        if self.recorded is not None:
            wrong = [int(t) for c, t in zip(self.codes[pos], self.recorded[pos]) if c > 0]
            if all(t < vocab and t not in (final, eos) for t in wrong):
                return int(self.recorded[pos, loop])
        token = WRONG_FROM + code - 1
        return token + (token >= final)


def _key(row: Tensor) -> bytes:
    """A hidden row's bytes (any dtype): equal rows, equal keys."""
    return row.detach().contiguous().view(torch.uint8).cpu().numpy().tobytes()


class ReplayModel:
    """What a server decodes with instead of a family's model: ``model`` (in eval mode) whose stepper replays
    ``pattern`` on every prompt it has answered once (one learning ``ReplayStepper``, kept across the engines a
    server rebuilds); its config and loops are the model's."""

    training = False

    def __init__(self, model: torch.nn.Module, pattern: FlipPattern) -> None:
        self.model = model
        self.config = model.config
        self.n_loops = model.n_loops
        self._stepper = ReplayStepper(model, {}, pattern, learn=True)

    def stepper(self) -> ReplayStepper:
        """The replaying stepper (the same one every time)."""
        return self._stepper
