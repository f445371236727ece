"""Training checkpoints: readable by speed.models.checkpoint.load_model, resumable, refused when incompatible."""

import random

import pytest
import torch

from speed.config import preset
from speed.models.checkpoint import (
    COMPLETE_FILE,
    latest_checkpoint,
    load_model,
    newest_complete_checkpoint,
    read_checkpoint_config,
)
from speed.models.t5 import SpeedT5
from speed.train.config import job_from_args, job_to_dict, resumable_job
from speed.train.optim import build_optimizer, build_scheduler
from speed.train.state import (
    IncompatibleCheckpointError,
    TrainingState,
    check_compatible,
    checkpoint_name,
    load_training_state,
    mark_complete,
    rng_state,
    save_training_checkpoint,
    set_rng_state,
)
from speed.train.train_log import StepRecord, format_duration, progress_line, records_to_table, window_mean


def _record(step):
    return StepRecord(step, 2.0 / step, [3.0 / step, 2.0 / step], 1e-3, 1.5, 100, 0.5, 200.0, 0.5 * step, 0)


@pytest.fixture
def saved(tmp_path):
    job = job_from_args("pretrain", ["--preset", "tiny", "--pattern", "2x2", "--time-budget-min", "5"])
    torch.manual_seed(0)
    model = SpeedT5(job.model)
    opt = build_optimizer(model, job.optim)
    sched = build_scheduler(opt, job.optim, job.train.max_steps)
    x = torch.randint(3, 100, (2, 5))
    model(x, x, labels=x).loss.backward()
    opt.step()
    sched.step()
    tokenizer = tmp_path / "spm.model"
    tokenizer.write_bytes(b"not really a tokenizer")
    state = TrainingState(
        3, opt.state_dict(), sched.state_dict(), [rng_state()], records_to_table([_record(s) for s in (1, 2, 3)])
    )
    where = tmp_path / "run" / checkpoint_name(3)
    directory = save_training_checkpoint(where, model, tokenizer, job_to_dict(job), state)
    mark_complete(str(directory), 3)
    return job, model, opt, directory


def test_checkpoint_is_a_model_checkpoint_plus_training_state(saved):
    job, model, opt, directory = saved
    loaded = load_model(directory)
    assert loaded.model.config == job.model
    for (name, a), b in zip(model.state_dict().items(), loaded.model.state_dict().values()):
        assert torch.equal(a, b), name
    assert loaded.config["job"]["train"]["time_budget_min"] == 5 and loaded.config["step"] == 3
    state = load_training_state(directory)
    assert state.step == 3 and state.log.column("step").to_pylist() == [1, 2, 3]
    assert state.log.column("loop_losses").to_pylist()[2] == pytest.approx([1.0, 2.0 / 3])
    opt2 = build_optimizer(SpeedT5(job.model), job.optim)
    opt2.load_state_dict(state.optimizer)
    assert opt2.state_dict()["state"][0]["step"] == opt.state_dict()["state"][0]["step"]


def test_rng_state_round_trip():
    state = rng_state()
    a = (torch.rand(3), random.random(), random.random() * 2)
    set_rng_state(state)
    b = (torch.rand(3), random.random(), random.random() * 2)
    assert torch.equal(a[0], b[0]) and a[1:] == b[1:]


def test_incompatible_checkpoints_are_refused_by_name(saved):
    job, _, _, directory = saved
    config = read_checkpoint_config(directory)
    tokenizer = (directory / "spm.model").read_bytes()
    check_compatible(config, job_to_dict(job), tokenizer, str(directory))  # itself: fine
    other = job.__class__(**{**job.__dict__, "model": preset("tiny", pattern="2x3")})
    with pytest.raises(IncompatibleCheckpointError, match=r"model.pattern is '2x2' there, '2x3' here"):
        check_compatible(config, job_to_dict(other), tokenizer, str(directory))
    with pytest.raises(IncompatibleCheckpointError, match="tokenizer"):
        check_compatible(config, job_to_dict(job), b"another tokenizer", str(directory))
    adafactor = job_from_args("pretrain", ["--preset", "tiny", "--pattern", "2x2", "--optimizer", "adafactor"])
    with pytest.raises(IncompatibleCheckpointError, match="optim.name is 'adamw' there, 'adafactor' here"):
        check_compatible(config, job_to_dict(adafactor), tokenizer, str(directory))


def test_latest_checkpoint_and_resumable_job(saved, tmp_path):
    job, _, _, directory = saved
    run = directory.parent
    (run / checkpoint_name(1)).mkdir()
    mark_complete(str(run / checkpoint_name(1)), 1)
    (run / checkpoint_name(4)).mkdir()  # a checkpoint cut off while written: no marker
    (run / checkpoint_name(4) / "model.pt").write_bytes(b"half")
    (run / "checkpoint_manager_snapshot.json").write_text("{}")
    assert latest_checkpoint(str(run)) == newest_complete_checkpoint(str(run)) == f"{run}/{checkpoint_name(3)}"
    assert (directory / COMPLETE_FILE).read_text() == "3\n"
    assert newest_complete_checkpoint(str(tmp_path / "missing")) is None
    assert latest_checkpoint(str(directory)) == str(directory)
    with pytest.raises(FileNotFoundError, match="no checkpoint or run directory"):
        latest_checkpoint(str(tmp_path / "missing"))
    resumed = resumable_job(str(run))
    assert resumed["resume"] == str(run) and resumed["train"]["time_budget_min"] is None
    assert resumed["model"]["pattern"] == "2x2"
    continued = job_from_args("pretrain", ["--resume", str(run), "--max-steps", "400"])
    assert continued.model == job.model and continued.train.max_steps == 400
    assert continued.train.time_budget_min is None


def test_progress_line_shows_every_loop_and_eta():
    line = progress_line(_record(2), max_steps=10, eta_s=3725)
    assert line.startswith("step 2/10 | loss 1.0000 | L_i 1.500 1.000 |")
    assert "200 tok/s" in line and line.endswith("ETA 1h02m05s")
    assert (format_duration(65), format_duration(7.2)) == ("1m05s", "7s")


def test_progress_shows_the_mean_of_the_window():
    records = [_record(1), _record(2), _record(4)]  # losses 2, 1, 0.5; 100 tokens in 0.5 s each
    mean = window_mean(records)
    assert mean.step == 4
    assert mean.loss == pytest.approx(3.5 / 3)
    assert mean.loop_losses == pytest.approx([5.25 / 3, 3.5 / 3])
    assert mean.tokens_per_s == pytest.approx(200.0) and mean.step_time_s == pytest.approx(0.5)
    assert window_mean(records[-1:]) == records[-1]
