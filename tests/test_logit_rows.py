"""Exit logits for a chosen part of a group pass's rows (``Stepper.step(..., logit_rows=...)``): a row's logits are
the same bits whichever other rows are scored, and SPEED that scores only the rows it needs equals sequential
decoding bit for bit (batch 8, greedy and sampled with branches, a traced request among untraced ones)."""

from __future__ import annotations

import random

import pytest
import torch
from engine_helpers import random_exits

from speed.config import lm_preset, preset
from speed.decode.exactness import LogitRecorder
from speed.engine import Engine, EngineConfig, Request, Speculation
from speed.engine.rows import Rows
from speed.engine.sampling import Sampling
from speed.engine.trace import TraceBuilder
from speed.models.looped_lm import LoopedLM
from speed.models.t5 import SpeedT5

M = 3
SLOTS = 5  # a request's M rows at its M loops, slot by slot: 15 rows, two tiles


def _t5() -> SpeedT5:
    torch.manual_seed(0)
    return random_exits(SpeedT5(preset("tiny", pattern=f"2x{M}")).eval(), seed=1)


def _lm() -> LoopedLM:
    torch.manual_seed(0)
    model = LoopedLM(lm_preset("tiny", pattern=f"1+1x{M}+1", exit_gate=True)).eval()
    with torch.no_grad():  # a gate that says something: lambdas spread over (0, 1)
        model.exit_gate.weight.normal_(0.0, 0.5)
    return random_exits(model, seed=2)


@pytest.mark.parametrize("make", [_t5, _lm], ids=["t5", "looped-lm"])
def test_picked_rows_logits_are_the_same_bits(make):
    stepper = make().stepper()
    gated = getattr(stepper, "gated", False)
    rng = random.Random(0)
    with torch.inference_mode():
        cache, memory = stepper.cache(SLOTS, 8, 4, side=False), stepper.memory(SLOTS, 8, 4)
        prompts = [torch.randint(3, 100, (rng.randint(1, 8),)) for _ in range(SLOTS)]
        admitted = stepper.admit(memory, cache, list(range(SLOTS)), prompts)
        pos = 0 if admitted[0].exits is None else 1  # an LM's prefill decided output position 0 already
        n = SLOTS * M
        rows = Rows.build([r // M for r in range(n)], [r % M for r in range(n)], [pos] * n)
        hidden = stepper.embed(torch.randint(3, 100, (n,)))

        def run(logit_rows):
            kwargs = {} if logit_rows is None else {"logit_rows": logit_rows}
            out = stepper.step_gated(memory, cache, rows, hidden, **kwargs) if gated else (
                *stepper.step(memory, cache, rows, hidden, **kwargs), None
            )
            for slot in range(SLOTS):
                cache.invalidate(slot, pos)
            return out

        carry, logits, lambdas = run(None)
        assert logits.shape[0] == n
        for k in (1, 2, 7, 9, n - 1):
            picked = tuple(sorted(rng.sample(range(n), k)))  # across both tiles of the pass
            part_carry, part, part_lambdas = run(picked)
            assert part.shape[0] == k
            assert torch.equal(part, logits[list(picked)]), picked
            assert torch.equal(part_carry, carry)
            if gated:
                assert torch.equal(part_lambdas, lambdas)


class Asked(LogitRecorder):
    """A ``LogitRecorder`` that also counts the rows whose exit logits the engine asked for."""

    def __init__(self, model) -> None:
        super().__init__(model)
        self.rows = self.scored = 0

    def step(self, memory, cache, rows, hidden, with_logits=True, logit_rows=None):
        self.rows += len(rows)
        self.scored += 0 if not with_logits else len(rows) if logit_rows is None else len(logit_rows)
        return super().step(memory, cache, rows, hidden, with_logits, logit_rows)


def _decode(model, ids, method, sampling, spec, traced, cost_model) -> tuple[dict[int, list[int]], Asked]:
    """Decode each row of ``ids`` as a request in one engine (untraced, but the requests in ``traced``, whose every
    loop's exit is then evaluated); return each request's tokens and the recorder."""
    recorder = Asked(model)
    engine = Engine(recorder, EngineConfig(len(ids), ids.shape[1], 12, trace=False, cost_model=cost_model))
    for b, row in enumerate(ids.tolist()):
        request = Request(row, 12, method=method, sampling=sampling, speculation=spec)
        engine.add(request)
        if b in traced:  # the engine's trace is all or nothing: this one request is traced, as in a server's mix
            seq = engine._waiting[-1]
            seq.trace, seq.all_exits = TraceBuilder(), True
    out: dict[int, list[int]] = {}
    while engine.has_work:
        for f in engine.step().finished:
            out[f.id] = f.tokens
    return out, recorder


CASES = [
    pytest.param(Sampling(), Speculation(), id="greedy"),
    pytest.param(Sampling(temperature=0.8, top_k=20, seed=5), Speculation(branches=2, branch_depth=2), id="sampled"),
]


@pytest.mark.parametrize(("sampling", "spec"), CASES)
@pytest.mark.parametrize("make", [_t5, _lm], ids=["t5", "looped-lm"])
def test_speed_scoring_part_of_its_rows_equals_sequential(make, sampling, spec, monkeypatch):
    """Batch 8 under a cost model that closes and opens steps (a made-up curve: rows cost a little), request 2
    traced: closed steps score the last-loop rows and the traced request's; the tokens, every last-loop logit and
    the traced request's every loop's logits equal sequential decoding's."""
    from speed.engine.cost import RowCost
    from speed.engine.kernels import TILE_ROWS

    seconds = tuple(1.0 + 0.3 * n for n in range(TILE_ROWS))
    monkeypatch.setattr("speed.engine.engine.measured_row_cost", lambda stepper: RowCost(seconds, seconds, 0, "x"))
    model = make()
    ids = torch.randint(3, 100, (8, 6), generator=torch.Generator().manual_seed(3))
    ref, reference = _decode(model, ids, "sequential", sampling, spec, traced=(2,), cost_model=False)
    out, candidate = _decode(model, ids, "speed", sampling, spec, traced=(2,), cost_model=True)
    assert out == ref
    assert candidate.scored < candidate.rows  # some steps scored a part of their rows
    # (position 0 past, an LM's prefill evaluated every loop of)
    loops = {slot: {loop for s, loop, p in reference.logits if s == slot and p} for slot in range(8)}
    assert loops[2] == set(range(M)) and loops[0] == {M - 1}  # untraced sequential decoding: the last loop only
    for key, logits in reference.logits.items():
        assert torch.equal(candidate.logits[key], logits), key
