"""How a loop's exit logits become a decision: greedy or seeded sampling, lossless under SPEED.

Every early exit and the last loop go through ``exit_scores`` and ``exit_choices``,
so SPEED's speculation and its committed tokens are decided by one function of
a row's own logits (never of the other rows of the step), and the engine's
policies (launching, branching, gating) read the same numbers per row.

Sampling is Gumbel-max: the token at output position ``pos`` is
``argmax(processed_logits + g)``, where ``processed_logits`` are the row's logits
after penalties, temperature, top-k and top-p (outside the support: -inf) and
``g`` is Gumbel noise that depends only on ``(seed, pos, vocabulary index)``:
an integer hash computed with int64 tensor ops (no global RNG stream, no batch,
no step, no device generator), turned into uniforms and ``-log(-log(u))`` in
float64 on the logits' device (``device_gumbel``; on the CPU ``gumbel``'s
numbers, bit for bit). The committed token is the last loop's draw; sequential
decoding draws the same token from the same logits with the same noise (on one
device, the same device computes both), so SPEED stays exact by construction.
Coupled speculation launches a successor from an early exit's draw under the
*same* noise: when the early distribution is nearly the final one, its draw is
nearly always the final draw.

Everything between a step's logits and its decisions runs on the logits' device, and ``exit_choices`` brings
the decisions back to the host in one copy (the host's one wait of a step on a GPU).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache
from typing import NamedTuple

import torch
from torch import Tensor

from speed.engine.rows import to_device

MAX_LOGPROBS = 20  # most alternatives a request may ask for per token (OpenAI's bound)
_MASK32 = 0xFFFFFFFF
_MASK64 = 0xFFFFFFFFFFFFFFFF
_GOLDEN64 = 0x9E3779B97F4A7C15  # 2**64 / golden ratio: splitmix64's stream increment
_STATE_STREAM = 0x5EED5747E  # keys the initial states' noise apart from the Gumbel noise of an equal seed


@dataclass(frozen=True)
class Sampling:
    """How one request turns its last loop's logits into tokens (the default: greedy)."""

    temperature: float = 0.0  # 0: greedy, the argmax of the (penalised) logits; top_k/top_p then do nothing
    top_k: int = 0  # keep the k most likely tokens (ties with the k-th kept too); 0: off
    top_p: float = 1.0  # keep the smallest most-likely set with probability >= top_p; 1: off
    seed: int = 0  # the noise is a function of (seed, output position) only
    presence_penalty: float = 0.0  # subtracted from every token already in the output before the position
    frequency_penalty: float = 0.0  # subtracted once per occurrence before the position
    coupled: bool = True  # speculate from the early exit's draw under the same noise; False: from its argmax

    def __post_init__(self) -> None:
        t = self.temperature
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not math.isfinite(t) or t < 0:
            raise ValueError(f"temperature must be a finite number >= 0, got {t!r}")
        if type(self.top_k) is not int or self.top_k < 0:
            raise ValueError(f"top_k must be an integer >= 0 (0: off), got {self.top_k!r}")
        p = self.top_p
        if isinstance(p, bool) or not isinstance(p, (int, float)) or not 0 < p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {p!r}")
        if type(self.seed) is not int:
            raise ValueError(f"seed must be an integer, got {self.seed!r}")
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not -2 <= v <= 2:
                raise ValueError(f"{name} must be in [-2, 2], got {v!r}")
        if not isinstance(self.coupled, bool):
            raise ValueError(f"coupled must be true or false, got {self.coupled!r}")

    @property
    def greedy(self) -> bool:
        """Temperature 0: no noise, the argmax."""
        return self.temperature == 0

    @property
    def penalized(self) -> bool:
        return self.presence_penalty != 0 or self.frequency_penalty != 0

    @property
    def plain(self) -> bool:
        """Greedy without penalties: the scores are the raw logits, bit for bit."""
        return self.greedy and not self.penalized


def choice_seed(seed: int, choice: int) -> int:
    """The seed of choice ``choice`` of an n-choice request with ``seed``: choice 0 keeps the seed itself,
    the others get well-separated seeds in [0, 2**63)."""
    if choice == 0:
        return seed
    return _mix64(_mix64(seed) ^ (choice * _GOLDEN64 & _MASK64)) >> 1


# ----- the noise: a counter-based generator keyed by (seed, position) -----------------------------------


def _mix64(x: int) -> int:
    """splitmix64's finalizer on Python integers (exact 64-bit arithmetic)."""
    x &= _MASK64
    x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9 & _MASK64
    x = (x ^ (x >> 27)) * 0x94D049BB133111EB & _MASK64
    return x ^ (x >> 31)


def _mul32(a: Tensor, c: int) -> Tensor:
    """``a * c mod 2**32`` for int64 ``a`` in [0, 2**32) and a 32-bit ``c``, never overflowing int64."""
    lo = (a & 0xFFFF) * c  # < 2**48
    hi = ((a >> 16) * c) & 0xFFFF  # only its low 16 bits survive the shift into bits 16..31
    return (lo + (hi << 16)) & _MASK32


def _fmix32(h: Tensor) -> Tensor:
    """MurmurHash3's 32-bit finalizer (a bijection of [0, 2**32)) on int64 tensors."""
    h = h ^ (h >> 16)
    h = _mul32(h, 0x85EBCA6B)
    h = h ^ (h >> 13)
    h = _mul32(h, 0xC2B2AE35)
    return h ^ (h >> 16)


def uniforms(seed: int, pos: int, n: int, device: torch.device | str = "cpu") -> Tensor:
    """(n,) float64 uniforms in (0, 1), a pure function of (seed, pos, index); distinct within a position. The
    integer hash is exact on every device."""
    key = _mix64(_mix64(seed) ^ (pos * _GOLDEN64 & _MASK64))
    i = torch.arange(n, dtype=torch.int64, device=device)  # (n,)
    h = _fmix32(_fmix32(i ^ (key & _MASK32)) ^ (key >> 32))  # two keyed rounds of a bijection
    return (h.double() + 0.5) / 2.0**32


def truncated_normals(seed: int, pos: int, n: int, bound: float = 3.0) -> Tensor:
    """(n,) float64 standard normals truncated to [-bound, bound] (the inverse CDF of ``uniforms``), a pure function
    of (seed, pos, index) on a stream of their own: a looped LM's random initial state (``InitialState``)."""
    low = torch.special.ndtr(torch.tensor(-bound, dtype=torch.float64))
    return torch.special.ndtri(low + uniforms(seed ^ _STATE_STREAM, pos, n) * (1 - 2 * low))


@lru_cache(maxsize=256)  # a position's noise is read by each of its M loops (and again after a flush)
def gumbel(seed: int, pos: int, n: int) -> Tensor:
    """(n,) float32 Gumbel noise of (seed, pos), computed on the CPU."""
    return device_gumbel(seed, pos, n, torch.device("cpu"))


@lru_cache(maxsize=256)
def _device_gumbel(seed: int, pos: int, n: int, device: torch.device) -> Tensor:
    return (-torch.log(-torch.log(uniforms(seed, pos, n, device)))).float()


def device_gumbel(seed: int, pos: int, n: int, device: torch.device | str) -> Tensor:
    """(n,) float32 Gumbel noise of (seed, pos) computed on ``device`` (no copy from the host): the CPU's numbers on
    the CPU; another device's float64 logs may round a last bit differently, so SPEED and sequential decoding on one
    device add the same noise, and two devices nearly always choose the same token."""
    return _device_gumbel(seed, pos, n, torch.device(device))


# ----- per-row processing and decisions ---------------------------------------------------------------


class Draw(NamedTuple):
    """What one row's decision needs beyond its logits."""

    sampling: Sampling
    pos: int  # output position of the token the row predicts
    history: list[int] | None  # the output tokens before ``pos`` (penalties only)


def process(logits: Tensor, sampling: Sampling, history: list[int] | None = None) -> Tensor:
    """One row's (V,) scores: penalties, then temperature, top-k and top-p (-inf outside the support).

    Computed on the row alone (the top-p sort and cumsum included), so a row's scores never depend on
    the rows it shares a step with. Greedy returns the (penalised) logits unscaled.
    """
    x = logits
    if sampling.penalized and history:
        counts = torch.bincount(to_device(history, x.device, torch.long), minlength=x.shape[-1]).to(x.dtype)  # (V,)
        x = x - sampling.frequency_penalty * counts - sampling.presence_penalty * (counts > 0).to(x.dtype)
    if sampling.greedy:
        return x
    x = x / sampling.temperature
    if 0 < sampling.top_k < x.shape[-1]:
        kth = x.topk(sampling.top_k).values[-1]
        x = x.masked_fill(x < kth, float("-inf"))
    if sampling.top_p < 1:
        ranked, order = x.sort(descending=True, stable=True)  # (V,)
        probs = ranked.softmax(-1)
        outside = (probs.cumsum(-1) - probs) >= sampling.top_p  # the mass before it already reaches top_p
        drop = torch.empty_like(outside)
        drop[order] = outside
        x = x.masked_fill(drop, float("-inf"))
    return x


def exit_scores(logits: Tensor, draws: Sequence[Draw | None]) -> tuple[Tensor, Tensor | None]:
    """Each row's scores (R, V) and noise (R, V) (None when no row samples) from a step's exit logits.

    A row whose draw is None or plain greedy keeps its raw logits (bit for bit) and zero noise; the others
    are processed one row at a time, with the Gumbel noise of their (seed, position).
    """
    rows = [(r, d) for r, d in enumerate(draws) if d is not None and not d.sampling.plain]
    if not rows:
        return logits, None
    scores = logits.clone()
    noise = None
    for r, d in rows:
        scores[r] = process(logits[r], d.sampling, d.history)
        if not d.sampling.greedy:
            if noise is None:
                noise = torch.zeros_like(logits)
            noise[r] = device_gumbel(d.sampling.seed, d.pos, logits.shape[-1], logits.device)
    return scores, noise


@dataclass(frozen=True)
class ExitChoices:
    """Per row of one step: what its exit decided."""

    token: list[int]  # argmax of scores + noise: the exit's draw (greedy rows: the argmax of their scores)
    runner_up: list[int]  # the second-best token of the same scores + noise
    p_top: list[float]  # probability of ``token`` under softmax(scores), without noise: the exit's confidence
    mode: list[int] | None = None  # argmax of the scores without noise; None when no row had noise (then = token)


def exit_choices(scores: Tensor, noise: Tensor | None = None) -> ExitChoices:
    """The draw, the runner-up and the draw's probability of each row of ``scores`` (R, V) with ``noise``: computed
    on the scores' device and brought to the host in one copy (``decisions``)."""
    return choices_of(decisions(scores, noise).tolist(), noise is not None)


def decisions(scores: Tensor, noise: Tensor | None = None) -> Tensor:
    """(R, 4) float64 on the scores' device, per row: the draw, the runner-up, the draw's probability and the
    argmax without noise (``ExitChoices``' fields; token ids are exact in float64, the float32 probability too), so
    that one device-to-host copy brings a step's decisions back."""
    keys = scores if noise is None else scores + noise  # (R, V)
    top = keys.argmax(-1)  # (R,) first maximum, as greedy decoding always took it
    rest = keys.scatter(-1, top[:, None], float("-inf"))  # (R, V) the top-1 masked out
    runner_up = rest.argmax(-1)  # (R,)
    p_top = (scores.gather(-1, top[:, None])[:, 0] - torch.logsumexp(scores.float(), -1)).exp()  # (R,)
    mode = top if noise is None else scores.argmax(-1)
    return torch.stack([top.double(), runner_up.double(), p_top.double(), mode.double()], dim=1)


def choices_of(rows: list[list[float]], noisy: bool) -> ExitChoices:
    """``ExitChoices`` from ``decisions``' rows on the host (``noisy``: some row had noise, so ``mode`` is kept)."""
    token, runner_up = [int(r[0]) for r in rows], [int(r[1]) for r in rows]
    return ExitChoices(token, runner_up, [r[2] for r in rows], [int(r[3]) for r in rows] if noisy else None)


# ----- log-probabilities ------------------------------------------------------------------------------


class TokenLogprob(NamedTuple):
    """A committed token's log-probability and the most likely alternatives, from the last loop's raw logits."""

    token: int
    logprob: float
    top: list[tuple[int, float]]  # (token, logprob) of the k most likely tokens, best first


def token_logprob(logits: Tensor, token: int, k: int) -> TokenLogprob:
    """``token``'s log_softmax under one row's raw (V,) logits and the ``k`` best, computed on the row alone."""
    lp = logits.float().log_softmax(-1)  # (V,)
    top = lp.topk(k) if k else None
    alternatives = [] if top is None else list(zip(top.indices.tolist(), top.values.tolist()))
    return TokenLogprob(token, lp[token].item(), alternatives)
