"""The memory of one training step, measured on the CPU beside the memory plan, with and without activation
checkpointing.

    PYTHONPATH=platform python -m speed.benchmarks.train_memory            # a table
    PYTHONPATH=platform python -m speed.benchmarks.train_memory --json     # one JSON object per row

A looped LM of Ouro's options (sandwich norm, loop norm, exit gate) at a small shape takes two optimizer steps
(AdamW) on random tokens; the second one's peak is measured with torch's ``MemTracker`` (every tensor storage
allocated and freed, by kind: parameters, gradients, optimizer state, activations, temporaries), in one process
with nothing else allocated, and compared with ``speed.train.memory_plan``'s peak for the same job. About 5 s.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict, dataclass

import torch

from speed.losses import loss_weights
from speed.models.family import build_model
from speed.models.looped_lm import CHECKPOINTING, next_token_labels
from speed.train.config import JobConfig, job_from_dict
from speed.train.memory_plan import plan_memory
from speed.train.optim import build_optimizer

# Ouro's block options at a shape where a step's activations and states are both visible (~0.6M parameters).
MODEL = {
    "family": "lm",
    "vocab_size": 512,
    "d_model": 128,
    "n_heads": 4,
    "n_kv_heads": 4,
    "head_dim": 32,
    "d_ff": 384,
    "pattern": "2x4",
    "norm": "sandwich",
    "loop_norm": True,
    "exit_gate": True,
}


@dataclass(frozen=True)
class StepMemory:
    """One step's measured peak beside the plan's, in bytes."""

    checkpointing: str
    measured: int
    planned: int
    activations_measured: int  # the activations' and temporaries' part of the measured peak
    activations_planned: int

    @property
    def ratio(self) -> float:
        return self.planned / self.measured


def bench_job(checkpointing: str, batch: int = 4, length: int = 64) -> JobConfig:
    """The benchmark's job: ``MODEL`` finetuned on ``batch`` sequences of 2 x ``length`` tokens."""
    return job_from_dict(
        {
            "kind": "finetune",
            "model": MODEL,
            "data": {"task": "translate_en_de", "max_source_len": length, "max_target_len": length},
            "train": {"batch_size": batch, "checkpoint_activations": checkpointing},
            "eval": None,
        }
    )


def measure_step(job: JobConfig) -> StepMemory:
    """The peak of a job's second step (one worker, float32, the CPU) measured, and its plan."""
    from torch.distributed._tools.mem_tracker import MemTracker

    torch.manual_seed(0)
    model = build_model(job.model).train()
    optimizer = build_optimizer(model, job.optim)
    plan = plan_memory(job)
    ids = torch.randint(2, job.model.vocab_size, (plan.micro_batch, plan.seq_len))
    labels = next_token_labels(ids)
    weights = loss_weights(job.train.loss_weights, model.n_loops)

    def step() -> None:
        model(ids, labels, weights=weights, run=job.run_shape).loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    step()  # the optimizer's state exists from here on
    tracker = MemTracker()
    tracker.track_external(model, optimizer)
    with tracker:
        step()
    (peak,) = tracker.get_tracker_snapshot("peak").values()
    kinds = {str(getattr(k, "value", k)): v for k, v in peak.items()}
    return StepMemory(
        checkpointing=job.train.checkpoint_activations,
        measured=kinds["Total"],
        planned=plan.total,
        activations_measured=kinds["Activation"] + kinds["Temp"],
        activations_planned=plan.total - plan.parameters - plan.optimizer,
    )


def main(argv: list[str] | None = None) -> list[StepMemory]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="one JSON object per row")
    args = parser.parse_args(argv)
    rows = [measure_step(bench_job(mode)) for mode in CHECKPOINTING]
    for row in rows:
        if args.json:
            print(json.dumps(asdict(row) | {"ratio": row.ratio}))
        else:
            print(
                f"checkpointing {row.checkpointing:<6} measured {row.measured / 2**20:7.2f} MiB  "
                f"planned {row.planned / 2**20:7.2f} MiB  plan/measured {row.ratio:.2f}"
            )
    return rows


if __name__ == "__main__":
    main()
