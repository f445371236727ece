"""The engine's decoding state: a request's ``RequestState`` (its decisions) beside its ``RequestCounts`` (counters,
timings, records), its ``InFlight`` tokens and their ``Exit``s."""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import NamedTuple

from speed.engine.gate import GateRun
from speed.engine.policies import LaunchRule
from speed.engine.sampling import Draw, TokenLogprob
from speed.engine.trace import TraceBuilder
from speed.engine.types import Request


class Exit(NamedTuple):
    """What one finished loop's early exit decided for an in-flight token (``NO_EXIT`` tokens and a nan
    probability when the exit was not evaluated)."""

    pred: int  # the prediction: the exit's draw (greedy: its argmax)
    runner_up: int  # the second-best token
    p_top: float  # the prediction's probability: the exit's confidence
    mode: int  # the noise-free argmax (= pred when greedy)


@dataclass
class InFlight:
    """A token in flight at decoder position ``pos`` with input ``token``: launched, not yet committed."""

    pos: int
    token: int
    exits: list[Exit] = field(default_factory=list)  # one per finished loop, in loop order
    ahead: int = 0  # uncommitted tokens ahead of it when launched: 0 on the committed path, else its draft position
    logprob: TokenLogprob | None = None  # after its last loop, when the request asked for logprobs
    lane: list[InFlight] = field(default_factory=list)  # its branch at pos + 1 (from its runner-up) and the
    # branch's own successors at pos + 2, ...; empty: no branch
    side: int = -1  # a lane token's side entry in the cache (its own key/value); -1 on the chain
    up: tuple[tuple[int, int], ...] = ()  # a lane token's earlier lane tokens, (pos, side entry), oldest first
    gate: GateRun | None = None  # an exit_gate request's token: its running exit pdf (``speed.engine.gate``)
    key: int = field(default_factory=itertools.count().__next__, compare=False, repr=False)  # unique for the
    # process: where the executor keeps its hidden state (never reused, so a new token never finds an old one's)

    @property
    def loops_done(self) -> int:
        """Its finished loops (0..M)."""
        return len(self.exits)

    @property
    def preds(self) -> list[int]:
        """Each finished loop's prediction, in loop order."""
        return [e.pred for e in self.exits]


@dataclass(kw_only=True)
class RequestCounts:
    """What is counted, timed and recorded of one request for its ``RequestStats`` and its trace: written as its
    rows run and its tokens commit (``Scheduler.update``, ``speed.engine.outputs``), never read by a decision."""

    added: float  # perf_counter at add
    admitted: float = float("nan")
    first_token: float = float("nan")
    steps: int = 0
    rows: int = 0
    flushes: int = 0
    wasted_rows: int = 0
    promotions: int = 0
    flips: list[int] = field(default_factory=list)  # per loop: committed tokens whose exit there differed
    drafts: int = 0  # speculative launches at draft position 1, chain or lane (RequestStats)
    draft_tokens: list[int] = field(default_factory=list)  # speculative launches (chain, lanes) by draft position - 1
    accepted: list[int] = field(default_factory=list)  # committed draft tokens by draft position - 1
    trace: TraceBuilder | None = None
    logprobs: list[TokenLogprob] | None = None  # per committed token, when the request asked for them
    exit_loops: list[int] = field(default_factory=list)  # exit_gate: each committed token's exit loop (1-based)


@dataclass
class RequestState(RequestCounts):
    """One request's decoding state, from ``add`` until it leaves: what the scheduler decides from and changes
    (its counters, timings and records are the ``RequestCounts`` fields, keyword-only)."""

    id: int
    request: Request
    launch: LaunchRule  # when its tokens may launch successors (sequential: launch loop M, so never early)
    all_exits: bool  # every loop's exit is evaluated (SPEED, or a traced sequential request)
    slot: int = -1  # its engine slot (its place in the KV cache and the encoder memory); -1 while queued
    out: list[int] = field(default_factory=list)  # committed tokens
    chain: list[InFlight] = field(default_factory=list)  # in flight, oldest first; chain[i+1] launched from chain[i]
    side_free: list[int] = field(default_factory=list)  # a heap of its slot's side entries its branches may take
    done: bool = False
    last_served: int = -1  # the last step that computed its committed-path row (budget fairness)
    idle: int = 0  # steps it ran closed since it last drafted (the cost model's evidence decays: survival_rate)

    def guess(self, t: InFlight) -> int:
        """The prediction to speculate from (its successor's token): the oracle's token if forced, else the latest
        exit's draw (coupled) or its argmax."""
        oracle = self.request.oracle
        if oracle is not None and t.pos < len(oracle):
            return oracle[t.pos]
        latest = t.exits[-1]
        return latest.pred if self.request.sampling.coupled else latest.mode

    def draw(self, t: InFlight) -> Draw | None:
        """What the token's exits need to decide: None for plain greedy (the raw logits' argmax)."""
        sampling = self.request.sampling
        if sampling.plain:
            return None
        history = None
        if sampling.penalized:  # the committed tokens, then the token's in-flight predecessors
            history = self.out + [c.token for c in self.chain[1 : t.pos - len(self.out) + 1]]
        return Draw(sampling, t.pos, history)

    def in_flight(self) -> list[InFlight]:
        """Every token that computes rows: the chain, then the lanes (by their parent, oldest first)."""
        return [*self.chain, *(t for c in self.chain for t in c.lane)]
