"""What a sweep searches: sharing patterns, loss-weight schemes, settle terms, the searcher and the scheduler.

A ``SweepConfig`` is frozen and validated; patterns may be named families
(``expand_patterns``), the loss weights may be a continuous parameter of a
``speed.losses`` family (``power`` or ``ratio``) sampled over a range, and the
settle terms are ``speed.losses.SettleConfig`` labels (``none``, ``to_last:1``,
``consecutive:3:fc``, ...). SPEED's levers (``SWEPT_LEVERS``: runner-up
``branches``, their ``branch_depth``, the ``min_confidence`` gate; fields of
``speed.engine.Speculation``) are settings of every trial's cost measurement,
each combination measured beside the launch loops and policies.
``check_job`` checks it against the base job before any work: a derived setting
the job cannot honour is adjusted with a note, an explicit one is refused.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

from speed.config import SharingPattern
from speed.engine import LEVERS, Speculation
from speed.losses import PARAMETRIC, SettleConfig, check_scheme, parametric

if TYPE_CHECKING:
    from speed.train.config import JobConfig, TrainConfig

SEARCHES = ("grid", "random")  # Tune's BasicVariantGenerator: every combination, or num_samples draws
SCHEDULERS = ("asha", "fifo")  # ASHA stops trials whose last-loop validation loss lags; fifo runs all to the end
METRIC = "val_loss_last"  # what ASHA ranks: the last loop's loss is comparable across loss-weight schemes
# ...or the teacher-forced flip cost (speed.eval.validation): SPEED's steps per token lost to flips, no decoding
METRICS = (METRIC, "val_flip_cost")
# SPEED's settings (speed.engine.LEVERS) a sweep lists values of: every trial's costs are measured for each combination
# beside every launch loop and both invalidation policies; branch_below stays at its default
SWEPT_LEVERS = tuple(name for name in LEVERS if name not in ("launch_loop", "invalidation", "branch_below"))


@dataclass(frozen=True)
class SweepConfig:
    """One sweep: the search space, how it is searched, and the per-trial measurements."""

    # NxM (an LM's P+NxM+C), or a family: depth=D (N*M = D), unique=N (Nx1 .. Nx(max_depth/N)), each with P+ / +C
    patterns: tuple[str, ...] = ("depth=4",)
    loss_weights: tuple[str, ...] = ("linear", "uniform")  # speed.losses schemes (grid: all; random: a choice)
    loss_family: str | None = None  # a PARAMETRIC family sampled over loss_range instead of loss_weights
    loss_range: tuple[float, float] = (0.0, 2.0)  # the family parameter's range (random: uniform; grid: 3 points)
    settle: tuple[str, ...] = ("none",)  # SettleConfig labels KIND[:WEIGHT[:fc][:wSTEPS]] (grid: all; random: a choice)
    metric: str = METRIC  # what the scheduler ranks (minimised): one of METRICS
    max_depth: int = 12  # bound of the unique=N family
    search: str = "grid"
    samples: int = 1  # Tune num_samples: grid repeats, random draws
    scheduler: str = "asha"
    grace_steps: int | None = None  # ASHA: steps before a trial may be stopped; None = max(checkpoint_every, steps/4)
    reduction_factor: int = 2  # ASHA: keep the best 1/reduction_factor at each rung (at least 2)
    measure_limit: int = 64  # validation examples each finished trial decodes (metrics, flips)
    cost_limit: int = 32  # the first of those whose SPEED steps are counted alone for every launch loop and policy
    val_limit: int = 256  # validation examples of the periodic validation loss
    max_new_tokens: int = 64
    latency_limit: int = 16  # validation examples the latency stage decodes (batch 1) per variant
    latency_reps: int = 3
    branches: tuple[int, ...] = (Speculation.branches,)  # runner-up branches the costs are measured with (above M: M)
    branch_depth: tuple[int, ...] = (Speculation.branch_depth,)  # their lanes' lengths (above M: M)
    min_confidence: tuple[float, ...] = (Speculation.min_confidence,)  # confidence gates of a launch
    fail_pattern: str | None = None  # fault drill: trials of this pattern fail in training (train.fail_at_step)

    def __post_init__(self) -> None:
        for name in ("patterns", "loss_weights", "loss_range", "settle", *SWEPT_LEVERS):
            object.__setattr__(self, name, tuple(getattr(self, name)))
        for name in SWEPT_LEVERS:
            if not getattr(self, name):
                raise ValueError(f"SweepConfig.{name} is empty: give at least one value")
            for value in getattr(self, name):
                try:
                    Speculation(**{name: value})  # checks the value
                except ValueError as err:
                    raise ValueError(f"SweepConfig.{name}: {err}") from None
        if self.search not in SEARCHES:
            raise ValueError(f"unknown search {self.search!r}; choose one of {list(SEARCHES)}")
        if self.scheduler not in SCHEDULERS:
            raise ValueError(f"unknown scheduler {self.scheduler!r}; choose one of {list(SCHEDULERS)}")
        expand_patterns(self.patterns, self.max_depth)  # raises on a bad pattern or family
        if not self.settle:
            raise ValueError("settle is empty: give at least 'none'")
        for label in self.settle:
            SettleConfig.parse(label)  # raises on a bad kind or weight
        if self.metric not in METRICS:
            raise ValueError(f"unknown metric {self.metric!r}; choose one of {list(METRICS)}")
        for scheme in self.loss_weights:
            check_scheme(scheme)
        if self.loss_family is not None:
            if self.loss_family not in PARAMETRIC:
                raise ValueError(f"unknown loss_family {self.loss_family!r}; choose one of {sorted(PARAMETRIC)}")
            lo, hi = self.loss_range
            if not lo < hi:
                raise ValueError(f"loss_range must be (low, high) with low < high, got {self.loss_range}")
            for end in (lo, hi):
                parametric(self.loss_family, end)  # raises when the range leaves the family's
        elif not self.loss_weights:
            raise ValueError("loss_weights is empty and no loss_family is set: nothing to train")
        for name in ("samples", "reduction_factor", "measure_limit", "cost_limit", "val_limit", "max_new_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"SweepConfig.{name} must be positive, got {getattr(self, name)}")
        if self.latency_limit < 0 or self.latency_reps < 1:
            raise ValueError("SweepConfig.latency_limit must be >= 0 (0: no latency stage) and latency_reps >= 1")
        if self.grace_steps is not None and self.grace_steps < 1:
            raise ValueError(f"SweepConfig.grace_steps must be positive or None, got {self.grace_steps}")
        if self.scheduler == "asha" and self.reduction_factor < 2:
            raise ValueError(
                f"ASHA keeps 1/reduction_factor of the trials at each rung: reduction_factor must be >= 2, "
                f"got {self.reduction_factor} (or use --scheduler fifo)"
            )
        if self.fail_pattern is not None and self.fail_pattern not in self.expanded_patterns:
            raise ValueError(f"fail_pattern {self.fail_pattern!r} is not among the swept patterns")

    @property
    def expanded_patterns(self) -> tuple[str, ...]:
        """The concrete NxM patterns, families expanded, in order, without repeats."""
        return expand_patterns(self.patterns, self.max_depth)

    @property
    def levers(self) -> dict[str, tuple]:
        """The lever values every trial's costs are measured with (``speed.sweep.measure.lever_settings``)."""
        return {name: getattr(self, name) for name in SWEPT_LEVERS}

    @property
    def trials(self) -> int:
        """How many trials the sweep runs: the grid times ``samples``, or ``samples`` random draws."""
        if self.search == "random":
            return self.samples
        return len(grid(self)) * self.samples

    @property
    def schemes(self) -> tuple[str, ...]:
        """The loss-weight schemes of a grid (for a family: its range's ends and midpoint)."""
        if self.loss_family is None:
            return self.loss_weights
        lo, hi = self.loss_range
        return tuple(dict.fromkeys(parametric(self.loss_family, x) for x in (lo, (lo + hi) / 2, hi)))


@dataclass(frozen=True)
class SchedulerPlan:
    """The scheduler a sweep runs with, its settings checked against the job's validation reports.

    A trial reports its validation loss every ``checkpoint_every`` steps and at its last step; ASHA
    judges a trial at its first report at or past each rung. Every rung lies on a report before the
    last one: a trial stopped at its last report would have trained fully and never be measured.
    """

    scheduler: str  # "asha" or "fifo"
    grace_steps: int | None = None  # ASHA: the first rung, a multiple of checkpoint_every
    max_t: int | None = None  # ASHA: the bound of the rungs, the last report before the last step
    notes: tuple[str, ...] = ()  # what was adjusted, and why: printed before the sweep starts


def plan_scheduler(sweep: SweepConfig, train: TrainConfig) -> SchedulerPlan:
    """ASHA's rungs on the trials' reports, or FIFO where ASHA could stop no trial before its last report.

    The default first rung is a quarter of the steps (at least ``checkpoint_every``), rounded up to a
    report; an explicit ``grace_steps`` is rounded up to a report with a note, and refused
    (``ValueError``) when no report before the last step reaches it.
    """
    if sweep.scheduler == "fifo":
        return SchedulerPlan("fifo")
    every = train.checkpoint_every
    last = min(train.max_steps, train.stop_at_step or train.max_steps)
    last_rung = (last - 1) // every * every  # the last report before the final one (0: there is none)
    if sweep.grace_steps is not None:
        grace = _round_up(sweep.grace_steps, every)
        if grace > last_rung:
            before = f"the last time before the end at step {last_rung}" if last_rung else "never before the end"
            raise ValueError(
                f"grace_steps={sweep.grace_steps} leaves ASHA no rung before a trial's last step {last}: "
                f"validation is reported every checkpoint_every={every} steps, {before}; lower --grace-steps "
                "or --checkpoint-every, or use --scheduler fifo"
            )
        notes = []
        if grace != sweep.grace_steps:
            notes.append(f"ASHA: grace_steps={sweep.grace_steps} rounded up to {grace}, the next validation report")
        return SchedulerPlan("asha", grace, last_rung, tuple(notes))
    if not last_rung:
        note = (
            f"ASHA off, every trial runs to the end: the trials report validation only at their last step {last} "
            f"(checkpoint_every={every}), so ASHA could stop none early; lower --checkpoint-every to use it"
        )
        return SchedulerPlan("fifo", notes=(note,))
    if sweep.trials < 2:
        return SchedulerPlan("fifo", notes=("ASHA off: a sweep of one trial has no other trial to compare it with",))
    return SchedulerPlan("asha", max(every, _round_up(last // 4, every)), last_rung)


def _round_up(steps: int, every: int) -> int:
    return -(-steps // every) * every


def check_job(sweep: SweepConfig, job: JobConfig) -> SchedulerPlan:
    """Check the sweep against its base job before any work; its scheduler plan. ``ValueError`` names a
    setting that cannot work with the job."""
    if job.train.time_budget_min is not None:
        raise ValueError(
            "train.time_budget_min does not apply to a sweep: every trial trains train.max_steps; "
            "drop --time-budget-min and bound the trials with --max-steps"
        )
    for pattern in sweep.expanded_patterns:
        try:
            job.model.replace(pattern=pattern)
        except ValueError as err:
            raise ValueError(f"pattern {pattern!r} does not fit the job's {job.family.name} model: {err}") from None
    t = job.train
    if sweep.fail_pattern is not None and t.checkpoint_every >= t.max_steps:
        raise ValueError(
            f"fail_pattern's trials fail on the step after their first checkpoint: checkpoint_every="
            f"{t.checkpoint_every} must be below max_steps={t.max_steps}"
        )
    return plan_scheduler(sweep, t)


def expand_patterns(specs: tuple[str, ...], max_depth: int = 12) -> tuple[str, ...]:
    """``NxM`` (or a looped LM's ``P+NxM+C``) as is; ``depth=D``: every NxM with N*M = D (N ascending);
    ``unique=N``: Nx1 .. Nx(max_depth // N). A family may carry a prelude and a coda: ``1+depth=4+1`` is
    ``1+1x4+1``, ``1+2x2+1``, ``1+4x1+1``."""
    out: list[str] = []
    for spec in specs:
        parts = spec.split("+")
        family = [i for i, part in enumerate(parts) if "=" in part]
        if not family:
            out.append(str(SharingPattern.parse(spec)))
            continue
        at = family[0]
        kind, _, value = parts[at].strip().partition("=")
        prefix, suffix = "".join(f"{p}+" for p in parts[:at]), "".join(f"+{p}" for p in parts[at + 1 :])
        if not value.strip().isdigit() or int(value) < 1:
            raise ValueError(f"pattern family {spec!r}: expected a positive integer after '='")
        n = int(value)
        if kind == "depth":
            cores = [f"{u}x{n // u}" for u in range(1, n + 1) if n % u == 0]
        elif kind == "unique":
            if n > max_depth:
                raise ValueError(f"pattern family {spec!r}: N={n} exceeds max_depth={max_depth}")
            cores = [f"{n}x{m}" for m in range(1, max_depth // n + 1)]
        else:
            raise ValueError(f"unknown pattern family {spec!r}; use NxM, depth=D or unique=N (P+ and +C allowed)")
        out.extend(str(SharingPattern.parse(f"{prefix}{core}{suffix}")) for core in cores)
    if not out:
        raise ValueError("no patterns to sweep")
    return tuple(dict.fromkeys(out))


def grid(config: SweepConfig) -> list[dict[str, str]]:
    """A grid's trials: every pattern with every scheme and settle term, except that a one-loop ``Nx1`` gets the
    first of each only.

    With one loop every scheme's weights are [1.0] and there is no other loop to settle toward, so the other
    choices would train the same model again. ``settle`` is in a pair only when the sweep varies it.
    """
    pairs = []
    for pattern in config.expanded_patterns:
        looped = SharingPattern.parse(pattern).n_loops > 1
        for scheme in config.schemes if looped else config.schemes[:1]:
            for settle in config.settle if looped else config.settle[:1]:
                pairs.append({"pattern": pattern, "loss_weights": scheme} | _settle_key(config, settle))
    return pairs


def _settle_key(config: SweepConfig, settle: str) -> dict[str, str]:
    # A sweep without settle terms keeps the trial configs (and names) sweeps had before them.
    return {} if config.settle == ("none",) else {"settle": SettleConfig.parse(settle).label}


def param_space(config: SweepConfig) -> dict[str, Any]:
    """The Tune search space: a grid of (pattern, scheme) pairs, or ``pattern`` and ``loss_weights`` (a scheme
    name, or a family parameter) drawn at random; read a trial's with ``trial_pattern`` and ``trial_scheme``."""
    from ray import tune

    patterns = list(config.expanded_patterns)
    space: dict[str, Any] = {}
    if config.search == "grid":
        space["grid"] = tune.grid_search(grid(config))
        return space
    space["pattern"] = tune.choice(patterns)
    if config.settle != ("none",):
        space["settle"] = tune.choice([SettleConfig.parse(label).label for label in config.settle])
    if config.loss_family is None:
        space["loss_weights"] = tune.choice(list(config.loss_weights))
    else:
        space["loss_family"] = config.loss_family
        space["loss_parameter"] = tune.uniform(*config.loss_range)
    return space


def trial_pattern(trial_config: dict[str, Any]) -> str:
    """The sharing pattern of one trial's Tune config (a grid pair's, or a random draw's)."""
    return trial_config.get("grid", trial_config)["pattern"]


def trial_scheme(trial_config: dict[str, Any]) -> str:
    """The loss-weight scheme of one trial's Tune config (a sampled family parameter made a scheme name)."""
    if "loss_parameter" in trial_config:
        return parametric(trial_config["loss_family"], trial_config["loss_parameter"])
    return trial_config.get("grid", trial_config)["loss_weights"]


def trial_settle(trial_config: dict[str, Any]) -> SettleConfig:
    """The settle term of one trial's Tune config (none when the sweep does not vary it)."""
    return SettleConfig.parse(trial_config.get("grid", trial_config).get("settle", "none"))


def sweep_digest(config: SweepConfig, job: dict[str, Any]) -> str:
    """A short hash of everything that changes a sweep's trials (not where it runs or how it is timed)."""
    d = asdict(config)
    for key in ("latency_limit", "latency_reps"):
        d.pop(key)
    plain = ((name, (getattr(Speculation, name),)) for name in SWEPT_LEVERS)
    for key, default in (("settle", ("none",)), ("metric", METRIC), *plain):
        if d[key] == default:
            d.pop(key)  # sweeps named before these settings existed keep their names (and resume)
    return hashlib.sha256(json.dumps({"sweep": d, "job": job}, sort_keys=True).encode()).hexdigest()[:8]
