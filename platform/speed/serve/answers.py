"""From committed tokens to an answer: each choice's text as its tokens commit, the choices' fan-in, and the
whole answer or its server-sent events.

``ChoiceText`` turns one choice's tokens into text deltas (incremental detokenisation, stop strings cut across
tokens, logprobs kept with the text they belong to). ``choice_events`` merges the token streams of a request's
submissions into one sequence of ``Event``: a text delta or a choice's end. A stop string cancels its choice in
the engine at once (its rows are freed), telling the runner how many tokens the answer kept (its record's).
``whole_answer`` collects the events into one body, ``streamed_answer`` sends each as it comes
(``speed.serve.responses`` shapes both).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from speed.engine import Finished
from speed.serve.records import choice_stats
from speed.serve.responses import DONE, Choice, Surface, TokenInfo, error_body, speed_object, sse
from speed.serve.runner import Submission

if TYPE_CHECKING:
    from speed.serve.planning import Plan

# ----- one choice's text -----------------------------------------------------------------------


class TextStream:
    """Incremental detokenisation: the text a new token adds to what was already sent.

    SentencePiece joins pieces with context (a leading ``▁`` is a space except
    at the start), so each delta is the difference of whole decodes; text that
    is not yet a clean extension is held back until it is.
    """

    def __init__(self, decode: Any) -> None:
        self._decode = decode
        self.tokens: list[int] = []
        self.sent = ""

    def push(self, token: int) -> str:
        """Add a token; return the new text to send (possibly empty)."""
        self.tokens.append(token)
        text = self._decode(self.tokens)
        if text.endswith("\ufffd") or not text.startswith(self.sent):  # a split character, or a rewrite
            return ""
        delta, self.sent = text[len(self.sent) :], text
        return delta

    def finish(self) -> str:
        """Whatever the final decode adds beyond what was sent (after held-back text)."""
        text = self._decode(self.tokens)
        delta = text[len(self.sent) :] if text.startswith(self.sent) else ""
        self.sent = text
        return delta


@dataclass
class Delta:
    """What one committed token releases to the client: text and the tokens it completes."""

    text: str
    tokens: list[TokenInfo] | None
    stopped: bool = False  # a stop string ended the choice: nothing follows


@dataclass
class ChoiceText:
    """One choice's text as its tokens commit: deltas to send, with stop strings cut out.

    Text that could still become the start of a stop string is held back until
    it cannot; when a stop string appears the text before it is released and
    the choice ends (the stop text itself is never sent). With logprobs, each
    token's entry goes out with the first delta at or after it.
    """

    decode: Any
    piece: Any  # token id -> its text piece (logprobs)
    stop: list[str] = field(default_factory=list)
    logprobs: bool = False
    prefix: str = ""  # echo: the prompt's text, sent first
    _text: TextStream = field(init=False)
    _released: int = field(init=False, default=0)  # characters of _text.sent already released
    _held: list[TokenInfo] = field(init=False, default_factory=list)
    text: str = field(init=False, default="")  # everything released so far (echo's prefix included)
    consumed: int = field(init=False, default=0)  # tokens taken, up to the one completing a stop string
    stopped: bool = field(init=False, default=False)

    def __post_init__(self) -> None:
        self._text = TextStream(self.decode)
        self.text = self.prefix

    def push(self, token: int, logprob: Any = None) -> Delta:
        """Add a committed token (``logprob``: the engine's ``TokenLogprob`` or None)."""
        self.consumed += 1
        offset = len(self.prefix) + len(self._text.sent)
        self._text.push(token)
        if self.logprobs and logprob is not None:
            top = [(self.piece(t), lp) for t, lp in logprob.top]
            self._held.append(TokenInfo(self.piece(logprob.token), logprob.logprob, top, offset))
        return self._release(self._text.sent, final=False)

    def finish(self) -> Delta:
        """The choice ended in the engine: release what was held back."""
        self._text.finish()
        return self._release(self._text.sent, final=True)

    def _release(self, full: str, final: bool) -> Delta:
        start = max(0, self._released - max((len(s) for s in self.stop), default=0))
        cut = min((i for i in (full.find(s, start) for s in self.stop) if i >= 0), default=-1)
        if cut >= 0:
            self.stopped, end = True, cut
        elif final:
            end = len(full)
        else:
            end = len(full) - _held_back(full, self.stop)
        delta = full[self._released : end] if end > self._released else ""
        self._released = max(self._released, end)
        tokens = None
        if self.logprobs and (delta or final or self.stopped):
            tokens, self._held = self._held, []
        elif self.logprobs:
            tokens = []
        self.text += delta
        return Delta(delta, tokens, self.stopped)


def _held_back(text: str, stops: list[str]) -> int:
    """How many characters at the end of ``text`` could begin a stop string (held back until they cannot)."""
    best = 0
    for s in stops:
        for k in range(min(len(s) - 1, len(text)), best, -1):
            if text.endswith(s[:k]):
                best = k
                break
    return best


# ----- the choices' fan-in and the answer --------------------------------------------------------


@dataclass
class Event:
    """One step of a choice: text released (``delta``), and with ``finished`` or ``error`` its end."""

    index: int  # the submission's position in the request (its choice index)
    delta: Delta
    finished: Finished | None = None
    error: BaseException | None = None  # the engine failed it


async def choice_events(
    submissions: list[Submission], texts: list[ChoiceText], cancel: Callable[[int, int | None], None]
) -> AsyncIterator[Event]:
    """Every choice's deltas as its tokens commit, then its end; on leaving early (a client gone, an error) the
    unfinished choices are cancelled (``cancel`` takes an engine id, and the tokens kept when a stop string ended
    the choice: ``EngineRunner.cancel_soon``)."""
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
                    cancel(s.id, text.consumed)
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
                cancel(s.id, None)


@dataclass(frozen=True)
class Answering:
    """One request being answered: how its route shapes it, its ids, its plan and its choices in the engine."""

    surface: Surface
    request_id: str
    created: int  # OpenAI's ``created`` (``speed.serve.responses.now``)
    model: str  # the served model's name
    replica: str
    plan: Plan
    submissions: list[Submission]  # one per choice, in the plan's order
    tokenizer: Any  # decode, piece
    cancel: Callable[[int, int | None], None]  # cancels an engine id without waiting (tokens kept by a stop string)

    def texts(self) -> list[ChoiceText]:
        """A fresh ``ChoiceText`` per choice (its prompt's echo first)."""
        plan, tok = self.plan, self.tokenizer
        logprobs = plan.logprobs is not None
        return [ChoiceText(tok.decode, tok.piece, plan.stops, logprobs, plan.echoes[p]) for p in plan.prompts]

    def choice(self, index: int, text: ChoiceText, finished: Finished) -> Choice:
        """The answer's view of a finished choice: its text, why it ended, its token counts and statistics."""
        tokens = finished.tokens
        stopped = text.stopped or finished.stopped
        return Choice(
            index=index,
            prompt=self.plan.prompts[index],
            text=text.text,
            finish_reason="stop" if stopped else "length",
            prompt_tokens=len(self.submissions[index].request.input_ids),
            completion_tokens=text.consumed if text.stopped else len(tokens),
            speed=choice_stats(finished),
        )


async def whole_answer(a: Answering) -> dict[str, Any]:
    """The answer as one body, once every choice ended; an engine failure raises."""
    texts = a.texts()
    tokens: list[list[TokenInfo]] = [[] for _ in a.submissions]
    choices = []
    async for event in choice_events(a.submissions, texts, a.cancel):
        if event.error is not None:
            raise event.error
        if event.delta.tokens:
            tokens[event.index] += event.delta.tokens
        if event.finished is not None:
            choice = a.choice(event.index, texts[event.index], event.finished)
            choice.tokens = tokens[event.index] if a.plan.logprobs is not None else None
            choices.append(choice)
    speed = speed_object(a.replica, a.plan.settings(), choices)
    return a.surface.body(a.request_id, a.created, a.model, choices, speed)


async def streamed_answer(a: Answering) -> AsyncIterator[str]:
    """Text deltas of every choice as their tokens commit, each choice's end, the usage (when asked for) with the
    statistics, [DONE]."""
    plan, texts = a.plan, a.texts()

    def chunk(index: int, text: str | None, finish: str | None = None, tokens: Any = None) -> str:
        return a.surface.chunk(a.request_id, a.created, a.model, index, text, finish, tokens, plan.include_usage)

    for index, text in enumerate(texts):
        if a.surface.chat:
            yield chunk(index, None)  # the role first, as OpenAI sends it
        elif text.prefix:
            yield chunk(index, text.prefix)
    choices: list[Choice] = []
    async for event in choice_events(a.submissions, texts, a.cancel):
        if event.error is not None:  # the engine failed it: say so, end the stream
            yield sse(error_body(f"decoding failed: {event.error}", kind="server_error"))
            break
        if event.finished is None:
            if event.delta.text:
                yield chunk(event.index, event.delta.text, None, event.delta.tokens)
            continue
        choice = a.choice(event.index, texts[event.index], event.finished)
        choices.append(choice)
        yield chunk(event.index, event.delta.text, choice.finish_reason, event.delta.tokens)
    else:
        speed = speed_object(a.replica, plan.settings(), choices)
        yield a.surface.final(a.request_id, a.created, a.model, choices, speed, plan.include_usage)
    yield DONE
