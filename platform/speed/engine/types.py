"""What crosses the engine's boundary: the ``Stepper`` it drives, its config, a request (with SPEED's settings) and
what comes back."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import InitVar, dataclass, field, fields
from typing import Any, Literal, NamedTuple, Protocol, get_args

import pyarrow as pa
from torch import Tensor

from speed.engine.cache import KVCache, Rows
from speed.engine.cost import RowCost
from speed.engine.memory import MemoryNeed
from speed.engine.sampling import Sampling, TokenLogprob

Method = Literal["sequential", "speed", "exit_gate"]  # exit_gate: Ouro's own exits, a lossy baseline (ExitRule)
Invalidation = Literal["eager", "final"]
ExitKind = Literal["threshold", "step", "mix"]
METHODS: tuple[Method, ...] = get_args(Method)  # the names every layer checks against
INVALIDATIONS: tuple[Invalidation, ...] = get_args(Invalidation)
EXIT_KINDS: tuple[ExitKind, ...] = get_args(ExitKind)

NO_EXIT = -1  # prediction of a loop whose early exit was not evaluated (sequential decoding without a trace)


class Admitted(NamedTuple):
    """What admitting a request's prompt into its slot gives the engine: output position 0's row."""

    token: int  # the input of the row that predicts output position 0: T5's start token, an LM's last prompt token
    exits: Tensor | None  # (M, V) that row's logits of every loop, when admission computed them (a decoder-only
    # prefill); None: the engine runs the row through its M loops as any other
    gates: Tensor | None = None  # (M,) that row's exit-gate lambdas beside ``exits``, from a gated model's stepper


class Stepper(Protocol):
    """What the engine needs from a looped decoder (a model hands out its own with ``model.stepper()``:
    ``speed.models.t5_stepper.T5Stepper``, ``speed.models.lm_stepper.LMStepper``).

    Positions in ``Rows`` are output positions (the row at position p predicts output token p); where a
    prompt occupies the cache too (a decoder-only LM), the stepper places them after it.
    """

    n_loops: int
    eos_id: int
    vocab_size: int

    def cache(
        self, n_slots: int, max_prompt_len: int, max_len: int, side: bool = True, blocks: int | None = None
    ) -> KVCache:
        """An empty cache for ``n_slots`` requests; the runner-up branches' side entries only if ``side``; a pool of
        ``blocks`` blocks (None: every slot at its longest). What it returns offers ``n_blocks`` and
        ``blocks_needed(prompt_len, max_new_tokens)`` (a request's worst case, reserved at admission) besides the
        ``KVCache`` methods the scheduler calls; the engine passes ``blocks`` only when it has one to ask for."""
        ...

    def memory_need(
        self, n_slots: int, max_prompt_len: int, max_len: int, side: bool = True, blocks: int | None = None
    ) -> MemoryNeed:
        """What ``cache`` and ``memory`` of this capacity allocate, and the weights, computed without allocating.
        Optional: the engine checks the memory of a stepper that has it (a model's), and builds a stub's as asked."""
        ...

    def memory(self, capacity: int, max_prompt_len: int, max_len: int) -> Any: ...

    def admit(self, memory: Any, cache: KVCache, slots: Sequence[int], prompts: Sequence[Tensor]) -> list[Admitted]:
        """Admit the prompts (each (P,)) admitted in one step into their empty slots; one ``Admitted`` each.
        What a request's admission leaves and gives must not depend on the others admitted with it."""
        ...

    def embed(self, tokens: Tensor) -> Tensor: ...

    def step(
        self,
        memory: Any,
        cache: KVCache,
        rows: Rows,
        hidden: Tensor,
        with_logits: bool = True,
        logit_rows: Sequence[int] | None = None,
    ) -> tuple[Tensor, Tensor | None]:
        """One group pass, the model's call in a pipeline step: the shared N-layer group once over R rows, each at
        its own loop; ``hidden`` (R, d) the rows' inputs. Returns their outputs (R, d) and, if asked, the
        early-exit logits (K, V) of the rows ``logit_rows`` names (ascending indices; None: all R), each row's the
        same bits whichever rows are scored. The engine passes ``logit_rows`` only when some rows but not all need
        their exits (a stub that never gets a part may leave it out). (The engine's own step is ``Engine.step``,
        which makes one such call.)

        A stepper whose model has an exit gate (Ouro's) says ``gated = True`` and offers ``step_gated(memory,
        cache, rows, hidden, logit_rows=None)``: the same pass, returning (outputs (R, d), logits (K, V), lambdas
        (R,)), each row's lambda = sigmoid(gate(its exit state)), row-invariant as the logits; its ``admit`` fills
        ``Admitted.gates``. The engine asks for it only in steps holding ``exit_gate`` requests."""
        ...


def as_stepper(model: Stepper | Any) -> Stepper:
    """The ``Stepper`` of ``model``: what its ``stepper()`` hands out (a model of a family), else ``model`` as it
    is (a stub, a ``LogitRecorder``, a stepper). The engine asks this of what it is given, and imports no model."""
    make = getattr(model, "stepper", None)
    return make() if callable(make) else model


@dataclass(frozen=True)
class EngineConfig:
    """Fixed capacity, chosen at construction."""

    max_active: int = 16  # requests decoded at once: engine slots, each a place in the KV cache and the memory
    max_prompt_len: int = 128  # prompt tokens per request (T5: encoder tokens; an LM: its context); longer: an error
    max_target_len: int = 128  # output positions per request (max_new_tokens <= this)
    row_budget: int | None = None  # rows per step; None: every in-flight row. Committed-path rows go first
    cost_model: bool = False  # each step runs the speculative rows this device's measured pass cost says pay
    # (speed.engine.cost; the row budget still caps them); False: every in-flight row, or the row budget's
    trace: bool = True  # per-request flip traces (sequential requests then evaluate every loop's exit)
    branches: bool = True  # runner-up branches allowed: the cache holds their side entries (False: none, smaller)
    # key/value blocks in the cache's pool (ATTN_CHUNK positions of one request at every virtual layer each); None:
    # max_active requests at their longest, capped by the memory available. A request waits until its worst case
    # (prompt + max_new_tokens positions) is free, and one that could never fit is refused at add
    kv_blocks: int | None = None
    # the group pass in row-count buckets over static buffers (speed.engine.graphs): padded rows in a scratch slot,
    # each bucket's pass captured as a CUDA graph; None: on a CUDA device for a stepper that can be captured
    # (``capturable``), else unpadded passes; True: on any device, captured where it can be (the CPU runs the same
    # bookkeeping eagerly); False: never
    graphs: bool | None = None
    max_source_len: InitVar[int | None] = None  # max_prompt_len's T5 name, still accepted (it wins when given)

    def __post_init__(self, max_source_len: int | None) -> None:
        if max_source_len is not None:
            object.__setattr__(self, "max_prompt_len", max_source_len)
        for name in ("max_active", "max_prompt_len", "max_target_len"):
            if getattr(self, name) < 1:
                raise ValueError(f"EngineConfig.{name} must be at least 1, got {getattr(self, name)}")
        if self.kv_blocks is not None and (type(self.kv_blocks) is not int or self.kv_blocks < 1):
            raise ValueError(f"EngineConfig.kv_blocks must be at least 1 or None, got {self.kv_blocks!r}")
        if self.graphs not in (None, True, False):
            raise ValueError(f"EngineConfig.graphs must be None, True or False, got {self.graphs!r}")
        if self.row_budget is not None and self.row_budget < 1:
            raise ValueError(f"EngineConfig.row_budget must be at least 1 or None, got {self.row_budget}")


@dataclass(frozen=True)
class Speculation:
    """SPEED's settings: when a token launches its successor, when a misprediction flushes, runner-up branches.

    The one definition every layer uses (``generate``, ``EvalConfig``, Serve's settings and request fields, the
    sweep, the benchmarks); flags, YAML and HTTP fields of the same names map onto it. Only what needs no model is
    checked here; the bounds that are the model's loops (M) are checked by the engine's ``add``. Sequential
    decoding ignores it (nothing launches before a token's last loop).
    """

    launch_loop: int = 1  # loops a token runs before its successor launches from its prediction (1..M)
    invalidation: Invalidation = "eager"  # a disagreeing prediction flushes at once, or only at the last loop
    branches: int = 0  # runner-up branches in flight at once (0..M; 0: none): see the module doc
    branch_depth: int = 1  # tokens a branch's lane may hold (1..M; 1: the branch launches no successor)
    branch_below: float = 1.0  # a token carries a branch only while its exit's top-1 probability is below this
    min_confidence: float = 0.0  # a successor launches only from an exit whose top-1 probability is at least this

    def __post_init__(self) -> None:
        for name, low in _COUNTS:
            value = getattr(self, name)
            if type(value) is not int or value < low:
                raise ValueError(f"{name} must be an integer >= {low}, got {value!r}")
        if self.invalidation not in INVALIDATIONS:
            raise ValueError(f"invalidation must be one of {INVALIDATIONS}, got {self.invalidation!r}")
        if not _number(self.branch_below) or not 0.0 < self.branch_below <= 1.0:
            raise ValueError(f"branch_below must be a number in (0, 1], got {self.branch_below!r}")
        if not _number(self.min_confidence) or not 0.0 <= self.min_confidence <= 1.0:
            raise ValueError(f"min_confidence must be a number in [0, 1], got {self.min_confidence!r}")

    def check_loops(self, n_loops: int) -> None:
        """``ValueError`` unless a model of ``n_loops`` loops (M) can honour these settings."""
        for name, low in _COUNTS:
            if getattr(self, name) > n_loops:
                raise ValueError(f"{name} must be in {low}..{n_loops} (the model's loops), got {getattr(self, name)!r}")


_COUNTS = (("launch_loop", 1), ("branches", 0), ("branch_depth", 1))  # Speculation's counts: least value; most: M

# SPEED's settings by name, in order: what configs, flags, request bodies and result rows spell out field by field
LEVERS: tuple[str, ...] = tuple(f.name for f in fields(Speculation))


def _number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


@dataclass(frozen=True, kw_only=True)
class SpeculationFields:
    """``Speculation``'s fields one by one, with its defaults, for a config whose flags or keys name them
    (``EvalConfig``, ``ServeSettings``): ``speculation`` is the ``Speculation`` they make, checked when the config
    is made. Keyword-only, so they follow the config's own fields."""

    launch_loop: int = Speculation.launch_loop
    invalidation: Invalidation = Speculation.invalidation
    branches: int = Speculation.branches
    branch_depth: int = Speculation.branch_depth
    branch_below: float = Speculation.branch_below
    min_confidence: float = Speculation.min_confidence

    def __post_init__(self) -> None:
        try:
            _ = self.speculation
        except ValueError as err:
            raise ValueError(f"{type(self).__name__}: {err}") from None

    @property
    def speculation(self) -> Speculation:
        """SPEED's settings these fields make."""
        return Speculation(**{name: getattr(self, name) for name in LEVERS})


@dataclass(frozen=True)
class ExitRule:
    """How an ``exit_gate`` request picks each token's logits from Ouro's exit gate (``OuroForCausalLM.forward``'s
    options). Every loop still runs: lambda_t = sigmoid(gate(h_t)), the exit pdf p_t = lambda_t * prod_{j<t}
    (1 - lambda_j), the last loop taking the rest. A lossy baseline beside SPEED, never exact w.r.t. full depth.

    ``threshold`` (Ouro's ``exit_threshold``): the logits of the first loop whose cumulative pdf reaches
    ``threshold``, else the last's; ``step`` (``exit_at_step``): loop ``step``'s (0-based, as Ouro counts);
    ``mix`` (``use_weighted_exit``): sum_t p_t * logits_t.
    """

    kind: ExitKind = "threshold"
    threshold: float = 1.0  # kind "threshold": the cumulative exit probability to reach, in (0, 1]
    step: int = 0  # kind "step": the 0-based loop whose logits decide (0..M-1)

    def __post_init__(self) -> None:
        if self.kind not in EXIT_KINDS:
            raise ValueError(f"exit rule kind must be one of {EXIT_KINDS}, got {self.kind!r}")
        if not _number(self.threshold) or not 0.0 < self.threshold <= 1.0:
            raise ValueError(f"exit rule threshold must be a number in (0, 1], got {self.threshold!r}")
        if type(self.step) is not int or self.step < 0:
            raise ValueError(f"exit rule step must be an integer >= 0, got {self.step!r}")

    def check_loops(self, n_loops: int) -> None:
        """``ValueError`` unless a model of ``n_loops`` loops (M) has the loop ``step`` names."""
        if self.kind == "step" and self.step >= n_loops:
            raise ValueError(
                f"exit rule step must be in 0..{n_loops - 1} (the model's loops, 0-based), got {self.step}"
            )


@dataclass(frozen=True)
class Request:
    """One decoding request."""

    input_ids: list[int]  # the prompt: T5's encoder ids (EOS-terminated as the tokenizer makes them), an LM's context
    max_new_tokens: int
    method: Method = "speed"
    speculation: Speculation = Speculation()  # SPEED's settings (sequential decoding ignores them)
    oracle: list[int] | None = None  # benchmarks: speculate the known final tokens (SPEED only)
    sampling: Sampling = Sampling()  # greedy by default
    logprobs: int | None = None  # None: none; k in 0..20: each token's logprob and its k best alternatives
    stop_ids: frozenset[int] | None = None  # generation ends at any of these (an imported chat model's end of turn
    # besides its EOS: ``HFTokenizer.stop_ids``); None: at the model's ``eos_id``
    exit_rule: ExitRule | None = None  # method "exit_gate" only (and required there): how the gate picks logits


@dataclass
class DecodeStats:
    """Counters of one decoding run or of an engine's life (all requests together), written by the engine's
    scheduler alone. Runs' stats add with ``+`` (``sum(stats, DecodeStats())``): counts and ``exit_seconds`` sum,
    ``row_cost`` is the right-hand side's curve where it has one, else the left's (the one curve a process
    measures per model); ``since`` is the difference of two totals by the same rule."""

    tokens: int = 0  # committed output tokens
    # engine iterations: a SPEED (or exit_gate) step counts each; a step running only sequential requests' rows
    # counts when it ends a token (a row at its last loop): for sequential decoding in lockstep, token positions
    steps: int = 0
    group_passes: int = 0  # runs of the shared N-layer group, each reading its weights once
    rows: int = 0  # token-loops computed (a row = one token through one loop)
    flushes: int = 0  # misprediction restarts (each may drop several in-flight tokens)
    wasted_rows: int = 0  # rows spent on tokens that were flushed, fell past EOS or were cancelled, branches dropped
    promotions: int = 0  # mispredictions whose runner-up branch took over the chain (no restart)
    gated_tokens: int = 0  # committed tokens of exit_gate requests
    exit_loops: int = 0  # their exit loops (1-based) summed: the loop passes the gate asks for
    held_rows: int = 0  # in-flight rows a step left out (the row budget's or the cost model's choice)
    closed_steps: int = 0  # steps the cost model ran as sequential decoding: no speculative row, no early exits
    exit_rows: int = 0  # rows whose exit logits became exits (scores, draws, runner-ups) ...
    # measurements, not counts (two equal runs' stats compare equal without them):
    exit_seconds: float = field(default=0.0, compare=False)  # ... and the time that took (the cost model's clock:
    # CPU time on one thread, else the wall clock): the cost model's per-row
    # price of an exit beside the pass's
    row_cost: RowCost | None = field(default=None, compare=False)  # the cost model's pass cost by rows (None: none)

    def __add__(self, other: DecodeStats) -> DecodeStats:
        """These stats and ``other``'s together: every count and ``exit_seconds`` summed; ``row_cost`` other's
        where it has one, else these'."""
        if not isinstance(other, DecodeStats):
            return NotImplemented
        summed = {f.name: getattr(self, f.name) + getattr(other, f.name) for f in fields(self) if f.name != "row_cost"}
        return DecodeStats(**summed, row_cost=self.row_cost if other.row_cost is None else other.row_cost)

    def __neg__(self) -> DecodeStats:
        """Every count and ``exit_seconds`` negated, no curve: what ``since`` adds."""
        return DecodeStats(**{f.name: -getattr(self, f.name) for f in fields(self) if f.name != "row_cost"})

    def since(self, before: DecodeStats) -> DecodeStats:
        """The counts added after ``before`` (an earlier copy of these totals: ``dataclasses.replace``), as the
        stats of what ran in between (these totals' curve)."""
        return self + -before

    @property
    def mean_exit_loop(self) -> float:
        """The mean exit loop (1-based) of the exit_gate requests' tokens (nan if none)."""
        return self.exit_loops / self.gated_tokens if self.gated_tokens else float("nan")

    @property
    def tokens_per_pass(self) -> float:
        """Committed tokens per group pass: for one sequence 1/M sequential, up to 1 SPEED (x batch size)."""
        return self.tokens / self.group_passes if self.group_passes else 0.0


@dataclass
class RequestStats:
    """Counters and timings of one request (times in seconds from ``add``)."""

    tokens: int  # committed tokens
    steps: int  # engine steps that computed at least one of its rows
    rows: int  # its rows computed
    flushes: int
    wasted_rows: int
    flip_rate: list[float]  # per loop: share of committed tokens whose loop-i exit differs; [] if not evaluated
    queued_s: float  # until admitted to a slot
    ttft_s: float  # until its first token was committed (nan if none)
    latency_s: float  # until it finished or was cancelled
    # Speculation counted as vLLM counts drafts. A draft token is a token launched from an early exit
    # (before its predecessor's last loop), on the chain or in a runner-up lane; its draft position is how
    # many uncommitted tokens were ahead of it when it was launched (1..M-1). A draft is a launch at position
    # 1: the start of a speculative chain or lane. Accepted tokens are draft tokens later committed unchanged
    # (never flushed; a lane's once promoted). A flush can relaunch at any position, so per position the
    # acceptance rate is accepted / draft tokens there (not / drafts).
    drafts: int = 0
    draft_tokens: int = 0
    accepted_tokens: int = 0
    accepted_per_pos: list[int] = field(default_factory=list)  # accepted tokens by draft position 1..M-1
    draft_tokens_per_pos: list[int] = field(default_factory=list)  # draft tokens by draft position 1..M-1
    promotions: int = 0  # runner-up branches that became the chain
    exit_loops: list[int] = field(default_factory=list)  # exit_gate: each committed token's exit loop (1-based)


@dataclass
class Finished:
    """A request that left the engine: finished, or cancelled (its tokens so far)."""

    id: int
    tokens: list[int]  # the stop token included when produced
    stats: RequestStats
    trace: pa.Table | None  # speed.engine.trace.TRACE_SCHEMA rows (sequence = request id), when the engine traces
    cancelled: bool = False
    logprobs: list[TokenLogprob] | None = None  # one per token, when the request asked for logprobs
    stopped: bool = False  # its last token is one of its stop ids (else it ran to max_new_tokens, or was cancelled)


class Commit(NamedTuple):
    """A token committed to a request in a step."""

    id: int  # request id
    token: int
    logprob: TokenLogprob | None  # when the request asked for logprobs


@dataclass
class StepResult:
    """What one ``step`` did."""

    committed: list[Commit]  # tokens committed in this step, in order
    finished: list[Finished]
    rows: int  # rows computed in this step
