"""Ouro's own exits as a decoding mode (``method="exit_gate"``, ``speed.engine.ExitRule``): a lossy baseline.

Greedy decoding under each rule equals a reference decoder written here from ``looped_refs.ouro_reference`` (the
whole sequence recomputed for every token, the rule's logits as ``OuroForCausalLM.forward`` picks them, their
argmax), token for token; batch composition does not change a request's tokens; threshold 1.0 is sequential
decoding; and the method and its rule are refused clearly where they cannot hold.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from looped_refs import ouro_exit_pdf, ouro_q_exit, ouro_reference, write_ouro_checkpoint

import speed
from speed.config import LM_PRESETS
from speed.decode.generate import DecodeOptions, generate
from speed.engine import Engine, EngineConfig, ExitRule, Request, Speculation
from speed.engine.gate import GateRun
from speed.models.looped_lm import LoopedLM

M, MAX_NEW = 4, 10
RULES = [
    ExitRule("threshold", threshold=0.15),
    ExitRule("step", step=1),
    ExitRule("step", step=0),
    ExitRule("mix"),
]


@pytest.fixture(scope="module")
def ouro_dir(tmp_path_factory):
    directory = tmp_path_factory.mktemp("ouro_gate")
    write_ouro_checkpoint(directory, total_ut_steps=M, seed=1, scale=2.0)
    return directory


@pytest.fixture(scope="module")
def model(ouro_dir):
    return speed.from_pretrained(ouro_dir)


def prompts(n: int, length: int = 6) -> list[list[int]]:
    g = torch.Generator().manual_seed(7)
    return torch.randint(1, 97, (n, length), generator=g).tolist()


def reference_decode(directory, prompt: list[int], rule: ExitRule, max_new: int) -> tuple[list[int], list[int]]:
    """Ouro's own greedy decoding under ``rule``, recomputing the whole sequence per token: its tokens and each
    one's exit loop (1-based)."""
    ids, loops = list(prompt), []
    for _ in range(max_new):
        out = ouro_reference(directory, torch.tensor([ids]))
        logits = [x[0, -1] for x in out.logits]  # M x (V,)
        lambdas = [lam[:, -1:] for lam in out.lambdas]  # M x (1, 1)
        pdf = ouro_exit_pdf(lambdas)[0, 0]  # (M,)
        if rule.kind == "step":
            chosen, loop = logits[rule.step], rule.step
        elif rule.kind == "threshold":
            loop = int(ouro_q_exit(lambdas, rule.threshold)[0, 0])
            chosen = logits[loop]
        else:
            chosen, loop = sum(x * p for x, p in zip(logits, pdf)), M - 1
        token = int(chosen.argmax())
        ids.append(token)
        loops.append(loop + 1)
        if token == 0:  # the tiny checkpoint's EOS
            break
    return ids[len(prompt) :], loops


@pytest.mark.parametrize("rule", RULES, ids=lambda r: f"{r.kind}-{r.threshold}-{r.step}")
def test_each_rule_equals_ouro_own_decoding(ouro_dir, model, rule):
    prompt = prompts(1)[0]
    want, loops = reference_decode(ouro_dir, prompt, rule, MAX_NEW)
    got = generate(
        model, torch.tensor([prompt]), options=DecodeOptions(method="exit_gate", exit_rule=rule, max_new_tokens=MAX_NEW)
    )
    assert got.tokens == [want]
    assert got.stats.gated_tokens == len(want)
    assert got.stats.mean_exit_loop == pytest.approx(sum(loops) / len(loops))


def test_the_rules_exit_early_and_change_tokens(ouro_dir, model):
    """The checkpoint is one where the gate matters: the threshold exits before the last loop for some tokens."""
    prompt = prompts(1)[0]
    _, loops = reference_decode(ouro_dir, prompt, RULES[0], MAX_NEW)
    assert min(loops) < M
    sequential = generate(
        model, torch.tensor([prompt]), options=DecodeOptions(method="sequential", max_new_tokens=MAX_NEW)
    ).tokens
    first_loop = generate(
        model,
        torch.tensor([prompt]),
        options=DecodeOptions(method="exit_gate", exit_rule=RULES[2], max_new_tokens=MAX_NEW),
    )
    assert first_loop.tokens != sequential


def test_threshold_one_is_sequential(model):
    batch = torch.tensor(prompts(3))
    sequential = generate(model, batch, options=DecodeOptions(method="sequential", max_new_tokens=MAX_NEW))
    gated = generate(
        model,
        batch,
        options=DecodeOptions(method="exit_gate", exit_rule=ExitRule("threshold", 1.0), max_new_tokens=MAX_NEW),
    )
    assert gated.tokens == sequential.tokens
    assert gated.stats.mean_exit_loop == M  # the pdf's float cumsum reaches 1.0 only at the last loop here


@pytest.mark.parametrize("rule", RULES, ids=lambda r: f"{r.kind}-{r.threshold}-{r.step}")
def test_batch_composition_does_not_change_a_request(model, rule):
    batch = prompts(8)
    together = generate(
        model, torch.tensor(batch), options=DecodeOptions(method="exit_gate", exit_rule=rule, max_new_tokens=MAX_NEW)
    )
    alone = [
        generate(
            model, torch.tensor([p]), options=DecodeOptions(method="exit_gate", exit_rule=rule, max_new_tokens=MAX_NEW)
        ).tokens[0]
        for p in batch
    ]
    assert together.tokens == alone


def test_beside_other_methods_in_one_engine(model):
    """Gated, SPEED and sequential requests share steps; each decodes as it would alone."""
    batch, rule = prompts(3), RULES[0]
    engine = Engine(model, EngineConfig(max_active=3, max_prompt_len=6, max_target_len=MAX_NEW))
    methods = ["exit_gate", "speed", "sequential"]
    ids = [
        engine.add(Request(p, MAX_NEW, m, exit_rule=rule if m == "exit_gate" else None)) for p, m in zip(batch, methods)
    ]
    done = {}
    while engine.has_work:
        done.update({f.id: f for f in engine.step().finished})
    gated = generate(
        model,
        torch.tensor([batch[0]]),
        options=DecodeOptions(method="exit_gate", exit_rule=rule, max_new_tokens=MAX_NEW),
    )
    assert done[ids[0]].tokens == gated.tokens[0]
    assert len(done[ids[0]].stats.exit_loops) == len(gated.tokens[0])
    for i, p in zip(ids[1:], batch[1:]):
        assert (
            done[i].tokens
            == generate(
                model, torch.tensor([p]), options=DecodeOptions(method="sequential", max_new_tokens=MAX_NEW)
            ).tokens[0]
        )
        assert done[i].stats.exit_loops == []


def test_pipelined_with_launches_and_branches_commits_the_same(model):
    batch, rule = torch.tensor(prompts(2)), RULES[0]
    plain = generate(model, batch, options=DecodeOptions(method="exit_gate", exit_rule=rule, max_new_tokens=MAX_NEW))
    spec = Speculation(launch_loop=2, branches=2, invalidation="final")
    other = generate(
        model,
        batch,
        options=DecodeOptions(method="exit_gate", exit_rule=rule, speculation=spec, max_new_tokens=MAX_NEW),
    )
    assert other.tokens == plain.tokens


def test_refused_without_a_gate_and_for_bad_values(model):
    gateless = LoopedLM(dataclasses.replace(LM_PRESETS["tiny"], exit_gate=False)).eval()
    prompt = prompts(1)[0]
    with pytest.raises(ValueError, match="needs a model with an exit gate"):
        Engine(gateless, EngineConfig(max_active=1, max_prompt_len=6, max_target_len=4)).add(
            Request(prompt, 4, "exit_gate", exit_rule=ExitRule())
        )
    engine = Engine(model, EngineConfig(max_active=1, max_prompt_len=6, max_target_len=4))
    with pytest.raises(ValueError, match="needs an exit_rule"):
        engine.add(Request(prompt, 4, "exit_gate"))
    with pytest.raises(ValueError, match="an exit_rule needs method='exit_gate'"):
        engine.add(Request(prompt, 4, "speed", exit_rule=ExitRule()))
    with pytest.raises(ValueError, match=r"step must be in 0\.\.3"):
        engine.add(Request(prompt, 4, "exit_gate", exit_rule=ExitRule("step", step=M)))
    for bad, message in [
        ({"kind": "first"}, "kind must be one of"),
        ({"threshold": 0.0}, r"threshold must be a number in \(0, 1\]"),
        ({"threshold": 1.5}, r"threshold must be a number in \(0, 1\]"),
        ({"step": -1}, "step must be an integer >= 0"),
        ({"step": 1.0}, "step must be an integer >= 0"),
    ]:
        with pytest.raises(ValueError, match=message):
            ExitRule(**bad)


def test_gate_run_follows_ouro_pdf():
    """``GateRun`` on plain numbers: p_t = lambda_t prod_{j<t} (1 - lambda_j), the last loop taking the rest."""
    lambdas = [torch.tensor(x) for x in (0.1, 0.5, 0.2, 0.9)]
    logits = [torch.full((3,), float(i)) for i in range(4)]
    pdf = ouro_exit_pdf([lam.reshape(1, 1) for lam in lambdas])[0, 0]

    def run(rule: ExitRule) -> tuple[list[torch.Tensor], int]:
        gate = GateRun(rule, 4)
        return [gate.feed(x, lam) for x, lam in zip(logits, lambdas)], gate.exit_loop

    recorded, loop = run(ExitRule("threshold", 0.5))  # cumsum: 0.1, 0.55, ...: loop 1 decides
    assert loop == 1 and [float(x[0]) for x in recorded] == [0.0, 1.0, 1.0, 1.0]
    recorded, loop = run(ExitRule("step", step=2))
    assert loop == 2 and [float(x[0]) for x in recorded] == [0.0, 1.0, 2.0, 2.0]
    recorded, loop = run(ExitRule("mix"))
    assert loop == 3 and torch.equal(recorded[-1], sum(x * p for x, p in zip(logits, pdf)))


def test_serve_request_fields_make_the_rule():
    from speed.serve.planning import engine_error, plan_request
    from speed.serve.protocol import CompletionRequest, inline_schema
    from speed.serve.settings import ServeSettings

    body = CompletionRequest.model_validate(
        {"prompt": [5, 6, 1], "method": "exit_gate", "exit_kind": "step", "exit_step": 2}
    )
    plan = plan_request(body, ServeSettings(), None, "m")
    assert plan.requests[0].exit_rule == ExitRule("step", step=2)
    shown = plan.settings()
    assert (shown["method"], shown["exit_kind"], shown["exit_step"], shown["exit_threshold"]) == (
        "exit_gate",
        "step",
        2,
        None,
    )
    plain = plan_request(
        CompletionRequest.model_validate({"prompt": [5, 1], "method": "exit_gate"}), ServeSettings(), None, "m"
    )
    assert plain.requests[0].exit_rule == ExitRule()
    assert (
        plan_request(CompletionRequest.model_validate({"prompt": [5, 1]}), ServeSettings(), None, "m")
        .requests[0]
        .exit_rule
        is None
    )
    for other in ({"method": "speed"}, {}):  # the method must be named, whatever the deployment's default
        with pytest.raises(ValueError, match="need method exit_gate in the request"):
            CompletionRequest.model_validate({"prompt": [5, 1], "exit_kind": "mix", **other})
    for bad in ({"exit_threshold": 0}, {"exit_threshold": 1.5}, {"exit_step": -1}, {"exit_kind": "first"}):
        with pytest.raises(ValueError):
            CompletionRequest.model_validate({"prompt": [5, 1], "method": "exit_gate", **bad})
    assert engine_error(ValueError("exit rule step must be in 0..3")).param == "exit_step"
    schema = inline_schema(CompletionRequest)
    assert {"exit_kind", "exit_threshold", "exit_step"} <= set(schema["properties"])
    assert any("exit_kind" in str(rule.get("if")) for rule in schema["allOf"])  # the rule is published


def test_served_statistics_carry_the_mean_exit_loop(model):
    from speed.serve.records import choice_stats

    engine = Engine(model, EngineConfig(max_active=2, max_prompt_len=6, max_target_len=MAX_NEW))
    batch = prompts(2)
    gated = engine.add(Request(batch[0], MAX_NEW, "exit_gate", exit_rule=RULES[0]))
    engine.add(Request(batch[1], MAX_NEW, "speed"))
    done = {}
    while engine.has_work:
        done.update({f.id: f for f in engine.step().finished})
    loops = done[gated].stats.exit_loops
    assert choice_stats(done[gated])["mean_exit_loop"] == sum(loops) / len(loops) and 1 <= min(loops) < M
    assert choice_stats(done[1 - gated])["mean_exit_loop"] is None
