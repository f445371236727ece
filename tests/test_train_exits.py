"""``jobs/train_exits.py``: exit adapters trained on a frozen tiny T5 checkpoint with Ray Train, saved beside it,
tracked in MLflow; a run stopped at a step and relaunched ends with the adapters of an uninterrupted one."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from job_helpers import job_module

from speed.config import preset
from speed.decode.generate import DecodeOptions, generate
from speed.models.checkpoint import backbone_state, load_model, newest_complete_checkpoint, save_model
from speed.models.exits import EXITS_CONFIG_FILE, exit_kl
from speed.models.t5 import SpeedT5
from speed.tokenizer import Tokenizer
from speed.train.config import job_from_args, job_to_dict
from speed.train.exits import ExitTrainConfig, _decoded, exits_run_name, run_exits
from speed.train.tracking import import_mlflow

STEPS = 4


def _tiny_checkpoint(directory, tokenizer) -> str:
    """A tiny 2x3 T5 saved as a finetuning job's checkpoint on 16 Multi30k records (its training split)."""
    flags = ["--preset", "tiny", "--pattern", "2x3", "--tokenizer", str(tokenizer), "--limit", "16"]
    job = job_from_args("finetune", [*flags, "--max-source-len", "24", "--max-target-len", "24"])
    torch.manual_seed(0)
    model = SpeedT5(job.model.replace(vocab_size=Tokenizer.load(tokenizer).vocab_size))
    job_dict = {k: v for k, v in job_to_dict(job).items() if k != "model"}
    save_model(directory, model, tokenizer, {"job": job_dict, "step": 1})
    return str(directory)


def _config(checkpoint, storage, **settings) -> ExitTrainConfig:
    base = {"rank": 8, "steps": STEPS, "batch_size": 4, "lr": 1e-2, "warmup_steps": 1, "log_every": 1}
    return ExitTrainConfig(checkpoint, **(base | {"checkpoint_every": 2, "cpus_per_worker": 1, **settings}),
                           storage_path=str(storage))  # fmt: skip


@pytest.fixture(scope="module")
def trained(ray_session, tiny_tokenizer, tmp_path_factory):
    """(outcome, the model checkpoint's weights before): STEPS steps in one go, the reference run."""
    checkpoint = _tiny_checkpoint(tmp_path_factory.mktemp("model") / "ckpt", tiny_tokenizer)
    before = {k: v.clone() for k, v in load_model(checkpoint).model.state_dict().items()}
    return run_exits(_config(checkpoint, tmp_path_factory.mktemp("runs"))), before


@pytest.mark.ray
@pytest.mark.slow
def test_adapters_are_trained_beside_the_frozen_checkpoint_and_tracked(trained):
    outcome, before = trained
    loaded = load_model(outcome.checkpoint)
    model, adapters = loaded.model, loaded.model.exit_adapters
    assert adapters is not None and adapters.config.loops == (1, 2) and adapters.config.rank == 8
    assert all(head.up.weight.abs().sum() > 0 for head in adapters.heads.values())  # trained: no longer identity
    for name, value in backbone_state(model).items():  # the backbone was frozen
        assert torch.equal(value, before[name]), name
    stored = json.loads(Path(outcome.checkpoint, EXITS_CONFIG_FILE).read_text())
    assert stored["step"] == STEPS and stored["run"] == outcome.run_dir and stored["job"]["rank"] == 8
    assert newest_complete_checkpoint(outcome.run_dir).endswith(f"checkpoint_{STEPS:08d}")
    assert outcome.metrics["step"] == STEPS and outcome.metrics["resumed_from"] == 0
    ids = torch.randint(3, 100, (3, 6), generator=torch.Generator().manual_seed(0))
    with_exits = generate(model, ids, options=DecodeOptions(max_new_tokens=8))
    plain = generate(load_model(outcome.checkpoint, exits=False).model, ids, options=DecodeOptions(max_new_tokens=8))
    assert with_exits.tokens == plain.tokens  # the output cannot change
    client = import_mlflow().MlflowClient(Path(outcome.config.storage_path, "mlruns").resolve().as_uri())
    (run,) = client.search_runs([client.get_experiment_by_name("exits").experiment_id])
    assert [m.step for m in client.get_metric_history(run.info.run_id, "kl_loop1")] == list(range(1, STEPS + 1))
    assert run.data.params["rank"] == "8" and run.data.tags["speed.run"] == outcome.config.name


@pytest.mark.ray
@pytest.mark.slow
def test_a_stopped_run_relaunched_ends_with_the_adapters_of_an_uninterrupted_one(trained, tiny_tokenizer, tmp_path):
    reference, _ = trained
    checkpoint = _tiny_checkpoint(tmp_path / "ckpt", tiny_tokenizer)  # the same weights, another folder
    first = run_exits(_config(checkpoint, tmp_path / "runs", stop_at_step=2))
    assert first.step == 2
    resumed = run_exits(_config(checkpoint, tmp_path / "runs"))  # the same command: the same run, resumed
    assert resumed.run_dir == first.run_dir and resumed.step == STEPS
    assert first.metrics["resumed_from"] == 0 and resumed.metrics["resumed_from"] == 2  # steps 3-4 alone this time
    a = load_model(reference.checkpoint).model.exit_adapters.state_dict()
    b = load_model(resumed.checkpoint).model.exit_adapters.state_dict()
    for name in a:
        torch.testing.assert_close(a[name], b[name], rtol=1e-5, atol=1e-6, msg=name)


def test_run_names_ignore_launch_settings(tmp_path):
    a = _config(str(tmp_path / "ckpt"), tmp_path)
    assert exits_run_name(a) == exits_run_name(_config(str(tmp_path / "ckpt"), tmp_path / "x", stop_at_step=2))
    assert exits_run_name(a) != exits_run_name(_config(str(tmp_path / "ckpt"), tmp_path, rank=4))
    assert exits_run_name(a).startswith("exits-ckpt-r8-")


def test_decoded_targets_are_the_models_greedy_outputs():
    torch.manual_seed(0)
    model = SpeedT5(preset("tiny", pattern="2x3")).eval()
    columns = {"input_ids": [[5, 6, 7, 1], [8, 9, 1]], "labels": [[4, 4, 1], [3, 1]]}
    decoded = _decoded(model, columns, 5)
    ids = torch.tensor([[5, 6, 7, 1], [8, 9, 1, 0]])
    expected = generate(
        model, ids, (ids != 0).long(), DecodeOptions(method="sequential", max_new_tokens=5, trace=False)
    ).tokens
    assert decoded == {"input_ids": columns["input_ids"], "labels": expected}


def test_exit_kl_is_zero_on_agreement_and_counts_agreement():
    """KL(last || k) is 0 where loop k's logits are the last's; agreement is the share of argmax matches, over the
    masked positions only."""
    last = torch.tensor([[[2.0, 0.0, 0.0], [0.0, 3.0, 0.0]]])  # (1, 2, 3)
    other = torch.tensor([[[0.0, 2.0, 0.0], [0.0, 3.0, 0.0]]])
    mask = torch.tensor([[True, True]])
    kl, agree = exit_kl([last, last, last], mask, (1, 2))
    assert torch.equal(kl, torch.zeros(2)) and torch.equal(agree, torch.ones(2))
    kl, agree = exit_kl([other, last, last], mask, (1,))
    assert kl[0] > 0 and agree.tolist() == [0.5]
    kl, agree = exit_kl([other, last, last], torch.tensor([[False, True]]), (1,))
    assert kl.abs().max() < 1e-6 and agree.tolist() == [1.0]


def _job():
    return job_module("train_exits")


def test_the_job_refuses_the_last_loop(tiny_tokenizer, tmp_path, capsys):
    checkpoint = _tiny_checkpoint(tmp_path / "ckpt", tiny_tokenizer)
    with pytest.raises(SystemExit) as exit_:
        _job().main(["--checkpoint", checkpoint, "--loops", "3", "--storage-path", str(tmp_path)])
    assert exit_.value.code == 2 and "never adapted" in capsys.readouterr().err


@pytest.mark.parametrize(
    "kind, flags, message",
    [
        ("ouro", [], "is a Hugging Face ouro directory: it records no task; pass --task"),
        ("ouro", ["--task", "nope"], "unknown task 'nope'"),
        ("gpt2", ["--task", "translate_en_de"], "model_type 'gpt2' is not one the platform loads"),
    ],
)
def test_the_job_refuses_a_directory_it_cannot_train_in_one_line(tmp_path, capsys, kind, flags, message):
    """A Hugging Face directory without --task (it records no split), or one the platform cannot read: one line,
    status 2, no run folder, nothing written beside the model."""
    from imported_helpers import write_chat_ouro

    directory = tmp_path / kind
    if kind == "ouro":
        write_chat_ouro(directory)
    else:
        directory.mkdir()
        (directory / "config.json").write_text(json.dumps({"model_type": kind}))
    before = sorted(p.name for p in directory.iterdir())
    runs = tmp_path / "runs"
    with pytest.raises(SystemExit) as exit_:
        _job().main(["--checkpoint", str(directory), *flags, "--storage-path", str(runs), "--no-tracking"])
    err = capsys.readouterr().err.strip()
    assert exit_.value.code == 2 and "\n" not in err and message in err, err
    assert not runs.exists() and sorted(p.name for p in directory.iterdir()) == before


def _ouro_flags(directory, runs) -> list[str]:
    split = ["--task", "translate_en_de", "--limit", "8", "--max-source-len", "96", "--max-target-len", "24"]
    loop = ["--rank", "4", "--steps", "2", "--batch-size", "4", "--warmup-steps", "1", "--checkpoint-every", "2"]
    return ["--checkpoint", str(directory), *split, *loop, "--cpus-per-worker", "1", "--storage-path", str(runs)]


def test_a_directory_is_written_once_as_a_platform_checkpoint_of_its_split(tmp_path, capsys):
    """``import_checkpoint``: the converted model (the directory's weights), its tokenizer files in tokenizer/, a job
    naming the split; complete, and kept by a relaunch; a failed conversion leaves nothing."""
    from imported_helpers import write_chat_ouro

    from speed.hf_tokenizer import tokenizer_files
    from speed.models.checkpoint import HF_TOKENIZER_DIR, read_checkpoint_config
    from speed.models.pretrained import from_pretrained
    from speed.train.exits import import_checkpoint, source_job

    directory = write_chat_ouro(tmp_path / "Ouro-tiny")
    config = _job().parse(_ouro_flags(directory, tmp_path / "runs"))
    target = import_checkpoint(config, str(tmp_path / "run"))
    assert target == str(tmp_path / "run" / "model") and sorted(p.name for p in (tmp_path / "run").iterdir()) == [
        "model"
    ]
    assert tokenizer_files(Path(target) / HF_TOKENIZER_DIR) == tokenizer_files(directory)
    saved = read_checkpoint_config(target)
    assert saved["step"] == 0 and saved["tokenizer"] == {"kind": "huggingface", "path": HF_TOKENIZER_DIR}
    job = source_job(target)
    assert (job.kind, job.data.task, job.data.limit, job.data.max_source_len) == ("finetune", "translate_en_de", 8, 96)
    assert job.family.name == "lm" and job.init_from == str(directory)
    want, got = from_pretrained(directory).state_dict(), load_model(target).model.state_dict()
    assert want.keys() == got.keys() and all(torch.equal(want[k], got[k]) for k in want)
    stamp = (Path(target) / "model.pt").stat().st_mtime_ns
    capsys.readouterr()
    assert import_checkpoint(config, str(tmp_path / "run")) == target  # the relaunch: kept, not written again
    assert (Path(target) / "model.pt").stat().st_mtime_ns == stamp and "earlier launch" in capsys.readouterr().out
    (directory / "model.safetensors").write_bytes(b"broken")
    with pytest.raises(ValueError, match="not a readable safetensors file"):
        import_checkpoint(config, str(tmp_path / "other"))
    assert not (tmp_path / "other").exists()


def test_a_conversion_that_fails_half_way_leaves_no_checkpoint(tmp_path, monkeypatch):
    from imported_helpers import write_chat_ouro

    import speed.train.exits as exits

    def half(directory, *args):
        Path(directory, "model.pt").write_bytes(b"half")
        raise OSError("disk full")

    monkeypatch.setattr(exits, "save_job_model", half)
    config = _job().parse(_ouro_flags(write_chat_ouro(tmp_path / "Ouro-tiny"), tmp_path / "runs"))
    with pytest.raises(OSError, match="disk full"):
        exits.import_checkpoint(config, str(tmp_path / "run"))
    assert not (tmp_path / "run").exists()


@pytest.mark.ray
@pytest.mark.slow
def test_adapters_train_on_a_hugging_face_directory_beside_its_platform_checkpoint(ray_session, tmp_path, capsys):
    """``jobs/train_exits.py --checkpoint <a tiny Ouro> --task``: the directory written into the run's ``model/``,
    said in the output; adapters trained there (a finite KL that the steps lowered) that the loader attaches, the
    backbone the directory's, the directory untouched, and SPEED with them equals sequential decoding bit for bit."""
    import math

    from imported_helpers import assert_speed_exact, write_chat_ouro

    from speed.models.pretrained import from_pretrained, load_pretrained
    from speed.train.exits import check_inputs

    directory = write_chat_ouro(tmp_path / "Ouro-tiny")
    before = {p.name: p.read_bytes() for p in directory.rglob("*") if p.is_file()}
    config = _job().parse([*_ouro_flags(directory, tmp_path / "runs"), "--no-tracking"])
    check_inputs(config)
    outcome = run_exits(config)
    target = Path(outcome.run_dir) / "model"
    assert Path(outcome.run_dir).name.startswith("exits-Ouro-tiny-r4-") and outcome.checkpoint == str(target)
    assert f"into the platform checkpoint {target}" in capsys.readouterr().out
    assert {p.name: p.read_bytes() for p in directory.rglob("*") if p.is_file()} == before
    assert outcome.step == 2 and math.isfinite(outcome.metrics["kl"]) and outcome.metrics["kl"] > 0
    stored = json.loads((target / EXITS_CONFIG_FILE).read_text())
    assert stored["step"] == 2 and stored["run"] == outcome.run_dir
    loaded = load_pretrained(str(target))
    assert loaded.model.exit_adapters is not None and loaded.model.exit_adapters.config.loops == (1, 2)
    assert all(head.up.weight.abs().sum() > 0 for head in loaded.model.exit_adapters.heads.values())
    want = from_pretrained(directory).state_dict()
    assert all(torch.equal(v, want[k]) for k, v in backbone_state(loaded.model).items())
    assert_speed_exact(loaded.model, seed=7)
