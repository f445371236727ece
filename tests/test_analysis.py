"""The analysis notebook runs on real result files (a tiny evaluation and benchmark)."""

import importlib.util

import torch

from speed.bench import BenchConfig, run_benchmark
from speed.config import preset
from speed.evaluate import EvalConfig, run_evaluation
from speed.model import SpeedT5
from speed.paths import repo_root
from speed.tokenizer import Tokenizer


def test_flip_report_reads_evaluation_and_benchmark(tmp_path, tiny_tokenizer):
    import pyarrow.parquet as pq

    tok = Tokenizer.load(tiny_tokenizer)
    torch.manual_seed(0)
    model = SpeedT5(preset("tiny", vocab_size=tok.vocab_size, pattern="2x3"))
    config = EvalConfig("translate_en_de", "validation", limit=4, max_new_tokens=8, max_source_len=64)
    run_evaluation(model, tok, config, tmp_path / "eval")
    bench = run_benchmark(BenchConfig(model=preset("tiny", pattern="2x3"), new_tokens=6, reps=1, compare_hf=False))
    pq.write_table(bench, tmp_path / "bench.parquet")

    spec = importlib.util.spec_from_file_location("flip_report", repo_root() / "analysis" / "flip_report.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    text = module.report(tmp_path / "eval", tmp_path / "bench.parquet")
    assert "pattern 2x3" in text and "flip_rate_final" in text
    assert "speed_oracle" in text and "positions 0-4" in text
