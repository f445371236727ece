"""The GPU check's stages that ask whether the CUDA paths work (``speed.benchmarks.gpu`` runs them): ``exactness``
(``pytest -m gpu`` in a subprocess: SPEED's logits bitwise equal to sequential decoding's on the device),
``agreement`` (the same weights decoded on the CPU and on the device: how many tokens agree) and ``training`` (a
few optimizer steps on the device, a training checkpoint saved and loaded on the CPU, one more step from both).
Each returns a named result; none imports Ray.
"""

from __future__ import annotations

import copy
import math
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from contextlib import nullcontext
from dataclasses import dataclass

import torch

from speed.benchmarks.decode import random_model
from speed.benchmarks.gpu_setup import CheckSize, sync
from speed.decode.generate import DecodeOptions, generate
from speed.engine.sampling import Sampling
from speed.losses import loss_weights, shift_right
from speed.models.checkpoint import load_model
from speed.models.t5 import SpeedT5
from speed.paths import repo_root
from speed.train.optim import OptimConfig, build_optimizer, build_scheduler, follow_parameters
from speed.train.state import TrainingState, load_training_state, rng_state, save_training_checkpoint, set_rng_state
from speed.train.train_log import TRAIN_LOG_SCHEMA


@dataclass(frozen=True)
class PytestRun:
    """``pytest -m gpu`` in a subprocess."""

    command: list[str]
    returncode: int | None  # None: stopped at its timeout
    timeout_s: float
    outcomes: dict[str, int]  # per test: PASSED, FAILED, SKIPPED, ERROR, ...
    failed: list[str]  # the tests that failed or errored
    summary: str  # pytest's last line
    tail: str  # the end of its output


@dataclass(frozen=True)
class Agreement:
    """Tokens of one decoding setting on two devices, the same weights and inputs."""

    sampling: str  # greedy | sampled (temperature 1, one seed)
    sequences: int
    identical: int  # sequences whose tokens are equal on both devices
    positions: int  # output positions compared (each sequence's shorter length)
    agreeing: int  # of them, with equal tokens
    rate: float  # agreeing / positions
    mean_prefix: float  # mean tokens before a sequence's first difference


@dataclass(frozen=True)
class TrainingRun:
    """A few optimizer steps on the device, a checkpoint round trip, and one step on from it."""

    steps: int
    losses: list[float]  # the weighted loss L_w of each step (the same batch every step)
    ms_per_step: float  # median
    peak_memory_mb: float | None  # CUDA only
    state_on_device: bool  # after loading on the CPU, every moment tensor followed the parameters to the device
    state_restored: bool  # ... and equals, bit for bit, the state that was saved
    continued_loss: float  # the next step's loss, uninterrupted
    resumed_loss: float  # the same step's loss from the reloaded checkpoint
    resume_max_abs_diff: float  # parameters after that step, resumed vs uninterrupted (CUDA atomics: may be > 0)

    @property
    def ok(self) -> bool:
        """Finite losses, and the optimizer state restored onto the device."""
        finite = all(math.isfinite(x) for x in (*self.losses, self.continued_loss, self.resumed_loss))
        return finite and self.state_on_device and self.state_restored


# ----- exactness: pytest -m gpu -----------------------------------------------------------------------------

_OUTCOME = re.compile(r"^(\S+::\S+) (PASSED|FAILED|SKIPPED|ERROR|XFAIL|XPASS)\b", re.MULTILINE)


def exactness_stage(timeout_s: float) -> PytestRun:
    """``pytest -m gpu tests/test_gpu_decode.py -v`` with this checkout's ``platform/`` on the path, stopped at
    ``timeout_s``; outcomes are read from its per-test lines, so a stopped run still counts what finished."""
    root = repo_root()
    command = [sys.executable, "-m", "pytest", "-m", "gpu", "tests/test_gpu_decode.py", "-v", "-p", "no:cacheprovider"]
    path = os.pathsep.join(p for p in (str(root / "platform"), os.environ.get("PYTHONPATH")) if p)
    # no plugins: the tests need none, and the ones installed here would only slow the start; unbuffered, so
    # that a run stopped at its timeout has written the lines of the tests it finished
    env = os.environ | {"PYTHONPATH": path, "PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1", "PYTHONUNBUFFERED": "1"}
    try:
        done = subprocess.run(command, cwd=root, env=env, capture_output=True, text=True, timeout=timeout_s)
        returncode, output = done.returncode, done.stdout + done.stderr
    except subprocess.TimeoutExpired as stopped:
        returncode = None
        output = "".join(_text(x) for x in (stopped.stdout, stopped.stderr))
    outcomes: dict[str, int] = {}
    failed = []
    for test, outcome in _OUTCOME.findall(output):
        outcomes[outcome] = outcomes.get(outcome, 0) + 1
        if outcome in ("FAILED", "ERROR"):
            failed.append(test)
    lines = output.strip().splitlines()
    return PytestRun(command, returncode, timeout_s, outcomes, failed, lines[-1] if lines else "",
                     "\n".join(lines[-40:]))  # fmt: skip


def _text(x: str | bytes | None) -> str:
    return x.decode(errors="replace") if isinstance(x, bytes) else (x or "")


# ----- agreement --------------------------------------------------------------------------------------------


def agreement(sampling: str, a: list[list[int]], b: list[list[int]]) -> Agreement:
    """How the tokens ``b`` of one setting on one device agree with ``a`` on another, sequence by sequence."""
    positions = agreeing = identical = 0
    prefixes = []
    for x, y in zip(a, b, strict=True):
        same = [p == q for p, q in zip(x, y)]
        positions += len(same)
        agreeing += sum(same)
        identical += x == y
        prefixes.append(same.index(False) if False in same else len(same))
    return Agreement(sampling, len(a), identical, positions, agreeing, agreeing / max(positions, 1),
                     statistics.mean(prefixes))  # fmt: skip


def agreement_stage(size: CheckSize, device: str) -> list[Agreement]:
    """Decode one random batch sequentially on the CPU and on ``device`` with the same weights, greedy and
    sampled (the noise computed on each device, ``device_gumbel``), and compare the tokens."""
    cpu = random_model(size.model(), seed=0)  # EOS disabled: every sequence runs its full length
    other = copy.deepcopy(cpu).to(device)
    shape = (size.agree_batch, size.source_len)
    ids = torch.randint(3, size.vocab_size, shape, generator=torch.Generator().manual_seed(2))
    found = []
    for name, sampling in (("greedy", None), ("sampled", Sampling(temperature=1.0, seed=7))):
        options = DecodeOptions(method="sequential", max_new_tokens=size.agree_tokens, trace=False, sampling=sampling)
        found.append(
            agreement(name, generate(cpu, ids, options=options).tokens, generate(other, ids, options=options).tokens)
        )
    return found


# ----- training ---------------------------------------------------------------------------------------------


def training_stage(size: CheckSize, device: str) -> TrainingRun:
    """Train ``size.train_steps`` steps on one random batch, save a training checkpoint, reload it on the CPU
    as a resume does (``speed.train.loop``), follow the parameters to the device, and take one more step from
    there and from the uninterrupted run."""
    dev = torch.device(device)
    config = size.model()
    optim = OptimConfig(warmup_steps=0, schedule="constant")  # the full lr from the first step: the loss moves
    torch.manual_seed(0)
    model = SpeedT5(config).to(dev).train()
    optimizer = build_optimizer(model, optim)
    scheduler = build_scheduler(optimizer, optim, size.train_steps + 1)
    weights = loss_weights("linear", model.n_loops).to(dev)
    generator = torch.Generator().manual_seed(1)
    labels = torch.randint(3, config.vocab_size, (size.train_batch, size.train_target_len), generator=generator)
    inputs = torch.randint(3, config.vocab_size, (size.train_batch, size.source_len), generator=generator)
    batch = {"input_ids": inputs, "attention_mask": torch.ones_like(inputs), "labels": labels}
    batch = {k: v.to(dev) for k, v in (batch | {"decoder_input_ids": shift_right(labels)}).items()}
    autocast = torch.autocast("cuda", dtype=torch.bfloat16) if dev.type == "cuda" else nullcontext()
    if dev.type == "cuda":
        torch.cuda.reset_peak_memory_stats(dev)

    def step(m: SpeedT5, opt: torch.optim.Optimizer, sched: torch.optim.lr_scheduler.LRScheduler) -> float:
        with autocast:  # the forward only, as in training
            out = m(**batch, weights=weights)
        out.loss.backward()
        torch.nn.utils.clip_grad_norm_(m.parameters(), optim.grad_clip)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        return float(out.loss.detach())

    losses, times = [], []
    for _ in range(size.train_steps):
        t0 = time.perf_counter()
        losses.append(step(model, optimizer, scheduler))
        sync(dev)
        times.append((time.perf_counter() - t0) * 1000)
    peak = torch.cuda.max_memory_allocated(dev) / 2**20 if dev.type == "cuda" else None

    with tempfile.TemporaryDirectory(prefix="speed-gpu-check-") as directory:
        state = TrainingState(
            size.train_steps, optimizer.state_dict(), scheduler.state_dict(), [rng_state()],
            TRAIN_LOG_SCHEMA.empty_table(),
        )  # fmt: skip
        save_training_checkpoint(directory, model, None, {}, state)
        saved = copy.deepcopy(optimizer.state_dict())  # the next step updates the live state in place
        continued_loss = step(model, optimizer, scheduler)
        resumed = load_model(directory).model.train()  # on the CPU, as a resume loads it
        restored = load_training_state(directory)
    resumed_opt = build_optimizer(resumed, optim)
    resumed_opt.load_state_dict(restored.optimizer)
    resumed_sched = build_scheduler(resumed_opt, optim, size.train_steps + 1)
    resumed_sched.load_state_dict(restored.scheduler)
    resumed.to(dev)
    follow_parameters(resumed_opt)
    set_rng_state(restored.rng[0])  # the dropout masks of the step the uninterrupted run took
    moments = [v for s in resumed_opt.state.values() for k, v in s.items() if k != "step" and torch.is_tensor(v)]
    state_restored = _same_state(saved, resumed_opt.state_dict())
    resumed_loss = step(resumed, resumed_opt, resumed_sched)
    diff = max(float((a.detach() - b.detach()).abs().max()) for a, b in zip(model.parameters(), resumed.parameters()))
    return TrainingRun(
        steps=size.train_steps,
        losses=losses,
        ms_per_step=statistics.median(times),
        peak_memory_mb=peak,
        state_on_device=bool(moments) and all(v.device.type == dev.type for v in moments),
        state_restored=state_restored,
        continued_loss=continued_loss,
        resumed_loss=resumed_loss,
        resume_max_abs_diff=diff,
    )


def _same_state(a: dict, b: dict) -> bool:
    """Two optimizer state dicts hold the same tensors, bit for bit (on any devices)."""
    if a["state"].keys() != b["state"].keys():
        return False
    for key, state in a["state"].items():
        other = b["state"][key]
        if state.keys() != other.keys() or not all(torch.equal(state[k].cpu(), other[k].cpu()) for k in state):
            return False
    return True

