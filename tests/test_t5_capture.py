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
from test_decoding_exact import random_case as t5_case

tk = pytest.importorskip("speed.engine.triton_kernels")  # before anything imports triton: it sets the interpreter

from capture_helpers import RowSource, any_slots, staged_equals_plain, staged_speed_equals_sequential  # noqa: E402

import speed.engine.kernels as kernels  # noqa: E402
from speed.decode.exactness import LogitRecorder  # noqa: E402
from speed.decode.generate import DecodeOptions, generate  # noqa: E402
from speed.engine import Engine, EngineConfig  # noqa: E402
from speed.engine.graphs import GraphSteps  # noqa: E402
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
    staged_speed_equals_sequential(model, reference, ref, ids, mask, sampling, case)


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
    staged, plain = (admitted(model, slots, random.Random(6)) for _ in range(2))
    assert staged[0].capturable
    graphs = GraphSteps(scratch=slots, device=torch.device("cpu"), capture=False)
    source = RowSource(model, slots, rng, first_pos=0, first_token=3)
    pick = (lambda: [rng.randrange(slots)]) if composition == "one_slot" else any_slots(rng, slots)
    staged_equals_plain(staged, plain, source, pick, graphs, 10, poison=True)
    a, b = staged[2], plain[2]
    assert np.array_equal(a.lengths[:, :, :slots], b.lengths[:, :, :slots])
