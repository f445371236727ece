"""A continuous-batching decoding engine: requests join and leave a running SPEED pipeline.

The engine never imports the model. It drives any ``Stepper``: an object that
encodes a request into a memory slot (``admit``), embeds tokens, and runs ONE
pass of its shared N-layer group over a set of rows, each row a token at its
own loop depth, reading and writing an engine-owned ``KVCache``.

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
"""

from speed.engine.engine import Engine
from speed.engine.policies import budget_rows, should_branch, should_flush, should_launch
from speed.engine.types import (
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
