"""Concurrent trainers lose no update; disjoint parameters step in parallel; no deadlock.

Values are exact: SGD with lr=1 on a parameter of ones, whose gradient is ones, leaves
``1 - (number of steps)`` in every element.
"""
import threading
from typing import List

import pytest
import torch
import torch.distributed.rpc as rpc

from distopt import DistributedOptimizer
from tests.distopt import remote
from tests.helpers import run_in_threads

STEPS = 20
SHAPE = (1024, 1024)


@pytest.mark.parametrize(
    "optimizer_class, functional",
    [(torch.optim.SGD, True), (remote.PlainSGD, False)],
    ids=["compiled", "eager"],
)
def test_concurrent_trainers_lose_no_update(world, optimizer_class, functional):
    rref = rpc.remote("worker1", remote.make_ones, args=(SHAPE,))
    kwargs = {"lr": 1.0}
    # Two trainers on other workers and two threads here, all over the same parameter.
    remote_trainers = [
        rpc.rpc_async(w, remote.train_sum_steps, args=(optimizer_class, [rref], STEPS, kwargs))
        for w in ("worker2", "worker3")
    ]
    paths: List[bool] = []
    run_in_threads(
        [lambda: paths.append(remote.train_sum_steps(optimizer_class, [rref], STEPS, kwargs))] * 2
    )
    paths.extend(f.wait() for f in remote_trainers)

    assert paths == [functional] * 4
    expected = torch.full(SHAPE, 1.0 - 4 * STEPS)
    assert torch.equal(rpc.rpc_sync("worker1", remote.value, args=(rref,)), expected)


def test_overlapping_parameter_sets_do_not_deadlock(world):
    a, b, c = (rpc.remote("worker1", remote.make_ones, args=((64,),)) for _ in range(3))
    # One optimizer per parameter first, so that each gets a lock of its own.
    singles = [DistributedOptimizer(torch.optim.SGD, [p], lr=1.0) for p in (a, b, c)]
    assert not rpc.rpc_sync("worker1", remote.same_lock, args=(a, b))
    pairs = [[a, b], [b, c], [c, a]]
    run_in_threads(
        [
            lambda ps=ps: remote.train_sum_steps(torch.optim.SGD, ps, STEPS, {"lr": 1.0})
            for ps in pairs
        ]
    )
    for p in (a, b, c):
        # Each parameter is in two of the pairs.
        assert torch.equal(
            rpc.rpc_sync("worker1", remote.value, args=(p,)), torch.full((64,), 1.0 - 2 * STEPS)
        )
    del singles


@pytest.mark.parametrize(
    "optimizer_class", [torch.optim.SGD, remote.PlainSGD], ids=["compiled", "eager"]
)
def test_disjoint_parameters_step_while_another_is_locked(world, optimizer_class):
    a = rpc.remote("worker1", remote.make_ones, args=((8,),))
    b = rpc.remote("worker1", remote.make_ones, args=((8,),))
    opt_a = DistributedOptimizer(optimizer_class, [a], lr=1.0)
    opt_a2 = DistributedOptimizer(optimizer_class, [a], lr=1.0)
    opt_b = DistributedOptimizer(optimizer_class, [b], lr=1.0)
    assert rpc.rpc_sync("worker1", remote.same_lock, args=(a, a))
    assert not rpc.rpc_sync("worker1", remote.same_lock, args=(a, b))

    rpc.rpc_sync("worker1", remote.hold_lock, args=(a,))
    blocked = threading.Thread(target=remote.sum_step, args=(opt_a2, [a]))
    try:
        blocked.start()
        # b's lock is free: this step completes although a's lock is held.
        remote.sum_step(opt_b, [b])
        assert torch.equal(rpc.rpc_sync("worker1", remote.value, args=(b,)), torch.zeros(8))
        # a's step cannot have run: its lock is still held.
        assert torch.equal(rpc.rpc_sync("worker1", remote.value, args=(a,)), torch.ones(8))
    finally:
        rpc.rpc_sync("worker1", remote.release_lock, args=(a,))
        blocked.join()
    assert torch.equal(rpc.rpc_sync("worker1", remote.value, args=(a,)), torch.zeros(8))
    remote.sum_step(opt_a, [a])
    assert torch.equal(rpc.rpc_sync("worker1", remote.value, args=(a,)), -torch.ones(8))
