"""A ``Stepper`` that wraps another and watches it: ``StepObserver``, the one place a wrapper forwards the engine's
calls, shows each admitted request and each group pass to its hooks, and hands the rest to the wrapped stepper.
The logit recorder (``speed.decode.exactness.LogitRecorder``) and the replayed model
(``speed.benchmarks.replay.ReplayStepper``) are its two hooks' users."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from torch import Tensor

from speed.engine.cache import KVCache, Rows
from speed.engine.types import Admitted, as_stepper


class StepObserver:
    """A ``Stepper`` that forwards to ``model``'s (``as_stepper``): ``admit`` and ``step`` run the wrapped stepper's,
    then show what they gave to ``after_admit`` (each admitted request) and ``after_step`` (each pass's exits, which
    it may read or rewrite in place); ``before_step`` sees a pass's rows and inputs first. Every attribute it does
    not define (n_loops, eos_id, vocab_size, memory, embed, cache, ...) is the wrapped stepper's."""

    def __init__(self, model: Any) -> None:
        self.model = as_stepper(model)  # a model's stepper, or a Stepper as it is

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_") or name == "model":  # private and not yet set (a copy, a half-built subclass)
            raise AttributeError(name)
        return getattr(self.model, name)

    def admit(self, memory: Any, cache: KVCache, slots: Sequence[int], prompts: Sequence[Tensor]) -> list[Admitted]:
        """The wrapped stepper's admission, each request's ``Admitted`` shown to ``after_admit`` in slot order."""
        admitted = self.model.admit(memory, cache, slots, prompts)
        for slot, prompt, each in zip(slots, prompts, admitted):
            self.after_admit(slot, prompt, each)
        return admitted

    def step(
        self,
        memory: Any,
        cache: KVCache,
        rows: Rows,
        hidden: Tensor,
        with_logits: bool = True,
        logit_rows: Sequence[int] | None = None,
    ) -> tuple[Tensor, Tensor | None]:
        """The wrapped stepper's group pass between ``before_step`` and ``after_step``; ``logit_rows`` passed on
        only when given (a stub stepper may not take it)."""
        self.before_step(rows, hidden)
        picked = {} if logit_rows is None else {"logit_rows": logit_rows}
        out, logits = self.model.step(memory, cache, rows, hidden, with_logits, **picked)
        self.after_step(rows, logits, logit_rows)
        return out, logits

    def after_admit(self, slot: int, prompt: Tensor, admitted: Admitted) -> None:
        """Sees a request admitted into ``slot``: its prompt (P,) and what its admission gave (``exits``: output
        position 0's (M, V), where the admission computed them). Nothing by default."""

    def before_step(self, rows: Rows, hidden: Tensor) -> None:
        """Sees a pass's rows and their inputs (R, d) before it runs. Nothing by default."""

    def after_step(self, rows: Rows, logits: Tensor | None, logit_rows: Sequence[int] | None) -> None:
        """Sees a pass's exit logits (K, V) of the rows ``logit_rows`` names (None: all R, a bucket's padding rows
        last), or None when the pass computed none. Nothing by default."""
