"""Our T5 decoding against CTranslate2 on the same random T5 v1.1-base weights (not a test; needs
`pip install ctranslate2`, not a dependency). Batch 1, 32 source tokens, 64 new ones, 2 threads, best of 5; run
each mode in its own process, alternating, as docs/benchmarks.md ("The CTranslate2 gap") did:

    python jobs/compare_ct2.py make DIR   # DIR/hf: random T5 v1.1-base, 12 decoder layers, EOS row zeroed; DIR/ct2
    python jobs/compare_ct2.py ct2 DIR    # CTranslate2's ms per token
    python jobs/compare_ct2.py seq DIR    # our sequential 12x1 on DIR/hf's weights
    python jobs/compare_ct2.py speed DIR  # our oracle SPEED 2x6 (random weights of the same dims)

With `PYTHONPATH=<another checkout>/platform` the last two time an older commit (the imports of the layouts before
2026-12-03 are tried too), which is how a regression is bisected.
"""

from __future__ import annotations

import argparse
import sys
import time

import torch

N_NEW, SRC_LEN, REPS = 64, 32, 5
SPECIAL = {0: "<pad>", 1: "</s>", 2: "<unk>"}


def _imports():
    try:
        from speed.decode.generate import generate
        from speed.models.convert_t5 import from_hf_model, hf_config_from
        from speed.models.t5 import SpeedT5
    except ImportError:  # the layout before 2026-12-03
        from speed.convert import from_hf_model, hf_config_from
        from speed.decoding import generate
        from speed.model import SpeedT5
    from speed.config import preset

    try:
        from speed.decode.generate import DecodeOptions
    except ImportError:  # before DecodeOptions: generate took its options as keywords, as decode does
        return from_hf_model, hf_config_from, generate, SpeedT5, preset

    def decode(model, ids, oracle=None, **options):
        return generate(model, ids, DecodeOptions(**options), oracle=oracle)

    return from_hf_model, hf_config_from, decode, SpeedT5, preset


def _ids() -> torch.Tensor:
    return torch.randint(3, 32000, (1, SRC_LEN), generator=torch.Generator().manual_seed(1))


def _best_ms_per_token(run) -> float:
    run()
    best = float("inf")
    for _ in range(REPS):
        start = time.perf_counter()
        run()
        best = min(best, time.perf_counter() - start)
    return best / N_NEW * 1000


class _Vocabulary:
    """What CTranslate2's T5 converter reads of a tokenizer: token strings by id (random weights need no text)."""

    pad_token, eos_token, unk_token = SPECIAL[0], SPECIAL[1], SPECIAL[2]

    def get_vocab(self) -> dict[str, int]:
        return {SPECIAL.get(i, f"t{i}"): i for i in range(32100)}

    def convert_ids_to_tokens(self, i: int) -> str:
        return SPECIAL.get(i, f"t{i}")


def main(mode: str, out: str) -> None:
    torch.set_num_threads(2)
    if mode == "make":
        import ctranslate2.converters.transformers as converters
        from transformers import T5ForConditionalGeneration

        from_hf_model, hf_config_from, decode, SpeedT5, preset = _imports()
        cfg = preset("base", pattern="12x1", vocab_size=32128, dropout=0.0)
        torch.manual_seed(0)
        hf = T5ForConditionalGeneration(hf_config_from(cfg, n_decoder_layers=12)).eval()
        with torch.no_grad():
            hf.lm_head.weight[cfg.eos_id].zero_()
        hf.save_pretrained(f"{out}/hf")

        class Converter(converters.TransformersConverter):
            def load_tokenizer(self, *args, **kwargs):
                return _Vocabulary()

        Converter(f"{out}/hf").convert(f"{out}/ct2", force=True)
        print(f"wrote {out}/hf and {out}/ct2")
    elif mode == "ct2":
        import ctranslate2

        translator = ctranslate2.Translator(f"{out}/ct2", device="cpu", inter_threads=1, intra_threads=2)
        source = [[SPECIAL.get(i, f"t{i}") for i in _ids()[0].tolist()] + ["</s>"]]
        options = {"beam_size": 1, "max_decoding_length": N_NEW, "min_decoding_length": N_NEW}
        print(f"ct2 {_best_ms_per_token(lambda: translator.translate_batch(source, **options)):.2f} ms/token")
    elif mode in ("seq", "speed"):
        from transformers import T5ForConditionalGeneration

        from_hf_model, hf_config_from, decode, SpeedT5, preset = _imports()
        hf = T5ForConditionalGeneration.from_pretrained(f"{out}/hf").eval()
        x = torch.cat([_ids(), torch.ones(1, 1, dtype=torch.long)], dim=1)  # EOS-terminated, as T5's sources are
        if mode == "seq":
            model = from_hf_model(hf, pattern="12x1").eval()
            kwargs = {"method": "sequential"}
        else:
            cfg = preset("base", pattern="2x6", vocab_size=32128, dropout=0.0)
            torch.manual_seed(0)
            model = SpeedT5(cfg).eval()
            with torch.no_grad():
                model.lm_head.weight[cfg.eos_id].zero_()
            reference = decode(model, x, method="sequential", max_new_tokens=N_NEW, trace=False).tokens
            kwargs = {"method": "speed", "oracle": reference}
        ms = _best_ms_per_token(lambda: decode(model, x, max_new_tokens=N_NEW, trace=False, **kwargs))
        print(f"{mode} {ms:.2f} ms/token")
    else:
        sys.exit(f"unknown mode {mode!r}: make, ct2, seq or speed")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("mode", choices=["make", "ct2", "seq", "speed"])
    parser.add_argument("dir", help="where `make` writes the weights (hf/, ct2/) and the others read them")
    args = parser.parse_args()
    main(args.mode, args.dir)
