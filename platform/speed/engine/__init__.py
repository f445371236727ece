"""A continuous-batching decoding engine: requests join and leave a running SPEED pipeline.

The engine never imports the model. It drives any ``Stepper``: an object that
encodes a request into a memory slot (``admit``), embeds tokens, and runs ONE
pass of its shared N-layer group over a set of rows, each row a token at its
own loop, reading and writing an engine-owned ``KVCache``.

SPEED (speculative pipelined execution): a token is launched from its
predecessor's early-exit prediction after ``launch_loop`` loops, so one step
advances up to M in-flight tokens of a request by one loop each, reading the
shared weights once. When a later loop's prediction differs from the token a
successor was launched with, the successor and everything after it are
flushed (``eager``: at once; ``final``: only when the predecessor finishes its
last loop) and relaunched from the new prediction. Committed tokens are always
the last loop's decisions, so the output equals sequential decoding: greedy, or
seeded sampling (``speed.sampling``), whose noise depends only on the
request's seed and the output position, never on the step or the batch.
Sequential decoding is the same pipeline that never launches a successor
before its predecessor's last loop.

Runner-up branches (tree speculation, ``Request.branches``): an in-flight
token whose exit is unsure may also carry a second successor launched from its
runner-up prediction. It runs beside the chain (its key/value in a side entry of
the cache, see ``speed.cache``) and may grow a lane of its own successors, up
to ``Request.branch_depth`` tokens (1: it launches nothing); when a later loop
switches to the runner-up, the lane becomes the chain and the old chain is
flushed, instead of a restart from the first loop. When the runner-up changes,
the branch restarts from the new one. Only last-loop predictions are committed,
so branches change the schedule, never the output. ``Request.min_confidence``
gates launching: a successor waits until its predecessor's exit is at least that
confident.

Capacity is fixed at construction: ``max_active`` slots, each a place in the
KV cache and in the encoder memory, handed out from a free list. A request waits in a
queue until a slot is free; joining or leaving writes only its own slot. Each
step computes every active request's in-flight rows, or at most
``row_budget`` of them: the rows on the committed path (each request's oldest
in-flight token, whose input is known to be right) first, speculative chain rows
in what is left, runner-up branches last.

Threads: ``add`` may be called from any thread at any time (it only queues);
``step`` and ``cancel`` hold the engine's lock, so one step runs at a time and
a cancel waits for a running step to end.

Modules: ``types`` (the ``Stepper`` protocol, ``EngineConfig``, ``Request``
and what comes back), ``policies`` (pure functions: launch, branch, flush,
row budget), ``state`` (a request's ``Sequence`` and its ``InFlight``
tokens), ``engine`` (``Engine``: admission, stepping, scheduling, locking).

Names, one per concept (M loops of N shared layers):

- request (``Request``): what a caller asks for. ``Sequence``: its decoding
  state in the engine, from ``add`` until it leaves (in traces the
  ``sequence`` column is its id).
- slot: a request's place while it is active, one of
  ``EngineConfig.max_active``: its index in the KV cache and in the encoder
  memory (``Sequence.slot``, ``Rows.slot``, ``Stepper.admit``).
- position (``pos``): a decoder output index, 0-based; a slot keeps keys at
  positions 0..max_len-1 of every virtual layer.
- loop: one run of the shared N-layer group (0-based in code, 1-based in
  traces); its early exit is that loop's prediction.
- virtual layer: one of a token's N*M layer runs, written (loop, layer) with
  ``layer`` the physical layer 0..N-1; the cache keeps keys per virtual
  layer. depth: their number, N*M (``SharingPattern.depth``).
- in-flight token (``InFlight``): launched, not yet committed; ``loops_done``
  (``len(preds)``) of its M loops are finished.
- chain (``Sequence.chain``): a request's in-flight tokens in position order,
  each launched from its predecessor's exit; the oldest is on the committed
  path. branch: a second successor launched from a runner-up prediction;
  lane: the branch and its own successors, whose keys live in the slot's
  side entries (``Request.branch_depth`` is a lane's length in tokens).
- row: one in-flight token through one loop in one step (``Rows``, R of
  them; ``row_budget``, ``DecodeStats.rows``). step: one engine iteration,
  one group pass over the step's rows.
- draft token, draft position: vLLM's speculation terms (``RequestStats``).
"""

from speed.engine.engine import Engine
from speed.engine.policies import budget_rows, should_branch, should_flush, should_launch
from speed.engine.types import (
    INVALIDATIONS,
    METHODS,
    NO_EXIT,
    Commit,
    DecodeStats,
    EngineConfig,
    Finished,
    Invalidation,
    Method,
    Request,
    RequestStats,
    Stepper,
    StepResult,
)

__all__ = [
    "INVALIDATIONS",
    "METHODS",
    "NO_EXIT",
    "Commit",
    "DecodeStats",
    "Engine",
    "EngineConfig",
    "Finished",
    "Invalidation",
    "Method",
    "Request",
    "RequestStats",
    "StepResult",
    "Stepper",
    "budget_rows",
    "should_branch",
    "should_flush",
    "should_launch",
]
