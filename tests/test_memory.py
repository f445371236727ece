"""Memory said before it fails: a stepper's ``memory_need`` equals what its cache and memory allocate, an engine
caps its default key/value pool by what is available and refuses one that cannot hold a request in one line saying
what fits, side entries only with branches."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from speed.config import ModelConfig, lm_preset
from speed.engine import Engine, EngineConfig, Request, Speculation
from speed.engine.memory import MEMORY_LIMIT_ENV, MemoryBudgetError, MemoryNeed
from speed.models.looped_lm import LoopedLM
from speed.models.t5 import SpeedT5

T5_CONFIG = ModelConfig(vocab_size=64, d_model=32, n_heads=2, d_kv=8, d_ff=64, n_encoder_layers=1, pattern="2x3")
LM_PATTERNS = ["2x3", "1+2x2+1"]  # without and with a prelude and a coda


def _models() -> list:
    t5 = SpeedT5(T5_CONFIG).eval()
    lms = [LoopedLM(lm_preset("tiny", pattern=p)).eval() for p in LM_PATTERNS]
    return [t5, *lms]


MODELS = _models()
IDS = ["t5", *(f"lm-{p}" for p in LM_PATTERNS)]


def _allocated(cache, memory) -> tuple[int, int]:
    """Bytes of the tensors a stepper's cache and memory hold: (the cache's, the memory's)."""
    parts = [cache] if hasattr(cache, "tensors") else [p for p in cache.inner._parts()]  # T5's, an LM's
    cache_bytes = sum(t.nbytes for part in parts for t in part.tensors)
    memory_bytes = 0 if memory is None else sum(t.nbytes for t in (*memory.keys, *memory.values))
    memory_bytes += 0 if memory is None else memory.cross_bias.nbytes + memory.self_bias.nbytes
    return cache_bytes, memory_bytes


@pytest.mark.parametrize("model", MODELS, ids=IDS)
@pytest.mark.parametrize("side", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_need_equals_what_is_allocated(model, side, dtype):
    stepper = model.to(dtype).stepper()
    for n_slots, prompt, length in [(1, 1, 1), (3, 5, 7), (2, 40, 33)]:
        need = stepper.memory_need(n_slots, prompt, length, side)
        cache, memory = _allocated(
            stepper.cache(n_slots, prompt, length, side), stepper.memory(n_slots, prompt, length)
        )
        assert (need.cache + need.side, need.memory) == (cache, memory)
        assert (need.side == 0) == (not side)
        assert need.weights == sum(p.nbytes for p in model.parameters())
    model.float()


def test_lm_cache_without_side_entries_has_no_side_tensors():
    stepper = MODELS[2].stepper()
    cache = stepper.cache(2, 4, 4, side=False).inner
    assert cache.prelude is not None
    for part in (cache.loops, cache.prelude):
        assert part.side_keys == part.side_values == [] and part.n_side == 0


@pytest.mark.parametrize("model", MODELS, ids=IDS)
def test_the_default_pool_is_capped_by_what_is_available(model, monkeypatch):
    """An engine whose requests at their longest do not all fit gets the largest pool that does (it admits fewer
    at once), exactly as ``memory_need`` counts it."""
    stepper = model.stepper()
    asked = EngineConfig(max_active=8, max_prompt_len=16, max_target_len=64)
    full = stepper.memory_need(8, 16, 64)
    limit = (stepper.memory_need(8, 16, 32).allocated + full.allocated) // 2
    monkeypatch.setenv(MEMORY_LIMIT_ENV, str(limit))
    blocks = Engine(model, asked).blocks[2]
    assert 0 < blocks < full.blocks
    assert stepper.memory_need(8, 16, 64, blocks=blocks).allocated <= limit
    assert stepper.memory_need(8, 16, 64, blocks=blocks + 1).allocated > limit


@pytest.mark.parametrize("model", MODELS, ids=IDS)
def test_refusal_says_what_fits(model, monkeypatch):
    """Below one request at its longest, or a kv_blocks that does not fit: one line, in the pool's terms, with the
    most blocks that fit."""
    stepper = model.stepper()
    asked = EngineConfig(max_active=8, max_prompt_len=16, max_target_len=64)
    longest = stepper.memory_need(1, 16, 64).blocks
    limit = stepper.memory_need(8, 16, 64, blocks=longest).allocated - 1
    monkeypatch.setenv(MEMORY_LIMIT_ENV, str(limit))
    with pytest.raises(MemoryBudgetError) as err:
        Engine(model, asked)
    line = str(err.value)
    assert "\n" not in line and "max_active=8, max_prompt_len=16, max_target_len=64 needs" in line, line
    assert MEMORY_LIMIT_ENV in line and isinstance(err.value, ValueError) and "blocks of" in line
    fits = int(line.split("fits: kv_blocks=")[1].split()[0])
    assert fits == longest - 1 and f"takes {longest})" in line
    # the figure is the largest that fits: an engine of it is accepted under the same limit, one more is not
    Engine(model, EngineConfig(max_active=8, max_prompt_len=16, max_target_len=64, kv_blocks=fits))
    with pytest.raises(MemoryBudgetError):
        Engine(model, EngineConfig(max_active=8, max_prompt_len=16, max_target_len=64, kv_blocks=fits + 1))


def test_side_entries_are_counted_and_dropped_without_branches(monkeypatch):
    model = MODELS[0]
    stepper = model.stepper()
    with_side, without = stepper.memory_need(4, 8, 16, True), stepper.memory_need(4, 8, 16, False)
    assert with_side.side > 0 and without.side == 0 and with_side.cache == without.cache
    monkeypatch.setenv(MEMORY_LIMIT_ENV, str(without.allocated))  # fits only without side entries
    pool = EngineConfig(max_active=4, max_prompt_len=8, max_target_len=16, kv_blocks=without.blocks)
    with pytest.raises(MemoryBudgetError):
        Engine(model, pool)
    Engine(model, dataclasses.replace(pool, branches=False))


def test_branches_refused_by_an_engine_without_side_entries():
    model = MODELS[1]
    engine = Engine(model, EngineConfig(max_active=1, max_prompt_len=4, max_target_len=4, branches=False))
    with pytest.raises(ValueError, match="without runner-up branches"):
        engine.add(Request([2, 3], 4, speculation=Speculation(branches=1)))
    engine.add(Request([2, 3], 4, speculation=Speculation(branches=0)))
    engine.add(Request([2, 3], 4, method="sequential", speculation=Speculation(branches=1)))  # ignores them


def test_need_names_its_parts():
    need = MemoryNeed(weights=2**30, cache=3 * 2**20, side=0, memory=512)
    assert need.total == 2**30 + 3 * 2**20 + 512 and need.allocated == 3 * 2**20 + 512
    assert need.describe() == "1.00 GiB (weights 1.00 GiB, cache 3.00 MiB, side entries 0 B, memory 512 B)"
    pool = MemoryNeed(weights=2**30, cache=4 * 2**20, side=0, memory=512, blocks=3)  # and the zero block
    assert pool.per_block == 2**20
    assert "cache 4.00 MiB: 3 blocks of 1.00 MiB, 32.00 KiB per token," in pool.describe()
