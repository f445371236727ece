"""The engine: admission, one pipeline step at a time, and the scheduling between steps (see ``speed.engine``)."""

from __future__ import annotations

import heapq
import threading
import time
from collections import deque
from typing import Any

import torch
from torch import Tensor

from speed.cache import Rows
from speed.engine.adapters import stepper_for
from speed.engine.policies import budget_rows, should_branch, should_flush, should_launch
from speed.engine.state import InFlight, Sequence
from speed.engine.types import (
    METHODS,
    NO_EXIT,
    Commit,
    DecodeStats,
    EngineConfig,
    Finished,
    Request,
    RequestStats,
    Speculation,
    Stepper,
    StepResult,
)
from speed.sampling import MAX_LOGPROBS, Sampling, exit_choices, exit_scores, token_logprob
from speed.trace import TraceBuilder


class Engine:
    """Continuous-batching decoder, greedy or seeded sampling, over a ``Stepper`` or a model its family's adapter
    makes one of (``speed.engine.adapters``; see the module doc)."""

    def __init__(self, model: Stepper | Any, config: EngineConfig = EngineConfig()) -> None:  # noqa: B008 (frozen)
        if getattr(model, "training", False):
            raise ValueError("the engine decodes with the model in eval mode: call model.eval() first")
        self.model: Stepper = stepper_for(model)
        self.config = config
        with torch.inference_mode():
            self._cache = self.model.cache(config.max_active, config.max_prompt_len, config.max_target_len)
            self._memory = self.model.memory(config.max_active, config.max_prompt_len, config.max_target_len)
        self._device = self._cache.device
        self._free = list(range(config.max_active))  # a heap: the lowest free slot is taken first
        self._waiting: deque[Sequence] = deque()
        self._active: dict[int, Sequence] = {}  # by id, in admission order
        self._next_id = 0
        self._step_no = 0
        self._lock = threading.Lock()  # the decoding state: step and cancel
        self._queue_lock = threading.Lock()  # the waiting queue and ids: add
        self.stats = DecodeStats()  # totals over the engine's life

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
    def has_work(self) -> bool:
        """Whether any request is active or queued."""
        return bool(self._active or self._waiting)

    def add(self, request: Request) -> int:
        """Validate and queue a request (``ValueError`` says what is wrong); return its id."""
        self._validate(request)
        M = self.model.n_loops
        seq_fields = {
            "request": request,
            "launch_loop": M if request.method == "sequential" else request.speculation.launch_loop,
            "all_exits": request.method == "speed" or self.config.trace,
            "added": time.perf_counter(),
            "flips": [0] * M,
            "accepted": [0] * (M - 1),
            "draft_tokens": [0] * (M - 1),
            "side_free": list(range(M * M)),
            "trace": TraceBuilder() if self.config.trace else None,
            "logprobs": None if request.logprobs is None else [],
        }
        with self._queue_lock:
            seq = Sequence(self._next_id, **seq_fields)
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
                dropped = sum(len(t.preds) for t in seq.in_flight())
                seq.wasted_rows += dropped
                self.stats.wasted_rows += dropped
                seq.chain.clear()
                self._release(seq)
            return self._finished(seq, time.perf_counter(), cancelled=True)

    def step(self) -> StepResult:
        """Admit queued requests into free slots, then run one pipeline step over the active ones."""
        with self._lock:
            if torch.is_inference_mode_enabled():  # e.g. inside generate: entering it again costs per step
                return self._step()
            with torch.inference_mode():
                return self._step()

    def _step(self) -> StepResult:
        committed: list[Commit] = []
        finished: list[Finished] = []
        prefilled = self._admit()
        now = time.perf_counter()
        for seq in prefilled:  # output position 0 was decided by admission: commit it, launch its successor
            self._after(seq, now, committed, finished)
        if not self._active:
            return StepResult(committed, finished, 0)
        work = self._select()
        self._step_no += 1
        fresh = [t for _, t in work if t.hidden is None]
        if fresh:
            tokens = torch.tensor([t.token for t in fresh], device=self._device)
            for t, h in zip(fresh, self.model.embed(tokens)):
                t.hidden = h
        M = self.model.n_loops
        rows = Rows.build(
            [s.slot for s, _ in work],
            [len(t.preds) for _, t in work],
            [t.pos for _, t in work],
            [t.side for _, t in work],
            [t.up for _, t in work],
        )
        with_logits = any(s.all_exits or len(t.preds) == M - 1 for s, t in work)
        inputs = work[0][1].hidden[None] if len(work) == 1 else torch.stack([t.hidden for _, t in work])  # (R, d)
        hidden, logits = self.model.step(self._memory, self._cache, rows, inputs, with_logits=with_logits)
        ran: dict[int, Sequence] = {}
        for (seq, t), h in zip(work, hidden.unbind(0)):
            t.hidden = h
            seq.rows += 1
            ran[seq.id] = seq
        self._record_exits(work, logits)
        st = self.stats
        st.steps += 1
        st.group_passes += 1
        st.rows += len(work)
        now = time.perf_counter()
        for seq in ran.values():
            seq.steps += 1
            self._after(seq, now, committed, finished)
        return StepResult(committed, finished, len(work))

    def _record_exits(self, work: list[tuple[Sequence, InFlight]], logits: Tensor | None) -> None:
        """Append each row's exit (its draw, runner-up, confidence, mode; its logprob after the last loop) to its
        token, from the rows' logits (R, V); None: no exit was evaluated."""
        if logits is not None:
            exits = exit_choices(*exit_scores(logits, [s.draw(t) for s, t in work]))
            preds, runners, p_top = exits.token, exits.runner_up, exits.p_top
            modes = preds if exits.mode is None else exits.mode
        else:
            preds = runners = modes = [NO_EXIT] * len(work)
            p_top = [float("nan")] * len(work)
        M = self.model.n_loops
        for r, (seq, t) in enumerate(work):
            t.preds.append(preds[r])
            t.runners.append(runners[r])
            t.p_top.append(p_top[r])
            t.modes.append(modes[r])
            if len(t.preds) == M and seq.request.logprobs is not None:
                t.logprob = token_logprob(logits[r], preds[r], seq.request.logprobs)

    def _after(self, seq: Sequence, now: float, committed: list[Commit], finished: list[Finished]) -> None:
        """Schedule ``seq`` after its rows ran; collect what it committed, and the request if it finished."""
        n = len(seq.out)
        self._schedule(seq)
        if len(seq.out) > n:
            if n == 0:
                seq.first_token = now
            lps = seq.logprobs[n:] if seq.logprobs is not None else [None] * (len(seq.out) - n)
            committed.extend(Commit(seq.id, t, lp) for t, lp in zip(seq.out[n:], lps))
        if seq.done:
            self._release(seq)
            finished.append(self._finished(seq, now, cancelled=False))

    # ----- internals -------------------------------------------------------------------------

    def _validate(self, request: Request) -> None:
        c, M = self.config, self.model.n_loops
        if request.method not in METHODS:
            raise ValueError(f"method must be one of {METHODS}, got {request.method!r}")
        spec = request.speculation
        if not isinstance(spec, Speculation):
            raise ValueError(f"speculation must be a speed.engine.Speculation, got {type(spec).__name__}")
        spec.check_loops(M)
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
        V = self.model.vocab_size
        bad = next((t for t in ids if type(t) is not int or not 0 <= t < V), None)
        if bad is not None:
            raise ValueError(f"input_ids must be token ids in [0, {V}), got {bad!r}")
        if request.oracle is not None and request.method != "speed":
            raise ValueError("an oracle needs method='speed'")
        if not isinstance(request.sampling, Sampling):
            raise ValueError(f"sampling must be a speed.sampling.Sampling, got {type(request.sampling).__name__}")
        k = request.logprobs
        if k is not None and (type(k) is not int or not 0 <= k <= min(MAX_LOGPROBS, V)):
            raise ValueError(f"logprobs must be None or an integer in 0..{min(MAX_LOGPROBS, V)}, got {k!r}")

    def _admit(self) -> list[Sequence]:
        """Move waiting requests into free slots and admit them there together (T5: encoding each prompt; a
        decoder-only LM: prefilling them in one pass), each one's result its own alone; return those whose
        output position 0 the admission decided."""
        coming = []
        while self._free and self._waiting:
            with self._queue_lock:
                seq = self._waiting.popleft()
            seq.slot = heapq.heappop(self._free)
            self._cache.reset(seq.slot)
            coming.append(seq)
        if not coming:
            return []
        prompts = [torch.tensor(list(seq.request.input_ids), device=self._device) for seq in coming]  # (P,) each
        admitted_all = self.model.admit(self._memory, self._cache, [seq.slot for seq in coming], prompts)
        prefilled = []
        for seq, admitted in zip(coming, admitted_all):
            first = InFlight(0, admitted.token)
            seq.chain.append(first)
            seq.admitted = time.perf_counter()
            self._active[seq.id] = seq
            if admitted.exits is not None:  # (M, V): the prefill ran the first row through every loop
                M = self.model.n_loops
                for loop in range(M):
                    self._record_exits([(seq, first)], admitted.exits[loop : loop + 1])
                prefilled.append(seq)
        return prefilled

    def _select(self) -> list[tuple[Sequence, InFlight]]:
        """This step's rows, in admission order: all in-flight rows, or the row budget's choice.

        The budget serves each request's committed path, then chain speculation, then branches; a branch
        runs only in a step that runs its parent, so it never catches up with the keys it reads.
        """
        seqs = self._active.values()
        budget = self.config.row_budget
        flying = {s.id: s.in_flight() for s in seqs}
        if budget is None or sum(map(len, flying.values())) <= budget:
            if budget is not None:
                for s in seqs:
                    s.last_served = self._step_no
            return [(s, t) for s in seqs for t in flying[s.id]]
        order = sorted(seqs, key=lambda s: s.last_served)  # stable: admission order among equals
        take = budget_rows([len(s.chain) for s in order], budget)
        branches = [[t for c in s.chain[:n] for t in c.lane] for s, n in zip(order, take)]  # a lane's own order
        branch_take = budget_rows([len(b) for b in branches], budget - sum(take))
        chosen = {s.id: [*s.chain[:n], *b[:m]] for s, n, b, m in zip(order, take, branches, branch_take)}
        work = []
        for s in seqs:
            if chosen[s.id]:
                s.last_served = self._step_no
                work.extend((s, t) for t in chosen[s.id])
        return work

    def _schedule(self, seq: Sequence) -> None:
        """After a step: commit a finished token, flush or promote past mispredictions, launch new tokens."""
        M, eos = self.model.n_loops, self.model.eos_id
        request, spec = seq.request, seq.request.speculation
        i = 0
        while i < len(seq.chain):
            t = seq.chain[i]
            loops_done = len(t.preds)
            if loops_done == 0:  # launched in this step, or left out by the row budget
                return
            if loops_done == M:  # the oldest token finished its last loop: commit it
                token = t.preds[-1]
                seq.chain.pop(0)
                self._commit(seq, t)
                if token == eos or len(seq.out) >= request.max_new_tokens:
                    self._drop_lane(seq, t.lane, 0)
                    self._flush(seq, 0, mispredicted=False)
                    seq.done = True
                    return
                self._follow(seq, t, 0, token)
                self._drop_lane(seq, t.lane, 0)  # not taken over: the chain was right
                if not seq.chain:
                    seq.chain.append(InFlight(t.pos + 1, token))
                continue  # the successor is now the oldest, at index 0
            guess = seq.guess(t)
            if should_flush(spec.invalidation, loops_done, M):
                self._follow(seq, t, i + 1, guess)
            succ = seq.chain[i + 1] if i + 1 < len(seq.chain) else None
            if (
                succ is None
                and should_launch(loops_done, seq.launch_loop, t.p_top[-1], spec.min_confidence)
                and guess != eos
                and t.pos + 1 < request.max_new_tokens
            ):
                succ = self._draft(seq, t.pos + 1, guess)
                seq.chain.append(succ)
            self._keep_lane(seq, t, succ, guess)
            i += 1

    def _follow(self, seq: Sequence, parent: InFlight, start: int, token: int) -> None:
        """Make ``token`` the successor of ``parent`` (at ``seq.chain[start]``): keep the chain if it has it,
        else promote the parent's lane if its branch has it, else flush the chain (it relaunches)."""
        succ = seq.chain[start] if start < len(seq.chain) else None
        if succ is not None and succ.token == token:
            return
        lane = parent.lane
        if not lane or lane[0].token != token:
            self._flush(seq, start, mispredicted=succ is not None)
            return
        parent.lane = []
        self._flush(seq, start, mispredicted=False)
        for t in lane:  # in position order: each lands at the end of the prefix its predecessor just extended
            self._cache.promote(seq.slot, t.side, t.pos, len(t.preds))
            heapq.heappush(seq.side_free, t.side)
            t.side, t.up = -1, ()
        seq.chain.extend(lane)
        seq.promotions += 1
        self.stats.promotions += 1

    def _keep_lane(self, seq: Sequence, parent: InFlight, succ: InFlight | None, guess: int) -> None:
        """Keep ``parent``'s branch on its runner-up (restart it when the runner-up changes; launch one if allowed),
        then grow or trim its lane as the chain grows: from each lane token's own latest prediction."""
        request, spec = seq.request, seq.request.speculation
        runner, eos = parent.runners[-1], self.model.eos_id
        lane = parent.lane
        if lane and (lane[0].token not in (runner, guess) or succ is None or lane[0].token == succ.token):
            self._drop_lane(seq, lane, 0)
        if (
            not lane
            and succ is not None
            and runner not in (succ.token, eos, NO_EXIT)
            and request.oracle is None
            and sum(bool(c.lane) for c in seq.chain) < spec.branches
            and should_branch(parent.p_top[-1], spec.branch_below)
        ):
            lane.append(self._draft(seq, parent.pos + 1, runner, side=heapq.heappop(seq.side_free)))
        M = self.model.n_loops
        for j, t in enumerate(lane):
            loops_done = len(t.preds)
            if loops_done == 0:
                return
            nxt = lane[j + 1] if j + 1 < len(lane) else None
            pred = t.preds[-1]
            if nxt is not None and nxt.token != pred and should_flush(spec.invalidation, loops_done, M):
                self._drop_lane(seq, lane, j + 1)
                nxt = None
            if (
                nxt is None
                and len(lane) < spec.branch_depth
                and should_launch(loops_done, seq.launch_loop, t.p_top[-1], spec.min_confidence)
                and pred != eos
                and t.pos + 1 < request.max_new_tokens
            ):
                side, up = heapq.heappop(seq.side_free), (*t.up, (t.pos, t.side))
                lane.append(self._draft(seq, t.pos + 1, pred, side=side, up=up))

    def _draft(
        self, seq: Sequence, pos: int, token: int, side: int = -1, up: tuple[tuple[int, int], ...] = ()
    ) -> InFlight:
        """A token launched at ``pos`` from an early exit (on the chain, or in a lane: ``side``, ``up``), counted
        as a draft token at its draft position: the uncommitted tokens ahead of it, chain and lane alike (a lane
        token that is promoted and committed is then an accepted one, as a chain token is)."""
        ahead = pos - len(seq.out)  # the committed path is at len(seq.out); every position up to pos is in flight
        seq.draft_tokens[ahead - 1] += 1
        seq.drafts += ahead == 1
        return InFlight(pos, token, ahead=ahead, side=side, up=up)

    def _drop_lane(self, seq: Sequence, lane: list[InFlight], start: int) -> None:
        """Drop lane tokens from index ``start`` on (their rows are wasted), freeing their side entries."""
        for t in lane[start:]:
            heapq.heappush(seq.side_free, t.side)
            seq.wasted_rows += len(t.preds)
            self.stats.wasted_rows += len(t.preds)
        del lane[start:]

    def _commit(self, seq: Sequence, t: InFlight) -> None:
        token = t.preds[-1]
        seq.out.append(token)
        self.stats.tokens += 1
        if t.ahead:
            seq.accepted[t.ahead - 1] += 1
        if seq.all_exits:
            for loop, pred in enumerate(t.preds):
                seq.flips[loop] += pred != token
        if seq.trace is not None:
            seq.trace.add_token(seq.id, t.pos, t.preds)
        if seq.logprobs is not None:
            seq.logprobs.append(t.logprob)

    def _flush(self, seq: Sequence, start: int, mispredicted: bool) -> None:
        """Drop the chain's tokens from index ``start`` on and invalidate their cache entries."""
        dropped = seq.chain[start:]
        if not dropped:
            return
        del seq.chain[start:]
        self._cache.invalidate(seq.slot, dropped[0].pos)
        for t in dropped:
            self._drop_lane(seq, t.lane, 0)
        wasted = sum(len(s.preds) for s in dropped)
        seq.wasted_rows += wasted
        seq.flushes += mispredicted
        self.stats.wasted_rows += wasted
        self.stats.flushes += mispredicted

    def _release(self, seq: Sequence) -> None:
        del self._active[seq.id]
        heapq.heappush(self._free, seq.slot)

    def _finished(self, seq: Sequence, now: float, cancelled: bool) -> Finished:
        tokens = len(seq.out)
        stats = RequestStats(
            tokens=tokens,
            steps=seq.steps,
            rows=seq.rows,
            flushes=seq.flushes,
            wasted_rows=seq.wasted_rows,
            flip_rate=[f / tokens for f in seq.flips] if seq.all_exits and tokens else [],
            queued_s=seq.admitted - seq.added,
            ttft_s=seq.first_token - seq.added,
            latency_s=now - seq.added,
            drafts=seq.drafts,
            draft_tokens=sum(seq.draft_tokens),
            accepted_tokens=sum(seq.accepted),
            accepted_per_pos=list(seq.accepted),
            draft_tokens_per_pos=list(seq.draft_tokens),
            promotions=seq.promotions,
        )
        trace = seq.trace.table() if seq.trace is not None else None
        return Finished(seq.id, seq.out, stats, trace, cancelled, seq.logprobs)
