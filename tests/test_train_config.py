"""Job configs: defaults < YAML < --set < flags, unknown keys rejected, deterministic run names."""

import pytest

from speed.config import ConfigError, preset
from speed.losses import SettleConfig
from speed.train.config import (
    JobConfig,
    TrainConfig,
    job_from_args,
    job_from_dict,
    job_to_dict,
    resolve_model,
    run_name,
)


def test_defaults_are_a_small_2x6_model():
    job = job_from_args("pretrain", [])
    assert job.kind == "pretrain" and job.data.task == "pretrain" and job.data.pack
    assert job.model == preset("mini", pattern="2x6")
    finetune = job_from_args("finetune", [])
    assert finetune.data.task == "translate_en_de" and finetune.eval is not None and job.eval is None
    final = finetune.final_eval  # follows the data section; the rest are EvalConfig's defaults
    assert (final.task, final.max_source_len, final.split, final.limit, final.check_sequential) == (
        "translate_en_de",
        64,
        "test",
        100,
        True,
    )
    assert job_from_args("finetune", ["--no-eval"]).eval is None


def test_yaml_then_set_then_flags(tmp_path):
    cfg = tmp_path / "job.yaml"
    cfg.write_text("model: {preset: tiny, pattern: 3x2}\noptim: {name: adafactor, lr: 0.01}\ntrain: {max_steps: 7}\n")
    job = job_from_args(
        "pretrain", ["--config", str(cfg), "--set", "optim.lr=0.02", "--set", "optim.betas=[0.8, 0.9]", "--lr", "0.03"]
    )
    assert job.model == preset("tiny", pattern="3x2")
    assert (job.optim.name, job.optim.lr, job.optim.betas) == ("adafactor", 0.03, (0.8, 0.9))
    assert job.train.max_steps == 7
    assert job.train.batch_size == 16  # pretrain default, untouched by the YAML


@pytest.mark.parametrize(
    "text, fragment",
    [
        ("train: {max_step: 3}\n", r"unknown TrainConfig key\(s\) \['max_step'\]"),
        ("model: {d_modle: 8}\n", r"unknown ModelConfig key\(s\) \['d_modle'\]"),
        ("optimizer: {lr: 1}\n", r"unknown JobConfig key\(s\) \['optimizer'\]"),
        ("model: {preset: huge}\n", "unknown model preset 'huge'"),
        ("data: {task: translate_fr}\n", "unknown task 'translate_fr'"),
        ("optim: {name: sgd}\n", "unknown optimizer 'sgd'"),
        ("train: {loss_weights: cubic}\n", "unknown loss-weight scheme 'cubic'"),
    ],
)
def test_unknown_or_invalid_keys_are_errors(tmp_path, text, fragment):
    cfg = tmp_path / "job.yaml"
    cfg.write_text(text)
    with pytest.raises(ValueError, match=fragment):
        job_from_args("pretrain", ["--config", str(cfg)])


def test_set_and_flags_reject_unknowns():
    with pytest.raises(ValueError, match=r"unknown TrainConfig key\(s\) \['nope'\]"):
        job_from_args("pretrain", ["--set", "train.nope=1"])
    with pytest.raises(ValueError, match="KEY=VALUE"):
        job_from_args("pretrain", ["--set", "train.max_steps"])
    with pytest.raises(SystemExit):
        job_from_args("pretrain", ["--max-step", "3"])  # argparse: no such flag (no prefix guessing of a typo)


def test_a_config_of_the_other_kind_is_refused(tmp_path):
    cfg = tmp_path / "job.yaml"
    cfg.write_text("kind: finetune\n")
    with pytest.raises(ValueError, match="is a 'finetune' config, not 'pretrain'"):
        job_from_args("pretrain", ["--config", str(cfg)])


def test_resolved_job_round_trips():
    job = job_from_args("finetune", ["--preset", "tiny", "--pattern", "2x3", "--use-gpu", "--num-workers", "4"])
    assert job.scale.use_gpu and job.scale.num_workers == 4
    assert job_from_dict(job_to_dict(job)) == job
    assert "preset" not in job_to_dict(job)["model"]  # stored fully resolved


def test_resolve_model_preset_plus_overrides():
    assert resolve_model({"preset": "tiny", "pattern": "1x4"}) == preset("tiny", pattern="1x4")
    assert resolve_model({"d_model": 64}).d_model == 64


def test_batch_must_split_over_workers_and_accumulation():
    with pytest.raises(ValueError, match="batch_size=10 must divide evenly into num_workers=2 x grad_accum=2"):
        job_from_args("pretrain", ["--batch-size", "10", "--num-workers", "2", "--grad-accum", "2"])
    job = job_from_args("pretrain", ["--batch-size", "12", "--num-workers", "2", "--grad-accum", "3"])
    assert job.micro_batch == 2


@pytest.mark.parametrize("drill", ["fail_at_step", "hang_at_step"])
def test_fault_injection_must_follow_a_checkpoint(drill):
    with pytest.raises(ValueError, match=f"{drill}=2 must lie after the first checkpoint"):
        TrainConfig(checkpoint_every=2, max_steps=5, **{drill: 2})
    with pytest.raises(ValueError, match=f"{drill}=6 must lie after the first checkpoint"):
        TrainConfig(checkpoint_every=2, max_steps=5, **{drill: 6})
    assert getattr(TrainConfig(checkpoint_every=2, max_steps=5, **{drill: 3}), drill) == 3


def test_run_name_is_deterministic_and_ignores_launch_settings():
    job = job_from_args("pretrain", ["--preset", "tiny"])
    assert run_name(job) == run_name(job_from_args("pretrain", ["--preset", "tiny"]))
    assert run_name(job).startswith("pretrain-pretrain-2x6-")
    same = job_from_args("pretrain", ["--preset", "tiny", "--time-budget-min", "3", "--num-workers", "2"])
    assert run_name(same) == run_name(job)
    drills = ["--fail-at-step", "60", "--hang-at-step", "70"]  # the tiny preset checkpoints every 50 of 100 steps
    assert run_name(job_from_args("pretrain", ["--preset", "tiny", *drills])) == run_name(job)
    assert run_name(job_from_args("pretrain", ["--preset", "tiny", "--lr", "0.5"])) != run_name(job)
    assert isinstance(job, JobConfig)


def test_values_are_coerced_by_field_type_and_misfits_name_the_key(tmp_path):
    cfg = tmp_path / "job.yaml"
    cfg.write_text("optim: {lr: 1e-3, betas: [0.9, 0.95]}\ntrain: {bf16: false, time_budget_min: 2}\n")
    job = job_from_args("pretrain", ["--config", str(cfg), "--set", "train.max_steps=30"])
    assert job.optim.lr == 0.001 and isinstance(job.optim.lr, float)  # YAML reads 1e-3 as a string
    assert job.optim.betas == (0.9, 0.95) and job.train.bf16 is False and job.train.max_steps == 30
    assert job_from_args("pretrain", ["--set", "optim.lr=1e-3"]).optim.lr == 0.001
    for setting, message in [
        ("train.bf16=maybe", "train.bf16: expected true or false, got 'maybe'"),
        ("optim.lr=fast", "optim.lr: expected a number, got 'fast'"),
        ("train.max_steps=2.5", "train.max_steps: expected an integer, got 2.5"),
        ("optim.betas=[0.9]", r"optim.betas: expected 2 values, got 1"),
        ("model.d_model=wide", "model.d_model: expected an integer, got 'wide'"),
        ("data.task=[a]", r"data.task: expected a string, got \['a'\]"),
        ("eval.invalidation=lazy", r"eval.invalidation: expected one of \['eager', 'final'\], got 'lazy'"),
        ("optim.betas=[0.9", "--set optim.betas=\\[0.9: not valid YAML"),
    ]:
        with pytest.raises(ConfigError, match=message):
            job_from_args("finetune", ["--set", setting])


def test_evaluation_settings_are_checked_when_the_job_starts():
    with pytest.raises(ValueError, match="task 'pretrain' has no references"):
        job_from_args("finetune", ["--task", "pretrain"])  # not after training: at parse time
    with pytest.raises(ValueError, match="EvalConfig.batch_size must be at least 1"):
        job_from_args("finetune", ["--set", "eval.batch_size=0"])
    job = job_from_args("finetune", ["--task", "summarize", "--set", "eval.task=translate_en_de"])
    assert job.final_eval.task == "translate_en_de" and job.data.task == "summarize"


def test_settle_term_is_a_typed_train_setting():
    settle = "train.settle={kind: consecutive, weight: 3, flip_cost_weighted: yes}"
    job = job_from_args("finetune", ["--preset", "tiny", "--set", settle])
    assert job.train.settle == SettleConfig("consecutive", 3.0, flip_cost_weighted=True)
    assert job_from_dict(job_to_dict(job)) == job  # travels in checkpoints
    assert job_from_args("finetune", ["--preset", "tiny"]).train.settle == SettleConfig()
    for bad, match in [
        ("train.settle.kind=kl", "unknown settle kind"),
        ("train.settle.kind=to_last", "needs a weight"),
        ("train.settle.lambda=1", "unknown SettleConfig key"),
    ]:
        with pytest.raises((ValueError, ConfigError), match=match):
            job_from_args("finetune", ["--preset", "tiny", "--set", bad])


def test_the_settle_term_names_a_new_run_and_leaves_old_names_alone():
    # The names main gave these jobs before the settle term existed: a rerun still resumes those runs.
    assert run_name(job_from_args("pretrain", ["--preset", "tiny"])) == "pretrain-pretrain-2x6-a6c2c469"
    assert run_name(job_from_args("finetune", ["--preset", "tiny"])) == "finetune-translate_en_de-2x6-14cea2ef"
    settled = job_from_args("finetune", ["--preset", "tiny", "--set", "train.settle={kind: to_last, weight: 1}"])
    assert run_name(settled) != "finetune-translate_en_de-2x6-14cea2ef"


def test_a_hang_drill_nobody_ends_fails_the_run(monkeypatch, capsys):
    """``--hang-at-step`` stops the workers until they are ended (tests/test_nodes.py ends their node); one that
    nobody ends fails after ``HANG_LIMIT_S``, with an error saying so, instead of hanging the run for good."""
    from speed.train import loop

    monkeypatch.setattr(loop, "HANG_LIMIT_S", 0.01)
    with pytest.raises(loop.InjectedFailure, match=r"rank 0 hung before step 5 \(train.hang_at_step\)"):
        loop._hang(0, 4)
    assert "hanging before step 5 (train.hang_at_step)" in capsys.readouterr().out


@pytest.mark.parametrize("asked", [None, "lm", "t5"])
def test_init_from_an_lm_checkpoint_finetunes_an_lm_whatever_model_says(tmp_path, tiny_tokenizer, capsys, asked):
    """``--init-from`` a platform LM checkpoint (or its run): the checkpoint's family wins, with one line when
    ``--model`` said otherwise; the job resolves to the checkpoint's model config, tokenizer and all."""
    import torch

    from speed.config import lm_preset
    from speed.models.checkpoint import COMPLETE_FILE
    from speed.models.looped_lm import LoopedLM
    from speed.tokenizer import Tokenizer
    from speed.train.launch import check_inputs
    from speed.train.state import save_job_model
    from speed.train.tokenizer_stage import tokenizer_stage

    torch.manual_seed(0)
    model = LoopedLM(lm_preset("tiny", pattern="1+2x3+1", vocab_size=Tokenizer.load(tiny_tokenizer).vocab_size))
    pretrain = job_from_args("pretrain", ["--model", "lm", "--pattern", "1+2x3+1"])
    run = tmp_path / "pretrain-run"
    save_job_model(run / "checkpoint_00000002", model, tiny_tokenizer, job_to_dict(pretrain), 2)
    (run / "checkpoint_00000002" / COMPLETE_FILE).write_text("2\n")
    flags = ["--init-from", str(run), "--task", "translate_en_de"] + (["--model", asked] if asked else [])
    job = job_from_args("finetune", flags)
    note = capsys.readouterr().out
    assert job.family.name == "lm" and job.kind == "finetune" and job.data.task == "translate_en_de"
    if asked == "t5":
        assert note.strip() == f"--model t5 ignored: {run} is a 'lm' checkpoint, and the checkpoint's family wins"
    else:
        assert note == ""
    check_inputs(job)
    resolved = tokenizer_stage(job, tmp_path / "scratch")
    assert resolved.job.model == model.config and resolved.job.family.name == "lm"
