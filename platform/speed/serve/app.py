"""The Ray Serve application: a FastAPI ingress deployment, one continuous-batching engine per replica.

    serve run speed.serve.app:build_app checkpoint=runs/.../checkpoint_000400   # or jobs/serve.py
    serve deploy jobs/configs/serve.yaml                                        # replicas, user_config, ...

Routes: ``POST /v1/completions`` and ``POST /v1/chat/completions`` (OpenAI's; see
``speed.serve.protocol``), ``GET /v1/models``, ``GET /healthz``, ``GET /v1/stats``
(this replica's totals). Each replica loads the checkpoint and its tokenizer (a
local path or a URI: ``speed.serve.settings.load_served_model``) and passes every request one way
through its stages:

1. parse (``speed.serve.limits``, ``speed.serve.protocol``): the body's size, JSON, text and prompt count,
   then its fields, before any work;
2. plan (``speed.serve.planning``): defaults resolved, prompts encoded as the checkpoint's family (T5 or
   looped LM) reads them, one engine request per choice;
3. run (``speed.serve.runner``): an ``EngineRunner`` decodes them;
4. answer (``speed.serve.answers``, ``speed.serve.responses``): their tokens become text, then one body or
   server-sent events;
5. record (``speed.serve.records``): every choice that leaves the engine becomes one ``REQUEST_SCHEMA`` record,
   and its flip trace, under ``stats_path`` (``speed.serve.sink``), and counts in Ray's Prometheus export
   (``speed.serve.metrics``). On local storage each record is logged before its answer leaves, and Serve's
   graceful stop writes the rest through ``drain``.

Live settings (``ServeSettings``) come from ``user_config`` via ``reconfigure`` (``speed.serve.settings``).
With an API key (``AppConfig.api_key`` or ``$SPEED_API_KEY``) every route but ``/healthz`` needs
``Authorization: Bearer <key>`` (``speed.serve.auth``).
"""

# No ``from __future__ import annotations``: Serve pickles the deployment class by value, and FastAPI
# must still resolve the route annotations (the request model) on the replica.

import copy
import dataclasses
import functools
import os
import time
import uuid
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import torch
from fastapi import FastAPI
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel
from ray import serve
from starlette.requests import Request as StarletteRequest

from speed.config import coerce
from speed.engine import as_stepper
from speed.engine.defaults import device_exit_adapters
from speed.models.precision import DTYPES
from speed.serve import auth, limits, protocol, responses
from speed.serve.answers import Answering, streamed_answer, whole_answer
from speed.serve.metrics import ServeCounters, ServeMetrics, resident_bytes
from speed.serve.planning import engine_error, plan_request
from speed.serve.protocol import BadRequest, ChatRequest, CompletionRequest
from speed.serve.records import ChoiceMeta, Recorder
from speed.serve.responses import Surface
from speed.serve.runner import EngineRunner
from speed.serve.settings import DEFAULT_STATS_PATH, AppConfig, ServeSettings, load_served_model
from speed.serve.sink import StatsSink

CHECKPOINT_ENV = "SPEED_CHECKPOINT"  # build_app's checkpoint when its args name none
api = FastAPI(title="speed", description="SPEED decoding of a looped T5 or LM behind OpenAI's completions API")
auth.require_key(api)  # a no-op until a replica sets api.state.api_key


@api.exception_handler(RequestValidationError)
async def _invalid(_request: Any, error: RequestValidationError) -> JSONResponse:
    message, param = protocol.validation_message(list(error.errors()))
    return JSONResponse(responses.error_body(message, param), status_code=400)


@api.exception_handler(BadRequest)
async def _bad(_request: Any, error: BadRequest) -> JSONResponse:
    kind = "not_found_error" if error.status == 404 else "invalid_request_error"  # 413 too: OpenAI's type
    return JSONResponse(responses.error_body(error.message, error.param, kind), status_code=error.status)


# one server-sent event: ``data:`` a JSON chunk (``speed.serve.responses.Surface.chunk``) or ``[DONE]``
_EVENT = {
    "type": "object",
    "properties": {"data": {"type": "string"}, "event": {"type": "string"}},
    "required": ["data"],
}


def _openapi(model: type[BaseModel]) -> dict[str, Any]:
    """What a route accepts and answers, for ``/openapi.json`` (the body is parsed by hand:
    ``speed.serve.limits.read_request``)."""
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


ROUTES = {"/v1/completions": CompletionRequest, "/v1/chat/completions": ChatRequest}


def served_openapi(app: FastAPI) -> dict[str, Any]:
    """``app``'s ``/openapi.json`` for the model its replica serves: FastAPI's document with the request schemas
    narrowed to what that model accepts (``protocol.served_schema``: ``method: "exit_gate"`` only with an exit
    gate, ``app.state.exit_gate``, which the replica sets as it sets its API key; unset: every method)."""
    document = copy.deepcopy(FastAPI.openapi(app))  # FastAPI's own, built once and kept by it
    for path, model in ROUTES.items():
        body = document["paths"][path]["post"]["requestBody"]["content"]["application/json"]
        body["schema"] = protocol.served_schema(model, getattr(app.state, "exit_gate", True))
    return document


api.openapi = functools.partial(served_openapi, api)  # what FastAPI's /openapi.json route calls


@serve.deployment(
    name="SpeedServer",
    max_ongoing_requests=32,  # per replica; beyond the engine's capacity they wait in its queue
    max_queued_requests=64,  # per caller; beyond that Serve answers 503 at once
    ray_actor_options={"num_cpus": 1},
    graceful_shutdown_timeout_s=20,  # ongoing requests get this long to finish on a stop (jobs/serve.py: 25 s in all)
    graceful_shutdown_wait_loop_s=0.25,  # how often a stopping replica checks for them: a drained one goes at once
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
        dtype: str = "float32",
        initial_state_seed: int | None = None,
        user_config: dict[str, Any] | None = None,
    ) -> None:
        api.state.api_key = auth.resolve(api_key)  # None: open (no key given, none in $SPEED_API_KEY)
        device = ("cuda" if torch.cuda.is_available() else "cpu") if device == "auto" else device
        if exit_adapters is None:  # the device's default (speed.engine.defaults): on a GPU yes, on a CPU no
            exit_adapters = device_exit_adapters(device)
        # user_config: the settings deployed with it (start_app's), which Serve applies in reconfigure; the load's
        # memory check counts their engine
        self.served = load_served_model(checkpoint, device, exit_adapters, dtype, user_config, initial_state_seed)
        api.state.exit_gate = getattr(as_stepper(self.served.model), "gated", False)  # what /openapi.json offers
        self.dtype = dtype
        self.model, self.tokenizer = self.served.model, self.served.tokenizer
        if self.tokenizer.vocab_size > self.model.config.vocab_size:
            raise ValueError(f"{checkpoint}: tokenizer has more ids than the model's vocabulary")
        self.model_name = model_name or Path(checkpoint.rstrip("/")).name
        context = serve.get_replica_context()
        self.replica = f"{context.app_name}#{context.deployment}#{context.replica_tag}"
        self.device = device
        self.settings = self._settings({})
        sink = StatsSink(stats_path, self.replica, self.settings.flush_rows, self.settings.flush_s)
        self.counters = ServeCounters(export=ServeMetrics())  # /v1/stats and Prometheus, each event counted once
        self.recorder = Recorder(sink, self.counters)
        self.runner = EngineRunner(
            self.model, self.settings.engine_config(), self.recorder.finished, self.recorder.step
        )

    async def reconfigure(self, user_config: dict[str, Any]) -> None:
        """Apply ``user_config`` (``ServeSettings`` keys); the engine is rebuilt when its capacity changes."""
        settings = self._settings(user_config)
        settings.check_model(self.model.n_loops)
        if settings.threads is not None:
            torch.set_num_threads(settings.threads)
        self.recorder.set_bounds(settings.flush_rows, settings.flush_s)
        await self.runner.reconfigure(settings.engine_config())
        self.settings = settings

    def _settings(self, user_config: dict[str, Any] | None) -> ServeSettings:
        """``user_config`` as this replica's settings (``ServeSettings.on_device``: SPEED's settings it leaves out,
        and whether branches are allocated, follow the device)."""
        return ServeSettings.on_device(self.device, self.model.n_loops, user_config)

    def check_health(self) -> None:
        """Serve's health probe: the stepping loop must not have died."""
        task = self.runner.loop_task
        if task is not None and task.done() and not task.cancelled() and task.exception() is not None:
            raise RuntimeError(f"the engine loop died: {task.exception()!r}")

    def drain(self) -> int:
        """Stop the engine, wait for statistics being written and write the rest; returns the records written now.
        Serve calls it (through ``__del__``) on every graceful stop, after the replica's requests drained."""
        runner, recorder = getattr(self, "runner", None), getattr(self, "recorder", None)  # None: __init__ failed
        if runner is not None:
            runner.close()
        return recorder.drain() if recorder is not None else 0

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
            "family": self.served.family.name,
            "pattern": str(c.pattern),
            "n_loops": self.model.n_loops,
            "dtype": self.dtype,  # the weights': float32, or bfloat16 (bf16 weights)
            "max_source_len": self.settings.max_source_len,
            "max_target_len": self.settings.max_target_len,
            "allow_branches": self.settings.allow_branches,  # whether a request may ask for runner-up branches
        }
        return {"object": "list", "data": [card]}

    @api.get("/v1/stats")
    def stats(self) -> dict[str, Any]:
        """This replica's totals since it started, its resident memory (bytes) and its settings."""
        counts = self.counters.snapshot(self.runner.active, self.runner.queued)
        memory = {"rss_bytes": resident_bytes(), "dtype": self.dtype, "packed_weights": self.served.packed_weights}
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

    # ----- one request, one way: parse, plan, run, answer (the runner hands each choice to the recorder) ------

    async def _answer(self, http: StarletteRequest, model: type[BaseModel], surface: Surface) -> Any:
        arrived, started = datetime.now(timezone.utc), time.perf_counter()
        self.recorder.start_flusher()
        settings, served = self.settings, self.served
        try:
            body = await limits.read_request(http, model, settings.max_body_bytes, settings.max_prompts)
            plan = plan_request(body, settings, self.tokenizer, self.model_name, served.family, served.template)
        except BadRequest:
            self.counters.add_rejected()
            raise
        request_id = f"{'chatcmpl' if surface.chat else 'cmpl'}-{uuid.uuid4().hex}"
        route = "chat" if surface.chat else "completions"
        by = {"replica": self.replica, "model": self.model_name, "family": served.family.name}
        metas = [
            ChoiceMeta(request_id, i, p, route, arrived, started, body.stream, plan.task, seed, **by)
            for i, (p, seed) in enumerate(zip(plan.prompts, plan.seeds))
        ]
        try:
            submissions = await self.runner.submit_all(plan.requests, metas)
        except ValueError as err:  # the engine's check of each request: said in the request's words
            self.counters.add_rejected()
            raise engine_error(err) from None
        self.counters.add_request()
        answering = Answering(
            surface=surface,
            request_id=request_id,
            created=responses.now(),
            model=self.model_name,
            replica=self.replica,
            plan=plan,
            submissions=submissions,
            tokenizer=self.tokenizer,
            cancel=self.runner.cancel_soon,
        )
        if body.stream:
            return StreamingResponse(streamed_answer(answering), media_type="text/event-stream")
        return await whole_answer(answering)


def build_app(args: dict[str, Any]) -> serve.Application:
    """Application builder for ``serve run speed.serve.app:build_app checkpoint=...`` and Serve config files.

    ``args``: ``checkpoint`` (a checkpoint or run directory, local or URI; default ``$SPEED_CHECKPOINT``),
    ``stats_path``, ``model_name``, ``device`` (``auto``, ``cpu``, ``cuda``), ``exit_adapters`` (``true``: the
    checkpoint's exit adapters when it has them; ``false``: plain exits; unset: the device's default, on a GPU
    yes, on a CPU no), ``dtype`` (``float32``, the default, or ``bfloat16``: bf16 weights), ``initial_state_seed``
    (Huginn's seeded random initial state; unset: zero). An API key comes from
    ``$SPEED_API_KEY`` in the replicas' environment, never from ``args`` (config files are not secret).
    """
    known = {"checkpoint", "stats_path", "model_name", "device", "exit_adapters", "dtype", "initial_state_seed"}
    unknown = sorted(set(args) - known)
    if unknown:
        raise ValueError(f"unknown application argument(s) {unknown}; valid ones are {sorted(known)}")
    args = dict(args)
    args.setdefault("checkpoint", os.environ.get(CHECKPOINT_ENV))
    if "exit_adapters" in args:  # `serve run ... exit_adapters=false` passes a string
        args["exit_adapters"] = coerce(args["exit_adapters"], bool, "exit_adapters")
    if "initial_state_seed" in args:  # a string too
        args["initial_state_seed"] = coerce(args["initial_state_seed"], int, "initial_state_seed")
    if args.get("dtype", DTYPES[0]) not in DTYPES:
        raise ValueError(f"dtype={args['dtype']!r}: choose one of {DTYPES}")
    if not args["checkpoint"]:
        raise ValueError(f"the application needs checkpoint=<checkpoint directory or URI> (or ${CHECKPOINT_ENV})")
    return SpeedServer.bind(**args)


def start_app(config: AppConfig) -> str:
    """Start Serve's HTTP proxy and deploy the application on the connected Ray as ``config`` says (loopback and
    one replica by default); returns its URL."""
    c = config
    serve.start(proxy_location=c.proxy_location, http_options={"host": c.host, "port": c.port})
    options: dict[str, Any] = {
        "num_replicas": c.replicas,
        "user_config": dict(c.settings),
        "ray_actor_options": {"num_cpus": c.num_cpus, "num_gpus": c.num_gpus},
    }
    for key in ("max_ongoing_requests", "max_queued_requests", "max_replicas_per_node"):
        if getattr(c, key) is not None:  # else the deployment's own
            options[key] = getattr(c, key)
    deployment = SpeedServer.options(**options)
    app = deployment.bind(
        c.checkpoint,
        c.stats_path,
        c.model_name,
        c.device,
        api_key=c.api_key,
        exit_adapters=c.exit_adapters,
        dtype=c.dtype,
        initial_state_seed=c.initial_state_seed,
        user_config=dict(c.settings),
    )
    serve.run(app, name=c.name, route_prefix=c.route_prefix)
    return f"http://{c.host}:{c.port}{c.route_prefix.rstrip('/')}"
