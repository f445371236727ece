"""Side-by-side decode latency of the decoder-only looped LM: sequential vs SPEED vs the shallow loop, and our
plain stack against ``transformers``' Llama ``generate`` on the same weights, in one process.

Each variant decodes the same prompts twice per round: once for one token (the time to first token: the
prefill of every prompt and its first token) and once for all of them; the decode time per token is the
difference over the tokens after the first. Repetitions are interleaved (``speed.benchmarks.decode.interleave``)
and medians reported; ratios are computed from them, never typed in.
"""

from __future__ import annotations

import json
import statistics
from collections.abc import Callable
from dataclasses import dataclass

import pyarrow as pa
import torch

from speed.benchmarks.decode import interleave, machine_name
from speed.config import LMConfig, to_dict
from speed.decoding import GenerateResult, generate
from speed.lm import LoopedLM

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
    ]
)


@dataclass(frozen=True)
class LMBenchConfig:
    """What to measure: model dims and pattern, prompt and output lengths, repetitions."""

    model: LMConfig
    batch: int = 1
    prompt_len: int = 64
    new_tokens: int = 64
    reps: int = 5
    seed: int = 0
    compare_hf: bool = True  # also time our sequential Dx1 (D = N*M) against transformers' Llama generate
    device: str = "cpu"


def random_lm(config: LMConfig, seed: int) -> LoopedLM:
    """A random looped LM whose EOS row is zeroed, so that every run decodes the full length."""
    torch.manual_seed(seed)
    model = LoopedLM(config).eval()
    with torch.no_grad():
        model.lm_head.weight[config.eos_id].zero_()
    return model


def run_lm_benchmark(cfg: LMBenchConfig) -> pa.Table:
    """Measure every variant side by side; one row per variant (``LM_BENCH_SCHEMA``)."""
    sharing = cfg.model.sharing
    if sharing.prelude or sharing.coda:
        raise ValueError(f"the benchmark compares NxM with Nx1 and Dx1; write the pattern NxM, got {cfg.model.pattern}")
    model = random_lm(cfg.model, cfg.seed).to(cfg.device)
    shallow = random_lm(cfg.model.replace(pattern=f"{sharing.n_unique}x1"), cfg.seed).to(cfg.device)
    torch.manual_seed(cfg.seed + 1)
    ids = torch.randint(2, cfg.model.vocab_size, (cfg.batch, cfg.prompt_len))
    n = cfg.new_tokens
    reference = generate(model, ids, method="sequential", max_new_tokens=n, trace=False)
    results: dict[str, GenerateResult] = {}
    configs = {"sequential": model.config, "speed": model.config, "speed_oracle": model.config}
    configs["shallow"] = shallow.config

    def run(name: str, m: LoopedLM, new: int, **kw) -> Callable[[], int]:
        def go() -> int:
            result = generate(m, ids, max_new_tokens=new, trace=False, **kw)
            if new == n:
                results[name] = result
            return 1  # interleave divides by this: times stay per run

        return go

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
    variants: dict[str, Callable[[], int]] = {}
    for name, (m, kw) in kinds.items():
        first = {k: v for k, v in kw.items() if k != "oracle"}  # one token: nothing to speculate
        variants[f"{name}/first"] = run(name, m, 1, **first)
        variants[name] = run(name, m, n, **kw)
    if hf is not None:

        def run_hf(new: int) -> Callable[[], int]:
            def go() -> int:
                hf_generate(new)
                return 1

            return go

        variants["hf_generate/first"], variants["hf_generate"] = run_hf(1), run_hf(n)
    print(
        f"LM benchmark: {cfg.model.pattern} d_model={cfg.model.d_model} vocab={cfg.model.vocab_size} "
        f"batch={cfg.batch} prompt={cfg.prompt_len} tokens={n} reps={cfg.reps} threads={torch.get_num_threads()} "
        f"device={cfg.device}",
        flush=True,
    )
    times = interleave(variants, cfg.reps, cfg.device)  # ms per run
    for name in ("speed", "speed_oracle"):
        if results[name].tokens != reference.tokens:
            raise AssertionError(f"{name} output differs from sequential greedy decoding")
    med = {name: statistics.median(ts) for name, ts in times.items()}
    decoded = cfg.batch * (n - 1)  # the tokens after each sequence's first
    ttft = {name: med[f"{name}/first"] for name in [*kinds, *(["hf_generate"] if hf else [])]}
    per_token = {name: (med[name] - ttft[name]) / decoded for name in ttft}
    machine = machine_name(cfg.device)
    rows = []
    for name in ttft:
        stats = results[name].stats if name in results else None
        baseline = "hf_generate" if name in ("ours_deep", "hf_generate") else "sequential"
        rows.append(
            {
                "variant": name,
                "pattern": configs[name].pattern,
                "model": json.dumps(to_dict(configs[name]), sort_keys=True),
                "ttft_ms": ttft[name],
                "ms_per_token": per_token[name],
                "baseline": baseline,
                "speedup": per_token[baseline] / per_token[name],
                "ratio_vs_shallow": per_token[name] / per_token["shallow"],
                "tokens": stats.tokens if stats else cfg.batch * n,
                "steps": stats.steps if stats else None,
                "flushes": stats.flushes if stats else None,
                "reps": cfg.reps,
                "prompt_len": cfg.prompt_len,
                "d_model": cfg.model.d_model,
                "vocab_size": cfg.model.vocab_size,
                "batch": cfg.batch,
                "threads": torch.get_num_threads(),
                "torch": torch.__version__,
                "machine": machine,
            }
        )
    return pa.Table.from_pylist(rows, schema=LM_BENCH_SCHEMA)


def _hf_pair(cfg: LMBenchConfig, ids: torch.Tensor):
    """Our sequential Dx1 and a ``generate(new)`` of transformers' Llama (greedy, KV cache on), same weights."""
    try:
        from transformers import LlamaConfig, LlamaForCausalLM

        from speed.convert_llama import from_llama
    except ImportError as err:  # transformers is a test/bench extra
        print(f"skipping the transformers comparison: {err}")
        return None
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

    def hf_generate(new: int) -> torch.Tensor:
        with torch.inference_mode():
            out = hf.generate(
                hf_ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new, do_sample=False, num_beams=1,
                use_cache=True,
            )  # fmt: skip
        assert out.shape[1] == hf_ids.shape[1] + new
        return out[:, hf_ids.shape[1] :]

    check = generate(ours, ids, method="sequential", max_new_tokens=cfg.new_tokens, trace=False).tokens
    if check != hf_generate(cfg.new_tokens).tolist():
        print("warning: our Dx1 greedy tokens differ from transformers' (numerical near-ties on random weights?)")
    return ours, hf_generate


def format_lm_table(table: pa.Table) -> str:
    """A fixed-width text table of the LM benchmark rows."""
    head = f"{'variant':<14}{'pattern':>8}{'TTFT ms':>10}{'ms/token':>10}{'speed-up':>9}{'over':>13}"
    head += f"{'vs shallow':>12}{'steps':>7}{'flushes':>9}"
    lines = [head, "-" * len(head)]
    for r in table.to_pylist():
        steps = "" if r["steps"] is None else r["steps"]
        flushes = "" if r["flushes"] is None else r["flushes"]
        lines.append(
            f"{r['variant']:<14}{r['pattern']:>8}{r['ttft_ms']:>10.1f}{r['ms_per_token']:>10.2f}{r['speedup']:>8.2f}x"
            f"{r['baseline']:>13}{r['ratio_vs_shallow']:>11.2f}x{steps:>7}{flushes:>9}"
        )
    return "\n".join(lines)
