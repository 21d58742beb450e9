"""Concurrent trainers over one table lose no row update (the owners' per-parameter locks)."""
import pytest
import torch
import torch.distributed.autograd as dist_autograd

from distopt.sparse import ShardedEmbedding, SparseSGD
from tests.helpers import run_in_threads

STEPS = 15
THREADS = 3
INDICES = torch.tensor([0, 1, 1, 5, 9, 9, 9, 14])


@pytest.mark.parametrize(
    "partition, duplicates", [("range", "sum"), ("hash", "sum"), ("hash", "mean")]
)
def test_concurrent_trainers_lose_no_row_update(world, partition, duplicates):
    emb = ShardedEmbedding.from_pretrained(torch.zeros(16, 4), ["worker1", "worker2"],
                                           partition=partition)

    def trainer() -> None:
        opt = SparseSGD([emb], lr=1.0, duplicates=duplicates)
        for _ in range(STEPS):
            with dist_autograd.context() as ctx:
                dist_autograd.backward(ctx, [emb(INDICES).sum()])
                opt.step(ctx)

    run_in_threads([trainer] * THREADS)
    # Each lookup of a row adds 1 to its gradient: summed, a row's gradient is its count.
    per_step = torch.bincount(INDICES, minlength=16).float()
    if duplicates == "mean":
        per_step = (per_step > 0).float()
    expected = (-THREADS * STEPS * per_step).unsqueeze(1).expand(16, 4)
    assert torch.equal(emb.full_weight(), expected)
