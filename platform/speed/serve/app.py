"""The Ray Serve application: a FastAPI ingress deployment, one continuous-batching engine per replica.

    serve run speed.serve.app:build_app checkpoint=runs/.../checkpoint_000400   # or jobs/serve.py
    serve deploy jobs/configs/serve.yaml                                        # replicas, user_config, ...

Routes: ``POST /v1/completions`` (OpenAI completions; see ``speed.serve.protocol``),
``GET /v1/models``, ``GET /healthz``, ``GET /v1/stats`` (this replica's totals).
Each replica loads the checkpoint and its tokenizer (a local path or a URI),
decodes with an ``EngineRunner`` and writes one ``REQUEST_SCHEMA`` row per
decoded prompt, and its flip trace, under ``stats_path``
(``speed.serve.stats``; on local storage each row is logged before its answer
leaves, and Serve's graceful stop writes the rest through ``drain``); counters and
histograms also go to Ray's metrics. Live settings (``ServeSettings``) come from
``user_config`` via ``reconfigure``. Bodies are checked for size, JSON, text and
prompt count before any work (``speed.serve.limits``); with an API key
(``start_app(api_key=...)`` or ``$SPEED_API_KEY``) every route but ``/healthz``
needs ``Authorization: Bearer <key>`` (``speed.serve.auth``).
"""

# No ``from __future__ import annotations``: Serve pickles the deployment class by value, and FastAPI
# must still resolve the route annotations (the request model) on the replica.

import asyncio
import dataclasses
import logging
import os
import time
import uuid
from collections.abc import AsyncIterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import pyarrow as pa
import torch
from fastapi import FastAPI
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import ValidationError
from ray import serve
from ray.serve import metrics
from starlette.requests import Request as StarletteRequest

from speed.checkpoint import load_model
from speed.config import from_dict
from speed.data import get_task
from speed.engine import EngineConfig, Finished, Request
from speed.paths import repo_root
from speed.serve import auth, limits, protocol
from speed.serve.limits import BadRequest
from speed.serve.protocol import Choice, CompletionRequest, TextStream
from speed.serve.runner import EngineRunner, Submission
from speed.serve.stats import StatsSink
from speed.tokenizer import EOS_ID, Tokenizer

log = logging.getLogger(__name__)

CHECKPOINT_ENV = "SPEED_CHECKPOINT"  # build_app's checkpoint when its args name none
DEFAULT_STATS_PATH = str(repo_root() / "runs" / "serve")
METHODS = ("speed", "sequential")
INVALIDATIONS = ("eager", "final")


@dataclass(frozen=True)
class ServeSettings:
    """A replica's live settings: Serve's ``user_config``, applied by ``reconfigure``; unknown keys are errors."""

    max_active: int = 16  # engine capacity: requests decoded at once
    max_source_len: int = 128  # longest prompt in tokens (task prefix and EOS included)
    max_target_len: int = 128  # largest max_tokens
    row_budget: int | None = None  # rows per engine step; None: every in-flight row
    method: str = "speed"  # defaults for requests that leave them out
    launch_loop: int = 1
    invalidation: str = "eager"
    task: str | None = None  # task prefix put before text prompts that name no task
    max_tokens: int = 64
    trace: bool = True  # per-request flip traces to Parquet
    threads: int | None = None  # torch CPU threads of the replica; None: torch's choice
    flush_rows: int = 256  # statistics: write a row group at this many requests ...
    flush_s: float = 30.0  # ... or when the oldest buffered row is this old
    max_prompts: int = 32  # prompts in one request (a longer prompt array is a 400)
    max_body_bytes: int = 1 << 20  # request body size (a larger body is a 413, refused before it is read)

    def __post_init__(self) -> None:
        positive = ("max_active", "max_source_len", "max_target_len", "launch_loop", "max_tokens", "flush_rows")
        for name in (*positive, "max_prompts", "max_body_bytes"):
            value = getattr(self, name)
            if type(value) is not int or value < 1:
                raise ValueError(f"ServeSettings.{name} must be an integer >= 1, got {value!r}")
        for name in ("row_budget", "threads"):
            value = getattr(self, name)
            if value is not None and (type(value) is not int or value < 1):
                raise ValueError(f"ServeSettings.{name} must be an integer >= 1 or null, got {value!r}")
        if self.method not in METHODS:
            raise ValueError(f"ServeSettings.method must be one of {METHODS}, got {self.method!r}")
        if self.invalidation not in INVALIDATIONS:
            raise ValueError(f"ServeSettings.invalidation must be one of {INVALIDATIONS}, got {self.invalidation!r}")
        if self.task is not None:
            get_task(self.task)
        if self.max_tokens > self.max_target_len:
            raise ValueError(f"ServeSettings.max_tokens {self.max_tokens} exceeds max_target_len {self.max_target_len}")
        if type(self.trace) is not bool:
            raise ValueError(f"ServeSettings.trace must be true or false, got {self.trace!r}")
        if not isinstance(self.flush_s, (int, float)) or self.flush_s <= 0:
            raise ValueError(f"ServeSettings.flush_s must be a positive number, got {self.flush_s!r}")

    def engine_config(self) -> EngineConfig:
        """The engine's fixed capacity and budget."""
        return EngineConfig(
            max_active=self.max_active,
            max_source_len=self.max_source_len,
            max_target_len=self.max_target_len,
            row_budget=self.row_budget,
            trace=self.trace,
        )


api = FastAPI(title="speed", description="SPEED greedy decoding of a parameter-shared T5, OpenAI completions API")
auth.require_key(api)  # a no-op until a replica sets api.state.api_key


@api.exception_handler(RequestValidationError)
async def _invalid(_request: Any, error: RequestValidationError) -> JSONResponse:
    message, param = protocol.validation_message(list(error.errors()))
    return JSONResponse(protocol.error_body(message, param), status_code=400)


@api.exception_handler(BadRequest)
async def _bad(_request: Any, error: BadRequest) -> JSONResponse:
    kind = "not_found_error" if error.status == 404 else "invalid_request_error"  # 413 too: OpenAI's type
    return JSONResponse(protocol.error_body(error.message, error.param, kind), status_code=error.status)


def load_served_model(checkpoint: str, device: str) -> tuple[torch.nn.Module, Tokenizer]:
    """The model (eval mode, on ``device``) and tokenizer of a checkpoint path or URI (or a run's newest)."""
    from speed.train.state import local_checkpoint

    with local_checkpoint(checkpoint) as directory:
        loaded = load_model(directory, map_location=device)
        if loaded.tokenizer_path is None:
            raise FileNotFoundError(f"checkpoint {checkpoint} holds no spm.model: a served model needs its tokenizer")
        tokenizer = Tokenizer.load(loaded.tokenizer_path)  # reads the file into memory
    return loaded.model.to(device).eval(), tokenizer


_COMPLETION_BODY = {
    "requestBody": {
        "required": True,
        "content": {"application/json": {"schema": CompletionRequest.model_json_schema()}},
    }
}


async def _parse(http: StarletteRequest, settings: ServeSettings) -> CompletionRequest:
    """The request body as a ``CompletionRequest``; anything else is a ``BadRequest`` saying what to fix.
    Size, JSON, text and prompt count are checked first (``speed.serve.limits``), before any work."""
    raw = await limits.read_body(http, settings.max_body_bytes)
    data = limits.parse_body(raw, settings.max_prompts)
    try:
        return CompletionRequest.model_validate(data)
    except ValidationError as err:
        message, param = protocol.validation_message(err)
        raise BadRequest(message, param) from None


@dataclass(frozen=True)
class _Plan:
    """A validated request: encoder inputs per prompt and resolved decoding settings."""

    inputs: list[list[int]]
    task: str | None
    max_tokens: int
    method: str
    launch_loop: int
    invalidation: str

    def settings(self) -> dict[str, Any]:
        return {"method": self.method, "launch_loop": self.launch_loop, "invalidation": self.invalidation}


def _settings_of(submission: Submission) -> dict[str, Any]:
    r = submission.request
    return {"method": r.method, "launch_loop": r.launch_loop, "invalidation": r.invalidation}


def _choice_stats(finished: Finished) -> dict[str, Any]:
    """The per-prompt part of an answer's ``speed`` object."""
    st = finished.stats
    return {
        "tokens": st.tokens,
        "steps": st.steps,
        "rows": st.rows,
        "flushes": st.flushes,
        "wasted_rows": st.wasted_rows,
        "flip_rate": list(st.flip_rate),
        "queued_ms": st.queued_s * 1e3,
        "ttft_ms": None if st.ttft_s != st.ttft_s else st.ttft_s * 1e3,  # nan: no token committed
        "latency_ms": st.latency_s * 1e3,
    }


def _trace_rows(trace: pa.Table | None, request_id: str, choice: int, replica: str) -> pa.Table | None:
    """The engine's trace of one request with the columns that key it in the served statistics."""
    if trace is None or trace.num_rows == 0:
        return None
    n = trace.num_rows
    keys = {
        "request_id": pa.array([request_id] * n, pa.string()),
        "choice": pa.array([choice] * n, pa.int32()),
        "replica": pa.array([replica] * n, pa.string()),
    }
    return pa.table({**keys, **{name: trace.column(name) for name in trace.column_names}})


class _Metrics:
    """Counters, histograms and gauges exported through Ray's Prometheus endpoint."""

    def __init__(self) -> None:
        self.requests = metrics.Counter(
            "speed_requests", "Prompts that left the engine", tag_keys=("method", "finish_reason")
        )
        self.tokens = metrics.Counter("speed_tokens", "Committed tokens", tag_keys=("method",))
        self.flushes = metrics.Counter("speed_flushes", "Misprediction flushes", tag_keys=("method",))
        ms = [5, 10, 25, 50, 100, 250, 500, 1000, 2500, 5000, 10000, 30000]
        self.latency = metrics.Histogram("speed_latency_ms", "Engine latency per prompt", ms, tag_keys=("method",))
        self.ttft = metrics.Histogram("speed_ttft_ms", "Time to first token per prompt", ms, tag_keys=("method",))
        rows = [1, 2, 4, 8, 16, 32, 64, 128, 256, 512]
        self.rows = metrics.Histogram("speed_rows_per_step", "Rows computed per engine step", rows)
        self.active = metrics.Gauge("speed_active", "Requests holding an engine slot")
        self.queued = metrics.Gauge("speed_queue_depth", "Requests waiting for an engine slot")

    def step(self, rows: int, active: int, queued: int) -> None:
        if rows:
            self.rows.observe(rows)
        self.active.set(active)
        self.queued.set(queued)

    def finished(self, row: dict[str, Any]) -> None:
        method = row["method"]
        self.requests.inc(tags={"method": method, "finish_reason": row["finish_reason"]})
        self.tokens.inc(row["completion_tokens"], tags={"method": method})
        if row["flushes"]:
            self.flushes.inc(row["flushes"], tags={"method": method})
        self.latency.observe(row["latency_ms"], tags={"method": method})
        if row["ttft_ms"] is not None:
            self.ttft.observe(row["ttft_ms"], tags={"method": method})


@serve.deployment(
    name="SpeedServer",
    max_ongoing_requests=32,  # per replica; beyond the engine's capacity they wait in its queue
    max_queued_requests=64,  # per caller; beyond that Serve answers 503 at once
    ray_actor_options={"num_cpus": 1},
    graceful_shutdown_timeout_s=20,  # ongoing requests get this long to finish on a stop (jobs/serve.py: 25 s in all)
)
@serve.ingress(api)
class SpeedServer:
    """One replica: model, tokenizer, engine runner, statistics sink and metrics."""

    def __init__(
        self,
        checkpoint: str,
        stats_path: str = DEFAULT_STATS_PATH,
        model_name: str | None = None,
        device: str = "auto",
        api_key: str | None = None,
    ) -> None:
        api.state.api_key = auth.resolve(api_key)  # None: open (no key given, none in $SPEED_API_KEY)
        device = ("cuda" if torch.cuda.is_available() else "cpu") if device == "auto" else device
        self.model, self.tokenizer = load_served_model(checkpoint, device)
        if self.tokenizer.vocab_size > self.model.config.vocab_size:
            raise ValueError(f"{checkpoint}: tokenizer has more ids than the model's vocabulary")
        self.model_name = model_name or Path(checkpoint.rstrip("/")).name
        context = serve.get_replica_context()
        self.replica = f"{context.app_name}#{context.deployment}#{context.replica_tag}"
        self.settings = ServeSettings()
        self.runner = EngineRunner(self.model, self.settings.engine_config(), self._record, self._step)
        self.sink = StatsSink(stats_path, self.replica, self.settings.flush_rows, self.settings.flush_s)
        self._writer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="speed-stats")  # Parquet, in order
        self._flusher: asyncio.Task | None = None
        self._metrics = _Metrics()

    async def reconfigure(self, user_config: dict[str, Any]) -> None:
        """Apply ``user_config`` (``ServeSettings`` keys); the engine is rebuilt when its capacity changes."""
        settings = from_dict(ServeSettings, dict(user_config or {}))
        if settings.launch_loop > self.model.n_loops:
            raise ValueError(f"launch_loop {settings.launch_loop} exceeds the model's {self.model.n_loops} loops")
        if settings.threads is not None:
            torch.set_num_threads(settings.threads)
        self.sink.max_rows, self.sink.max_seconds = settings.flush_rows, float(settings.flush_s)
        await self.runner.reconfigure(settings.engine_config())
        self.settings = settings

    def check_health(self) -> None:
        """Serve's health probe: the stepping loop must not have died."""
        task = self.runner.loop_task
        if task is not None and task.done() and not task.cancelled() and task.exception() is not None:
            raise RuntimeError(f"the engine loop died: {task.exception()!r}")

    def drain(self) -> int:
        """Stop the engine, wait for statistics being written and write the rest; returns the rows written now.
        Serve calls it (through ``__del__``) on every graceful stop, after the replica's requests drained."""
        runner, sink = getattr(self, "runner", None), getattr(self, "sink", None)
        if runner is not None:
            runner.close()
        if getattr(self, "_flusher", None) is not None:
            self._flusher.cancel()
        if getattr(self, "_writer", None) is not None:
            self._writer.shutdown(wait=True)
        return sink.flush() if sink is not None else 0

    def __del__(self) -> None:
        """What Serve's graceful shutdown calls on a replica (``serve.delete``, ``serve.shutdown``, a redeploy,
        scaling down): ``drain``. A replica killed hard skips it; its logged rows are kept (``speed.serve.stats``)."""
        self.drain()

    # ----- routes ---------------------------------------------------------------------------------

    @api.get("/healthz")
    def healthz(self) -> dict[str, Any]:
        """Liveness, with the engine's load."""
        return {"status": "ok", "replica": self.replica, "active": self.runner.active, "queued": self.runner.queued}

    @api.get("/v1/models")
    def models(self) -> dict[str, Any]:
        """The served model, OpenAI style, with its shape and limits."""
        c = self.model.config
        card = {
            "id": self.model_name,
            "object": "model",
            "created": 0,
            "owned_by": "speed",
            "pattern": str(c.pattern),
            "n_loops": self.model.n_loops,
            "max_source_len": self.settings.max_source_len,
            "max_target_len": self.settings.max_target_len,
        }
        return {"object": "list", "data": [card]}

    @api.get("/v1/stats")
    def stats(self) -> dict[str, Any]:
        """This replica's totals since it started, with its settings."""
        counts = self.runner.counters.snapshot(self.runner.active, self.runner.queued)
        return {"replica": self.replica, **counts, "settings": dataclasses.asdict(self.settings)}

    @api.post("/v1/completions", openapi_extra=_COMPLETION_BODY)
    async def completions(self, http: StarletteRequest) -> Any:
        """Greedy completions of one or more prompts; ``stream`` answers as server-sent events."""
        arrived, started = datetime.now(timezone.utc), time.perf_counter()
        self._start_flusher()
        try:
            body = await _parse(http, self.settings)
            plan = self._plan(body)
        except BadRequest:
            self.runner.counters.rejected += 1
            raise
        self.runner.counters.requests += 1
        request_id = f"cmpl-{uuid.uuid4().hex}"
        meta = {
            "request_id": request_id,
            "arrived": arrived,
            "started": started,
            "stream": body.stream,
            "task": plan.task,
            "max_tokens": plan.max_tokens,
        }
        submissions: list[Submission] = []
        try:
            for choice, ids in enumerate(plan.inputs):
                request = Request(ids, plan.max_tokens, plan.method, plan.launch_loop, plan.invalidation)
                submissions.append(await self.runner.submit(request, {**meta, "choice": choice}))
        except ValueError as err:
            for s in submissions:
                self.runner.cancel_soon(s.id)
            raise BadRequest(str(err)) from None
        created = protocol.now()
        if body.stream:
            return StreamingResponse(self._stream(request_id, created, submissions), media_type="text/event-stream")
        try:
            finished = await asyncio.gather(*(s.done for s in submissions))
        finally:
            for s in submissions:  # the client left (Serve cancels this task): free their rows
                if not s.done.done():
                    self.runner.cancel_soon(s.id)
        choices = [self._choice(s, f) for s, f in zip(submissions, finished)]
        speed = protocol.speed_object(self.replica, plan.settings(), choices)
        return protocol.completion_body(request_id, created, self.model_name, choices, speed)

    # ----- helpers --------------------------------------------------------------------------------

    def _plan(self, body: CompletionRequest) -> _Plan:
        """Resolve defaults, encode prompts and check them against the model's limits."""
        s = self.settings
        if body.model is not None and body.model != self.model_name:
            raise BadRequest(
                f"model {body.model!r} is not served here; this server serves {self.model_name!r}", "model", status=404
            )
        prompts = body.prompts()
        texts = isinstance(prompts[0], str)
        if body.task is not None and not texts:
            raise BadRequest("task applies to text prompts only; token-id prompts are sent as they are", "task")
        task = (body.task or s.task) if texts else None
        try:
            prefix = get_task(task).prefix if task else ""
        except ValueError as err:
            raise BadRequest(str(err), "task") from None
        inputs = self.tokenizer.encode_batch([prefix + p for p in prompts]) if texts else [list(p) for p in prompts]
        for i, ids in enumerate(inputs):
            if len(ids) > s.max_source_len:
                which = f"prompt[{i}]" if len(inputs) > 1 else "prompt"
                raise BadRequest(
                    f"{which} has {len(ids)} tokens (task prefix and EOS included); this server accepts at most "
                    f"{s.max_source_len}: shorten it",
                    "prompt",
                )
            bad = next((t for t in ids if t >= self.model.config.vocab_size), None)
            if bad is not None:
                raise BadRequest(
                    f"token id {bad} is outside the vocabulary [0, {self.model.config.vocab_size})", "prompt"
                )
        max_tokens = body.max_tokens if body.max_tokens is not None else s.max_tokens
        if max_tokens > s.max_target_len:
            raise BadRequest(f"max_tokens must be at most {s.max_target_len}, got {max_tokens}", "max_tokens")
        launch_loop = body.launch_loop if body.launch_loop is not None else s.launch_loop
        if launch_loop > self.model.n_loops:
            raise BadRequest(
                f"launch_loop must be in 1..{self.model.n_loops} (the model's loops), got {launch_loop}", "launch_loop"
            )
        return _Plan(
            inputs, task, max_tokens, body.method or s.method, launch_loop, body.invalidation or s.invalidation
        )

    async def _stream(self, request_id: str, created: int, submissions: list[Submission]) -> AsyncIterator[str]:
        """Text deltas of every choice as their tokens commit, each choice's end, usage and statistics, [DONE]."""
        events: asyncio.Queue[tuple[int, int | None]] = asyncio.Queue()

        async def pump(index: int, s: Submission) -> None:
            async for token in s.stream():
                events.put_nowait((index, token))
            events.put_nowait((index, None))

        pumps = [asyncio.create_task(pump(i, s)) for i, s in enumerate(submissions)]
        texts = [TextStream(self.tokenizer.decode) for _ in submissions]
        choices: list[Choice] = []
        try:
            while len(choices) < len(submissions):
                index, token = await events.get()
                if token is not None:
                    delta = texts[index].push(token)
                    if delta:
                        yield protocol.chunk(request_id, created, self.model_name, index, delta, None)
                    continue
                s = submissions[index]
                try:
                    finished = await s.done
                except Exception as err:  # the engine failed it: say so, end the stream
                    yield protocol.sse(protocol.error_body(f"decoding failed: {err}", kind="server_error"))
                    break
                choice = self._choice(s, finished)
                choices.append(choice)
                tail = texts[index].finish()
                yield protocol.chunk(request_id, created, self.model_name, index, tail, choice.finish_reason)
            else:
                final = {
                    "id": request_id,
                    "object": "text_completion",
                    "created": created,
                    "model": self.model_name,
                    "choices": [],
                    "usage": protocol.usage(choices),
                    "speed": protocol.speed_object(self.replica, _settings_of(submissions[0]), choices),
                }
                yield protocol.sse(final)
            yield protocol.DONE
        finally:  # also when the client disconnected: free the rows of unfinished choices
            for p in pumps:
                p.cancel()
            for s in submissions:
                if not s.done.done():
                    self.runner.cancel_soon(s.id)

    def _choice(self, submission: Submission, finished: Finished) -> Choice:
        tokens = finished.tokens
        return Choice(
            index=submission.meta["choice"],
            text=self.tokenizer.decode(tokens),
            finish_reason="stop" if tokens and tokens[-1] == EOS_ID else "length",
            prompt_tokens=len(submission.request.input_ids),
            completion_tokens=len(tokens),
            speed=_choice_stats(finished),
        )

    def _step(self, rows: int, active: int, queued: int) -> None:
        """After every engine step: rows per step and the engine's load to Ray's metrics."""
        self._metrics.step(rows, active, queued)

    def _record(self, finished: Finished, submission: Submission) -> None:
        """A request left the engine: one statistics row (and its trace) to the sink, metrics."""
        meta, request = submission.meta, submission.request
        tokens = finished.tokens
        reason = "cancelled" if finished.cancelled else ("stop" if tokens and tokens[-1] == EOS_ID else "length")
        row = {
            "request_id": meta["request_id"],
            "choice": meta["choice"],
            "replica": self.replica,
            "engine_id": finished.id,
            "arrived": meta["arrived"],
            "model": self.model_name,
            "task": meta["task"],
            "method": request.method,
            "launch_loop": request.launch_loop,
            "invalidation": request.invalidation,
            "stream": meta["stream"],
            "max_tokens": meta["max_tokens"],
            "prompt_tokens": len(request.input_ids),
            "completion_tokens": len(tokens),
            "finish_reason": reason,
            **{k: v for k, v in _choice_stats(finished).items() if k != "tokens"},
            "total_ms": (time.perf_counter() - meta["started"]) * 1e3,
            "max_active": self.runner.config.max_active,
            "row_budget": self.runner.config.row_budget,
        }
        self.sink.add(row, _trace_rows(finished.trace, meta["request_id"], meta["choice"], self.replica))
        self._metrics.finished(row)
        if self.sink.due():
            self._write_soon()

    def _write_soon(self) -> None:
        """Write the buffered statistics on the writer thread, so the event loop keeps serving."""
        taken = self.sink.take()
        if taken is not None:
            self._writer.submit(self.sink.write, taken).add_done_callback(_log_write_error)

    def _start_flusher(self) -> None:
        if self._flusher is None:
            self._flusher = asyncio.get_running_loop().create_task(self._flush_periodically())

    async def _flush_periodically(self) -> None:
        """The time bound: flush buffered rows once they are ``flush_s`` old, even when no request comes."""
        while True:
            await asyncio.sleep(min(1.0, self.sink.max_seconds / 4))
            if self.sink.due():
                self._write_soon()


def _log_write_error(done: Future) -> None:
    if done.exception() is not None:  # the rows stay in their write-ahead log on local storage
        log.error("writing request statistics failed: %r", done.exception())


def build_app(args: dict[str, Any]) -> serve.Application:
    """Application builder for ``serve run speed.serve.app:build_app checkpoint=...`` and Serve config files.

    ``args``: ``checkpoint`` (a checkpoint or run directory, local or URI; default ``$SPEED_CHECKPOINT``),
    ``stats_path``, ``model_name``, ``device`` (``auto``, ``cpu``, ``cuda``). An API key comes from
    ``$SPEED_API_KEY`` in the replicas' environment, never from ``args`` (config files are not secret).
    """
    known = {"checkpoint", "stats_path", "model_name", "device"}
    unknown = sorted(set(args) - known)
    if unknown:
        raise ValueError(f"unknown application argument(s) {unknown}; valid ones are {sorted(known)}")
    args = dict(args)
    args.setdefault("checkpoint", os.environ.get(CHECKPOINT_ENV))
    if not args["checkpoint"]:
        raise ValueError(f"the application needs checkpoint=<checkpoint directory or URI> (or ${CHECKPOINT_ENV})")
    return SpeedServer.bind(**args)


def start_app(
    checkpoint: str,
    *,
    port: int = 8000,
    host: str = "127.0.0.1",
    replicas: int = 1,
    settings: dict[str, Any] | None = None,
    stats_path: str = DEFAULT_STATS_PATH,
    model_name: str | None = None,
    device: str = "auto",
    num_cpus: float = 1,
    num_gpus: float = 0,
    max_ongoing_requests: int | None = None,
    max_queued_requests: int | None = None,
    name: str = "speed",
    route_prefix: str = "/",
    api_key: str | None = None,
) -> str:
    """Start Serve's HTTP proxy on ``host:port`` (loopback by default) and deploy the application under
    ``route_prefix`` on the connected Ray; returns its URL. ``settings`` is the ``user_config``
    (``ServeSettings`` keys); ``api_key`` (else the replicas' ``$SPEED_API_KEY``) is required on every
    route but ``/healthz``."""
    from_dict(ServeSettings, dict(settings or {}))  # fail here, not in a replica
    serve.start(http_options={"host": host, "port": port})
    options: dict[str, Any] = {
        "num_replicas": replicas,
        "user_config": dict(settings or {}),
        "ray_actor_options": {"num_cpus": num_cpus, "num_gpus": num_gpus},
    }
    for key, value in (("max_ongoing_requests", max_ongoing_requests), ("max_queued_requests", max_queued_requests)):
        if value is not None:
            options[key] = value
    deployment = SpeedServer.options(**options)
    app = deployment.bind(checkpoint, stats_path, model_name, device, api_key=api_key)
    serve.run(app, name=name, route_prefix=route_prefix)
    return f"http://{host}:{port}{route_prefix.rstrip('/')}"
