"""duplicates="mean": lookups are recorded on the owners, consumed by the step, pruned when
their context ends without one."""
import torch
import torch.distributed.autograd as dist_autograd
import torch.distributed.rpc as rpc

from distopt.sparse import ShardedEmbedding, SparseSGD, _owner
from tests.distopt.sparse import remote


def records(worker: str) -> int:
    return rpc.rpc_sync(worker, remote.tracked_records)


def test_repeated_lookups_across_calls_are_averaged_and_records_consumed(world):
    emb = ShardedEmbedding.from_pretrained(torch.zeros(4, 1), ["worker1", "worker2"])
    opt = SparseSGD([emb], lr=1.0, duplicates="mean")
    before = [records(w) for w in emb.owners]
    with dist_autograd.context() as ctx:
        # Row 0: gradients 1, 2 (one call) and 3, 4 (two more calls); row 3: 5.
        a = emb(torch.tensor([0, 0]))
        b = emb(torch.tensor([0]))
        c = emb(torch.tensor([3, 0]))
        w = torch.tensor([[1.0], [2.0]])
        loss = (a * w).sum() + 3 * b.sum() + (c * torch.tensor([[5.0], [4.0]])).sum()
        dist_autograd.backward(ctx, [loss])
        assert [records(w) for w in emb.owners] == [before[0] + 1, before[1] + 1]
        opt.step(ctx)
        assert [records(w) for w in emb.owners] == before
    assert emb.full_weight().reshape(-1).tolist() == [-2.5, 0.0, 0.0, -5.0]


def test_sum_optimizer_over_a_tracked_table_still_sums(world):
    emb = ShardedEmbedding.from_pretrained(torch.zeros(4, 1), ["worker1", "worker2"])
    SparseSGD([emb], lr=1.0, duplicates="mean")
    summing = SparseSGD([emb], lr=1.0)
    with dist_autograd.context() as ctx:
        dist_autograd.backward(ctx, [emb(torch.tensor([1, 1, 2])).sum()])
        summing.step(ctx)
    assert emb.full_weight().reshape(-1).tolist() == [0.0, -2.0, -1.0, 0.0]


def test_records_of_ended_contexts_are_pruned(world):
    # Runs here, on the trainer, which has the owner module too: fake dead context ids.
    dead = 1 << 40
    start = _owner.tracked_records()
    for i in range(_owner._prune_at[0] + 1):
        _owner._record(dead + i, 0, torch.tensor([0]))
    assert _owner.tracked_records() <= start
