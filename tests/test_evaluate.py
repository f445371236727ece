"""The evaluate job end to end on a tiny model, and run_evaluation's checks."""

from __future__ import annotations

import json
import math

import pyarrow.compute as pc
import pyarrow.parquet as pq
import pytest
import torch
from job_helpers import job_module

import speed.eval.evaluate
from speed import SpeedT5, preset
from speed.config import ConfigError, from_dict, lm_preset
from speed.data import load_records, truncate
from speed.data.batching import encode_prompts
from speed.decode.exactness import LogitRecorder
from speed.engine import Speculation
from speed.eval.evaluate import EVAL_TRACE_SCHEMA, PREDICTIONS_SCHEMA, DecodingMismatch, EvalConfig, run_evaluation
from speed.models.checkpoint import save_model
from speed.models.looped_lm import LoopedLM
from speed.tokenizer import train_tokenizer


@pytest.fixture(autouse=True)
def one_thread():
    """Tiny models decode fastest on one thread; leave torch as it was for other tests."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A tiny 2x3 model and its tokenizer, saved as a checkpoint."""
    root = tmp_path_factory.mktemp("ckpt")
    ds = load_records("translate_en_de", "train", limit=300)
    tok = train_tokenizer([*ds["source"], *ds["target"]], root / "spm.model", vocab_size=200, num_extra=10)
    torch.manual_seed(0)
    model = SpeedT5(preset("tiny", vocab_size=tok.vocab_size, pattern="2x3"))
    return save_model(root / "model", model, tok.path), model, tok


@pytest.fixture(scope="module")
def lm_checkpoint(checkpoint, tmp_path_factory):
    """A tiny 1+2x2+1 looped LM (two loops) with the T5's tokenizer, saved as a checkpoint."""
    _, _, tok = checkpoint
    torch.manual_seed(0)
    model = LoopedLM(lm_preset("tiny", vocab_size=tok.vocab_size, pattern="1+2x2+1"))
    return save_model(tmp_path_factory.mktemp("lm") / "model", model, tok.path), model, tok


def _job():
    return job_module("evaluate")


def test_job_end_to_end(checkpoint, tmp_path, capsys):
    directory, _, tok = checkpoint
    out = tmp_path / "eval"
    flags = ["--checkpoint", str(directory), "--task", "translate_en_de", "--limit", "6", "--batch-size", "4"]
    summary = _job().main([*flags, "--max-new-tokens", "8", "--threads", "1", "--out", str(out)])

    printed = capsys.readouterr()
    assert "nrefs:1|case:mixed|eff:no|tok:13a" in printed.out and "speed-up" in printed.out
    # Not a terminal: a progress line at the first batch and at the end (not one per batch), with rate and ETA.
    bars = [line.split(" [#")[0] for line in printed.err.splitlines() if line.startswith("[evaluate ")]
    assert bars == [f"[evaluate speed+sequential] {n}/6 examples" for n in (4, 6)]
    assert "examples/s | ETA 0s" in printed.err.splitlines()[-1]

    predictions = pq.read_table(out / "predictions.parquet")
    trace = pq.read_table(out / "trace.parquet")
    assert predictions.schema.equals(PREDICTIONS_SCHEMA) and trace.schema.equals(EVAL_TRACE_SCHEMA)
    assert predictions["example"].to_pylist() == list(range(6))
    expected = load_records("translate_en_de", "test", limit=6)
    assert predictions["source"].to_pylist() == expected["source"][:]
    assert predictions["reference"].to_pylist() == expected["target"][:]
    for row in predictions.to_pylist():  # the trace joins on example and holds the decoded tokens
        rows = trace.filter(pc.equal(trace["example"], row["example"]))
        assert rows.num_rows == 3 * row["output_tokens"]  # one row per token and loop
        final = rows.filter(pc.equal(rows["loop"], 3))["token"].to_pylist()
        assert tok.decode(final) == row["hypothesis"] and len(final) <= 8

    assert json.loads((out / "summary.json").read_text()) == summary
    assert set(summary["metrics"]) == {"bleu", "chrf"} and 0 <= summary["metrics"]["bleu"]["score"] <= 100
    loops = {}  # (example, position) -> each loop's prediction, from the trace's raw predictions
    for r in trace.to_pylist():
        loops.setdefault((r["example"], r["position"]), {})[r["loop"]] = r["prediction"]
    assert [r["loop"] for r in summary["flip_rates"]] == [1, 2, 3]
    for rate in summary["flip_rates"]:
        lo = rate["loop"]
        prev = [lo > 1 and p[lo] != p[lo - 1] for p in loops.values()]
        final = [p[lo] != p[3] for p in loops.values()]
        assert rate["tokens"] == len(loops)
        got = (rate["flip_rate_prev"], rate["flip_rate_final"])
        assert got == pytest.approx((sum(prev) / len(prev), sum(final) / len(final))), lo
    assert 0 < summary["flip_rates"][0]["flip_rate_final"] < 1  # early exits that flip: the rates tell loops apart
    decode = summary["decode"]
    assert decode["identical"] and decode["mismatches"] == [] and decode["speedup"] > 0
    assert decode["speed"]["tokens"] == decode["sequential"]["tokens"] == sum(predictions["output_tokens"].to_pylist())
    assert decode["speed"]["tokens_per_s"] > 0
    config = summary["config"]  # EvalConfig's defaults; no training job in this checkpoint: 512 input tokens
    assert [config[k] for k in ("limit", "split", "max_source_len", "check_sequential")] == [6, "test", 512, True]
    assert summary["model"]["pattern"] == "2x3" and summary["family"] == "t5"
    intervals = summary["intervals"]  # BLEU and ROUGE-L, each inside its own 95% bootstrap interval
    assert intervals["bleu"]["score"] == pytest.approx(summary["metrics"]["bleu"]["score"])
    assert all(r["low"] <= r["score"] <= r["high"] and r["samples"] == 1000 for r in intervals.values())
    perplexity = summary["perplexity"]  # teacher-forced on the references, each cut to 8 tokens
    refs = [min(len(ids), 8) for ids in tok.encode_batch(predictions["reference"].to_pylist())]
    assert perplexity["tokens"] == sum(refs) and len(perplexity["perplexity"]) == 3
    assert perplexity["perplexity"] == pytest.approx([math.exp(x) for x in perplexity["loss"]])
    assert "bootstrap interval" in printed.out and "perplexity of the references, per loop" in printed.out


def test_summarization_reports_rouge(checkpoint, tmp_path):
    _, model, tok = checkpoint
    config = EvalConfig("summarize", "validation", limit=3, max_new_tokens=4, max_source_len=32, check_sequential=False)
    summary = run_evaluation(model, tok.path, config, tmp_path, progress=False)
    assert set(summary["metrics"]) == {"rouge"} and set(summary["metrics"]["rouge"]) >= {"rouge1", "rouge2", "rougeL"}
    assert "sequential" not in summary["decode"] and summary["examples"] == 3


def test_a_looped_lm_is_evaluated_as_a_t5_is(lm_checkpoint, tmp_path, capsys):
    """The job on an LM checkpoint and a summarization task: ROUGE with intervals, flip rates per loop, steps
    per token beside the oracle's, SPEED checked identical to sequential, and every loop's perplexity of the
    references after the prompts, checked against the model's own logits."""
    directory, model, tok = lm_checkpoint
    out = tmp_path / "eval"
    flags = ["--checkpoint", str(directory), "--task", "summarize", "--split", "validation", "--limit", "4"]
    flags += ["--batch-size", "2", "--max-new-tokens", "6", "--max-source-len", "48", "--threads", "1"]
    summary = _job().main([*flags, "--bootstrap-samples", "200", "--out", str(out)])
    assert "rougeL" in capsys.readouterr().out
    assert set(summary["metrics"]) == {"rouge"} and summary["model"]["pattern"] == "1+2x2+1"
    assert summary["family"] == "lm"
    assert summary["intervals"]["rougeL"]["score"] == pytest.approx(summary["metrics"]["rouge"]["rougeL"])
    assert summary["intervals"]["rougeL"]["samples"] == 200
    assert [r["loop"] for r in summary["flip_rates"]] == [1, 2]
    decode = summary["decode"]
    assert decode["identical"] and decode["speedup"] > 0
    assert decode["oracle_steps_per_token"] <= decode["steps_per_token"]
    predictions = pq.read_table(out / "predictions.parquet").to_pydict()
    assert decode["speed"]["tokens"] == sum(predictions["output_tokens"])

    prompts = encode_prompts(predictions["source"], tok, 48)
    answers = [truncate(ids, 6) for ids in tok.encode_batch(predictions["reference"])]  # EOS last, as in training
    losses, tokens = torch.zeros(2, dtype=torch.float64), 0
    with torch.no_grad():
        for prompt, answer in zip(prompts, answers):  # one example at a time: no padding, no collate
            logits = model(torch.tensor([prompt + answer]), return_logits=True).loop_logits  # M x (1, T, V)
            for loop, lg in enumerate(logits):
                predicting = lg[0, len(prompt) - 1 : len(prompt) + len(answer) - 1]  # (A, V): the answer's logits
                losses[loop] += torch.nn.functional.cross_entropy(predicting, torch.tensor(answer), reduction="sum")
            tokens += len(answer)
    perplexity = summary["perplexity"]
    assert perplexity["tokens"] == tokens
    assert perplexity["loss"] == pytest.approx((losses / tokens).tolist(), rel=1e-5)
    assert perplexity["perplexity"] == pytest.approx([math.exp(x) for x in perplexity["loss"]])


def _break_sequential(monkeypatch):
    """Make sequential decoding of the second example of each 2-example batch emit another first token."""
    real = speed.eval.evaluate.generate
    calls = []

    def broken(model, ids, mask, options, **kwargs):
        result = real(model, ids, mask, options, **kwargs)
        calls.append("oracle" if kwargs.get("oracle") else options.method)
        if options.method == "sequential" and len(result.tokens) == 2 and not isinstance(model, LogitRecorder):
            result.tokens[1][0] += 1  # the timed batch, not the warm-up nor the gap's re-run
        return result

    monkeypatch.setattr(speed.eval.evaluate, "generate", broken)
    return calls


def _config(**kw) -> EvalConfig:
    return EvalConfig("translate_en_de", **({"batch_size": 2, "max_new_tokens": 8, "max_source_len": 64} | kw))


def test_decode_summary_reports_the_oracle_branches_and_flip_cost(checkpoint, tmp_path):
    """Steps and rows per token beside the oracle's (counted by the same engine on the same outputs), the flip
    cost from the trace, and the branch settings recorded; branches change the steps, never the output."""
    _, model, tok = checkpoint
    # the cost model off: it closes steps by this machine's measured pass cost, which would make the steps compared
    # below a matter of timing (with it on, plain and branched SPEED once took the same 84 steps)
    settled = {"limit": 6, "batch_size": 1, "cost_model": False}
    plain = run_evaluation(model, tok, _config(**settled), tmp_path / "plain", progress=False)
    tree = run_evaluation(model, tok, _config(**settled, branches=3), tmp_path / "tree", progress=False)
    lengths = pq.read_table(tmp_path / "plain" / "predictions.parquet")["output_tokens"].to_pylist()
    for summary in (plain, tree):
        d = summary["decode"]
        tokens = d["speed"]["tokens"]
        assert tokens == sum(lengths) and d["identical"]
        # oracle speculation never flushes: one sequence of T tokens takes T + M - 1 steps
        assert d["oracle_steps_per_token"] * tokens == pytest.approx(sum(n + 2 for n in lengths))
        assert d["oracle_steps_per_token"] <= d["steps_per_token"] == pytest.approx(d["speed"]["steps"] / tokens)
        assert d["own_over_oracle"] == pytest.approx(d["oracle_steps_per_token"] / d["steps_per_token"])
        assert d["rows_per_token"] == pytest.approx(3 + d["wasted_rows_per_token"])
        rates = summary["flip_rates"]
        assert d["flip_cost_per_loop"] == pytest.approx([(r["loop"] - 1) * r["flip_rate_prev"] for r in rates])
        assert d["flip_cost"] == pytest.approx(sum(d["flip_cost_per_loop"]))
    assert (plain["config"]["branches"], tree["config"]["branches"]) == (0, 3)
    assert plain["decode"]["speed"]["promotions"] == 0 < tree["decode"]["speed"]["promotions"]
    assert plain["decode"]["speed"]["steps"] != tree["decode"]["speed"]["steps"]
    assert plain["decode"]["oracle_steps_per_token"] == tree["decode"]["oracle_steps_per_token"]
    off = run_evaluation(model, tok, _config(limit=2, oracle=False), tmp_path / "off", progress=False)
    assert "oracle_steps_per_token" not in off["decode"] and "steps_per_token" in off["decode"]


def test_a_mismatch_is_recorded_written_then_fails(checkpoint, tmp_path, monkeypatch):
    _, model, tok = checkpoint
    calls = _break_sequential(monkeypatch)
    with pytest.raises(DecodingMismatch, match="differ on 2 example.*bitwise mode.*example 1, position 0"):
        run_evaluation(model, tok, _config(limit=4), tmp_path)
    summary = json.loads((tmp_path / "summary.json").read_text())  # finished work is kept
    assert pq.read_table(tmp_path / "predictions.parquet").num_rows == 4 and (tmp_path / "trace.parquet").is_file()
    decode = summary["decode"]
    assert not decode["identical"] and decode["check"]["bitwise"]
    assert [(m["example"], m["position"]) for m in decode["mismatches"]] == [(1, 0), (3, 0)]
    assert all(m["sequential_token"] == m["speed_token"] + 1 and m["top2_gap"] > 0 for m in decode["mismatches"])
    # interleaved timing: after the warm-up, batch 1 runs SPEED first, batch 2 sequential first
    timed = [c for c in calls[2:] if c in ("speed", "sequential")]
    assert timed[:2] == ["speed", "sequential"] and timed[3:5] == ["sequential", "speed"]


def test_near_ties_may_be_allowed(checkpoint, tmp_path, monkeypatch):
    _, model, tok = checkpoint
    _break_sequential(monkeypatch)
    with pytest.raises(DecodingMismatch, match="not a near-tie"):  # a real gap is not a near-tie
        run_evaluation(model, tok, _config(limit=2, bitwise=False), tmp_path, progress=False)
    summary = run_evaluation(model, tok, _config(limit=2, bitwise=False, near_tie=1e9), tmp_path, progress=False)
    assert len(summary["decode"]["mismatches"]) == 1 and not summary["decode"]["identical"]


def test_sampled_evaluation_is_checked_against_sequential_sampling(checkpoint, tmp_path):
    """With a temperature both methods sample with the seed: identical outputs, unlike greedy's; the
    seed changes them."""
    _, model, tok = checkpoint
    runs = {}
    for name, kw in {"greedy": {}, "a": {"temperature": 1.0, "seed": 1}, "b": {"temperature": 1.0, "seed": 2}}.items():
        config = EvalConfig("translate_en_de", limit=4, max_new_tokens=8, max_source_len=64, **kw)
        summary = run_evaluation(model, tok, config, tmp_path / name, progress=False)
        assert summary["decode"]["identical"] and summary["config"]["temperature"] == kw.get("temperature", 0.0)
        runs[name] = pq.read_table(tmp_path / name / "predictions.parquet")["hypothesis"].to_pylist()
    assert runs["a"] != runs["greedy"] and runs["a"] != runs["b"]


def test_bad_settings(checkpoint, tmp_path):
    _, model, tok = checkpoint
    with pytest.raises(ValueError, match="no references"):
        EvalConfig(task="pretrain")
    with pytest.raises(ValueError, match="invalidation"):
        EvalConfig(invalidation="lazy")
    with pytest.raises(ValueError, match="batch_size"):
        EvalConfig(batch_size=0)
    with pytest.raises(ValueError, match="EvalConfig: top_p must be in"):
        EvalConfig(top_p=0.0)
    with pytest.raises(ValueError, match="branch_below"):
        EvalConfig(branch_below=0.0)
    with pytest.raises(ValueError, match="min_confidence"):
        EvalConfig(min_confidence=2.0)
    with pytest.raises(ValueError, match="evaluation needs task and max_source_len"):
        run_evaluation(model, tok, EvalConfig(), tmp_path)
    small = SpeedT5(preset("tiny", vocab_size=tok.vocab_size - 1))
    with pytest.raises(ValueError, match=f"tokenizer has {tok.vocab_size} ids"):
        run_evaluation(small, tok, EvalConfig("translate_en_de", limit=1, max_source_len=64), tmp_path)


def test_settings_are_coerced_by_type_and_follow_the_training_data():
    config = from_dict(EvalConfig, {"limit": "5", "check_sequential": "false", "invalidation": "final", "top_k": "3"})
    assert (config.limit, config.check_sequential, config.invalidation, config.top_k) == (5, False, "final", 3)
    assert config.speculation == Speculation(invalidation="final")  # its flags make one Speculation
    assert from_dict(EvalConfig, {"branches": "2"}).speculation == Speculation(branches=2)
    with pytest.raises(ConfigError, match=r"invalidation: expected one of \['eager', 'final'\], got 'lazy'"):
        from_dict(EvalConfig, {"invalidation": "lazy"})
    with pytest.raises(ConfigError, match="batch_size: expected an integer, got 'two'"):
        from_dict(EvalConfig, {"batch_size": "two"})
    followed = EvalConfig(max_source_len=32).following("summarize", "some/folder", 128)
    assert (followed.task, followed.source, followed.max_source_len) == ("summarize", "some/folder", 32)


def test_exit_adapters_are_used_when_asked_and_change_only_the_drafts(checkpoint, tmp_path):
    """A checkpoint with exit adapters (``speed.models.exits``) is evaluated with them with --exit-adapters (its summary
    names them), or without them (beside, not over, the other evaluation): by default on a CPU, or with
    --no-exit-adapters: the same hypotheses, other early exits and steps."""
    import shutil
    from pathlib import Path

    from engine_helpers import random_exits

    from speed.models.checkpoint import load_model, save_exits

    directory, model, _ = checkpoint
    adapted = tmp_path / "adapted"
    shutil.copytree(directory, adapted)
    save_exits(str(adapted), random_exits(load_model(adapted).model, seed=0).exit_adapters)
    flags = ["--checkpoint", str(adapted), "--task", "translate_en_de", "--limit", "4", "--batch-size", "4"]
    flags += ["--max-new-tokens", "8", "--threads", "1"]
    with_exits = _job().main([*flags, "--exit-adapters"])
    without = _job().main([*flags, "--no-exit-adapters"])
    assert with_exits["exit_adapters"]["loops"] == [1, 2] and without["exit_adapters"] is None
    cpu = _job().main([*flags, "--device", "cpu"])  # the CPU's default: without them (speed.engine.defaults)
    assert cpu["exit_adapters"] is None and cpu["files"] == without["files"]
    assert json.loads(Path(with_exits["files"]["summary"]).read_text()) == with_exits
    assert with_exits["files"]["summary"].endswith("eval/translate_en_de-test/summary.json")
    assert without["files"]["summary"].endswith("eval/translate_en_de-test-no-exit-adapters/summary.json")
    hypotheses = [pq.read_table(s["files"]["predictions"])["hypothesis"] for s in (with_exits, without)]
    assert hypotheses[0].equals(hypotheses[1])
    assert with_exits["decode"]["identical"] and without["decode"]["identical"]  # each checked against sequential
    assert with_exits["flip_rates"] != without["flip_rates"]


def test_speeds_settings_left_unset_take_the_devices_defaults(checkpoint, tmp_path, monkeypatch):
    """jobs/evaluate.py: a GPU's defaults (runner-up branches with lanes, speed.engine.defaults) fill the SPEED
    settings no flag sets; a flag wins. The CPU's are plain SPEED. (Run here with the GPU's defaults on the CPU.)"""
    from speed.engine import Speculation
    from speed.engine.defaults import device_exit_adapters, device_levers

    assert not device_exit_adapters("cpu") and device_exit_adapters("cuda:0")
    assert device_levers("cpu", 6) == {} and device_levers("cuda:1", 6) == {"branches": 6, "branch_depth": 6}
    Speculation(**device_levers("cuda", 3)).check_loops(3)  # within any model's loops
    directory, _, _ = checkpoint
    job = _job()
    monkeypatch.setattr(job, "device_levers", lambda device, n_loops: device_levers("cuda", n_loops))
    flags = ["--checkpoint", str(directory), "--task", "translate_en_de", "--limit", "2", "--max-new-tokens", "6"]
    flags += ["--no-oracle", "--no-perplexity", "--bootstrap-samples", "0"]
    config = job.main([*flags, "--out", str(tmp_path / "a")])["config"]
    assert (config["branches"], config["branch_depth"]) == (3, 3)
    config = job.main([*flags, "--branches", "1", "--out", str(tmp_path / "b")])["config"]
    assert (config["branches"], config["branch_depth"]) == (1, 3)
    config = _job().main([*flags, "--out", str(tmp_path / "c")])["config"]  # this machine's own: the CPU's
    assert (config["branches"], config["branch_depth"]) == (0, 1)


def test_an_imported_ouro_directory_is_evaluated_in_its_own_template_and_stop_tokens(tmp_path, capsys):
    """jobs/evaluate.py on a Hugging Face directory (a tiny Ouro with its tokenizer.json and ChatML template): each
    source is one user turn of the directory's template, outputs end at its stop ids (<|im_end|> too), SPEED is
    checked against sequential decoding, and the files are written as for a platform checkpoint."""
    from imported_helpers import write_chat_ouro

    from speed import DecodeOptions, from_pretrained, generate
    from speed.hf_tokenizer import load_tokenizer

    directory = write_chat_ouro(tmp_path / "Ouro-tiny", end_of_turn_bias=0.36)  # 2 of 4 end at <|im_end|>
    out = tmp_path / "eval"
    flags = ["--checkpoint", str(directory), "--task", "translate_en_de", "--limit", "4", "--batch-size", "2"]
    summary = _job().main([*flags, "--max-new-tokens", "8", "--threads", "1", "--out", str(out)])
    assert (summary["examples"], summary["family"], summary["tokenizer"]) == (4, "lm", str(directory))
    assert "bleu" in summary["metrics"] and (out / "trace.parquet").is_file()
    predictions = pq.read_table(out / "predictions.parquet").to_pydict()
    model, tok = from_pretrained(directory), load_tokenizer(directory)
    for source, hypothesis, finished in zip(predictions["source"], predictions["hypothesis"], predictions["finished"]):
        ids = tok.encode_chat([{"role": "user", "content": source}])  # the instruction is in the source
        ref = generate(
            model,
            torch.tensor([ids]),
            options=DecodeOptions(method="sequential", max_new_tokens=8, stop_ids=tok.stop_ids),
        )
        assert (hypothesis, finished) == (tok.decode(ref.tokens[0]), ref.stopped[0])
    assert any(predictions["finished"]) and not all(predictions["finished"]), predictions["finished"]


@pytest.mark.parametrize(
    "config, message",
    [
        ({"model_type": "gpt2"}, "model_type 'gpt2' is not one the platform loads"),
        ({"architectures": ["X"]}, "config.json has no model_type"),
    ],
)
def test_a_directory_the_platform_cannot_read_is_one_line_and_status_2(tmp_path, capsys, config, message):
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "config.json").write_text(json.dumps(config))
    out = tmp_path / "eval"
    with pytest.raises(SystemExit) as exit_:
        _job().main(["--checkpoint", str(bad), "--task", "translate_en_de", "--out", str(out)])
    err = capsys.readouterr().err.strip()
    assert exit_.value.code == 2 and "\n" not in err and message in err, err
    assert not out.exists()  # nothing half-written


def test_the_exit_gate_is_reported_beside_speed_and_sequential(checkpoint, tmp_path, capsys):
    """``--method exit_gate`` on an LM with an exit gate (lambda about 0.5 at initialisation, so Q-exit at 0.6 leaves
    at loop 2 of 3 mostly): its quality, group passes per token and mean exit loop beside SPEED's on the same
    text, SPEED still checked identical to sequential; the rule's flags are checked."""
    _, _, tok = checkpoint
    torch.manual_seed(0)
    model = LoopedLM(lm_preset("tiny", vocab_size=tok.vocab_size, pattern="2x3", exit_gate=True))
    directory = save_model(tmp_path / "gated", model, tok.path)
    flags = ["--checkpoint", str(directory), "--task", "summarize", "--split", "validation", "--limit", "3"]
    flags += ["--batch-size", "3", "--max-new-tokens", "5", "--max-source-len", "48", "--threads", "1"]
    flags += ["--bootstrap-samples", "0", "--no-perplexity", "--out", str(tmp_path / "eval")]
    summary = _job().main([*flags, "--method", "exit_gate", "--exit-kind", "threshold", "--exit-threshold", "0.6"])
    decode = summary["decode"]
    gate = decode["exit_gate"]
    assert "exit gate (threshold, lossy)" in capsys.readouterr().out
    assert decode["identical"] and gate["rule"] == {"kind": "threshold", "threshold": 0.6, "step": 0}
    assert gate["gated_tokens"] == gate["tokens"] > 0 and set(gate["metrics"]) == {"rouge"}
    assert 1.0 <= gate["mean_exit_loop"] < 3.0  # the gate asks for fewer loops than it runs
    assert gate["group_passes_per_token"] == gate["group_passes"] / gate["tokens"]
    assert decode["speed"]["group_passes_per_token"] == decode["speed"]["group_passes"] / decode["speed"]["tokens"]
    assert 0.0 <= gate["prefix_agreement"] <= 1.0
    assert "exit_gate" not in _job().main(flags)["decode"]  # method speed: no gated decoding
    for bad, says in [
        ({"exit_threshold": 0.0}, "threshold"),
        ({"exit_kind": "first"}, "exit_kind"),
        ({"method": "x"}, "method"),
    ]:
        with pytest.raises((ValueError, ConfigError), match=says):
            from_dict(EvalConfig, bad)


@pytest.mark.parametrize("speedup", [0.47, 1.6])
def test_a_speed_up_below_one_says_why(speedup):
    """The documented tiny evaluations run random weights, whose exits flip at every loop: SPEED is then slower
    than sequential decoding, and the printed summary says why beside the number (never above 1)."""
    from speed.eval.summary import format_summary

    summary = {
        "task": "translate_en_de", "split": "test", "examples": 8, "source": "local", "metrics": {},
        "flip_rates": [{"loop": 1, "flip_rate_final": 0.81}, {"loop": 2, "flip_rate_final": 0.0}],
        "decode": {
            "speed": {"tokens_per_s": 10.0, "tokens_per_pass": 0.5, "flushes": 9},
            "sequential": {"tokens_per_s": 10.0 / speedup}, "identical": True, "speedup": speedup,
        },
    }  # fmt: skip
    line = next(x for x in format_summary(summary).splitlines() if "speed-up" in x)
    assert f"SPEED speed-up {speedup:.2f}x" in line
    why = "(below 1: loop 1's exit disagrees with the last loop's on 81 % of tokens"
    assert (why in line) == (speedup < 1) and ("random or untrained weights" in line) == (speedup < 1)


def test_the_load_is_checked_with_the_evaluations_engine_and_the_seed_reaches_the_loader(tmp_path, capsys, monkeypatch):
    """On a CPU the job's memory check counts the engine a batch builds (``EvalConfig.engine_capacity``) beside the
    weights: where the weights fit and that does not, one line, status 2, nothing written; ``--initial-state-seed``
    reaches the loader, which refuses it for a form without injection."""
    from imported_helpers import write_chat_ouro

    from speed.engine.memory import MEMORY_LIMIT_ENV
    from speed.models.pretrained import check_load

    directory = str(write_chat_ouro(tmp_path / "Ouro-tiny"))
    out = tmp_path / "eval"
    flags = ["--checkpoint", directory, "--task", "translate_en_de", "--out", str(out), "--device", "cpu"]
    flags += ["--batch-size", "4", "--max-new-tokens", "8", "--max-source-len", "56"]
    planned = from_dict(EvalConfig, {"batch_size": 4, "max_new_tokens": 8, "max_source_len": 56})
    monkeypatch.setenv(MEMORY_LIMIT_ENV, str(2**40))
    weights, need = check_load(directory), check_load(directory, capacity=planned.engine_capacity())
    assert need.cache > 0 and need.blocks == 2  # one request of 64 positions: the engine's floor
    monkeypatch.setenv(MEMORY_LIMIT_ENV, str(weights.total + need.allocated // 2))
    for extra, says in [([], "Ouro-tiny as float32 needs"), (["--initial-state-seed", "3"], "initial_state_seed=3")]:
        with pytest.raises(SystemExit) as exit_:
            _job().main([*flags, *extra])
        err = capsys.readouterr().err.strip()
        assert exit_.value.code == 2 and "\n" not in err and says in err, err
    assert not out.exists()
