"""Loss-weight schemes for the shared early-exit loss ``L_w = sum_i w_i L_i``.

Every scheme is a pure function ``(n_loops) -> weights`` of shape (M,) that
sums to 1; loop i is 1-based in the formulas below. Parametric families take
their parameter after a colon, so that a sweep can sample it: ``power:P``
(w_i proportional to i^P) and ``ratio:R`` (w_i proportional to R^i).

Beside the weights: Ouro's gate objective (``gate``: the expected loop loss under the exit gate's
distribution, minus an entropy bonus; ``gate_objective``), a scheme whose weights are each token's own, so it
is named like the others (``--loss-weights gate``) but computed by the model's forward; the flip cost
(``flip_cost``, SPEED's steps per token lost to flips, from per-loop flip rates); and the settle term
(``SettleConfig``, ``settle_loss``), an agreement loss that makes later loops stop changing the prediction,
each exit pulled toward a detached later one.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor


def _normalise(raw: Tensor) -> Tensor:
    return raw / raw.sum()


def linear(n_loops: int) -> Tensor:
    """The paper's default: w_i = i / sum_j j (later loops weigh more)."""
    return _normalise(torch.arange(1, n_loops + 1, dtype=torch.float64)).float()


def uniform(n_loops: int) -> Tensor:
    """w_i = 1 / M."""
    return torch.full((n_loops,), 1.0 / n_loops)


def last(n_loops: int) -> Tensor:
    """Only the final loop: plain (non-early-exit) training."""
    w = torch.zeros(n_loops)
    w[-1] = 1.0
    return w


def geometric(n_loops: int) -> Tensor:
    """w_i proportional to 2^i: each loop weighs twice the one before."""
    return _normalise(2.0 ** torch.arange(1, n_loops + 1, dtype=torch.float64)).float()


def sqrt(n_loops: int) -> Tensor:
    """w_i proportional to sqrt(i): between uniform and linear."""
    return _normalise(torch.arange(1, n_loops + 1, dtype=torch.float64).sqrt()).float()


SCHEMES: dict[str, Callable[[int], Tensor]] = {
    "linear": linear,
    "uniform": uniform,
    "last": last,
    "geometric": geometric,
    "sqrt": sqrt,
}


def power(n_loops: int, p: float) -> Tensor:
    """w_i proportional to i^p: p = 0 is uniform, 0.5 sqrt, 1 linear; larger p favours later loops."""
    return _normalise(torch.arange(1, n_loops + 1, dtype=torch.float64) ** p).float()


def ratio(n_loops: int, r: float) -> Tensor:
    """w_i proportional to r^i: r = 1 is uniform, 2 geometric; r < 1 favours earlier loops."""
    # r^(i - M) keeps the largest term at 1 whatever r and M (no overflow for large r).
    return _normalise(r ** torch.arange(1 - n_loops, 1, dtype=torch.float64)).float()


PARAMETRIC: dict[str, Callable[[int, float], Tensor]] = {"power": power, "ratio": ratio}
_PARAMETER_RANGE = {"power": (-8.0, 8.0), "ratio": (0.05, 20.0)}  # beyond these one loop takes all the weight


def parametric(family: str, value: float) -> str:
    """The scheme name of a parametric family at ``value``, e.g. ``parametric("power", 1.5) == "power:1.5"``."""
    name = f"{family}:{value:.4g}"
    check_scheme(name)
    return name


GATE = "gate"  # Ouro's gate objective: per-token weights from the exit gate (``gate_objective``), no fixed weights


def check_scheme(scheme: str) -> None:
    """Raise ValueError unless ``scheme`` is a named scheme, ``gate``, or ``family:value`` of a parametric family in
    range."""
    family, sep, value = scheme.partition(":")
    if not sep:
        if scheme not in SCHEMES and scheme != GATE:
            raise ValueError(
                f"unknown loss-weight scheme {scheme!r}; choose one of {sorted(SCHEMES)} "
                f"or a parametric {'|'.join(f'{f}:VALUE' for f in PARAMETRIC)}"
            )
        return
    if family not in PARAMETRIC:
        raise ValueError(f"unknown loss-weight scheme {scheme!r}; parametric families are {sorted(PARAMETRIC)}")
    try:
        x = float(value)
    except ValueError:
        raise ValueError(f"loss-weight scheme {scheme!r}: {value!r} is not a number") from None
    lo, hi = _PARAMETER_RANGE[family]
    if not lo <= x <= hi:
        raise ValueError(f"loss-weight scheme {scheme!r}: the {family} parameter must lie in [{lo}, {hi}]")


def loss_weights(scheme: str, n_loops: int) -> Tensor:
    """The (n_loops,) weights of a scheme (named or ``family:value``); unknown names, ``gate`` (its weights are each
    token's exit distribution: ``gate_objective``) and n_loops < 1 are errors."""
    check_scheme(scheme)
    if scheme == GATE:
        raise ValueError("the gate objective has no fixed loop weights: each token's come from the exit gate")
    if n_loops < 1:
        raise ValueError(f"n_loops must be at least 1, got {n_loops}")
    family, sep, value = scheme.partition(":")
    return PARAMETRIC[family](n_loops, float(value)) if sep else SCHEMES[scheme](n_loops)


@dataclass
class LoopOutput:
    """A looped model's training forward: per-loop losses (M,), the weighted loss, optional per-loop logits."""

    loop_losses: Tensor | None
    loss: Tensor | None
    loop_logits: list[Tensor] | None  # M x (B, T, V), only when asked for


def loop_output(
    exit_logits: Iterable[Tensor], labels: Tensor | None, weights: Tensor | None, return_logits: bool
) -> LoopOutput:
    """Each loop's exit logits (B, T, V), in loop order, against ``labels`` (B, T; -100 = ignore): each loop's mean
    token cross-entropy L_i and ``weighted_loss``'s L_w; without labels, no losses."""
    losses, all_logits = [], []
    for logits in exit_logits:
        if labels is not None:
            losses.append(F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(), ignore_index=-100))
        if return_logits:
            all_logits.append(logits)
    kept = all_logits if return_logits else None
    if labels is None:
        return LoopOutput(None, None, kept)
    loop_losses = torch.stack(losses)  # (M,)
    return LoopOutput(loop_losses, weighted_loss(loop_losses, weights), kept)


def weighted_loss(loop_losses: Tensor, weights: Tensor | None = None) -> Tensor:
    """``L_w = sum_i w_i L_i`` of per-loop losses (M,); ``weights`` (M,) default to the paper's linear scheme."""
    n_loops = loop_losses.shape[0]
    weights = (loss_weights("linear", n_loops) if weights is None else weights).to(loop_losses)
    if weights.shape != loop_losses.shape:
        raise ValueError(f"loss weights have shape {tuple(weights.shape)}, expected ({n_loops},) for {n_loops} loops")
    return (weights * loop_losses).sum()


# ----- Ouro's gate objective -------------------------------------------------------------------------------
#
# Ouro (arXiv 2510.25741, section 3) trains its exit gate with the expected loop loss under the gate's exit
# distribution, p_k = lambda_k prod_{j<k} (1 - lambda_j) (the last loop takes the rest), minus beta times the
# distribution's entropy: a KL to the uniform prior over loops up to the constant log M. Without the entropy
# term the gate collapses onto the loop with the lowest loss and stops being a decision.


def exit_log_distribution(gate_logits: Tensor) -> Tensor:
    """(..., M) log p_k of the exit distribution from the gate's logits z_k (lambda_k = sigmoid(z_k)): log lambda_k
    plus sum_{j<k} log(1 - lambda_j), the last loop's log the survival of all before it (computed in log space:
    ``logsigmoid``, no 0 * log 0)."""
    z = gate_logits.float()
    stay = F.logsigmoid(-z)  # (..., M) log(1 - lambda_k)
    before = torch.cumsum(stay, dim=-1) - stay  # (..., M) sum_{j<k} log(1 - lambda_j)
    log_p = F.logsigmoid(z) + before
    return torch.cat([log_p[..., :-1], before[..., -1:]], dim=-1)


def gate_objective(token_losses: Tensor, gate_logits: Tensor, entropy: float) -> Tensor:
    """Ouro's gate objective over n tokens: mean_t [sum_k p_tk L_tk - ``entropy`` * H(p_t)], ``token_losses``
    (n, M) each token's cross-entropy at each loop, ``gate_logits`` (n, M) the exit gate's logits there, H the
    entropy of the token's exit distribution (``exit_log_distribution``). Gradients reach the losses (through
    the weights p) and the gate alike. The form is the Ouro paper's (arXiv 2510.25741, section 3; an entropy
    bonus is a KL to the uniform prior over loops up to log M); no public Ouro training code confirms the
    per-token aggregation or the coefficient (docs/training.md)."""
    if token_losses.shape != gate_logits.shape:
        raise ValueError(f"token losses {tuple(token_losses.shape)} and gate logits {tuple(gate_logits.shape)} differ")
    log_p = exit_log_distribution(gate_logits)  # (n, M)
    p = log_p.exp()
    expected = (p * token_losses.float()).sum(-1)  # (n,)
    neg_entropy = (p * log_p).sum(-1)  # (n,): -H(p_t)
    return (expected + entropy * neg_entropy).mean()


# ----- flip cost and the settle term -----------------------------------------------------------------------
#
# Under SPEED a flip at loop k (loop k's prediction differs from loop k-1's) restarts the successor, which had
# been launched from loop 1 and has run k-1 loops by then: about k-1 pipeline steps lost. The flip cost
# ``sum_k flip_prev(k) * (k - 1)`` estimates SPEED's steps per token above the oracle's (launch loop 1, eager);
# it needs no decoding, only every loop's prediction (a teacher-forced pass gives them).


def flip_cost_weights(n_loops: int) -> Tensor:
    """(n_loops,) the steps a flip at loop k = 1..M costs the successor: k - 1 (loop 1 cannot flip)."""
    if n_loops < 1:
        raise ValueError(f"n_loops must be at least 1, got {n_loops}")
    return torch.arange(n_loops, dtype=torch.float64)


def flip_cost(flip_rate_prev: Sequence[float]) -> float:
    """``sum_k flip_prev(k) * (k - 1)``: steps per token a SPEED decoder loses to flips (loop 1 first)."""
    rates = torch.as_tensor(list(flip_rate_prev), dtype=torch.float64)
    return float((rates * flip_cost_weights(len(rates))).sum())


SETTLE_KINDS = ("none", "to_last", "consecutive")


@dataclass(frozen=True)
class SettleConfig:
    """An agreement term that makes later loops stop changing the prediction: ``L = L_w + lambda_t * S``.

    ``to_last``: S is the mean over loops j < M of KL(sg(p_M) || p_j), every earlier exit pulled toward the
    detached last loop. ``consecutive``: KL(sg(p_{j+1}) || p_j), each exit toward the detached next one (a flip
    at loop j+1 is what SPEED pays for). The target is always the later loop and never gets a gradient, so the
    term moves earlier exits toward what later loops decide, not the reverse. ``flip_cost_weighted`` weighs
    loop j's term by j, the steps a flip at loop j+1 costs (``flip_cost_weights``), instead of equally; the
    weights are normalised either way. ``lambda_t = weight * min(1, step / warmup_steps)``.
    """

    kind: str = "none"  # none | to_last | consecutive
    weight: float = 0.0  # lambda after warm-up
    warmup_steps: int = 0  # optimizer steps of the linear ramp of lambda from 0; 0 = full weight from step 1
    flip_cost_weighted: bool = False

    def __post_init__(self) -> None:
        if self.kind not in SETTLE_KINDS:
            raise ValueError(f"unknown settle kind {self.kind!r}; choose one of {list(SETTLE_KINDS)}")
        if self.weight < 0 or not math.isfinite(self.weight):
            raise ValueError(f"SettleConfig.weight must be a finite number >= 0, got {self.weight}")
        if self.warmup_steps < 0:
            raise ValueError(f"SettleConfig.warmup_steps must be >= 0, got {self.warmup_steps}")
        if self.kind == "none" and (self.weight or self.warmup_steps or self.flip_cost_weighted):
            raise ValueError("settle kind 'none' takes no weight, warmup_steps or flip_cost_weighted")
        if self.kind != "none" and self.weight == 0:
            raise ValueError(f"settle kind {self.kind!r} needs a weight > 0 (kind 'none' turns the term off)")

    @property
    def active(self) -> bool:
        return self.kind != "none"

    def weight_at(self, step: int) -> float:
        """lambda at optimizer step ``step`` (1-based: the step being trained)."""
        if not self.active:
            return 0.0
        return self.weight * (1.0 if self.warmup_steps == 0 else min(1.0, step / self.warmup_steps))

    @property
    def label(self) -> str:
        """A short name for trial names and tables: ``none``, ``to_last:1``, ``consecutive:3:fc:w100``."""
        if not self.active:
            return "none"
        parts = [self.kind, f"{self.weight:g}"] + ["fc"] * self.flip_cost_weighted
        return ":".join(parts + ([f"w{self.warmup_steps}"] if self.warmup_steps else []))

    @classmethod
    def parse(cls, label: str) -> SettleConfig:
        """The inverse of ``label``: ``KIND[:WEIGHT[:fc][:wSTEPS]]`` (e.g. ``consecutive:3:fc``)."""
        kind, *rest = label.split(":")
        if kind == "none" or not rest:
            return cls(kind=kind)
        try:
            weight = float(rest[0])
        except ValueError:
            raise ValueError(f"settle {label!r}: {rest[0]!r} is not a weight") from None
        weighted, warmup = False, 0
        for part in rest[1:]:
            if part == "fc":
                weighted = True
            elif part.startswith("w") and part[1:].isdigit():
                warmup = int(part[1:])
            else:
                raise ValueError(f"settle {label!r}: {part!r} is neither 'fc' nor 'wSTEPS'")
        return cls(kind=kind, weight=weight, warmup_steps=warmup, flip_cost_weighted=weighted)


def settle_pair_weights(n_loops: int, flip_cost_weighted: bool) -> Tensor:
    """(M-1,) weights of the terms of loops j = 1..M-1, summing to 1 (all zero-length for M = 1)."""
    raw = flip_cost_weights(n_loops)[1:] if flip_cost_weighted else torch.ones(n_loops - 1, dtype=torch.float64)
    return (raw / raw.sum()).float() if n_loops > 1 else raw.float()


def settle_loss(loop_logits: Sequence[Tensor], labels: Tensor, settle: SettleConfig) -> Tensor:
    """The settle term S (a scalar) over the target tokens (labels != -100) of M x (B, T, V) exit logits.

    Each loop j < M contributes its mean token KL(sg(target) || p_j) (``SettleConfig`` says which target),
    weighted by ``settle_pair_weights``; 0 for one loop or kind ``none``.
    """
    keep = labels.reshape(-1) != -100  # (B*T,)
    logits = torch.stack([lg.reshape(-1, lg.shape[-1])[keep] for lg in loop_logits]).float()  # (M, n, V)
    n_loops = logits.shape[0]
    if not settle.active or n_loops == 1 or logits.shape[1] == 0:
        return logits.new_zeros(())
    logp = F.log_softmax(logits, dim=-1)  # (M, n, V)
    students = logp[:-1]  # (M-1, n, V): loops 1..M-1
    targets = (logp[1:] if settle.kind == "consecutive" else logp[-1:].expand_as(students)).detach()
    kl = (targets.exp() * (targets - students)).sum(-1).mean(-1)  # (M-1,): mean token KL per loop
    return (settle_pair_weights(n_loops, settle.flip_cost_weighted).to(kl) * kl).sum()


def settled_loss(
    weighted: Tensor, loop_logits: Sequence[Tensor] | None, labels: Tensor, settle: SettleConfig, step: int
) -> tuple[Tensor, Tensor | None]:
    """(the training loss, the settle term or None): ``L_w + lambda_step * S``; exactly ``L_w`` when lambda is 0."""
    lam = settle.weight_at(step)
    if lam == 0.0:
        return weighted, None
    if loop_logits is None:
        raise ValueError("the settle term needs every loop's logits (forward with return_logits=True)")
    term = settle_loss(loop_logits, labels, settle)
    return weighted + lam * term, term


def teacher_forced_flips(loop_logits: Sequence[Tensor], labels: Tensor) -> tuple[Tensor, Tensor, int]:
    """Per loop, over the target tokens: (flips vs the previous loop (M,), flips vs the last loop (M,), tokens).

    Counts, not rates, so batches add up; loop 1 never flips vs the previous, loop M never vs the last.
    """
    keep = labels.reshape(-1) != -100
    preds = torch.stack([lg.reshape(-1, lg.shape[-1])[keep].argmax(-1) for lg in loop_logits])  # (M, n)
    prev = torch.cat([torch.zeros_like(preds[:1], dtype=torch.bool), preds[1:] != preds[:-1]])  # (M, n)
    final = preds != preds[-1:]
    return prev.sum(-1), final.sum(-1), int(keep.sum())


def shift_right(labels: Tensor, start_id: int = 0, pad_id: int = 0) -> Tensor:
    """Decoder inputs for teacher forcing: start token, then labels[:-1] (-100 -> pad)."""
    shifted = labels.new_full(labels.shape, start_id)
    shifted[:, 1:] = labels[:, :-1]
    return shifted.masked_fill(shifted == -100, pad_id)
