"""The memory of one training step, measured on the CPU beside the memory plan, with and without activation
checkpointing, under DDP (one worker) and FSDP (two workers, gloo).

    PYTHONPATH=platform python -m speed.benchmarks.train_memory            # a table
    PYTHONPATH=platform python -m speed.benchmarks.train_memory --json     # one JSON object per row

A looped LM of Ouro's options (sandwich norm, loop norm, exit gate) at a small shape takes two optimizer steps
(AdamW) on random tokens; the second one's peak is measured with torch's ``MemTracker`` (every tensor storage
allocated and freed, by kind: parameters, gradients, optimizer state, activations, temporaries), in one process
with nothing else allocated, and compared with ``speed.train.memory_plan``'s peak for the same job. Under FSDP
(``speed.train.sharding``'s units) each of two processes on a gloo group measures its own step with
``FSDPMemTracker`` (``MemTracker`` that also sees FSDP's sharded and gathered parameters and its all-gather
buffers), on the same micro-batch per worker; rank 0's peak is the row's. About 20 s.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed._tools.mem_tracker import MemTracker

from speed.losses import loss_weights
from speed.models.family import build_model
from speed.models.looped_lm import CHECKPOINTING, next_token_labels
from speed.train.config import JobConfig, job_from_dict, job_to_dict
from speed.train.memory_plan import plan_memory
from speed.train.optim import build_optimizer
from speed.train.sharding import shard_model

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
    """One step's measured peak on one worker beside the plan's, in bytes."""

    strategy: str
    world: int
    checkpointing: str
    measured: int
    planned: int
    activations_measured: int  # the activations' and temporaries' part of the measured peak
    activations_planned: int

    @property
    def ratio(self) -> float:
        return self.planned / self.measured


def bench_job(
    checkpointing: str, micro_batch: int = 4, length: int = 64, strategy: str = "ddp", world: int = 1
) -> JobConfig:
    """The benchmark's job: ``MODEL`` finetuned on ``micro_batch`` sequences of 2 x ``length`` tokens per worker,
    over ``world`` workers with ``strategy``."""
    return job_from_dict(
        {
            "kind": "finetune",
            "model": MODEL,
            "data": {"task": "translate_en_de", "max_source_len": length, "max_target_len": length},
            "train": {"batch_size": micro_batch * world, "checkpoint_activations": checkpointing},
            "scale": {"num_workers": world, "strategy": strategy},
            "eval": None,
        }
    )


def measure_step(job: JobConfig) -> StepMemory:
    """The peak of a job's second step (float32, the CPU) measured on one worker, and its plan: in this process
    (DDP, one worker), or in ``job.scale.num_workers`` processes on a gloo group (FSDP; rank 0's)."""
    if job.scale.strategy == "fsdp":
        import torch.multiprocessing as mp

        with tempfile.TemporaryDirectory(prefix="speed-train-memory-") as scratch:
            out = Path(scratch) / "rank0.json"
            world = job.scale.num_workers
            mp.spawn(_fsdp_worker, args=(world, f"file://{scratch}/store", job_to_dict(job), str(out)), nprocs=world)
            return StepMemory(**json.loads(out.read_text()))
    torch.manual_seed(0)
    model = build_model(job.model).train()
    return _measured_step(job, model, MemTracker)


def _measured_step(job: JobConfig, model: torch.nn.Module, tracker_class: type) -> StepMemory:
    """Two steps of ``model`` (built, sharded if it is), the second under ``tracker_class``, beside the plan."""
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
    if tracker_class is MemTracker:
        tracker = MemTracker()
        tracker.track_external(model, optimizer)
    else:
        tracker = tracker_class(model, optimizer)
    with tracker:
        step()
    (peak,) = tracker.get_tracker_snapshot("peak").values()
    kinds = {str(getattr(k, "value", k)): v for k, v in peak.items()}
    return StepMemory(
        strategy=job.scale.strategy,
        world=job.scale.num_workers,
        checkpointing=job.train.checkpoint_activations,
        measured=kinds["Total"],
        planned=plan.total,
        activations_measured=kinds["Activation"] + kinds["Temp"],
        activations_planned=plan.total - plan.parameters - plan.optimizer,
    )


def _fsdp_worker(rank: int, world: int, init_method: str, job: dict, out: str) -> None:
    """One FSDP worker of ``measure_step``: the same weights on every rank, sharded, its own random tokens."""
    from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=world)
    try:
        config = job_from_dict(job)
        torch.manual_seed(0)
        model = shard_model(build_model(config.model).train(), world, torch.device("cpu"), bf16=False)
        torch.manual_seed(1 + rank)  # each worker its own micro-batch, as a data-parallel step has
        row = _measured_step(config, model, FSDPMemTracker)
        if rank == 0:
            Path(out).write_text(json.dumps(asdict(row)))
    finally:
        dist.destroy_process_group()


def bench_jobs() -> list[JobConfig]:
    """The benchmark's rows: every checkpointing mode under DDP on one worker, then under FSDP on two."""
    return [bench_job(mode, strategy=s, world=w) for s, w in (("ddp", 1), ("fsdp", 2)) for mode in CHECKPOINTING]


def main(argv: list[str] | None = None) -> list[StepMemory]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="one JSON object per row")
    args = parser.parse_args(argv)
    rows = [measure_step(job) for job in bench_jobs()]
    for row in rows:
        if args.json:
            print(json.dumps(asdict(row) | {"ratio": row.ratio}))
        else:
            print(
                f"{row.strategy} x{row.world}  checkpointing {row.checkpointing:<6} "
                f"measured {row.measured / 2**20:7.2f} MiB  planned {row.planned / 2**20:7.2f} MiB  "
                f"plan/measured {row.ratio:.2f}"
            )
    return rows


if __name__ == "__main__":
    main()
