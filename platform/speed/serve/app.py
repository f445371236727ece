"""The Ray Serve application: a FastAPI ingress deployment, one continuous-batching engine per replica.

    serve run speed.serve.app:build_app checkpoint=runs/.../checkpoint_000400   # or jobs/serve.py
    serve deploy jobs/configs/serve.yaml                                        # replicas, user_config, ...

Routes: ``POST /v1/completions`` and ``POST /v1/chat/completions`` (OpenAI's; see
``speed.serve.protocol``), ``GET /v1/models``, ``GET /healthz``, ``GET /v1/stats``
(this replica's totals). Each replica loads the checkpoint and its tokenizer (a
local path or a URI: ``speed.serve.loading``), plans each request into engine requests
(``speed.serve.planning``; the family, T5 or looped LM, is the checkpoint's), decodes them with
an ``EngineRunner``, merges their tokens into answers (``speed.serve.answers``) and writes one ``REQUEST_SCHEMA``
record per decoded choice, and its flip trace, under ``stats_path``
(``speed.serve.records``, ``speed.serve.sink``); counters and histograms also go
to Ray's Prometheus export (``speed.serve.metrics``). On local storage each record
is logged before its answer leaves, and Serve's graceful stop writes the rest
through ``drain``. Live settings (``ServeSettings``) come from ``user_config``
via ``reconfigure`` (``speed.serve.settings``). Bodies are checked for size, JSON, text and prompt count
before any work (``speed.serve.limits``); with an API key
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
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import torch
from fastapi import FastAPI
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel, ValidationError
from ray import serve
from starlette.requests import Request as StarletteRequest

from speed.config import coerce, from_dict
from speed.engine import LEVERS, Finished
from speed.engine.defaults import device_exit_adapters, device_levers
from speed.serve import auth, limits, protocol, responses
from speed.serve.answers import choice_events, choice_of
from speed.serve.limits import BadRequest
from speed.serve.loading import load_served_model
from speed.serve.metrics import ServeMetrics, resident_bytes
from speed.serve.planning import Plan, plan_request
from speed.serve.protocol import ChatRequest, CompletionRequest
from speed.serve.records import ChoiceMeta, choice_stats, request_record, trace_records
from speed.serve.responses import Choice, Surface, TokenInfo
from speed.serve.runner import EngineRunner, Submission
from speed.serve.settings import DEFAULT_STATS_PATH, ServeSettings
from speed.serve.sink import StatsSink
from speed.serve.text import ChoiceText
from speed.tokenizer import EOS_ID

log = logging.getLogger(__name__)

CHECKPOINT_ENV = "SPEED_CHECKPOINT"  # build_app's checkpoint when its args name none
api = FastAPI(title="speed", description="SPEED decoding of a looped T5 or LM behind OpenAI's completions API")
auth.require_key(api)  # a no-op until a replica sets api.state.api_key


@api.exception_handler(RequestValidationError)
async def _invalid(_request: Any, error: RequestValidationError) -> JSONResponse:
    message, param = protocol.validation_message(list(error.errors()))
    return JSONResponse(protocol.error_body(message, param), status_code=400)


@api.exception_handler(BadRequest)
async def _bad(_request: Any, error: BadRequest) -> JSONResponse:
    kind = "not_found_error" if error.status == 404 else "invalid_request_error"  # 413 too: OpenAI's type
    return JSONResponse(protocol.error_body(error.message, error.param, kind), status_code=error.status)


# what an engine error can be about
_PARAMS = ("max_tokens", "method", *LEVERS, "prompt")


# one server-sent event: ``data:`` a JSON chunk (``speed.serve.responses.Surface.chunk``) or ``[DONE]``
_EVENT = {
    "type": "object",
    "properties": {"data": {"type": "string"}, "event": {"type": "string"}},
    "required": ["data"],
}


def _openapi(model: type[BaseModel]) -> dict[str, Any]:
    """What a route accepts and answers, for ``/openapi.json`` (the body is parsed by hand: ``_parse``)."""
    error = {"application/json": {"schema": protocol.inline_schema(responses.ErrorResponse)}}
    answer = protocol.inline_schema(responses.ChatResponse if model is ChatRequest else responses.CompletionResponse)
    return {
        "requestBody": {"required": True, "content": {"application/json": {"schema": protocol.inline_schema(model)}}},
        "responses": {
            "200": {
                "description": "the answer, or with stream: server-sent events ending in data: [DONE]",
                "content": {
                    "application/json": {"schema": answer},
                    "text/event-stream": {"schema": _EVENT},
                },
            },
            "400": {"description": "a request that cannot be decoded as asked", "content": error},
            "404": {"description": "a model that is not served here", "content": error},
            "413": {"description": "a body over the deployment's max_body_bytes", "content": error},
            "503": {"description": "the replica's queue is full: try again"},
        },
    }


async def _parse(http: StarletteRequest, settings: ServeSettings, model: type[BaseModel] = CompletionRequest) -> Any:
    """The request body as a ``model`` (``CompletionRequest``, ``ChatRequest``); anything else is a
    ``BadRequest`` saying what to fix. Size, JSON, text and prompt count are checked first
    (``speed.serve.limits``), before any work."""
    raw = await limits.read_body(http, settings.max_body_bytes)
    data = limits.parse_body(raw, settings.max_prompts)
    try:
        return model.model_validate(data)
    except ValidationError as err:
        message, param = protocol.validation_message(err, model)
        raise BadRequest(message, param) from None


# Defined before the deployment class: Serve serializes the class when it is decorated, with the module's
# globals as they are at that moment, so a helper defined below it does not exist in the replicas.
def _log_write_error(done: Future) -> None:
    if done.exception() is not None:  # the records stay in their write-ahead log on local storage
        log.error("writing request statistics failed: %r", done.exception())


@serve.deployment(
    name="SpeedServer",
    max_ongoing_requests=32,  # per replica; beyond the engine's capacity they wait in its queue
    max_queued_requests=64,  # per caller; beyond that Serve answers 503 at once
    ray_actor_options={"num_cpus": 1},
    graceful_shutdown_timeout_s=20,  # ongoing requests get this long to finish on a stop (jobs/serve.py: 25 s in all)
)
@serve.ingress(api)
class SpeedServer:
    """One replica: model (its family from the checkpoint), tokenizer, engine runner, statistics sink and metrics."""

    def __init__(
        self,
        checkpoint: str,
        stats_path: str = DEFAULT_STATS_PATH,
        model_name: str | None = None,
        device: str = "auto",
        api_key: str | None = None,
        exit_adapters: bool | None = None,
    ) -> None:
        api.state.api_key = auth.resolve(api_key)  # None: open (no key given, none in $SPEED_API_KEY)
        device = ("cuda" if torch.cuda.is_available() else "cpu") if device == "auto" else device
        if exit_adapters is None:  # the device's default (speed.engine.defaults): on a GPU yes, on a CPU no
            exit_adapters = device_exit_adapters(device)
        self.served = load_served_model(checkpoint, device, exits=exit_adapters)
        self.model, self.tokenizer = self.served.model, self.served.tokenizer
        if self.tokenizer.vocab_size > self.model.config.vocab_size:
            raise ValueError(f"{checkpoint}: tokenizer has more ids than the model's vocabulary")
        self.model_name = model_name or Path(checkpoint.rstrip("/")).name
        context = serve.get_replica_context()
        self.replica = f"{context.app_name}#{context.deployment}#{context.replica_tag}"
        self.device = device
        self.settings = self._settings({})
        self.runner = EngineRunner(self.model, self.settings.engine_config(), self._record, self._step)
        self.sink = StatsSink(stats_path, self.replica, self.settings.flush_rows, self.settings.flush_s)
        self._writer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="speed-stats")  # Parquet, in order
        self._flusher: asyncio.Task | None = None
        self._metrics = ServeMetrics()

    async def reconfigure(self, user_config: dict[str, Any]) -> None:
        """Apply ``user_config`` (``ServeSettings`` keys); the engine is rebuilt when its capacity changes."""
        settings = self._settings(user_config)
        settings.check_model(self.model.n_loops)
        if settings.threads is not None:
            torch.set_num_threads(settings.threads)
        self.sink.max_records, self.sink.max_seconds = settings.flush_rows, float(settings.flush_s)
        await self.runner.reconfigure(settings.engine_config())
        self.settings = settings

    def _settings(self, user_config: dict[str, Any] | None) -> ServeSettings:
        """``user_config`` as settings; SPEED's settings it leaves out take the device's defaults
        (``speed.engine.defaults``: runner-up branches with lanes on a GPU, plain SPEED on a CPU)."""
        return from_dict(ServeSettings, device_levers(self.device, self.model.n_loops) | dict(user_config or {}))

    def check_health(self) -> None:
        """Serve's health probe: the stepping loop must not have died."""
        task = self.runner.loop_task
        if task is not None and task.done() and not task.cancelled() and task.exception() is not None:
            raise RuntimeError(f"the engine loop died: {task.exception()!r}")

    def drain(self) -> int:
        """Stop the engine, wait for statistics being written and write the rest; returns the records written now.
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
        scaling down): ``drain``. A replica killed hard skips it; its logged records are kept (``speed.serve.sink``)."""
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
            "family": self.served.family,
            "pattern": str(c.pattern),
            "n_loops": self.model.n_loops,
            "max_source_len": self.settings.max_source_len,
            "max_target_len": self.settings.max_target_len,
        }
        return {"object": "list", "data": [card]}

    @api.get("/v1/stats")
    def stats(self) -> dict[str, Any]:
        """This replica's totals since it started, its resident memory (bytes) and its settings."""
        counts = self.runner.counters.snapshot(self.runner.active, self.runner.queued)
        memory = {"rss_bytes": resident_bytes()}
        return {"replica": self.replica, **counts, **memory, "settings": dataclasses.asdict(self.settings)}

    @api.post("/v1/completions", openapi_extra=_openapi(CompletionRequest))
    async def completions(self, http: StarletteRequest) -> Any:
        """Completions of one or more prompts, n choices each; ``stream`` answers as server-sent events."""
        return await self._answer(http, CompletionRequest, responses.COMPLETIONS)

    @api.post("/v1/chat/completions", openapi_extra=_openapi(ChatRequest))
    async def chat_completions(self, http: StarletteRequest) -> Any:
        """Chat completions: a T5 decodes the last user message (under the request's or the deployment's task),
        a looped LM the messages in its checkpoint's chat template."""
        return await self._answer(http, ChatRequest, responses.CHAT)

    # ----- helpers --------------------------------------------------------------------------------

    async def _answer(self, http: StarletteRequest, model: type[BaseModel], surface: Surface) -> Any:
        arrived, started = datetime.now(timezone.utc), time.perf_counter()
        self._start_flusher()
        try:
            body = await _parse(http, self.settings, model)
            served = self.served
            plan = plan_request(body, self.settings, self.tokenizer, self.model_name, served.family, served.template)
        except BadRequest:
            self.runner.counters.rejected += 1
            raise
        request_id = f"{'chatcmpl' if surface.chat else 'cmpl'}-{uuid.uuid4().hex}"
        route = "chat" if surface.chat else "completions"
        metas = [
            {"choice": ChoiceMeta(request_id, i, p, route, arrived, started, body.stream, plan.task, seed)}
            for i, (p, seed) in enumerate(zip(plan.prompts, plan.seeds))
        ]
        try:
            submissions = await self.runner.submit_all(plan.requests, metas)
        except ValueError as err:  # the engine's check of each request: said in the request's words
            self.runner.counters.rejected += 1
            message = str(err).replace("max_new_tokens", "max_tokens").replace("input_ids", "prompt")
            message = f"prompt{message}" if message.startswith("[") else message
            raise BadRequest(message, next((p for p in _PARAMS if p in message), None)) from None
        self.runner.counters.requests += 1
        texts = [self._choice_text(plan, p) for p in plan.prompts]
        created = responses.now()
        if body.stream:
            events = self._stream(surface, request_id, created, plan, submissions, texts)
            return StreamingResponse(events, media_type="text/event-stream")
        tokens: list[list[TokenInfo]] = [[] for _ in submissions]
        choices = []
        async for event in choice_events(submissions, texts, self.runner.cancel_soon):
            if event.error is not None:
                raise event.error
            if event.delta.tokens:
                tokens[event.index] += event.delta.tokens
            if event.finished is not None:
                choice = self._choice(event.index, plan, submissions[event.index], texts, event.finished)
                choice.tokens = tokens[event.index] if plan.logprobs is not None else None
                choices.append(choice)
        speed = responses.speed_object(self.replica, plan.settings(), choices)
        return surface.body(request_id, created, self.model_name, choices, speed)

    def _choice_text(self, plan: Plan, prompt: int) -> ChoiceText:
        tok = self.tokenizer
        return ChoiceText(tok.decode, tok.piece, plan.stops, plan.logprobs is not None, plan.echoes[prompt])

    def _choice(
        self, index: int, plan: Plan, submission: Submission, texts: list[ChoiceText], finished: Finished
    ) -> Choice:
        prompt_tokens = len(submission.request.input_ids)
        return choice_of(
            index, plan.prompts[index], prompt_tokens, texts[index], finished, EOS_ID, choice_stats(finished)
        )

    async def _stream(
        self,
        surface: Surface,
        request_id: str,
        created: int,
        plan: Plan,
        submissions: list[Submission],
        texts: list[ChoiceText],
    ) -> AsyncIterator[str]:
        """Text deltas of every choice as their tokens commit, each choice's end, the usage (when asked for)
        with the statistics, [DONE]."""

        def chunk(index: int, text: str | None, finish: str | None = None, tokens: Any = None) -> str:
            return surface.chunk(request_id, created, self.model_name, index, text, finish, tokens, plan.include_usage)

        for index, text in enumerate(texts):
            if surface.chat:
                yield chunk(index, None)  # the role first, as OpenAI sends it
            elif text.prefix:
                yield chunk(index, text.prefix)
        choices: list[Choice] = []
        async for event in choice_events(submissions, texts, self.runner.cancel_soon):
            if event.error is not None:  # the engine failed it: say so, end the stream
                yield responses.sse(protocol.error_body(f"decoding failed: {event.error}", kind="server_error"))
                break
            if event.finished is None:
                if event.delta.text:
                    yield chunk(event.index, event.delta.text, None, event.delta.tokens)
                continue
            choice = self._choice(event.index, plan, submissions[event.index], texts, event.finished)
            choices.append(choice)
            yield chunk(event.index, event.delta.text, choice.finish_reason, event.delta.tokens)
        else:
            speed = responses.speed_object(self.replica, plan.settings(), choices)
            yield surface.final(request_id, created, self.model_name, choices, speed, plan.include_usage)
        yield responses.DONE

    def _step(self, rows: int, active: int, queued: int) -> None:
        """After every engine step: rows per step and the engine's load to Ray's metrics."""
        self._metrics.step(rows, active, queued)

    def _record(self, finished: Finished, submission: Submission) -> None:
        """A choice left the engine: one statistics record (and its trace) to the sink, metrics."""
        meta: ChoiceMeta = submission.meta["choice"]
        record = request_record(
            meta,
            submission.request,
            finished,
            replica=self.replica,
            model=self.model_name,
            family=self.served.family,
            eos_id=EOS_ID,
            stopped_at=submission.meta.get("stopped_at"),
            gaps=submission.gaps,
            total_s=time.perf_counter() - meta.started,
            max_active=self.runner.config.max_active,
            row_budget=self.runner.config.row_budget,
        )
        self.sink.add(record, trace_records(finished.trace, meta.request_id, meta.choice, self.replica))
        self._metrics.finished(record, submission.gaps)
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
        """The time bound: flush buffered records once they are ``flush_s`` old, even when no request comes."""
        while True:
            await asyncio.sleep(min(1.0, self.sink.max_seconds / 4))
            if self.sink.due():
                self._write_soon()


def build_app(args: dict[str, Any]) -> serve.Application:
    """Application builder for ``serve run speed.serve.app:build_app checkpoint=...`` and Serve config files.

    ``args``: ``checkpoint`` (a checkpoint or run directory, local or URI; default ``$SPEED_CHECKPOINT``),
    ``stats_path``, ``model_name``, ``device`` (``auto``, ``cpu``, ``cuda``), ``exit_adapters`` (``true``: the
    checkpoint's exit adapters when it has them; ``false``: plain exits; unset: the device's default, on a GPU
    yes, on a CPU no). An API key comes from
    ``$SPEED_API_KEY`` in the replicas' environment, never from ``args`` (config files are not secret).
    """
    known = {"checkpoint", "stats_path", "model_name", "device", "exit_adapters"}
    unknown = sorted(set(args) - known)
    if unknown:
        raise ValueError(f"unknown application argument(s) {unknown}; valid ones are {sorted(known)}")
    args = dict(args)
    args.setdefault("checkpoint", os.environ.get(CHECKPOINT_ENV))
    if "exit_adapters" in args:  # `serve run ... exit_adapters=false` passes a string
        args["exit_adapters"] = coerce(args["exit_adapters"], bool, "exit_adapters")
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
    max_replicas_per_node: int | None = None,
    proxy_location: str = "EveryNode",
    exit_adapters: bool | None = None,
) -> str:
    """Start Serve's HTTP proxy on ``host:port`` (loopback by default) and deploy the application under
    ``route_prefix`` on the connected Ray; returns its URL. ``settings`` is the ``user_config``
    (``ServeSettings`` keys); ``api_key`` (else the replicas' ``$SPEED_API_KEY``) is required on every
    route but ``/healthz``. ``max_replicas_per_node=1`` spreads the replicas over the nodes;
    ``proxy_location="HeadOnly"``: one proxy (several nodes on one machine cannot all bind ``host:port``);
    ``exit_adapters`` (None: the device's default, on a GPU yes, on a CPU no) drafts with the checkpoint's exit
    adapters where it has them."""
    from_dict(ServeSettings, dict(settings or {}))  # fail here, not in a replica
    serve.start(proxy_location=proxy_location, http_options={"host": host, "port": port})
    options: dict[str, Any] = {
        "num_replicas": replicas,
        "user_config": dict(settings or {}),
        "ray_actor_options": {"num_cpus": num_cpus, "num_gpus": num_gpus},
    }
    given = {
        "max_ongoing_requests": max_ongoing_requests,
        "max_queued_requests": max_queued_requests,
        "max_replicas_per_node": max_replicas_per_node,
    }
    for key, value in given.items():
        if value is not None:
            options[key] = value
    deployment = SpeedServer.options(**options)
    app = deployment.bind(checkpoint, stats_path, model_name, device, api_key=api_key, exit_adapters=exit_adapters)
    serve.run(app, name=name, route_prefix=route_prefix)
    return f"http://{host}:{port}{route_prefix.rstrip('/')}"
