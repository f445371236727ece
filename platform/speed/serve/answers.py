"""The fan-in of a request's choices: their committed tokens, as they come, turned into text deltas and ends.

``choice_events`` merges the token streams of a request's submissions into
one sequence of ``Event``: a text delta (stop strings cut, logprobs aligned:
``speed.serve.text.ChoiceText``) or a choice's end. A stop string cancels
its choice in the engine at once (its rows are freed) after recording, in the
submission's ``meta["stopped_at"]``, how many tokens the answer kept. Streamed
answers send each event as it comes; whole answers collect them.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

from speed.engine import Finished
from speed.serve.responses import Choice
from speed.serve.runner import Submission
from speed.serve.text import ChoiceText, Delta


@dataclass
class Event:
    """One step of a choice: text released (``delta``), and with ``finished`` or ``error`` its end."""

    index: int  # the submission's position in the request (its choice index)
    delta: Delta
    finished: Finished | None = None
    error: BaseException | None = None  # the engine failed it


async def choice_events(
    submissions: list[Submission], texts: list[ChoiceText], cancel: Callable[[int], None]
) -> AsyncIterator[Event]:
    """Every choice's deltas as its tokens commit, then its end; on leaving early (a client gone, an error) the
    unfinished choices are cancelled (``cancel`` takes an engine id)."""
    queue: asyncio.Queue[tuple[int, object]] = asyncio.Queue()

    async def pump(index: int, s: Submission) -> None:
        async for commit in s.stream():
            queue.put_nowait((index, commit))
        queue.put_nowait((index, None))

    pumps = [asyncio.create_task(pump(i, s)) for i, s in enumerate(submissions)]
    left = len(submissions)
    try:
        while left:
            index, commit = await queue.get()
            s, text = submissions[index], texts[index]
            if commit is not None:
                if text.stopped:  # committed after the stop string, before the cancel took effect
                    continue
                delta = text.push(commit.token, commit.logprob)
                if text.stopped:
                    s.meta["stopped_at"] = text.consumed
                    cancel(s.id)
                yield Event(index, delta)
                continue
            left -= 1
            try:
                finished = await s.done
            except Exception as err:
                yield Event(index, Delta("", None), error=err)
                return
            tail = Delta("", [] if text.logprobs else None, True) if text.stopped else text.finish()
            yield Event(index, tail, finished)
    finally:
        for p in pumps:
            p.cancel()
        for s in submissions:
            if not s.done.done():
                cancel(s.id)


def choice_of(
    index: int, prompt: int, prompt_tokens: int, text: ChoiceText, finished: Finished, eos_id: int, speed: dict
) -> Choice:
    """The answer's view of a finished choice: its text, why it ended, its token counts and statistics."""
    tokens = finished.tokens
    stopped = text.stopped or (bool(tokens) and tokens[-1] == eos_id)
    return Choice(
        index=index,
        prompt=prompt,
        text=text.text,
        finish_reason="stop" if stopped else "length",
        prompt_tokens=prompt_tokens,
        completion_tokens=text.consumed if text.stopped else len(tokens),
        speed=speed,
    )
