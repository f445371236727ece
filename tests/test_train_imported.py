"""Finetuning an imported looped LM (a tiny Ouro directory as published: safetensors, tokenizer.json, a ChatML
template) with ``jobs/finetune.py --model lm --init-from <directory>``: the data tokenized with the directory's own
tokenizer and chat template (the prompts evaluation writes), its tokenizer files copied into every checkpoint, which
``load_pretrained`` reads back and decodes with (SPEED == sequential), and a run that stops resumes. On the session's
local Ray; what a Hugging Face tokenizer cannot train is one line, without Ray.
"""

from __future__ import annotations

import math
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import torch
from imported_helpers import assert_speed_exact, write_chat_ouro

from speed.data import get_task, load_records
from speed.data.corpus import open_corpus
from speed.hf_tokenizer import HFTokenizer, chat_renderer, load_tokenizer, tokenizer_files
from speed.models.checkpoint import HF_TOKENIZER_DIR
from speed.models.pretrained import load_pretrained
from speed.paths import TRAIN_LOG_FILE
from speed.train.config import job_from_args
from speed.train.state import load_training_state


def _flags(ouro, storage, *extra):
    flags = ["--model", "lm", "--init-from", str(ouro), "--task", "translate_en_de", "--limit", "8"]
    flags += ["--max-source-len", "96", "--max-target-len", "24", "--batch-size", "4", "--max-steps", "4"]
    flags += ["--checkpoint-every", "2", "--log-every", "1", "--warmup-steps", "1", "--lr", "3e-3"]
    flags += ["--cpus-per-worker", "1", "--storage-path", str(storage), "--no-tracking", *extra]
    return flags


@pytest.fixture(scope="module")
def tuned(ray_session, tmp_path_factory):
    """4 steps of finetuning a tiny Ouro, stopped at step 2 and resumed by the same command: (directory, outcomes)."""
    from speed.train.launch import run_job

    root = tmp_path_factory.mktemp("imported")
    ouro = write_chat_ouro(root / "Ouro-tiny")
    first = run_job(job_from_args("finetune", _flags(ouro, root / "runs", "--stop-at-step", "2", "--no-eval")))
    evaluate = ["--eval-limit", "2", "--set", "eval.max_new_tokens=4", "--set", "eval.batch_size=2"]
    second = run_job(job_from_args("finetune", _flags(ouro, root / "runs", *evaluate)))
    return ouro, first, second


@pytest.mark.ray
def test_finetuning_an_ouro_directory_trains_with_its_tokenizer_and_resumes(tuned):
    ouro, first, second = tuned
    assert first.run_dir == second.run_dir and load_training_state(first.checkpoint).step == 2
    log = pq.read_table(f"{second.checkpoint}/{TRAIN_LOG_FILE}").to_pydict()
    assert log["step"] == [1, 2, 3, 4] and log["restarts"] == [0, 0, 1, 1]  # steps 3, 4: the resumed launch
    assert all(math.isfinite(x) for x in log["loss"]) and log["loss"][-1] != log["loss"][0]
    tokenizer = HFTokenizer.load(ouro)
    assert log["tokens"][0] > 0 and second.job.model.vocab_size == tokenizer.vocab_size
    # The trained weights moved away from the directory's.
    start, end = load_pretrained(ouro).model.state_dict(), load_pretrained(second.checkpoint).model.state_dict()
    # exit adapters may sit beside the checkpoint (the module's adapter test writes them, in any test order)
    end = {k: v for k, v in end.items() if not k.startswith("exit_adapters.")}
    assert start.keys() == end.keys() and any(not torch.equal(start[k], end[k]) for k in start)


@pytest.mark.ray
def test_the_checkpoint_holds_the_directory_tokenizer_and_decodes_speed_as_sequential(tuned):
    ouro, _, second = tuned
    loaded = load_pretrained(second.checkpoint)
    assert loaded.config["tokenizer"] == {"kind": "huggingface", "path": HF_TOKENIZER_DIR}
    assert loaded.tokenizer_path == f"{second.checkpoint}/{HF_TOKENIZER_DIR}"
    assert tokenizer_files(loaded.tokenizer_path) == tokenizer_files(ouro)
    mine, theirs = load_tokenizer(loaded.tokenizer_path), HFTokenizer.load(ouro)
    assert isinstance(mine, HFTokenizer) and (mine.eos_id, mine.stop_ids) == (theirs.eos_id, theirs.stop_ids)
    # The prompts the data was prepared with: one user turn of the directory's ChatML template, exactly what
    # evaluation writes (Family.encode_sources in the tokenizer's chat_renderer); the answers end in its EOS.
    (prepared,) = (Path(second.run_dir).parent / "data").glob("translate_en_de-train-*")
    examples = open_corpus(str(prepared)).examples(list(range(8)), 0, 0)
    task = get_task("translate_en_de")
    sources = [
        task.instruction + s.removeprefix(task.prefix) for s in load_records(task.name, "train", limit=8)["source"]
    ]
    assert examples["input_ids"] == second.job.family.encode_sources(sources, mine, 96, chat_renderer(mine))
    chats = [theirs.encode_chat([{"role": "user", "content": source}]) for source in sources]  # apply_chat_template
    whole = [i for i, chat in enumerate(chats) if len(chat) <= 96]  # prompts not cut to --max-source-len
    assert whole and all(examples["input_ids"][i] == chats[i] for i in whole)
    assert all(answer[-1] == theirs.eos_id for answer in examples["labels"])
    assert_speed_exact(loaded.model, seed=3)
    summary = second.evaluation
    assert summary["examples"] == 2 and summary["tokenizer"] == loaded.tokenizer_path
    assert summary["config"]["check_sequential"] and summary["config"]["bitwise"]


@pytest.mark.ray
def test_exit_adapters_train_on_the_finetuned_checkpoint_with_its_tokenizer(tuned, tmp_path):
    """``jobs/train_exits.py --checkpoint <the finetuned run>``: the split prepared with the checkpoint's tokenizer/
    (the cached one: the same tokens), adapters beside the frozen model, SPEED with them == sequential."""
    from speed.train.exits import ExitTrainConfig, check_inputs, run_exits

    _, _, second = tuned
    before = {k: v.clone() for k, v in load_pretrained(second.checkpoint).model.state_dict().items()}
    settings = {"rank": 4, "steps": 2, "batch_size": 4, "warmup_steps": 1, "log_every": 1, "cpus_per_worker": 1}
    config = ExitTrainConfig(second.checkpoint, **settings, checkpoint_every=2, storage_path=str(tmp_path))
    check_inputs(config)
    outcome = run_exits(config)
    loaded = load_pretrained(outcome.checkpoint)
    assert loaded.model.exit_adapters is not None and outcome.step == 2
    assert all(torch.equal(v, before[k]) for k, v in loaded.model.state_dict().items() if k in before)
    assert_speed_exact(loaded.model, seed=5)
