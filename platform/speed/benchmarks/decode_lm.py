"""Side-by-side decode latency of the decoder-only looped LM: sequential vs SPEED vs the shallow loop, and our
plain stack against ``transformers``' Llama ``generate`` on the same weights, in one process.

Each variant decodes the same prompts once per round, and the run splits its own time at the moment every
sequence had its first token (``GenerateResult.first_token_s``, TTFT: the prefill of every prompt and its first
token; ``decode_s``, the rest; transformers' ``generate`` is split by a streamer, ``FirstTokenClock``): the decode
time per token is the rest over the tokens after the first, so no figure can be negative. Repetitions are
interleaved (``speed.benchmarks.decode.interleave``) and medians reported; ratios are computed from them, never
typed in.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import pyarrow as pa
import torch

from speed.benchmarks.decode import (
    DecodeBenchConfig,
    bench_models,
    check_exact,
    decoding,
    interleave,
    run_columns,
    transformers_installed,
    variant_columns,
    warn_unless_hf_agrees,
)
from speed.config import LMConfig
from speed.decode.generate import GenerateResult

LM_BENCH_SCHEMA = pa.schema(
    [
        pa.field("variant", pa.string()),  # sequential | speed | speed_oracle | shallow | ours_deep | hf_generate
        pa.field("pattern", pa.string()),
        pa.field("model", pa.string()),  # the timed model's resolved LMConfig as JSON (its weights are random)
        pa.field("ttft_ms", pa.float64()),  # median: the prompts' prefill and every sequence's first token
        pa.field("ms_per_token", pa.float64()),  # median decode time per token after the first (all sequences)
        pa.field("baseline", pa.string()),  # the variant this row's speed-up is measured against
        pa.field("speedup", pa.float64()),  # baseline ms per token / this one's
        pa.field("ratio_vs_shallow", pa.float64()),  # this ms per token / the shallow Nx1's
        pa.field("tokens", pa.int64()),
        pa.field("steps", pa.int64()),
        pa.field("flushes", pa.int64()),
        pa.field("reps", pa.int32()),
        pa.field("prompt_len", pa.int32()),
        pa.field("d_model", pa.int32()),
        pa.field("vocab_size", pa.int32()),
        pa.field("batch", pa.int32()),
        pa.field("threads", pa.int32()),
        pa.field("torch", pa.string()),
        pa.field("machine", pa.string()),
        # the real-shape rows' (speed.benchmarks.shapes; null in the tiny presets' rows)
        pa.field("shape", pa.string()),  # the published model whose shape the random weights have
        pa.field("dtype", pa.string()),
        pa.field("layout", pa.string()),  # packed | plain: the weights packed for the native kernel or as loaded
        pa.field("weight_bytes_per_token", pa.float64()),  # weights read once per loop pass, over the batch
        pa.field("gb_per_s", pa.float64()),  # weight_bytes_per_token over the time per token
        pa.field("read_gb_per_s", pa.float64()),  # the machine's read bandwidth, measured in the same run
        pa.field("limit_ms_per_token", pa.float64()),  # weight_bytes_per_token at read_gb_per_s
        pa.field("ratio_vs_limit", pa.float64()),  # ms_per_token / limit_ms_per_token
        pa.field("peak_rss_bytes", pa.int64()),  # the process's peak resident set after this batch's runs
    ]
)


@dataclass(frozen=True)
class LMBenchConfig(DecodeBenchConfig):
    """The decoder-only LM's: an ``LMConfig`` and its prompt length (``compare_hf``: against Llama's generate)."""

    model: LMConfig
    prompt_len: int = 64


class FirstTokenClock:
    """A transformers ``generate`` streamer that splits one run's time where its first new tokens were made (its
    second ``put``: the first is the prompt), each reading taken after the device finished its work."""

    def __init__(self, device: torch.device) -> None:
        self.device, self.puts, self.first = device, 0, math.nan
        self.start = time.perf_counter()

    def _now(self) -> float:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return time.perf_counter()

    def put(self, value: torch.Tensor) -> None:
        self.puts += 1
        if self.puts == 2:
            self.first = self._now()

    def end(self) -> None:
        pass

    def split(self) -> tuple[float, float]:
        """(seconds from the clock's making to the first new tokens, seconds after them), read when called."""
        return self.first - self.start, self._now() - self.first


def split_medians(
    splits: dict[str, list[tuple[float, float]]], tokens_after_first: int
) -> tuple[dict[str, float], dict[str, float]]:
    """Each variant's median TTFT in ms and median ms per token after each sequence's first (``tokens_after_first``
    of them a run), from its runs' own splits (first seconds, rest seconds)."""
    ttft = {name: statistics.median(first * 1000 for first, _ in s) for name, s in splits.items()}
    per_token = {
        name: statistics.median(rest * 1000 / tokens_after_first for _, rest in s) for name, s in splits.items()
    }
    return ttft, per_token


def decode_runs(
    results: dict[str, GenerateResult],
    ids: torch.Tensor,
    n: int,
    splits: dict[str, list[tuple[float, float]]] | None = None,
) -> Callable[..., Callable[[], int]]:
    """``run(name, model, new, **generate's options)``: a run for ``interleave`` that decodes ``ids`` for ``new``
    tokens (1: the time to first token; ``n``: all of them, its result kept in ``results[name]``) and returns 1,
    so that its times stay per run; each run of ``n`` tokens appends its own split of its time, (seconds to every
    sequence's first token, seconds after it), to ``splits[name]`` where given. Each run keeps its engine
    (``decoding``): built, and its CUDA graphs captured, in its first call (``interleave``'s untimed one)."""

    def run(name: str, model: torch.nn.Module, new: int, **kw) -> Callable[[], int]:
        decode = decoding(model, ids, new, trace=False, **kw)

        def go() -> int:
            result = decode()
            if new == n:
                results[name] = result
                if splits is not None:
                    splits.setdefault(name, []).append((result.first_token_s, result.decode_s))
            return 1

        return go

    return run


def run_lm_benchmark(cfg: LMBenchConfig) -> pa.Table:
    """Measure every variant side by side; one row per variant (``LM_BENCH_SCHEMA``)."""
    sharing = cfg.model.sharing
    if sharing.prelude or sharing.coda:
        raise ValueError(f"the benchmark compares NxM with Nx1 and Dx1; write the pattern NxM, got {cfg.model.pattern}")
    bench = bench_models(cfg, cfg.prompt_len, first_id=2)
    model, shallow, ids, reference = bench.model, bench.shallow, bench.ids, bench.reference
    n = cfg.new_tokens
    results: dict[str, GenerateResult] = {}
    configs = bench.configs()

    splits: dict[str, list[tuple[float, float]]] = {}  # per variant, each run's (first seconds, rest seconds)
    run = decode_runs(results, ids, n, splits)
    kinds = {
        "sequential": (model, {"method": "sequential"}),
        "speed": (model, {"method": "speed"}),
        "speed_oracle": (model, {"method": "speed", "oracle": reference.tokens}),
        "shallow": (shallow, {"method": "sequential"}),
    }
    hf = _hf_pair(cfg, ids) if cfg.compare_hf else None
    if hf is not None:
        ours, hf_generate = hf
        kinds["ours_deep"] = (ours, {"method": "sequential"})
        configs["ours_deep"] = configs["hf_generate"] = ours.config  # transformers' Llama has the same weights
    variants: dict[str, Callable[[], int]] = {name: run(name, m, n, **kw) for name, (m, kw) in kinds.items()}
    if hf is not None:

        def run_hf() -> int:
            clock = FirstTokenClock(torch.device(cfg.device))
            hf_generate(n, clock)
            splits.setdefault("hf_generate", []).append(clock.split())
            return 1

        variants["hf_generate"] = run_hf
    print(
        f"LM benchmark: {cfg.model.pattern} d_model={cfg.model.d_model} vocab={cfg.model.vocab_size} "
        f"batch={cfg.batch} prompt={cfg.prompt_len} tokens={n} reps={cfg.reps} threads={torch.get_num_threads()} "
        f"device={cfg.device}",
        flush=True,
    )
    interleave(variants, cfg.reps, cfg.device, unit="ms a run")  # each run's split lands in splits
    check_exact(results, reference, ("speed", "speed_oracle"))
    timed = {name: splits[name][1:] for name in variants}  # interleave's first run is untimed
    ttft, per_token = split_medians(timed, cfg.batch * (n - 1))  # the tokens after each sequence's first
    shared = run_columns(cfg) | {"prompt_len": cfg.prompt_len}
    rows = [
        variant_columns(name, configs[name], results.get(name), per_token, cfg.batch * n)
        | shared
        | {"ttft_ms": ttft[name]}
        for name in ttft
    ]
    return pa.Table.from_pylist(rows, schema=LM_BENCH_SCHEMA)


def _hf_pair(cfg: LMBenchConfig, ids: torch.Tensor):
    """Our sequential Dx1 and a ``generate(new, streamer)`` of transformers' Llama (greedy, KV cache on), same
    weights."""
    if not transformers_installed():
        return None
    from transformers import LlamaConfig, LlamaForCausalLM

    from speed.models.convert_llama import from_llama

    c = cfg.model
    torch.manual_seed(cfg.seed)
    hf_config = LlamaConfig(
        vocab_size=c.vocab_size,
        hidden_size=c.d_model,
        intermediate_size=c.d_ff,
        num_hidden_layers=c.sharing.depth,
        num_attention_heads=c.n_heads,
        num_key_value_heads=c.n_kv_heads,
        head_dim=c.head_dim,
        rms_norm_eps=c.norm_eps,
        rope_theta=c.rope_theta,
        tie_word_embeddings=False,
        eos_token_id=c.eos_id,
        pad_token_id=c.eos_id,
        bos_token_id=None,
    )
    hf = LlamaForCausalLM(hf_config).eval()
    with torch.no_grad():
        hf.lm_head.weight[c.eos_id].zero_()
    ours = from_llama(hf).eval().to(cfg.device)
    hf, hf_ids = hf.to(cfg.device), ids.to(cfg.device)
    mask = torch.ones_like(hf_ids)

    def hf_generate(new: int, streamer: FirstTokenClock | None = None) -> torch.Tensor:
        with torch.inference_mode():
            out = hf.generate(
                hf_ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new, do_sample=False, num_beams=1,
                use_cache=True, streamer=streamer,
            )  # fmt: skip
        assert out.shape[1] == hf_ids.shape[1] + new
        return out[:, hf_ids.shape[1] :]

    warn_unless_hf_agrees(ours, ids, cfg.new_tokens, hf_generate(cfg.new_tokens))
    return ours, hf_generate
