"""Concurrent trainers over one table lose no row update (the owners' per-parameter locks)."""
import threading
from typing import Any, Callable, List

import pytest
import torch
import torch.distributed.autograd as dist_autograd

from distopt.sparse import ShardedEmbedding, SparseSGD

STEPS = 15
THREADS = 3
INDICES = torch.tensor([0, 1, 1, 5, 9, 9, 9, 14])


def run_in_threads(targets: List[Callable[[], Any]]) -> None:
    errors: List[BaseException] = []

    def guarded(target: Callable[[], Any]) -> None:
        try:
            target()
        except BaseException as exc:  # reported in the test's thread
            errors.append(exc)

    threads = [threading.Thread(target=guarded, args=(t,)) for t in targets]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]


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
