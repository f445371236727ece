"""Sweeps: search-space expansion, the Pareto frontier, and one tiny real sweep on the local Ray.

The real sweep (five tiny trials of four steps on the session's local Ray, with and
without a settle term) is interrupted with SIGINT after its first trial, then resumed
by running it again; the trials of one pattern are made to fail in training.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import signal
from dataclasses import replace
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from ray import tune

from speed.losses import SettleConfig, flip_cost
from speed.paths import repo_root
from speed.sweep import FRONTIER_SCHEMA, RESULTS_SCHEMA, SweepConfig, expand_patterns, frontier, pareto_front, run_sweep
from speed.sweep.results import FRONTIER_FILE, LATENCY_FILE, LATENCY_SCHEMA, RESULTS_FILE
from speed.sweep.run import scheduler
from speed.sweep.space import (
    check_job,
    grid,
    param_space,
    plan_scheduler,
    sweep_digest,
    trial_pattern,
    trial_scheme,
    trial_settle,
)
from speed.train.config import TrainConfig, job_from_args


def test_pattern_families():
    assert expand_patterns(("depth=12",)) == ("1x12", "2x6", "3x4", "4x3", "6x2", "12x1")
    assert expand_patterns(("unique=3",), max_depth=12) == ("3x1", "3x2", "3x3", "3x4")
    assert expand_patterns(("2x6", "depth=4", "2x2")) == ("2x6", "1x4", "2x2", "4x1")  # in order, no repeats
    # a looped LM's prelude and coda around a family, or written out
    assert expand_patterns(("1+depth=4+1",)) == ("1+1x4+1", "1+2x2+1", "1+4x1+1")
    assert expand_patterns(("2+unique=3",), max_depth=6) == ("2+3x1", "2+3x2")
    assert expand_patterns(("depth=2+1", "1+2x3+1")) == ("1x2+1", "2x1+1", "1+2x3+1")
    for bad, match in [
        (("depth=0",), "positive integer"),
        (("width=3",), "unknown pattern family"),
        (("2y6",), "has no 'x'"),
        (("0+depth=4",), "P \\(prelude layers\\) must be at least 1"),
        (("1+depth=x+1",), "positive integer after '='"),
        (("1+width=4",), "unknown pattern family"),
    ]:
        with pytest.raises(ValueError, match=match):
            expand_patterns(bad)


def test_an_lm_sweep_takes_the_lm_base_job_and_its_layouts():
    """--model lm: the LM's base job (jobs/configs/sweep_lm_local.yaml) unless --config; prelude/coda patterns
    fit an LM and are refused, before any work, for a T5."""
    job_module = _sweep_job_module()
    sweep, job = job_module.parse(["--model", "lm", "--patterns", "1+depth=2+1", "2x2", "--schemes", "linear"])
    assert job.family.name == "lm" and job.model.d_model == 128 and job.data.task == "translate_en_de"
    assert sweep.expanded_patterns == ("1+1x2+1", "1+2x1+1", "2x2") and sweep.trials == 3
    assert check_job(sweep, job).scheduler == "asha"
    _, t5 = job_module.parse(["--patterns", "2x2"])
    assert t5.family.name == "t5"
    with pytest.raises(ValueError, match="pattern '1\\+1x2\\+1' does not fit the job's t5 model"):
        check_job(sweep, t5)


def test_layer_steps_count_the_prelude_once_and_the_coda_in_every_exit():
    from speed.sweep.results import layer_steps, sequential_layers

    assert layer_steps("2x6", 1.5) == 3.0 and sequential_layers("2x6") == 12  # T5: steps * N, N*M
    assert layer_steps("1+2x3+1", 1.0) == 1 + 3 and sequential_layers("1+2x3+1") == 1 + 3 * 3
    assert layer_steps("2+4x2", 2.0) == 2 + 8 and sequential_layers("4x2+2") == 12


def test_sweep_config_is_validated():
    with pytest.raises(ValueError, match="unknown scheduler"):
        SweepConfig(scheduler="hyperband")
    with pytest.raises(ValueError, match="unknown loss-weight scheme"):
        SweepConfig(loss_weights=("linear", "cubic"))
    with pytest.raises(ValueError, match="must lie in"):
        SweepConfig(loss_family="ratio", loss_range=(0.0, 2.0))  # ratio 0 is no scheme
    with pytest.raises(ValueError, match="not among the swept patterns"):
        SweepConfig(patterns=("2x2",), fail_pattern="2x1")
    grid = SweepConfig(patterns=("depth=4", "2x1"), loss_family="power", loss_range=(0.0, 2.0), samples=2)
    assert grid.schemes == ("power:0", "power:1", "power:2")
    assert grid.trials == (2 * 3 + 2) * 2  # 1x4, 2x2 with each scheme; 4x1, 2x1 with one (one loop: weights [1])
    assert SweepConfig(search="random", samples=5).trials == 5


def test_sweep_job_flags():
    job_module = _sweep_job_module()
    sweep, job = job_module.parse(
        ["--patterns", "depth=6", "2x1", "--schemes", "linear", "power:1.5", "--max-steps", "7", "--scheduler", "fifo"]
    )
    settled, _ = job_module.parse(["--patterns", "2x3", "--settle", "none", "to_last:2", "--metric", "val_flip_cost"])
    assert settled.settle == ("none", "to_last:2") and settled.metric == "val_flip_cost" and settled.trials == 2 * 2
    config = str(repo_root() / "jobs" / "configs" / "sweep_settle_cpu.yaml")
    cpu, cpu_job = job_module.parse(
        ["--config", config, "--patterns", "2x6", "2x1", "--schemes", "linear", "--settle", "none", "to_last:1"]
    )
    assert cpu.trials == 3 and cpu_job.train.max_steps == 300 and not cpu_job.train.settle.active
    with pytest.raises(SystemExit):
        job_module.parse(["--settle", "to_last:1", "--set", "train.settle={kind: to_last, weight: 1}"])
    assert sweep.expanded_patterns == ("1x6", "2x3", "3x2", "6x1", "2x1") and sweep.scheduler == "fifo"
    assert sweep.loss_weights == ("linear", "power:1.5") and sweep.trials == 8
    assert job.kind == "finetune" and job.train.max_steps == 7
    assert job.train.checkpoint_every == 20  # the rest from jobs/configs/sweep_local.yaml
    with pytest.raises(SystemExit):
        job_module.parse(["--pattern", "2x6"])  # the sweep sets the pattern per trial


def _sweep_job_module():
    spec = importlib.util.spec_from_file_location("sweep_job", repo_root() / "jobs" / "sweep.py")
    job_module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(job_module)
    return job_module


# The command of the issue: 4 steps, validation reported every 20 (jobs/configs/sweep_local.yaml), so only at the end.
SHORT_SWEEP = ["--preset", "tiny", "--patterns", "2x3", "3x2", "--schemes", "linear", "uniform", "--max-steps", "4"]
SHORT_SWEEP += ["--limit", "200", "--vocab-size", "500"]


def _rungs(sched) -> list[float]:
    """ASHA's rungs (milestones), as its public ``debug_string`` lists them: ``Bracket: Iter 40.000: ... | ...``."""
    return sorted(float(m) for m in re.findall(r"Iter ([0-9.]+):", sched.debug_string()))


@pytest.mark.parametrize("max_steps", [1, 4, 21, 60, 100])
@pytest.mark.parametrize("every", [1, 20, 50])
@pytest.mark.parametrize("grace", [None, 5, 20, 50])
@pytest.mark.parametrize("factor", [2, 3])
def test_asha_rungs_lie_on_reports_before_the_last_step(max_steps, every, grace, factor):
    """Every rung is a validation report before the last one (a trial stopped at its last report trained fully and
    is never measured); a derived setting ASHA cannot use turns ASHA off with a note, an explicit one is refused."""
    sweep = SweepConfig(patterns=("1x2", "2x2"), grace_steps=grace, reduction_factor=factor)
    train = TrainConfig(max_steps=max_steps, checkpoint_every=every)
    reports = [s for s in range(every, max_steps, every)]  # and the last step
    if grace is not None and (not reports or -(-grace // every) * every > reports[-1]):
        with pytest.raises(ValueError, match="leaves ASHA no rung before"):
            plan_scheduler(sweep, train)
        return
    plan = plan_scheduler(sweep, train)
    sched = scheduler(sweep, plan)  # ASHAScheduler asserts its settings: this constructs it
    if not reports:
        assert plan.scheduler == "fifo" and "ASHA off" in plan.notes[0] and type(sched).__name__ == "FIFOScheduler"
        return
    assert plan.scheduler == "asha" and set(_rungs(sched)) <= set(reports) and _rungs(sched)
    assert _rungs(sched)[0] == plan.grace_steps >= (grace or 1)
    assert bool(plan.notes) == (grace is not None and grace % every != 0)  # rounded up to the next report


def test_short_sweep_runs_without_asha_and_says_so():
    sweep, job = _sweep_job_module().parse(SHORT_SWEEP)
    plan = check_job(sweep, job)
    assert plan.scheduler == "fifo" and len(plan.notes) == 1
    assert "last step 4 (checkpoint_every=20)" in plan.notes[0]
    assert type(scheduler(sweep, plan)).__name__ == "FIFOScheduler"
    plan = check_job(sweep, _sweep_job_module().parse(SHORT_SWEEP + ["--checkpoint-every", "2"])[1])
    assert plan.scheduler == "asha" and plan.grace_steps == plan.max_t == 2 and not plan.notes
    one = SweepConfig(patterns=("2x3",), loss_weights=("linear",))
    assert "one trial" in check_job(one, replace(job, train=replace(job.train, checkpoint_every=2))).notes[0]


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--grace-steps", "3"], "error: grace_steps=3 leaves ASHA no rung before a trial's last step 4"),
        (["--reduction-factor", "1"], "error: ASHA keeps 1/reduction_factor"),
        (["--time-budget-min", "5"], "error: train.time_budget_min does not apply to a sweep"),
        (["--fail-pattern", "2x3"], "error: fail_pattern's trials fail on the step after their first checkpoint"),
    ],
)
def test_a_sweep_its_job_cannot_run_is_refused_before_any_work(flags, message, capsys, monkeypatch):
    job_module = _sweep_job_module()
    monkeypatch.setattr(job_module, "run_sweep", lambda *a: pytest.fail("the sweep started"))
    with pytest.raises(SystemExit) as exit_:
        job_module.main(SHORT_SWEEP + flags)
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith(message) and err.count("\n") == 1


def test_grid_trains_each_one_loop_pattern_once():
    """Every scheme weighs a one-loop decoder's single loss by 1: an Nx1 trial per scheme would repeat itself."""
    sweep = SweepConfig(patterns=("2x1", "2x3", "6x1"), loss_weights=("uniform", "linear", "power:2"))
    pairs = [(p["pattern"], p["loss_weights"]) for p in param_space(sweep)["grid"]["grid_search"]]
    assert pairs == [("2x1", "uniform"), ("2x3", "uniform"), ("2x3", "linear"), ("2x3", "power:2"), ("6x1", "uniform")]
    assert sweep.trials == len(pairs)
    assert [(trial_pattern({"grid": p}), trial_scheme({"grid": p})) for p in grid(sweep)] == pairs
    assert trial_pattern({"pattern": "2x6", "loss_weights": "linear"}) == "2x6"  # a random draw's flat config


def test_settle_terms_are_swept_like_schemes():
    sweep = SweepConfig(patterns=("2x1", "2x3"), loss_weights=("linear",), settle=("none", "consecutive:3.0:fc"))
    pairs = [(p["pattern"], p["loss_weights"], p.get("settle")) for p in grid(sweep)]
    # One loop has nothing to settle toward: Nx1 once; the label is normalised (3.0 -> 3).
    assert pairs == [("2x1", "linear", "none"), ("2x3", "linear", "none"), ("2x3", "linear", "consecutive:3:fc")]
    assert sweep.trials == 3
    assert trial_settle({"grid": grid(sweep)[2]}) == SettleConfig("consecutive", 3.0, flip_cost_weighted=True)
    assert trial_settle({"pattern": "2x3", "loss_weights": "linear"}) == SettleConfig()  # a sweep without settle
    assert "settle" not in grid(SweepConfig())[0]  # trial configs, names and digests as before the settle term
    assert sweep_digest(SweepConfig(), {"a": 1}) == "ae40f167"  # main's digest of this sweep: it still resumes
    assert sweep_digest(SweepConfig(metric="val_flip_cost"), {"a": 1}) != "ae40f167"
    random = param_space(SweepConfig(patterns=("2x6",), settle=("none", "to_last:1"), search="random"))
    assert random["settle"].categories == ["none", "to_last:1"]
    for bad, match in [({"settle": ("to_last",)}, "needs a weight"), ({"settle": ()}, "settle is empty")]:
        with pytest.raises(ValueError, match=match):
            SweepConfig(**bad)
    with pytest.raises(ValueError, match="unknown metric"):
        SweepConfig(metric="bleu")


def test_levers_are_sweep_settings_of_the_cost_measurement():
    """--branches, --branch-depth, --min-confidence: validated, in the digest only when set, combined per model."""
    from speed.engine import Speculation
    from speed.sweep.measure import PLAIN, lever_settings

    sweep, _ = _sweep_job_module().parse(["--patterns", "2x3", "--branches", "0", "6", "--min-confidence", "0", "0.5"])
    assert sweep.levers == {"branches": (0, 6), "branch_depth": (1,), "min_confidence": (0.0, 0.5)}
    assert sweep.trials == SweepConfig(patterns=("2x3",)).trials  # measurement settings, not trials
    assert sweep_digest(SweepConfig(branches=[0]), {"a": 1}) == "ae40f167"  # the default keeps the sweep's name
    assert sweep_digest(replace(SweepConfig(), branches=(0, 6)), {"a": 1}) != "ae40f167"
    for bad, match in [
        ({"branches": (-1,)}, "SweepConfig.branches: branches must be an integer >= 0, got -1"),
        ({"branch_depth": (0,)}, "SweepConfig.branch_depth: branch_depth must be an integer >= 1"),
        ({"min_confidence": (1.5,)}, r"SweepConfig.min_confidence: min_confidence must be a number in \[0, 1\]"),
        ({"branches": ()}, "SweepConfig.branches is empty"),
    ]:
        with pytest.raises(ValueError, match=match):
            SweepConfig(**bad)
    assert PLAIN == Speculation() and lever_settings(SweepConfig().levers, 6) == [PLAIN]
    # capped at the model's loops, the depth moot without branches, no repeats, in order; a lever left out: plain
    assert lever_settings({"branches": (0, 6, 3), "branch_depth": (1, 4)}, 3) == [
        PLAIN,
        Speculation(branches=3, branch_depth=1),
        Speculation(branches=3, branch_depth=3),
    ]


def test_speed_costs_per_lever_setting_and_the_best_of_them(tiny_tokenizer):
    """Every lever setting is measured beside each launch loop and policy (rows per token with it), and the best
    cost breaks ties on steps with rows; a measurement from before the levers still has a best (plain) cost."""
    import torch

    from speed import SpeedT5, preset
    from speed.config import lm_preset
    from speed.models.looped_lm import LoopedLM
    from speed.sweep.measure import Measurement, lever_settings, speed_costs

    torch.manual_seed(0)
    model = SpeedT5(preset("tiny", pattern="2x3", vocab_size=400)).eval()
    levers = lever_settings({"branches": (0, 3), "branch_depth": (2,), "min_confidence": (0.0, 0.5)}, model.n_loops)
    inputs = [[5, 17, 33, 1], [8, 9, 1]]
    costs = speed_costs(model, inputs, 6, levers)
    assert len(costs) == 3 * 2 * 4
    got = {(c["launch_loop"], c["invalidation"], c["branches"], c["branch_depth"], c["min_confidence"]) for c in costs}
    assert got == {(k, p, b, 2 if b else 1, g) for k in (1, 2, 3) for p in ("eager", "final") for b in (0, 3)
                   for g in (0.0, 0.5)}  # fmt: skip
    for c in costs:
        assert 1 <= c["steps_per_token"] <= 3 and c["rows_per_token"] >= 3  # every token runs all its loops
        if c["launch_loop"] == 3:  # launching after the last loop: sequential, nothing to branch or gate
            assert c["steps_per_token"] == 3 and c["rows_per_token"] == 3
    m = Measurement("bleu", 0.0, {}, [], [], costs, 2)
    best = m.best_cost()
    fewest = min(c["layer_steps_per_token"] for c in costs)
    assert best["layer_steps_per_token"] == fewest
    assert best["rows_per_token"] == min(c["rows_per_token"] for c in costs if c["layer_steps_per_token"] == fewest)
    lm = LoopedLM(lm_preset("tiny", pattern="1+1x3+1", vocab_size=400)).eval()  # the LM's costs: P + steps(N + C)
    lm_costs = speed_costs(lm, inputs, 6)
    assert len(lm_costs) == 3 * 2
    for c in lm_costs:
        assert c["layer_steps_per_token"] == pytest.approx(1 + 2 * c["steps_per_token"])
    old = [{k: v for k, v in c.items() if k not in ("branches", "branch_depth", "min_confidence", "rows_per_token")}
           for c in costs if c["branches"] == 0 and c["min_confidence"] == 0]  # fmt: skip
    assert Measurement("bleu", 0.0, {}, [], [], old, 2).best_cost()["launch_loop"] in (1, 2, 3)


def test_random_search_samples_the_parametric_family():
    space = param_space(SweepConfig(patterns=("2x6",), loss_family="ratio", loss_range=(0.5, 2.0), search="random"))
    assert isinstance(space["loss_parameter"], tune.search.sample.Float)
    assert trial_scheme({"pattern": "2x6", "loss_family": "ratio", "loss_parameter": 1.25}) == "ratio:1.25"


def test_pareto_front():
    points = [(10.0, 5.0), (12.0, 5.0), (8.0, 2.0), (8.0, 3.0), (15.0, 12.0), (15.0, 12.0), (11.0, 13.0)]
    assert pareto_front(points) == [2, 1, 4]  # cheapest first; dominated and duplicate points dropped
    assert pareto_front([]) == []


def test_frontier_keeps_only_finished_undominated_trials():
    base = dict.fromkeys(RESULTS_SCHEMA.names)
    rows = []
    for trial, status, accuracy, cost in [
        ("a", "finished", 20.0, 4.0),
        ("b", "finished", 25.0, 6.0),
        ("c", "finished", 19.0, 5.0),  # dominated by a
        ("d", "failed", None, None),
        ("e", "stopped", None, None),
    ]:
        rows.append(
            base
            | {"sweep": "s", "trial": trial, "status": status, "task": "t", "pattern": "2x2", "n_unique": 2}
            | {"n_loops": 2, "depth": 4, "loss_weights": "linear", "job": "{}", "accuracy": accuracy}
            | {"accuracy_metric": "bleu", "speed_cost": cost, "speed_steps_per_token": cost and cost / 2}
            | {"best_launch_loop": 1, "best_invalidation": "eager", "checkpoint": f"/c/{trial}"}
        )
    front = frontier(pa.Table.from_pylist(rows, schema=RESULTS_SCHEMA))
    assert front.schema == FRONTIER_SCHEMA
    assert front.column("trial").to_pylist() == ["a", "b"]


# ----- one tiny real sweep ------------------------------------------------------------------------------


class _InterruptAfterFirstTrial(tune.Callback):
    """Sends this process SIGINT (as Ctrl+C would) when the first trial completes, once per marker file."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def on_trial_complete(self, iteration, trials, trial, **info) -> None:
        if not self.marker.exists():  # Tune restores its callbacks with the sweep: fire only once
            self.marker.write_text(trial.trial_id)
            os.kill(os.getpid(), signal.SIGINT)


def _job(storage: Path, tokenizer: Path):
    flags = ["--preset", "tiny", "--task", "translate_en_de", "--limit", "64", "--tokenizer", str(tokenizer)]
    flags += ["--batch-size", "4", "--max-steps", "4", "--checkpoint-every", "2", "--warmup-steps", "1"]
    flags += ["--max-source-len", "24", "--max-target-len", "24", "--cpus-per-worker", "2", "--log-every", "2"]
    flags += ["--max-failures", "1"]  # the failing pattern's trials: Tune restarts each once, which re-raises at once
    return job_from_args("finetune", flags + ["--storage-path", str(storage)])


# The smallest measurement that still exercises every stage of a sweep (test_sweep_lm.py's sweep too): every
# trial to the end (fifo: the tests check each one's row), a few validation examples, a two-input latency stage.
TINY_SWEEP = {"scheduler": "fifo", "val_limit": 8, "max_new_tokens": 8, "latency_limit": 2, "latency_reps": 1}

SWEEP = SweepConfig(
    patterns=("1x2", "2x2", "2x1"),
    loss_weights=("linear",),
    settle=("none", "consecutive:1:fc"),  # 1x2 and 2x2 with and without the settle term, 2x1 once
    measure_limit=4,
    cost_limit=3,
    branches=(0, 2),  # each trial's costs with and without runner-up branches (capped at 1 for 2x1)
    fail_pattern="2x2",
    **TINY_SWEEP,
)


@pytest.fixture(scope="module")
def sweep(ray_session, tiny_tokenizer, tmp_path_factory):
    """The sweep interrupted after its first trial, then the same sweep run again."""
    storage = tmp_path_factory.mktemp("sweeps")
    job = _job(storage, tiny_tokenizer)
    first = run_sweep(SWEEP, job, callbacks=[_InterruptAfterFirstTrial(storage / "interrupted")])
    first_results = Path(first.directory, "00000-1x2-linear", "result.json").read_text()
    second = run_sweep(SWEEP, job)
    return first, first_results, second


@pytest.mark.ray
@pytest.mark.slow
def test_an_interrupted_sweep_resumes_without_losing_finished_trials(sweep):
    first, first_results, second = sweep
    assert first.name == second.name and first.directory == second.directory  # deterministic, no timestamp
    status = dict(zip(first.results.column("trial").to_pylist(), first.results.column("status").to_pylist()))
    assert status["00000-1x2-linear"] == "finished"
    assert set(status.values()) <= {"finished", "unfinished"} and first.latency is None  # interrupted: no latency
    done = {r["trial"]: r for r in second.results.to_pylist()}
    assert [done[t]["status"] for t in sorted(done)] == ["finished", "finished", "failed", "failed", "finished"]
    # The finished trial was not run again: same row, and Tune logged no further result for it.
    before = next(r for r in first.results.to_pylist() if r["trial"] == "00000-1x2-linear")
    assert done["00000-1x2-linear"] == before
    assert Path(second.directory, "00000-1x2-linear", "result.json").read_text() == first_results


@pytest.mark.ray
@pytest.mark.slow
def test_a_failing_trial_is_recorded_and_the_sweep_goes_on(sweep):
    rows = {r["trial"]: r for r in sweep[2].results.to_pylist()}
    failed = rows["00002-2x2-linear"]
    assert failed["status"] == "failed" and "injected failure" in failed["error"]
    assert failed["accuracy"] is None and json.loads(failed["job"])["model"]["pattern"] == "2x2"
    assert rows["00004-2x1-linear"]["status"] == "finished"  # ran after the failures


@pytest.mark.ray
@pytest.mark.slow
def test_every_trial_is_one_mlflow_run_with_its_config_and_reports(sweep):
    from speed.train.tracking import SWEEP_TAG, import_mlflow

    outcome = sweep[2]
    client = import_mlflow().MlflowClient((Path(outcome.directory).parent / "mlruns").as_uri())  # the default store
    experiment = client.get_experiment_by_name(outcome.name)
    runs = client.search_runs([experiment.experiment_id])
    assert {r.data.tags[SWEEP_TAG] for r in runs} == {outcome.name}
    # Runs are named like the trials (with the settle label's colons); the interrupted trial's run was continued.
    by_index = {r.data.tags["trial_name"].split("-", 1)[0]: r for r in runs}
    assert len(by_index) == len(runs) == outcome.results.num_rows
    for row in outcome.results.to_pylist():
        run = by_index[row["trial"].split("-", 1)[0]]
        assert run.info.status == ("FAILED" if row["status"] == "failed" else "FINISHED")
        params = run.data.params
        assert params["grid/pattern"] == row["pattern"] and params["grid/loss_weights"] == row["loss_weights"]
        if row["status"] == "finished":  # every report: validation at the checkpoints, then the measured one
            assert run.data.metrics["val_loss_last"] == pytest.approx(row["val_loss_last"])
            assert run.data.metrics["val_flip_cost"] == pytest.approx(row["val_flip_cost"])
            assert run.data.metrics["step"] == row["steps"]
            history = client.get_metric_history(run.info.run_id, "val_loss_last")
            assert len(history) >= 2  # the step-2 checkpoint's report and the final one


@pytest.mark.ray
@pytest.mark.slow
def test_results_table_frontier_and_latency(sweep):
    outcome = sweep[2]
    results = pq.read_table(Path(outcome.directory, RESULTS_FILE))
    assert results.schema == RESULTS_SCHEMA and results.equals(outcome.results)
    for r in results.to_pylist():
        job = json.loads(r["job"])
        assert job["model"]["pattern"] == r["pattern"] and job["train"]["loss_weights"] == r["loss_weights"]
        settle = SettleConfig(**job["train"]["settle"])
        # Tune's trial folders, which name the rows, spell the label's colons as underscores.
        assert settle.label == r["settle"] and r["trial"].endswith("-consecutive_1_fc") == settle.active
        if r["status"] != "finished":
            continue
        m, n = r["n_loops"], r["n_unique"]
        # Teacher-forced flips at the final checkpoint; the flip cost from the same rates, and of the decoded tokens.
        assert len(r["val_flip_rate_prev"]) == m and r["val_flip_rate_prev"][0] == 0
        assert r["val_flip_cost"] == pytest.approx(flip_cost(r["val_flip_rate_prev"]))
        assert r["flip_cost"] == pytest.approx(flip_cost(r["flip_rate_prev"]))
        assert r["steps"] == 4 and r["accuracy_metric"] == "bleu" and r["accuracy"] == r["bleu"] >= 0
        assert len(r["val_loss_loops"]) == m and r["val_loss_last"] == r["val_loss_loops"][-1] > 0
        assert len(r["flip_rate_final"]) == m and r["flip_rate_final"][-1] == 0  # the last loop is the token
        costs = {(c["launch_loop"], c["invalidation"], c["branches"]): c for c in r["costs"]}
        assert set(costs) == {(k, p, b) for k in range(1, m + 1) for p in ("eager", "final") for b in (0, min(2, m))}
        for c in r["costs"]:
            assert 1 <= c["steps_per_token"] <= m and c["layer_steps_per_token"] == pytest.approx(
                c["steps_per_token"] * n
            )
        # Launching from the last loop is sequential decoding: exactly M steps per token.
        assert costs[(m, "eager", 0)]["steps_per_token"] == m
        assert r["speed_cost"] == min(c["layer_steps_per_token"] for c in r["costs"])
        best = costs[(r["best_launch_loop"], r["best_invalidation"], r["best_branches"])]
        assert (best["layer_steps_per_token"], best["rows_per_token"]) == (r["speed_cost"], r["speed_rows_per_token"])
        assert (r["best_branch_depth"], r["best_min_confidence"]) == (1, 0.0)
    front = pq.read_table(Path(outcome.directory, FRONTIER_FILE))
    assert front.schema == FRONTIER_SCHEMA and front.equals(outcome.frontier)
    finished = [r for r in results.to_pylist() if r["status"] == "finished"]
    for f in front.to_pylist():  # no finished trial beats a frontier trial on both axes
        assert not any(
            r["accuracy"] >= f["accuracy"]
            and r["speed_cost"] <= f["speed_cost"]
            and (r["accuracy"], r["speed_cost"]) != (f["accuracy"], f["speed_cost"])
            for r in finished
        )
    latency = pq.read_table(Path(outcome.directory, LATENCY_FILE))
    assert latency.schema == LATENCY_SCHEMA and latency.equals(outcome.latency)
    rows = latency.to_pylist()
    assert {(r["trial"], r["variant"]) for r in rows} >= {("00004-2x1-linear", "sequential")}
    best = {r["trial"]: r["best_branches"] for r in results.to_pylist()}
    for r in rows:
        assert r["ms_per_token"] > 0 and r["tokens"] > 0 and r["rows"] >= r["tokens"]
        if r["variant"] == "sequential":
            assert r["speedup_vs_sequential"] == 1.0 and r["branches"] is None
        else:
            assert r["branches"] == best[r["trial"]]


@pytest.mark.ray
@pytest.mark.slow
def test_sweep_analysis_and_notebook_on_the_real_sweep(sweep, tmp_path):
    """speed.analysis reads the sweep's folder as the notebook does, and the notebook draws its figures there."""
    import shutil

    from speed.analysis import discover, launch_costs, load_sweep, loop_flips, trials
    from speed.analysis.notebooks import run_notebooks

    folder = tmp_path / "results" / Path(sweep[2].directory).name
    shutil.copytree(sweep[2].directory, folder, ignore=shutil.ignore_patterns("train", "0000*"))
    assert discover(tmp_path / "results").sweeps == [folder]
    loaded = load_sweep(folder)
    assert loaded.results.equals(sweep[2].results) and loaded.latency.equals(sweep[2].latency)
    table = trials(loaded.results)
    finished = [r for r in sweep[2].results.to_pylist() if r["status"] == "finished"]
    assert sorted(table.column("trial").to_pylist()) == sorted(r["trial"] for r in finished)
    front = set(sweep[2].frontier.column("trial").to_pylist())
    assert {r["trial"] for r in table.to_pylist() if r["on_frontier"]} == front
    for r in table.to_pylist():
        assert r["saving"] == pytest.approx(r["depth"] / r["speed_cost"])
    flips = loop_flips(loaded.results)
    assert flips.num_rows == sum(r["n_loops"] for r in finished)
    best = {r["trial"]: (r["best_branches"], r["speed_rows_per_token"]) for r in finished}
    assert {r["trial"]: (r["best_branches"], r["speed_rows_per_token"]) for r in table.to_pylist()} == best
    costs = launch_costs(loaded.results)  # plain SPEED's: the settings with branches stay in results' costs
    assert costs.num_rows == sum(2 * r["n_loops"] for r in finished)
    assert set(costs.column("branches").to_pylist()) == {0}
    run_notebooks(tmp_path / "results", [repo_root() / "analysis" / "sweep.ipynb"])
    assert {r["recipe"] for r in table.to_pylist()} == {"linear", "linear + settle consecutive:1:fc"}
    for figure in (
        "sweep_tradeoff.png",
        "sweep_flips.png",
        "sweep_costs.png",
        "sweep_flip_cost.png",
        "sweep_latency.png",
    ):
        assert (folder / figure).stat().st_size > 0, figure


# ----- a looped LM's sweep ------------------------------------------------------------------------------------

# 1+1x2+1 and 1+2x1+1 (a prelude and a coda around each core), no settle term, no branches, no failing pattern
