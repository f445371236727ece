"""The training loop's one all-reduce per step (``speed.train.loop.StepSums``): packed, summed, unpacked."""

from __future__ import annotations

import torch
import torch.distributed as dist

from speed.train.loop import StepSums


def test_step_sums_survive_the_all_reduce_packing(tmp_path):
    """Through a real (one-process, gloo) all-reduce, each field comes back where it went in: a swapped offset
    would put the token count in a loss or the settle term in the out-of-time flag."""
    sums = StepSums(torch.tensor([3.5, 2.25, 1.125]), 1234.0, 1.0, torch.tensor(0.75), torch.tensor(2.5))
    assert sums.summed(1) is sums  # one worker: nothing to add up
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        total = sums.summed(2)  # the packed path (a group of one adds nothing)
    finally:
        dist.destroy_process_group()
    assert torch.equal(total.loop_losses, sums.loop_losses)
    assert (total.tokens, total.out_of_time, float(total.settle), float(total.objective)) == (1234.0, 1.0, 0.75, 2.5)
