"""SPEED's settings as one object (``speed.engine.Speculation``): its checks, the layers that spell it out field by
field (``LEVERS``), and ``generate`` driven by it."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from test_engine import tiny_model

from speed.decode.generate import DecodeOptions, generate
from speed.engine import LEVERS, Request, Speculation, SpeculationFields


@pytest.mark.parametrize(
    "kw, fragment",
    [
        ({"launch_loop": 0}, "launch_loop must be an integer >= 1, got 0"),
        ({"launch_loop": 1.0}, "launch_loop must be an integer >= 1, got 1.0"),
        ({"launch_loop": True}, "launch_loop must be an integer >= 1, got True"),
        ({"invalidation": "lazy"}, r"invalidation must be one of \('eager', 'final'\), got 'lazy'"),
        ({"branches": -1}, "branches must be an integer >= 0, got -1"),
        ({"branch_depth": 0}, "branch_depth must be an integer >= 1, got 0"),
        ({"branch_below": 0.0}, r"branch_below must be a number in \(0, 1\], got 0.0"),
        ({"branch_below": 1.5}, r"branch_below must be a number in \(0, 1\], got 1.5"),
        ({"min_confidence": -0.1}, r"min_confidence must be a number in \[0, 1\], got -0.1"),
        ({"min_confidence": True}, r"min_confidence must be a number in \[0, 1\], got True"),
    ],
)
def test_bad_settings_are_refused_when_made(kw, fragment):
    with pytest.raises(ValueError, match=fragment):
        Speculation(**kw)


def test_the_edges_are_settings_and_the_models_loops_bound_three_of_them():
    for kw in ({"branch_below": 1.0}, {"min_confidence": 0}, {"min_confidence": 1.0}, {"launch_loop": 9}):
        Speculation(**kw)
    Speculation(launch_loop=3, branches=3, branch_depth=3).check_loops(3)
    for name in ("launch_loop", "branches", "branch_depth"):
        with pytest.raises(ValueError, match=rf"{name} must be in [01]\.\.3 \(the model's loops\), got 4"):
            Speculation(**{name: 4}).check_loops(3)
    with pytest.raises(dataclasses.FrozenInstanceError):
        Speculation().branches = 2  # type: ignore[misc]
    assert Request([5], 4).speculation == Speculation()


def test_every_layer_spells_out_the_one_definition():
    """LEVERS are Speculation's fields; Serve's planning, settings and protocol, evaluation's config and the sweep
    take their names from it (the sweep a subset), the configs' flat fields are SpeculationFields, and their
    defaults are its defaults."""
    from speed.eval.evaluate import EvalConfig
    from speed.serve import planning
    from speed.serve.protocol import ChatRequest, CompletionRequest
    from speed.serve.settings import ServeSettings
    from speed.sweep.space import SWEPT_LEVERS, SweepConfig

    assert LEVERS == tuple(f.name for f in dataclasses.fields(Speculation))
    assert planning.LEVERS is LEVERS
    assert SWEPT_LEVERS == tuple(n for n in LEVERS if n in SWEPT_LEVERS) and set(SWEPT_LEVERS) < set(LEVERS)
    assert tuple(SweepConfig().levers) == SWEPT_LEVERS
    assert all(SweepConfig().levers[n] == (getattr(Speculation(), n),) for n in SWEPT_LEVERS)
    assert tuple(f.name for f in dataclasses.fields(SpeculationFields)) == LEVERS  # the flat config fields
    assert issubclass(EvalConfig, SpeculationFields) and issubclass(ServeSettings, SpeculationFields)
    assert EvalConfig().speculation == ServeSettings().speculation == Speculation()
    assert EvalConfig(branches=2).speculation == Speculation(branches=2)
    for body in (CompletionRequest, ChatRequest):
        assert set(LEVERS) <= set(body.model_fields)  # the HTTP fields, one per setting


def test_a_request_body_becomes_one_speculation_over_the_deployments():
    from speed.serve.planning import plan_request
    from speed.serve.protocol import CompletionRequest
    from speed.serve.settings import ServeSettings

    body = CompletionRequest.model_validate({"prompt": [[5, 6, 1], [7, 1]], "n": 2, "branches": 2})
    plan = plan_request(body, ServeSettings(launch_loop=2, min_confidence=0.25, allow_branches=True), None, "m")
    first = plan.requests[0].speculation
    assert first == Speculation(launch_loop=2, branches=2, min_confidence=0.25)
    assert all(r.speculation is first for r in plan.requests)  # converted once
    assert {n: plan.settings()[n] for n in LEVERS} == dataclasses.asdict(first)
    sequential = CompletionRequest.model_validate({"prompt": [5, 1], "method": "sequential", "branches": 2})
    shown = plan_request(sequential, ServeSettings(), None, "m").settings()
    assert (shown["launch_loop"], shown["invalidation"], shown["branches"], shown["min_confidence"]) == (
        1, "eager", None, None
    )  # fmt: skip


def test_generate_decodes_as_its_speculation_says():
    """None is the default Speculation; every setting gives the sequential tokens; sequential decoding ignores it;
    launching after the last loop is sequential's schedule."""
    model = tiny_model(0, "2x3")
    ids = torch.randint(3, model.vocab_size, (3, 6), generator=torch.Generator().manual_seed(1))
    sequential = generate(model, ids, options=DecodeOptions(method="sequential", max_new_tokens=10, trace=False))
    plain = generate(model, ids, options=DecodeOptions(max_new_tokens=10, trace=False))
    assert (
        plain.stats
        == generate(model, ids, options=DecodeOptions(max_new_tokens=10, speculation=Speculation(), trace=False)).stats
    )
    settings = [
        Speculation(2, "final"),
        Speculation(branches=3, branch_depth=2),
        Speculation(branches=1, branch_below=0.9, min_confidence=0.3),
    ]
    for speculation in settings:
        got = generate(model, ids, options=DecodeOptions(max_new_tokens=10, speculation=speculation, trace=False))
        assert got.tokens == sequential.tokens == plain.tokens, speculation
    levered = generate(
        model, ids, options=DecodeOptions(method="sequential", max_new_tokens=10, speculation=settings[1], trace=False)
    )
    assert levered.tokens == sequential.tokens and levered.stats == sequential.stats
    last = generate(
        model, ids, options=DecodeOptions(max_new_tokens=10, speculation=Speculation(launch_loop=3), trace=False)
    )
    assert (last.stats.rows, last.stats.flushes) == (sequential.stats.rows, 0)
