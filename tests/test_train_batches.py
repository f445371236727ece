"""Data sharding is a pure function of (seed, step): shards tile the global batch, epochs are permutations."""

import numpy as np
import pytest

from speed.train.batches import BatchPlan, Permutation


def test_rank_shards_tile_the_one_worker_global_batch():
    lengths = list(range(1, 101))
    one = BatchPlan(lengths, global_batch=8, seed=3)
    for step in (0, 5, 12, 30):  # 30 is in the third epoch
        expected = one.global_batch_at(step)
        shards = [BatchPlan(lengths, 8, world_size=2, rank=r, grad_accum=2, seed=3).micro_batches(step) for r in (0, 1)]
        flat = np.concatenate([m for shard in shards for m in shard])
        assert flat.tolist() == expected.tolist()
        assert [len(m) for shard in shards for m in shard] == [2, 2, 2, 2]


@pytest.mark.parametrize("group", [False, True])
def test_each_epoch_is_a_permutation_and_the_order_replays(group):
    lengths = np.random.default_rng(0).integers(1, 50, size=103).tolist()
    plan = BatchPlan(lengths, global_batch=10, seed=7, group_by_length=group)
    assert plan.steps_per_epoch == 10
    epoch0 = np.concatenate([plan.global_batch_at(s) for s in range(10)])
    assert len(set(epoch0.tolist())) == 100  # no repeats; 3 examples dropped
    epoch1 = np.concatenate([plan.global_batch_at(s) for s in range(10, 20)])
    assert epoch1.tolist() != epoch0.tolist()
    assert [plan.epoch_at(s) for s in (0, 9, 10, 25)] == [0, 0, 1, 2]
    fresh = BatchPlan(lengths, global_batch=10, seed=7, group_by_length=group)  # a resumed run: no history
    assert fresh.global_batch_at(14).tolist() == plan.global_batch_at(14).tolist()
    other_seed = BatchPlan(lengths, global_batch=10, seed=8, group_by_length=group)
    assert other_seed.global_batch_at(0).tolist() != plan.global_batch_at(0).tolist()


def test_grouping_by_length_cuts_padding():
    lengths = np.random.default_rng(1).integers(5, 60, size=2000)

    def padding(plan):
        batches = [lengths[plan.global_batch_at(s)] for s in range(plan.steps_per_epoch)]
        return sum(int(b.max() * len(b) - b.sum()) for b in batches)

    plain = BatchPlan(lengths.tolist(), 16, seed=0)
    grouped = BatchPlan(lengths.tolist(), 16, seed=0, group_by_length=True)
    assert padding(grouped) < 0.2 * padding(plain)


def test_invalid_plans_are_refused():
    with pytest.raises(ValueError, match="does not split into 3 workers"):
        BatchPlan([1] * 20, 8, world_size=3)
    with pytest.raises(ValueError, match="cannot fill one global batch"):
        BatchPlan([1] * 5, 8)
    with pytest.raises(ValueError, match="rank 2 outside"):
        BatchPlan([1] * 20, 8, world_size=2, rank=2)


@pytest.mark.parametrize("n", [1, 2, 3, 5, 64, 100, 1000, 4097])
def test_permutation_is_a_bijection_computed_at_any_position(n):
    order = Permutation(n, (3, 0))
    everything = order(np.arange(n))
    assert sorted(everything.tolist()) == list(range(n))
    positions = np.array([n - 1, 0, n // 2])
    assert order(positions).tolist() == everything[positions].tolist()  # no state: any position, any order
    assert Permutation(n, (3, 0))(np.arange(n)).tolist() == everything.tolist()
    if n >= 64:
        assert Permutation(n, (3, 1))(np.arange(n)).tolist() != everything.tolist()
        assert abs(np.corrcoef(np.arange(n), everything)[0, 1]) < 0.3  # shuffled, not a near-identity


def test_a_plan_reads_lengths_lazily():
    class Counted:
        """Lengths that count how many are looked up: the plan must not read them all."""

        looked_up = 0

        def __len__(self):
            return 10_000_000

        def __getitem__(self, indices):
            Counted.looked_up += len(indices)
            return np.asarray(indices) % 97

    plan = BatchPlan(Counted(), 32, world_size=2, rank=1, seed=1, group_by_length=True)
    batches = [plan.micro_batches(step)[0] for step in (0, 1, 312_499)]
    assert all(len(b) == 16 and b.max() < 10_000_000 for b in batches)
    assert Counted.looked_up <= 3 * 32 * 50  # one grouping window per step at most
