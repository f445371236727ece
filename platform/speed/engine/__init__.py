"""A continuous-batching decoding engine: requests join and leave a running SPEED pipeline.

The scheduling never touches a model. It drives any ``Stepper``: an object that
admits a request's prompt into its slot (``admit``: T5 encodes it into the
slot's memory; a decoder-only LM prefills it into the slot's KV entries of
every virtual layer), embeds tokens, and runs ONE pass of its shared N-layer
group (a group pass, ``Stepper.step``) over a set of rows, each row a token at
its own loop, reading and writing an engine-owned ``KVCache``. A model hands out its own (``model.stepper()``:
``speed.models.t5_stepper.T5Stepper``, ``speed.models.lm_stepper.LMStepper``); ``Engine(model)`` asks it for one
(``as_stepper``), so the engine imports no model.

Admission runs output position 0's row: T5's is the start token, run
through the M loops like any other row; an LM's is the prompt's last token,
whose exits the prefill already computed, so its token is committed at once
and its successor launches in the same step. The requests admitted in a step
are admitted together (an LM's prompts prefilled in one pass), each one's
result its own alone, so nothing it decodes depends on the requests admitted
with it.

SPEED (speculative pipelined execution; its settings are one ``Speculation``,
each request's ``Request.speculation``): a token is launched from its
predecessor's early-exit prediction after ``launch_loop`` loops, so one step
advances up to M in-flight tokens of a request by one loop each, reading the
shared weights once. When a later loop's prediction differs from the token a
successor was launched with, the successor and everything after it are
flushed (``eager``: at once; ``final``: only when the predecessor finishes its
last loop) and relaunched from the new prediction. Committed tokens are always
the last loop's decisions, so the output equals sequential decoding: greedy, or
seeded sampling (``speed.engine.sampling``), whose noise depends only on the
request's seed and the output position, never on the step or the batch.
Sequential decoding is the same pipeline that never launches a successor
before its predecessor's last loop.

Runner-up branches (tree speculation, ``Speculation.branches``): an in-flight
token whose exit is unsure may also carry a second successor launched from its
runner-up prediction. It runs beside the chain (its key/value in a side entry of
the cache, see ``speed.engine.cache``) and may grow a lane of its own successors, up
to ``Speculation.branch_depth`` tokens (1: it launches nothing); when a later loop
switches to the runner-up, the lane becomes the chain and the old chain is
flushed, instead of a restart from the first loop. When the runner-up changes,
the branch restarts from the new one. Only last-loop predictions are committed,
so branches change the schedule, never the output. ``Speculation.min_confidence``
gates launching: a successor waits until its predecessor's exit is at least that
confident.

Capacity is fixed at construction: ``max_active`` slots, each a place in the
KV cache and in the memory (T5's encoder keys), handed out from a free list,
for prompts of up to ``max_prompt_len`` tokens (a longer one is refused at
``add``). A request waits in a
queue until a slot is free; joining or leaving writes only its own slot. Each
step computes every active request's in-flight rows, or at most
``row_budget`` of them: the rows on the committed path (each request's oldest
in-flight token, whose input is known to be right) first, speculative chain rows
in what is left, runner-up branches last.

Threads: ``add`` may be called from any thread at any time (it only queues);
``step`` and ``cancel`` hold the engine's lock, so one step runs at a time and
a cancel waits for a running step to end.

Modules: ``types`` (the ``Stepper`` protocol, ``Admitted``, ``EngineConfig``,
``Speculation`` and its flat ``SpeculationFields``, ``Request`` and what comes
back, ``DecodeStats``), ``policies`` (pure functions: the one launch rule ``may_launch``,
what follows a token, branch, flush, row budget), ``cost`` (``RowCost``: the device's measured pass cost) and
``cost_policy`` (``CostPolicy``: the cost model's choice of a step's rows, a pure query), ``state`` (a request's
``RequestState`` and ``RequestCounts``, its ``InFlight`` tokens and their
``Exit``s), ``scheduler`` (``Scheduler``: a step's plan as plain data, and
after it what each chain and lane becomes, the commits and the one writer of
``DecodeStats``), ``outputs`` (what a step records: exits, commits' counters
and traces, ``Finished``), ``engine`` (``Engine``: admission, validation, the
executor (the model call, the hidden states), locking), as vLLM v1 splits
its scheduler, executor and output processing. What a stepper computes with: ``cache`` (``KVCache``) and
``cache_index`` (the device indices a pass reads it through), ``kernels`` and ``matmuls`` (the row-invariant
ops), ``native`` and ``triton_kernels`` (their CPU and GPU kernels), ``graphs`` (row-count buckets, CUDA graphs),
``sampling``, ``memory``; ``observer`` (``StepObserver``: a ``Stepper`` wrapping another, whose passes it
watches: the logit recorder's and the replay's base). A ``Stepper`` per model family lives beside its model
(``speed.models.t5_stepper.T5Stepper``, ``speed.models.lm_stepper.LMStepper``).

Names, one per concept (M loops of N shared layers):

- request (``Request``): what a caller asks for. ``RequestState``: its decoding
  state in the engine, from ``add`` until it leaves (in traces the
  ``sequence`` column is its id).
- prompt: a request's input ids (``Request.input_ids``): T5's encoder
  input, an LM's context; at most ``EngineConfig.max_prompt_len`` tokens
  (``max_source_len``, its T5 name, is still accepted).
- slot: a request's place while it is active, one of
  ``EngineConfig.max_active``: its index in the KV cache and in the memory
  (``RequestState.slot``, ``Rows.slot``, ``Stepper.admit``).
- position (``pos``): an output index, 0-based: the row at position p
  predicts output token p. T5's slot keeps keys at positions 0..max_len-1 of
  every virtual layer; an LM's keeps its prompt's P first, and output
  position p at cache position P - 1 + p (its stepper translates).
- loop: one run of the shared N-layer group (0-based in code, 1-based in
  traces); its early exit is that loop's prediction.
- virtual layer: one of a token's N*M layer runs, written (loop, layer) with
  ``layer`` the physical layer 0..N-1; the cache keeps keys per virtual
  layer. depth: their number, N*M (``SharingPattern.depth``).
- in-flight token (``InFlight``): launched, not yet committed; ``loops_done``
  of its M loops are finished, each leaving an ``Exit`` (its
  prediction, runner-up, top-1 probability and mode).
- chain (``RequestState.chain``): a request's in-flight tokens in position order,
  each launched from its predecessor's exit; the oldest is on the committed
  path. branch: a second successor launched from a runner-up prediction;
  lane: the branch and its own successors, whose keys live in the slot's
  side entries (``Speculation.branch_depth`` is a lane's length in tokens).
- row: one in-flight token through one loop in one pipeline step (``Rows``,
  R of them; ``row_budget``, ``DecodeStats.rows``). A line of a statistics
  file is a record (``speed.serve.records``), never a row.
- pipeline step (in the engine, plain *step*): one engine iteration,
  ``Engine.step``: admit what fits, run one group pass over the step's rows,
  then commit, launch and flush (``StepResult``, ``DecodeStats.steps``; one
  line of the worked schedule, ``speed.decode.schedule.ScheduleStep``).
- group pass: the model's call in a pipeline step, its shared N-layer group
  once over the step's rows, each at its own loop (``Stepper.step``,
  ``LoopedLM.step``; ``Engine._execute``; ``DecodeStats.group_passes``,
  the weight reads). A training step (``TrainConfig.max_steps``) is one
  optimizer update, a word of ``speed.train`` only.
- draft token, draft position: vLLM's speculation terms (``RequestStats``).
"""

from speed.engine.engine import Engine
from speed.engine.policies import budget_rows, should_branch, should_flush, should_launch
from speed.engine.types import (
    EXIT_KINDS,
    INVALIDATIONS,
    LEVERS,
    METHODS,
    NO_EXIT,
    Admitted,
    Commit,
    DecodeStats,
    EngineConfig,
    ExitKind,
    ExitRule,
    Finished,
    Invalidation,
    Method,
    Request,
    RequestStats,
    Speculation,
    SpeculationFields,
    Stepper,
    StepResult,
    as_stepper,
)

__all__ = [
    "EXIT_KINDS",
    "INVALIDATIONS",
    "LEVERS",
    "METHODS",
    "NO_EXIT",
    "Admitted",
    "Commit",
    "DecodeStats",
    "Engine",
    "EngineConfig",
    "ExitKind",
    "ExitRule",
    "Finished",
    "Invalidation",
    "Method",
    "Request",
    "RequestStats",
    "Speculation",
    "SpeculationFields",
    "StepResult",
    "Stepper",
    "budget_rows",
    "should_branch",
    "should_flush",
    "should_launch",
    "as_stepper",
]
