"""The engine: admission, and one pipeline step at a time (see ``speed.engine``).

A pipeline step (``Engine.step``) is three parts, as vLLM v1's scheduler, executor and output processing: the
``Scheduler`` plans the step's rows as plain data (``StepPlan``), the executor runs them in one group pass
(``_execute``, the only model call besides admission; it keeps every in-flight token's hidden state), and the
scheduler's ``update`` turns the exit logits into the step's commits, its finished requests and its counts.
"""

from __future__ import annotations

import heapq
import threading
import time
from collections import deque
from functools import partial
from typing import Any

import torch
from torch import Tensor

from speed.engine.cache import Rows
from speed.engine.cost import row_cost as measured_row_cost
from speed.engine.graphs import GraphSteps, kv_caches
from speed.engine.memory import check_memory
from speed.engine.outputs import finished
from speed.engine.policies import LaunchRule
from speed.engine.rows import to_device
from speed.engine.sampling import MAX_LOGPROBS, Sampling
from speed.engine.scheduler import Scheduled, Scheduler, StepPlan
from speed.engine.state import InFlight, RequestState
from speed.engine.trace import TraceBuilder
from speed.engine.types import (
    METHODS,
    EngineConfig,
    ExitRule,
    Finished,
    Request,
    Speculation,
    Stepper,
    StepResult,
    as_stepper,
)


class Engine:
    """Continuous-batching decoder, greedy or seeded sampling, over a ``Stepper`` or a model its family's adapter
    makes one of (``speed.models.steppers``; see the module doc)."""

    def __init__(self, model: Stepper | Any, config: EngineConfig = EngineConfig()) -> None:  # noqa: B008 (frozen)
        if getattr(model, "training", False):
            raise ValueError("the engine decodes with the model in eval mode: call model.eval() first")
        self.model: Stepper = as_stepper(model)
        self.config = config
        c = config
        cuda = torch.device(getattr(self.model, "device", "cpu")).type == "cuda"
        capture = cuda and getattr(self.model, "capturable", False)  # a pass a CUDA graph can replay
        # padding pays only where the padded pass is captured (one launch); elsewhere it only adds rows
        bucketed = capture if c.graphs is None else c.graphs
        # bucketed passes pad their rows into one more slot, the scratch slot, with one block of its own
        self._scratch_blocks = int(bucketed)
        slots, blocks = c.max_active + self._scratch_blocks, c.kv_blocks
        blocks = None if blocks is None else blocks + self._scratch_blocks
        need = getattr(self.model, "memory_need", None)
        if need is not None:  # a model's stepper says what it needs: refuse before allocating what does not fit
            capacity = (slots, c.max_prompt_len, c.max_target_len, self.model.device)
            blocks = check_memory(partial(need, side=c.branches), *capacity, blocks=blocks).blocks
        pool = {} if blocks is None else {"blocks": blocks}  # a stub's cache sizes its own pool
        with torch.inference_mode():
            self._cache = self.model.cache(slots, c.max_prompt_len, c.max_target_len, side=c.branches, **pool)
            self._memory = self.model.memory(slots, config.max_prompt_len, config.max_target_len)
            parts = kv_caches(self._cache) if bucketed else []
            for kv in parts:
                kv.set_scratch(c.max_active)  # the last slot: never free, so no request gets it
        self._device = self._cache.device
        self._graphs: GraphSteps | None = None
        if parts:  # a stub's cache holds no KVCache to keep padding rows apart: its passes run unpadded
            self._graphs = GraphSteps(c.max_active, self._device, capture)
        self._free = list(range(config.max_active))  # a heap: the lowest free slot is taken first
        self._reserved: dict[int, int] = {}  # the cache's blocks each active request reserved, by id
        self._waiting: deque[RequestState] = deque()
        self._active: dict[int, RequestState] = {}  # by id, in admission order
        self._next_id = 0
        self._step_no = 0
        self._lock = threading.Lock()  # the decoding state: step and cancel
        self._queue_lock = threading.Lock()  # the waiting queue and ids: add
        self._hidden: dict[int, Tensor] = {}  # the executor's: each in-flight token's hidden state (d,), by key
        row_cost = measured_row_cost(self.model) if config.cost_model else None  # once per process and model shape
        self._scheduler = Scheduler(self._cache, self.model.n_loops, config.row_budget, row_cost=row_cost)
        self.stats = self._scheduler.stats  # totals over the engine's life (the scheduler's update writes them)

    # ----- public API ----------------------------------------------------------------------

    @property
    def active(self) -> int:
        """Requests holding a slot."""
        return len(self._active)

    @property
    def queued(self) -> int:
        """Requests waiting for a slot."""
        return len(self._waiting)

    @property
    def blocks(self) -> tuple[int, int, int]:
        """The cache's pool: (blocks taken now, blocks the active requests reserved, blocks in the pool)."""
        return self._cache.blocks_used, sum(self._reserved.values()), self._pool_blocks

    @property
    def _pool_blocks(self) -> int:
        """The requests' blocks in the pool (the scratch slot's one is not theirs)."""
        return self._cache.n_blocks - self._scratch_blocks

    @property
    def has_work(self) -> bool:
        """Whether any request is active or queued."""
        return bool(self._active or self._waiting)

    def add(self, request: Request) -> int:
        """Validate and queue a request (``ValueError`` says what is wrong); return its id."""
        self._validate(request)
        M, spec = self.model.n_loops, request.speculation
        launch_loop = M if request.method == "sequential" else spec.launch_loop
        stops = frozenset({self.model.eos_id}) if request.stop_ids is None else frozenset(request.stop_ids)
        seq_fields = {
            "request": request,
            "launch": LaunchRule(launch_loop, spec.min_confidence, stops, request.max_new_tokens),
            "all_exits": request.method != "sequential" or self.config.trace,
            "added": time.perf_counter(),
            "flips": [0] * M,
            "accepted": [0] * (M - 1),
            "draft_tokens": [0] * (M - 1),
            "side_free": list(range(M * M)),
            "trace": TraceBuilder() if self.config.trace else None,
            "logprobs": None if request.logprobs is None else [],
        }
        with self._queue_lock:
            seq = RequestState(self._next_id, **seq_fields)
            self._next_id += 1
            self._waiting.append(seq)
        return seq.id

    def cancel(self, request_id: int) -> Finished | None:
        """Remove a queued or active request at once, freeing its slot; None if it is not here."""
        with self._lock:
            seq = self._active.get(request_id)
            if seq is None:
                with self._queue_lock:
                    seq = next((s for s in self._waiting if s.id == request_id), None)
                    if seq is None:
                        return None
                    self._waiting.remove(seq)
            else:
                self._scheduler.cancel(seq)
                self._release(seq)
            return finished(seq, time.perf_counter(), cancelled=True)

    def step(self) -> StepResult:
        """Admit queued requests into free slots, then run one pipeline step over the active ones."""
        with self._lock:
            if torch.is_inference_mode_enabled():  # e.g. inside generate: entering it again costs per step
                return self._step()
            with torch.inference_mode():
                return self._step()

    def _step(self) -> StepResult:
        prefilled, exits, gates = self._admit()
        # output position 0 of a prefilled request was decided by admission: commit it, launch its successor
        now = time.perf_counter()
        admitted = self._scheduler.admitted(prefilled, exits, now, gates)
        committed, done = admitted.committed, self._leave(admitted, now)
        if not self._active:
            return StepResult(committed, done, 0)
        plan = self._scheduler.select(self._active.values(), self._step_no)
        self._step_no += 1
        logits, gates = self._execute(plan)
        now = time.perf_counter()
        ran = self._scheduler.update(plan, logits, now, gates)
        done += self._leave(ran, now)
        live = {t.key for seq in self._active.values() for t in seq.in_flight()}
        self._hidden = {key: h for key, h in self._hidden.items() if key in live}  # the others left the chains
        return StepResult(committed + ran.committed, done, len(plan.rows))

    def _execute(self, plan: StepPlan) -> tuple[Tensor | None, Tensor | None]:
        """Run the plan's rows through one group pass of the model (``Stepper.step``, or ``step_gated`` for a plan
        with exit_gate rows; embedding the tokens launched since), keep each token's hidden state for its next
        loop, and return the exit logits (K, V) of the plan's ``logit_rows`` (None: no row needed them) and every
        row's gate lambda (R,) (None: not asked for)."""
        fresh = [r for r in plan.rows if r.key not in self._hidden]
        if fresh:
            tokens = to_device([r.token for r in fresh], self._device, torch.long)
            for r, h in zip(fresh, self.model.embed(tokens)):
                self._hidden[r.key] = h
        rows = Rows.build(
            [r.slot for r in plan.rows],
            [r.loops_done for r in plan.rows],
            [r.pos for r in plan.rows],
            [r.side for r in plan.rows],
            [r.up for r in plan.rows],
        )
        held = [self._hidden[r.key] for r in plan.rows]
        inputs = held[0][None] if len(held) == 1 else torch.stack(held)  # (R, d)
        gates, picked = None, {} if plan.logit_rows is None else {"logit_rows": plan.logit_rows}
        if plan.with_gates:  # exit-gate steps (a lossy baseline) run unpadded, eagerly
            hidden, logits, gates = self.model.step_gated(self._memory, self._cache, rows, inputs, **picked)  # type: ignore[attr-defined]
        elif self._graphs is not None:
            prepare = getattr(self.model, "prepare", None)
            hidden, logits = self._graphs.run(
                self._pass, rows, inputs, plan.with_logits, plan.logit_rows,
                None if prepare is None else partial(prepare, self._memory, self._cache),
            )  # fmt: skip
        else:
            hidden, logits = self.model.step(self._memory, self._cache, rows, inputs, plan.with_logits, **picked)
        for r, h in zip(plan.rows, hidden.unbind(0)):
            self._hidden[r.key] = h
        return logits, gates

    def _pass(
        self, rows: Rows, inputs: Tensor, with_logits: bool, logit_rows: list[int] | None
    ) -> tuple[Tensor, Tensor | None]:
        """The stepper's group pass, as ``GraphSteps`` calls it (``logit_rows`` passed only when given)."""
        picked = {} if logit_rows is None else {"logit_rows": logit_rows}
        return self.model.step(self._memory, self._cache, rows, inputs, with_logits, **picked)

    def _leave(self, scheduled: Scheduled, now: float) -> list[Finished]:
        """Release the requests the scheduler found done at ``now``, freeing their slots; what each gives back."""
        for seq in scheduled.done:
            self._release(seq)
        return [finished(seq, now, cancelled=False) for seq in scheduled.done]

    # ----- internals -------------------------------------------------------------------------

    def _validate(self, request: Request) -> None:
        c, M = self.config, self.model.n_loops
        if request.method not in METHODS:
            raise ValueError(f"method must be one of {METHODS}, got {request.method!r}")
        spec = request.speculation
        if not isinstance(spec, Speculation):
            raise ValueError(f"speculation must be a speed.engine.Speculation, got {type(spec).__name__}")
        spec.check_loops(M)
        if request.method == "speed" and spec.branches and not c.branches:
            raise ValueError(
                f"speculation.branches={spec.branches}, but this engine was built without runner-up branches "
                "(EngineConfig.branches=False: its cache has no side entries)"
            )
        n = request.max_new_tokens
        if type(n) is not int or n < 1:
            raise ValueError(f"max_new_tokens must be at least 1, got {n!r}")
        if n > c.max_target_len:
            raise ValueError(
                f"max_new_tokens must be at most {c.max_target_len} (the engine's max_target_len), got {n}"
            )
        ids = request.input_ids
        if not isinstance(ids, (list, tuple)) or not ids:
            raise ValueError("input_ids must be a non-empty list of token ids")
        if len(ids) > c.max_prompt_len:
            raise ValueError(
                f"input_ids has {len(ids)} tokens, more than {c.max_prompt_len} "
                "(the engine's max_source_len, or max_prompt_len: the longest prompt)"
            )
        blocks = self._cache.blocks_needed(len(ids), n)
        if blocks > self._pool_blocks:
            raise ValueError(
                f"a prompt of {len(ids)} tokens and max_new_tokens={n} need {blocks} key/value blocks, but the "
                f"engine's cache holds {self._pool_blocks} (EngineConfig.kv_blocks, or what the memory allows): "
                "shorten the prompt or max_new_tokens"
            )
        V = self.model.vocab_size
        bad = next((t for t in ids if type(t) is not int or not 0 <= t < V), None)
        if bad is not None:
            raise ValueError(f"input_ids must be token ids in [0, {V}), got {bad!r}")
        stops = request.stop_ids
        if stops is not None and (
            isinstance(stops, (str, bytes)) or not stops or any(type(t) is not int or not 0 <= t < V for t in stops)
        ):
            raise ValueError(f"stop_ids must be None or a non-empty set of token ids in [0, {V}), got {stops!r}")
        if request.oracle is not None and request.method != "speed":
            raise ValueError("an oracle needs method='speed'")
        self._validate_exit_rule(request)
        if not isinstance(request.sampling, Sampling):
            got = type(request.sampling).__name__
            raise ValueError(f"sampling must be a speed.engine.sampling.Sampling, got {got}")
        k = request.logprobs
        if k is not None and (type(k) is not int or not 0 <= k <= min(MAX_LOGPROBS, V)):
            raise ValueError(f"logprobs must be None or an integer in 0..{min(MAX_LOGPROBS, V)}, got {k!r}")

    def _validate_exit_rule(self, request: Request) -> None:
        """An exit_gate request needs an ``ExitRule`` the model's loops allow and a model with an exit gate; no
        other method takes one."""
        rule = request.exit_rule
        if request.method != "exit_gate":
            if rule is not None:
                raise ValueError(f"an exit_rule needs method='exit_gate', got method={request.method!r}")
            return
        if not isinstance(rule, ExitRule):
            raise ValueError(f"method='exit_gate' needs an exit_rule (a speed.engine.ExitRule), got {rule!r}")
        rule.check_loops(self.model.n_loops)
        if not getattr(self.model, "gated", False):
            raise ValueError("method='exit_gate' needs a model with an exit gate (Ouro's; LMConfig.exit_gate)")

    def _admit(self) -> tuple[list[RequestState], list[Tensor], list[Tensor | None]]:
        """Move waiting requests into free slots and admit them there together (T5: encoding each prompt; a
        decoder-only LM: prefilling them in one pass), each one's result its own alone; return those whose
        output position 0 the admission decided, with that row's logits of every loop (M, V) each and its exit
        gate's lambdas (M,) (None: the stepper gave none)."""
        coming = []
        while self._free and self._waiting:
            with self._queue_lock:  # first come, first served: the head waits until its worst case is free
                seq = self._waiting[0]
                blocks = self._cache.blocks_needed(len(seq.request.input_ids), seq.request.max_new_tokens)
                if sum(self._reserved.values()) + blocks > self._pool_blocks:
                    break
                self._waiting.popleft()
            self._reserved[seq.id] = blocks
            seq.slot = heapq.heappop(self._free)
            self._cache.reset(seq.slot)
            coming.append(seq)
        if not coming:
            return [], [], []
        prompts = [to_device(list(seq.request.input_ids), self._device, torch.long) for seq in coming]  # (P,) each
        admitted_all = self.model.admit(self._memory, self._cache, [seq.slot for seq in coming], prompts)
        prefilled, exits, gates = [], [], []
        for seq, admitted in zip(coming, admitted_all):
            seq.chain.append(InFlight(0, admitted.token))
            seq.admitted = time.perf_counter()
            self._active[seq.id] = seq
            if admitted.exits is not None:  # the prefill ran the first row through every loop
                prefilled.append(seq)
                exits.append(admitted.exits)
                gates.append(admitted.gates)
        return prefilled, exits, gates

    def _release(self, seq: RequestState) -> None:
        del self._active[seq.id], self._reserved[seq.id]
        self._cache.reset(seq.slot)  # its blocks go back to the pool
        heapq.heappush(self._free, seq.slot)
