"""T5's capturable pass (``T5Stepper.prepare`` + ``SpeedT5.step_staged``): the cache's bookkeeping staged before the
pass, the pass reading device tensors only (each row's slot of the encoder memory picked on the device, its
position bias indexed by its device position, every span padded to the memory's and the cache's capacity), so a
CUDA graph can replay it.

On the CPU the staged pass runs eagerly on the Triton kernels under the interpreter (``SPEED_DECODE_OPS=triton``),
the path a GPU captures: SPEED through the engine's buckets equals sequential decoding run unstaged and unpadded,
bit for bit (greedy and seeded sampling, branches); each staged pass equals the unstaged pass of the same rows
whatever the batch's composition (one request's rows, several requests', prompts of different lengths), and it
reads nothing of the rows on the host. ``tests/test_gpu_decode.py`` replays the captured graphs on CUDA.
"""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch
from engine_helpers import speed_as_sequential
from test_decoding_exact import random_case as t5_case

tk = pytest.importorskip("speed.engine.triton_kernels")  # before anything imports triton: it sets the interpreter

import speed.engine.kernels as kernels  # noqa: E402
from speed.decode.exactness import LogitRecorder  # noqa: E402
from speed.decode.generate import DecodeOptions, generate  # noqa: E402
from speed.engine import Engine, EngineConfig, Speculation  # noqa: E402
from speed.engine.graphs import GraphSteps  # noqa: E402
from speed.engine.rows import Rows  # noqa: E402
from speed.engine.sampling import Sampling  # noqa: E402
from speed.models.t5 import SpeedT5  # noqa: E402

pytestmark = pytest.mark.skipif(not tk.interpreted(), reason="a GPU is here: tests/test_gpu_decode.py covers it")

MAX_PROMPT, MAX_LEN = 40, 24  # prompts past one attention chunk of encoder memory


@pytest.fixture(autouse=True)
def triton_ops(monkeypatch):
    """Every decode op on the Triton kernels (under the interpreter), as on a GPU."""
    monkeypatch.setattr(kernels, "DECODE_OPS", "triton")


def test_the_stepper_is_capturable_on_the_triton_kernels_only(monkeypatch):
    """``capturable`` is what the engine reads to capture (``Engine.__init__``): True on the Triton kernels, whose
    pass ``prepare`` stages; the CPU's own kernels neither stage nor capture."""
    model = t5_case(0)[0]
    stepper = model.stepper()
    assert stepper.capturable and getattr(stepper, "capturable", False)
    engine = Engine(model, EngineConfig(max_active=2, max_prompt_len=8, max_target_len=8, graphs=True))
    assert engine._graphs is not None and not engine._graphs.capture  # a CPU device: bucketed, run eagerly
    monkeypatch.setattr(kernels, "DECODE_OPS", "auto")
    assert not model.stepper().capturable


def count_staged(model: SpeedT5) -> list[int]:
    """A list that gets, for every staged pass of ``model`` from now on, its row count (the instance's method
    wrapped)."""
    seen = []
    run = model.step_staged

    def counted(memory, cache, staged, rows, hidden, *args, **kw):
        seen.append(hidden.shape[0])
        return run(memory, cache, staged, rows, hidden, *args, **kw)

    model.step_staged = counted
    return seen


@pytest.mark.slow
@pytest.mark.parametrize("case", ["greedy", "sampled"])
def test_t5_speed_through_staged_passes_equals_sequential(case):
    """Every bucketed pass staged (the spy counts them), SPEED with and without branches equal to sequential decoding
    run unstaged and unpadded: every loop's logits, the tokens. Prompts of different lengths in one batch."""
    model = t5_case(2 if case == "greedy" else 4)[0]
    sampling = None if case == "greedy" else Sampling(temperature=0.9, top_k=6, seed=11)
    rng = random.Random(len(case))
    ids = torch.tensor([[rng.randrange(3, model.vocab_size) for _ in range(35)] for _ in range(2)])
    mask = torch.ones_like(ids)
    mask[1, 3:] = 0  # one prompt of 35 tokens (two chunks of encoder memory), one of 3
    reference = LogitRecorder(model)
    ref = generate(
        reference, ids, mask, DecodeOptions(method="sequential", max_new_tokens=5, sampling=sampling, graphs=False)
    )
    staged = count_staged(model)
    for speculation in (Speculation(1, "eager"), Speculation(1, "final", branches=2, branch_depth=2)):
        speed_as_sequential(
            model, reference, ref, ids, mask, 5, (case, speculation), speculation=speculation,
            sampling=sampling, graphs=True,
        )  # fmt: skip
    assert len(staged) > 10 and max(staged) > 2, staged  # passes of several rows, padded to buckets


class RowSource:
    """Valid rows for a cache's slots without an engine: each slot decodes its own tokens loop by loop, one row a
    step for each slot a step picks."""

    def __init__(self, model: SpeedT5, slots: int, rng: random.Random) -> None:
        self.model, self.rng, self.slots = model, rng, slots
        self.next = [(0, 0)] * slots  # (position, loop)
        self.carry: dict[tuple[int, int], torch.Tensor] = {}

    def rows(self, picked: list[int]) -> tuple[Rows, torch.Tensor]:
        hidden = []
        for s in picked:
            pos, loop = self.next[s]
            if loop == 0:
                token = torch.tensor([self.rng.randrange(3, self.model.vocab_size)], device=self.model.device)
                self.carry[(s, pos)] = self.model.shared(token)[0]
            hidden.append(self.carry[(s, pos)])
        at = [self.next[s] for s in picked]
        return Rows.build(picked, [loop for _, loop in at], [pos for pos, _ in at]), torch.stack(hidden)

    def advance(self, rows: Rows, out: torch.Tensor) -> None:
        M = self.model.n_loops
        for s, pos, loop, h in zip(rows.slot.tolist(), rows.pos.tolist(), rows.loop.tolist(), out):
            self.carry[(s, pos)] = h
            self.next[s] = (pos, loop + 1) if loop + 1 < M else (pos + 1, 0)


def admitted(model: SpeedT5, slots: int, rng: random.Random):
    """A stepper, its memory and cache (a scratch slot after ``slots`` request slots) with a random prompt of 1 to
    ``MAX_PROMPT`` tokens encoded into each slot."""
    stepper = model.stepper()
    cache = stepper.cache(slots + 1, MAX_PROMPT, MAX_LEN, side=True)
    cache.set_scratch(slots)
    memory = stepper.memory(slots + 1, MAX_PROMPT, MAX_LEN)
    lengths = [rng.randint(1, MAX_PROMPT) for _ in range(slots)]
    prompts = [
        torch.tensor([rng.randrange(3, model.vocab_size) for _ in range(n)], device=model.device) for n in lengths
    ]
    stepper.admit(memory, cache, list(range(slots)), prompts)
    return stepper, memory, cache


@pytest.mark.slow
@pytest.mark.parametrize("composition", ["one_slot", "mixed"])
def test_a_staged_pass_reads_nothing_of_the_rows_on_the_host(composition):
    """Two caches fed the same prompts and rows, step after step: one through ``GraphSteps`` (padded to buckets,
    ``prepare`` staging each pass, then the rows' host arrays overwritten with garbage before the pass runs), the
    other unstaged and unpadded. Every output and every row's logits equal, bit for bit, and the cache's
    bookkeeping the same: the staged pass read only what ``prepare`` staged and the bucket's device buffers.
    ``one_slot``: every step one slot's rows (a pipeline of one request); ``mixed``: any slots, 1 to 5 rows."""
    rng = random.Random(5)
    model = t5_case(1)[0]
    torch.manual_seed(1)
    with torch.no_grad():  # a position bias that differs per head and offset, strong enough to matter
        torch.nn.init.normal_(model.decoder_bias.embedding.weight, std=1.0)
    slots = 5
    (staged, mem_a, a), (plain, mem_b, b) = (admitted(model, slots, random.Random(6)) for _ in range(2))
    assert staged.capturable
    graphs = GraphSteps(scratch=slots, device=torch.device("cpu"), capture=False)
    source = RowSource(model, slots, rng)

    def poisoned(rows: Rows) -> None:
        staged.prepare(mem_a, a, rows)
        for array in (rows.slot, rows.loop, rows.pos):
            array[:] = 10**6  # any host read of them now indexes out of range or reads another slot

    with torch.inference_mode():
        for _ in range(10):
            if composition == "one_slot":
                picked = [rng.randrange(slots)]
            else:
                picked = sorted(rng.sample(range(slots), rng.randint(1, slots)))
            rows, hidden = source.rows(picked)
            keep = Rows(rows.slot.copy(), rows.loop.copy(), rows.pos.copy())
            step = lambda r, h, w, names: staged.step(mem_a, a, r, h, w)  # noqa: E731
            got, got_logits = graphs.run(step, rows, hidden, True, None, poisoned)
            want, want_logits = plain.step(mem_b, b, keep, hidden, True)
            assert torch.equal(got, want) and torch.equal(got_logits, want_logits), keep
            source.advance(keep, want)
    assert np.array_equal(a.lengths[:, :, :slots], b.lengths[:, :, :slots])
