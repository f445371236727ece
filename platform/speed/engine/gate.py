"""Ouro's exit gate as the engine applies it to an ``exit_gate`` request: each in-flight token's running exit pdf
(``GateRun``), and the logits the engine records after each of its loops.

A lossy baseline, never exact w.r.t. full depth: Ouro (``OuroForCausalLM.forward``) runs all M loops for every
token, keeps every loop's keys and values, and only then picks a loop's logits (``ExitRule``). So does the
engine: skipping the deeper loops would leave their KV entries unwritten for later tokens, which changes what
those tokens attend to, and hence is not done. What the gate saves is reported (``GateRun.exit_loop``: the loop
passes it asks for), not taken.

Until the rule decides, a loop's own logits are recorded (and the pipeline launches from them, as SPEED's
early exits); from then on the decided ones, so a token's last-loop logits, which commit it, are exactly what
Ouro's decoding picks: Q-exit the deciding loop's, ``exit_at_step`` loop k's, the mix at the last loop.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from speed.engine.types import ExitRule


@dataclass
class GateRun:
    """One token's exit pdf so far under ``rule``, over a model of ``n_loops`` loops; ``feed`` it each loop."""

    rule: ExitRule
    n_loops: int
    loops: int = 0  # loops fed so far
    remaining: Tensor | None = None  # prod_{j<t} (1 - lambda_j), in the gate's dtype (None: 1, before loop 0)
    cumulative: float = 0.0  # the pdf's running sum, accumulated in double as CPU torch.cumsum does for float32
    decided: Tensor | None = None  # (V,) the rule's logits, once it decided
    mix: Tensor | None = None  # (V,) sum_t p_t * logits_t so far (kind "mix")
    exit_loop: int = -1  # the 0-based loop whose logits decided (the last for "mix"); -1 until decided

    def feed(self, logits: Tensor, lam: Tensor) -> Tensor:
        """The logits (V,) to record after the next loop, given its own logits (V,) and gate lambda (0-d)."""
        loop, last, rule = self.loops, self.loops == self.n_loops - 1, self.rule
        self.loops += 1
        remaining = torch.ones_like(lam) if self.remaining is None else self.remaining
        p = remaining if last else lam * remaining  # p_t as Ouro computes it: the last loop takes the rest
        self.remaining = remaining * (1.0 - lam)
        self.cumulative += float(p)
        if self.decided is not None:
            return self.decided
        if rule.kind == "step":
            if loop == rule.step:
                self._decide(logits, loop)
        elif rule.kind == "threshold":
            reached = torch.tensor(self.cumulative, dtype=p.dtype) >= rule.threshold  # compared in float, as Ouro
            if bool(reached) or last:
                self._decide(logits, loop)
        else:
            term = logits * p.to(logits.dtype)
            self.mix = term if self.mix is None else self.mix + term
            if last:
                self._decide(self.mix, loop)
        return logits if self.decided is None else self.decided

    def _decide(self, logits: Tensor, loop: int) -> None:
        self.decided, self.exit_loop = logits.clone(), loop
