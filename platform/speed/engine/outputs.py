"""What the engine records of a step: each row's exit from the model's logits, each committed token's counters,
trace and logprob (a request's ``RequestCounts``), and what a request that leaves gives back."""

from __future__ import annotations

from torch import Tensor

from speed.engine.gate import GateRun
from speed.engine.sampling import exit_choices, exit_scores, token_logprob
from speed.engine.state import Exit, InFlight, RequestState
from speed.engine.types import NO_EXIT, Finished, RequestStats


def record_exits(
    work: list[tuple[RequestState, InFlight]],
    logits: Tensor | None,
    n_loops: int,
    gates: Tensor | None = None,
    wanted: list[bool] | None = None,
) -> None:
    """Append each row's ``Exit`` (its draw, runner-up, confidence, mode; its logprob after the last of the
    ``n_loops`` loops) to its token, from the logits (K, V) of the rows ``wanted`` marks (None: all), in row order;
    None: no exit was evaluated. The other rows record none. An exit_gate request's rows record what their gate's
    rule decides (``gate_logits``), from every row's lambda ``gates`` (R,)."""
    scored = [r for r in range(len(work)) if wanted is None or wanted[r]]
    logits = logits if scored else None  # (a stub's logits of a step that wanted none)
    assert logits is None or logits.shape[0] == len(scored), "a stepper returns the logits of the rows asked for"
    if logits is not None and gates is not None:
        logits = gate_logits([work[r] for r in scored], logits, gates[scored], n_loops)
    exits = [Exit(NO_EXIT, NO_EXIT, float("nan"), NO_EXIT)] * len(work)
    at = {r: k for k, r in enumerate(scored)}  # a scored row's place in the logits
    if logits is not None:
        choices = exit_choices(*exit_scores(logits, [work[r][0].draw(work[r][1]) for r in scored]))
        modes = choices.token if choices.mode is None else choices.mode
        for r, e in zip(scored, map(Exit, choices.token, choices.runner_up, choices.p_top, modes)):
            exits[r] = e
    for r, ((seq, t), e) in enumerate(zip(work, exits)):
        t.exits.append(e)
        if len(t.exits) == n_loops and seq.request.logprobs is not None:
            t.logprob = token_logprob(logits[at[r]], e.pred, seq.request.logprobs)


def gate_logits(work: list[tuple[RequestState, InFlight]], logits: Tensor, gates: Tensor, n_loops: int) -> Tensor:
    """The rows' logits (K, V), each exit_gate request's row replaced by what its token's ``GateRun`` records
    (``gates`` (K,): the rows' lambdas)."""
    out = None
    for r, (seq, t) in enumerate(work):
        rule = seq.request.exit_rule
        if rule is None:
            continue
        if t.gate is None:
            t.gate = GateRun(rule, n_loops)
        out = logits.clone() if out is None else out
        out[r] = t.gate.feed(logits[r], gates[r])
    return logits if out is None else out


def record_commit(seq: RequestState, t: InFlight, now: float) -> None:
    """Count the token ``t`` the scheduler just committed at ``now`` (the last of ``seq.out``): the first token's
    time, acceptance, flips per loop, its trace rows and logprob."""
    token = seq.out[-1]
    if len(seq.out) == 1:
        seq.first_token = now
    if t.ahead:
        seq.accepted[t.ahead - 1] += 1
    if seq.all_exits:
        for loop, e in enumerate(t.exits):
            seq.flips[loop] += e.pred not in (token, NO_EXIT)  # an exit a closed step skipped is no flip
    if seq.trace is not None:
        seq.trace.add_token(seq.id, t.pos, t.preds)
    if seq.logprobs is not None:
        seq.logprobs.append(t.logprob)
    if t.gate is not None:
        seq.exit_loops.append(t.gate.exit_loop + 1)


def finished(seq: RequestState, now: float, cancelled: bool) -> Finished:
    """What ``seq`` gives back when it leaves at ``now`` (perf_counter): its tokens, counters, trace, logprobs."""
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
        exit_loops=list(seq.exit_loops),
    )
    trace = seq.trace.table() if seq.trace is not None else None
    stopped = bool(seq.out) and seq.out[-1] in seq.launch.stop_ids
    return Finished(seq.id, seq.out, stats, trace, cancelled, seq.logprobs, stopped)
