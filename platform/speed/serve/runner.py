"""One continuous-batching engine driven by an asyncio loop: what a Serve replica runs (no Ray here).

Every engine call (``add``, ``step``, ``cancel``, rebuilding) runs on one
worker thread, in submission order, so the event loop keeps answering HTTP
while a step computes, and the engine is only ever touched by that thread.
The stepping task runs while requests are active and sleeps otherwise.
Committed tokens (``speed.engine.Commit``: token and log-probabilities) go to
each request's queue as they come, for streaming, with the time they arrived.
The runner counts nothing itself: it hands every step (``on_step``) and every
request that leaves the engine (``on_finished``, an ``Ended``) to its caller.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

from speed.engine import Commit, Engine, EngineConfig, Finished, Request

log = logging.getLogger(__name__)

Meta = TypeVar("Meta")  # the caller's own record of a request (the app's: its choice's ChoiceMeta)


@dataclass
class Submission(Generic[Meta]):
    """A request inside the runner: its engine id, its tokens as they commit, and its end."""

    request: Request
    meta: Meta  # the caller's record of it, handed back in its ``Ended``
    id: int = -1  # the engine's id, set when the engine accepted it
    tokens: asyncio.Queue[Commit | None] = field(default_factory=asyncio.Queue)  # None after the last token
    done: asyncio.Future[Finished] = field(default_factory=lambda: asyncio.get_running_loop().create_future())
    times: list[float] = field(default_factory=list)  # perf_counter when each committed token reached the runner
    config: EngineConfig | None = None  # the engine's capacity and row budget it runs under, set when queued
    stopped_at: int | None = None  # the caller ended it at a stop string, keeping these tokens (``cancel_soon``)

    async def stream(self) -> AsyncIterator[Commit]:
        """The committed tokens, in order, until the request finishes."""
        while (commit := await self.tokens.get()) is not None:
            yield commit

    @property
    def gaps(self) -> list[float]:
        """Seconds between consecutive committed tokens (inter-token latencies)."""
        return [b - a for a, b in zip(self.times, self.times[1:])]


@dataclass(frozen=True)
class Ended(Generic[Meta]):
    """A request that left the engine (finished or cancelled), as the runner saw it: what its record is made of."""

    request: Request
    meta: Meta  # the caller's record of it (``submit``)
    finished: Finished
    stopped_at: int | None  # tokens the answer kept when a stop string ended it; None: no stop string did
    gaps: list[float]  # seconds between its committed tokens
    left: float  # perf_counter when it left the engine
    config: EngineConfig  # the engine's capacity and row budget it ran under


class EngineRunner:
    """Owns an ``Engine`` and steps it from a background task while requests are active.

    ``on_finished(ended)`` is called on the event loop with every request that leaves the engine (finished or
    cancelled), before its submission completes; ``on_step(rows, active, queued)`` after every step, before the
    step's tokens are handed out (a test may submit from it: arrivals at a known step).
    """

    def __init__(
        self,
        model: Any,
        config: EngineConfig,
        on_finished: Callable[[Ended], None] | None = None,
        on_step: Callable[[int, int, int], None] | None = None,
    ) -> None:
        self.model = model
        self.config = config
        self.on_finished = on_finished
        self.on_step = on_step
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="speed-engine")
        self._engine = Engine(model, config)
        self._pending: dict[int, Submission] = {}
        self._adding = 0  # submissions waiting for the engine's add
        self._wake: asyncio.Event | None = None
        self._open: asyncio.Event | None = None  # cleared while the engine is rebuilt
        self._task: asyncio.Task | None = None
        self._cancels: set[asyncio.Task] = set()

    # ----- public API --------------------------------------------------------------------------

    @property
    def active(self) -> int:
        """Requests holding an engine slot."""
        return self._engine.active

    @property
    def queued(self) -> int:
        """Requests waiting for a slot."""
        return self._engine.queued

    @property
    def loop_task(self) -> asyncio.Task | None:
        """The stepping task (None before the first request)."""
        return self._task

    @property
    def pending(self) -> int:
        """Requests submitted and not yet finished."""
        return len(self._pending)

    async def submit(self, request: Request, meta: Meta = None) -> Submission[Meta]:
        """Queue a request (``ValueError`` from the engine says what is wrong with it); ``meta``: the caller's
        record of it, kept in its ``Submission``."""
        (submission,) = await self.submit_all([request], [meta])
        return submission

    async def submit_all(self, requests: list[Request], metas: list[Meta]) -> list[Submission[Meta]]:
        """Queue several requests, all or none: when the engine refuses one (``ValueError``, its message
        prefixed with the request's index when there are several), those already queued are removed
        without a trace (no ``on_finished``)."""
        self._start()
        await self._open.wait()
        # No await until the adds are counted (_adding): a reconfigure waits for them, so this is their engine's.
        submissions = [Submission(r, m, config=self.config) for r, m in zip(requests, metas)]
        engine = self._engine

        def add() -> None:  # on the engine thread: registered before any step can commit its tokens
            for i, s in enumerate(submissions):
                try:
                    s.id = engine.add(s.request)
                except ValueError as err:
                    for added in submissions[:i]:
                        engine.cancel(added.id)
                        del self._pending[added.id]
                    raise ValueError(f"[{i}]: {err}" if len(submissions) > 1 else str(err)) from None
                self._pending[s.id] = s

        self._adding += 1
        try:
            await self._call(add)
        finally:
            self._adding -= 1
        self._wake.set()
        return submissions

    def cancel_soon(self, request_id: int, stopped_at: int | None = None) -> None:
        """Cancel a request without waiting (safe inside ``finally`` of a cancelled task); ``stopped_at``: the
        answer ended it at a stop string, keeping that many tokens (its ``Ended`` says so, even if it finishes
        before the cancel takes effect)."""
        submission = self._pending.get(request_id)
        if submission is None:
            return
        if stopped_at is not None:
            submission.stopped_at = stopped_at
        task = asyncio.get_running_loop().create_task(self.cancel(request_id))
        self._cancels.add(task)
        task.add_done_callback(self._cancels.discard)

    async def cancel(self, request_id: int) -> None:
        """Remove a request from the engine, freeing its slot; its submission ends as cancelled."""
        if request_id not in self._pending:
            return
        finished = await self._call(self._engine.cancel, request_id)
        if finished is not None:
            self._finish(finished)

    async def reconfigure(self, config: EngineConfig) -> None:
        """Use a new capacity or row budget: new requests wait, active ones finish, then the engine is rebuilt."""
        if config == self.config:
            return
        self._start()
        self._open.clear()
        try:
            while self._pending or self._adding:
                await asyncio.sleep(0.01)
            self._engine = await self._call(Engine, self.model, config)
            self.config = config
        finally:
            self._open.set()

    def close(self) -> None:
        """Stop stepping and release the worker thread; requests still pending end with an error."""
        if self._task is not None:
            self._task.cancel()
            self._task = None
        self._fail_all(RuntimeError("the replica is shutting down"))
        self._executor.shutdown(wait=False, cancel_futures=True)

    # ----- the stepping loop ---------------------------------------------------------------------

    def _start(self) -> None:
        if self._task is None:
            self._wake, self._open = asyncio.Event(), asyncio.Event()
            self._open.set()
            self._task = asyncio.get_running_loop().create_task(self._loop(), name="speed-engine-loop")

    async def _call(self, fn: Callable[..., Any], *args: Any) -> Any:
        return await asyncio.get_running_loop().run_in_executor(self._executor, fn, *args)

    async def _loop(self) -> None:
        while True:
            self._wake.clear()
            if not self._pending:
                await self._wake.wait()
                continue
            try:
                result = await self._call(self._engine.step)
            except Exception as err:  # a fault in decoding: fail its requests, keep the replica serving
                log.exception("engine step failed; failing %d requests and rebuilding the engine", len(self._pending))
                # New requests wait for the new engine. Those added to the old one, even after the fault (their
                # add was queued before the rebuild on the engine thread), are all pending once it is built: fail.
                self._open.clear()
                try:
                    self._engine = await self._call(Engine, self.model, self.config)
                finally:
                    self._fail_all(err)
                    self._open.set()
                continue
            if self.on_step is not None:
                self.on_step(result.rows, self._engine.active, self._engine.queued)
            now = time.perf_counter()
            for commit in result.committed:
                submission = self._pending.get(commit.id)
                if submission is not None:
                    submission.times.append(now)
                    submission.tokens.put_nowait(commit)
            for finished in result.finished:
                self._finish(finished)

    def _finish(self, finished: Finished) -> None:
        submission = self._pending.pop(finished.id, None)
        if submission is None:
            return
        if self.on_finished is not None:
            s = submission
            ended = Ended(s.request, s.meta, finished, s.stopped_at, s.gaps, time.perf_counter(), s.config)
            try:
                self.on_finished(ended)
            except Exception:  # statistics must never break an answer
                log.exception("on_finished failed for request %d", finished.id)
        submission.tokens.put_nowait(None)
        submission.done.set_result(finished)

    def _fail_all(self, err: BaseException) -> None:
        for submission in self._pending.values():
            submission.tokens.put_nowait(None)
            if not submission.done.done():
                submission.done.set_exception(err)
        self._pending.clear()
