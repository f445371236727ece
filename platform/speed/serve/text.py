"""A choice's text as its tokens commit: incremental detokenisation, stop strings cut across tokens, logprobs
kept with the text they belong to."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from speed.serve.responses import TokenInfo


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
