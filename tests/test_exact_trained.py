"""Exactness on a really trained checkpoint with long outputs, where near-ties are common.

A random model's logits are far apart; a trained one's often are not (the
issue's Multi30k checkpoint met a 4.8e-07 top-2 gap at position 54). So a
small 2x3 model is trained for real on Multi30k EN-DE (in-process, 150 steps:
loss 3.2, and its smallest last-loop top-2 gap on the test below is of the same order as after 300 steps,
measured 3.2e-04 against 1.3e-04, at half the cost), and SPEED's per-loop logits must equal sequential decoding's
bit for bit on 100+ test sentences decoded to 64 tokens each, in batches of
varying composition, for several launch loops and both policies, with and
without runner-up branches and the confidence gate, on 2 threads, greedy and
with seeded sampling (every other batch; half the churn's requests).
"""

from __future__ import annotations

import random

import pytest
import torch
from checkpoint_helpers import train_steps
from engine_helpers import drive

from speed.config import preset
from speed.data import load_records, pad_inputs, truncate
from speed.decode.exactness import LogitRecorder, compare_logits, top2_gap
from speed.decode.generate import DecodeOptions, generate
from speed.engine import Engine, EngineConfig, Request, Speculation
from speed.engine.sampling import Sampling
from speed.losses import shift_right
from speed.models.t5 import SpeedT5
from speed.tokenizer import train_tokenizer

STEPS, BATCH, SENTENCES, NEW_TOKENS = 150, 32, 104, 64


@pytest.fixture(scope="session")
def trained(tmp_path_factory):
    """(model, tokenizer): a 2x3 model trained STEPS steps on Multi30k EN-DE, on one thread (~25 s)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        train = load_records("translate_en_de", "train", limit=STEPS * BATCH // 3)
        path = tmp_path_factory.mktemp("trained") / "spm.model"
        tok = train_tokenizer([*train["source"], *train["target"]], path, vocab_size=500, num_extra=4)
        sources = [truncate(ids, 48) for ids in tok.encode_batch(train["source"])]
        targets = [truncate(ids, 48) for ids in tok.encode_batch(train["target"])]
        torch.manual_seed(0)
        config = preset("tiny", vocab_size=tok.vocab_size, d_model=64, n_heads=4, d_kv=16, d_ff=128, pattern="2x3")
        model = SpeedT5(config)
        order = random.Random(0)

        def batch_loss() -> torch.Tensor:
            pick = order.sample(range(len(sources)), BATCH)
            input_ids, mask = pad_inputs([sources[i] for i in pick])  # (B, S)
            labels, label_mask = pad_inputs([targets[i] for i in pick])  # (B, T)
            labels = labels.masked_fill(label_mask == 0, -100)
            return model(input_ids, shift_right(labels), mask, labels=labels).loss

        loss = train_steps(model, batch_loss, STEPS)
        assert loss < 4.5, f"the model did not train (loss {loss:.2f})"
        return model.eval(), tok
    finally:
        torch.set_num_threads(threads)


def long_output_model(model: SpeedT5, stop_id: int) -> SpeedT5:
    """The same weights with a sentinel (never in the targets) as the stop token, so outputs run to the limit."""
    long = SpeedT5(model.config.replace(eos_id=stop_id)).eval()
    long.load_state_dict(model.state_dict())
    return long


@pytest.mark.slow
def test_trained_checkpoint_long_outputs_bitwise(trained):
    threads = 2  # two threads split oneDNN's matmuls; the kernel tests also cover one
    model, tok = trained
    model = long_output_model(model, tok.vocab_size - 1)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        test = load_records("translate_en_de", "test", limit=SENTENCES)
        inputs = [truncate(ids, 48) for ids in tok.encode_batch(test["source"])]
        rng = random.Random(threads)
        policies = [
            Speculation(1, "eager"),
            Speculation(2, "final"),
            Speculation(3, "eager"),
            Speculation(1, "eager", branches=3),
            Speculation(1, "final", branches=1, min_confidence=0.5),
        ]
        start, batch_no, rows_checked, gaps, sampled, promotions = 0, 0, 0, [], 0, 0
        while start < len(inputs):
            size = rng.randint(1, 8)  # batch compositions change: different rows share each step
            input_ids, mask = pad_inputs(inputs[start : start + size])
            sampling = Sampling(temperature=rng.choice([0.7, 1.0]), top_p=rng.choice([1.0, 0.9]), seed=batch_no)
            sampling = sampling if batch_no % 2 else None  # greedy and sampled batches alternate
            sampled += sampling is not None
            reference = LogitRecorder(model)
            ref = generate(
                reference,
                input_ids,
                mask,
                DecodeOptions(method="sequential", max_new_tokens=NEW_TOKENS, sampling=sampling),
            )
            assert all(len(t) == NEW_TOKENS for t in ref.tokens)
            candidate = LogitRecorder(model)
            got = generate(
                candidate,
                input_ids,
                mask,
                DecodeOptions(
                    method="speed",
                    max_new_tokens=NEW_TOKENS,
                    speculation=policies[batch_no % len(policies)],
                    sampling=sampling,
                ),
            )
            assert compare_logits(reference, candidate, ref.tokens, model.n_loops) == [], (start, size)
            promotions += got.stats.promotions
            assert got.tokens == ref.tokens
            rows_checked += sum(map(len, ref.tokens)) * model.n_loops
            gaps += [top2_gap(reference.logits[(b, 2, p)]) for b in range(len(ref.tokens)) for p in range(NEW_TOKENS)]
            start += size
            batch_no += 1
    finally:
        torch.set_num_threads(before)
    assert rows_checked == SENTENCES * NEW_TOKENS * model.n_loops and sampled > 5
    assert promotions > 0  # runner-up branches took over
    assert min(gaps) < 1e-3  # near-ties were met (measured 3.2e-04), the case this test exists for
    print(
        f"{rows_checked} logit rows bit-identical; smallest last-loop top-2 gap {min(gaps):.2e}; "
        f"{promotions} promotions"
    )


class RequestRecorder(LogitRecorder):
    """Records an engine's early-exit logits by (request id, loop, position): its slots pass from request to request."""

    engine: Engine | None = None

    def key(self, slot, loop, pos):
        owner = next(seq.id for seq in self.engine._active.values() if seq.slot == slot)
        return (owner, loop, pos)


@pytest.mark.slow
def test_trained_checkpoint_engine_churn_bitwise(trained):
    """The serving engine on the trained checkpoint: requests arrive, leave and are cancelled at random, with
    row budgets and capacities that change who shares each step; every request's per-loop logits equal
    decoding it alone sequentially, bit for bit, up to 64 tokens long."""
    model, tok = trained
    model = long_output_model(model, tok.vocab_size - 1)
    test = load_records("translate_en_de", "test", limit=160)
    inputs = [truncate(ids, 48) for ids in tok.encode_batch(test["source"])][104:]  # not the other test's sentences
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    checked = cancelled = flushes = sampled = promotions = 0
    try:
        for seed in range(3):
            rng = random.Random(seed)
            config = EngineConfig(
                max_active=rng.choice([3, 5, 8]),
                max_source_len=48,
                max_target_len=NEW_TOKENS,
                row_budget=[None, 6, 11][seed],
            )
            recorder = RequestRecorder(model)
            engine = recorder.engine = Engine(recorder, config)

            def make(rng=rng):
                ids, n = rng.choice(inputs), rng.choice([24, 40, NEW_TOKENS])
                method = rng.choice(["speed", "speed", "sequential"])
                launch_loop, invalidation = rng.randint(1, model.n_loops), rng.choice(["eager", "final"])
                sampling = rng.choice(
                    [Sampling(), Sampling(temperature=rng.choice([0.7, 1.0]), seed=rng.randrange(2**63))]
                )  # the draws in the order they were
                levers = {"branches": rng.choice([0, 1, model.n_loops]), "min_confidence": rng.choice([0.0, 0.0, 0.4])}
                return Request(ids, n, method, Speculation(launch_loop, invalidation, **levers), sampling=sampling)

            requests, finished = drive(engine, rng, [rng.randrange(0, 150) for _ in range(16)], make, 0.2, 40)
            for f in finished:
                request = requests[f.id]
                reference = LogitRecorder(model)
                ref = generate(
                    reference,
                    torch.tensor([request.input_ids]),
                    options=DecodeOptions(
                        method="sequential", max_new_tokens=request.max_new_tokens, sampling=request.sampling
                    ),
                )
                assert f.tokens == ref.tokens[0][: len(f.tokens)]
                assert f.cancelled or len(f.tokens) == request.max_new_tokens  # the sentinel stop never comes
                for pos in range(len(f.tokens)):
                    for loop in range(model.n_loops):
                        got = recorder.logits[(f.id, loop, pos)]
                        assert torch.equal(got, reference.logits[(0, loop, pos)]), (seed, f.id, request, loop, pos)
                        checked += 1
                cancelled += f.cancelled
                flushes += f.stats.flushes
                sampled += not request.sampling.greedy
                promotions += f.stats.promotions
    finally:
        torch.set_num_threads(before)
    assert cancelled > 0 and flushes > 0 and sampled > 0 and promotions > 0 and checked > 3 * 10 * 24 * model.n_loops
    print(
        f"{checked} logit rows bit-identical under churn; {cancelled} cancelled; {flushes} flushes; "
        f"{promotions} promotions"
    )


@pytest.mark.slow
def test_trained_exit_adapters_raise_agreement_and_never_change_the_output(trained):
    """Exit adapters trained (``speed.train.exits.exits_loss``) on the trained checkpoint with its backbone frozen:
    on held-out sentences loop 1 agrees more with the last loop (teacher-forced), SPEED's drafts and steps
    change, and the tokens and last-loop logits equal the model's without them, bit for bit, greedy and sampled,
    in batches of 1 to 8."""
    from speed.data import collate
    from speed.models.exits import attach, exits_for
    from speed.train.exits import exits_loss

    model, tok = trained
    adapted = SpeedT5(model.config).eval()
    adapted.load_state_dict(model.state_dict())
    adapted.requires_grad_(False)
    torch.manual_seed(0)
    attach(adapted, exits_for(adapted, rank=32))
    train = load_records("translate_en_de", "train", limit=2000)
    test = load_records("translate_en_de", "test", limit=64)

    def batch(records, pick):
        columns = {"input_ids": tok.encode_batch([records["source"][i] for i in pick]),
                   "labels": tok.encode_batch([records["target"][i] for i in pick])}  # fmt: skip
        return collate({k: [truncate(x, 48) for x in v] for k, v in columns.items()})

    held_out = batch(test, range(64))
    with torch.no_grad():
        kl_before, agree_before = exits_loss(adapted, held_out)
    optimizer = torch.optim.AdamW(adapted.exit_adapters.parameters(), lr=3e-3)
    order = random.Random(0)
    for _ in range(80):
        kl, _ = exits_loss(adapted, batch(train, order.sample(range(2000), 32)))
        optimizer.zero_grad()
        kl.sum().backward()
        optimizer.step()
    adapted.eval()
    with torch.no_grad():
        kl_after, agree_after = exits_loss(adapted, held_out)
    assert kl_after.sum() < kl_before.sum() and agree_after[0] > agree_before[0], (agree_before, agree_after)

    inputs = [truncate(ids, 48) for ids in tok.encode_batch(test["source"])][:24]
    rng, start, steps = random.Random(5), 0, {True: 0, False: 0}
    while start < len(inputs):
        size = rng.randint(1, 8)
        input_ids, mask = pad_inputs(inputs[start : start + size])
        sampling = Sampling(temperature=1.0, seed=start) if start % 2 else None
        recorders, tokens = {}, {}
        for with_exits, m in ((True, adapted), (False, model)):
            recorders[with_exits] = LogitRecorder(m)
            out = generate(recorders[with_exits], input_ids, mask, DecodeOptions(max_new_tokens=32, sampling=sampling))
            steps[with_exits] += out.stats.steps
            tokens[with_exits] = out.tokens
        assert tokens[True] == tokens[False]
        last = model.n_loops - 1
        for b, out in enumerate(tokens[True]):
            for pos in range(len(out)):
                assert torch.equal(recorders[True].logits[(b, last, pos)], recorders[False].logits[(b, last, pos)])
        start += size
    assert steps[True] != steps[False]
    print(
        f"loop-1 agreement {agree_before[0]:.3f} -> {agree_after[0]:.3f}; SPEED steps {steps[False]} -> {steps[True]}"
    )
