"""The exclusive fast path: unshared compiled optimizers step with no Python on the owner.

Values are exact: SGD with lr=1 on parameters of ones, whose gradients are ones, leaves
``1 - (number of steps)`` in every element. The trainer's RPCs (``rpc_calls``) tell which
path each step took: ``distopt.owner.step_local_optimizer`` is the locked Python path.
"""
import threading
from typing import Any, List

import pytest
import torch
import torch.distributed.rpc as rpc

from distopt import DistributedOptimizer, DistributedOptimizerError, exclusive, owner
from tests.distopt import remote
from tests.distopt.test_concurrency import run_in_threads

SHAPE = (64,)
STEPS = 10


def ones_on(*owners: str) -> List[rpc.RRef]:
    return [rpc.remote(o, remote.make_ones, args=(SHAPE,)) for o in owners]


def value(rref: rpc.RRef) -> torch.Tensor:
    return rpc.rpc_sync(rref.owner(), remote.value, args=(rref,))


def python_steps(rpc_calls: List[Any], opt: DistributedOptimizer) -> List[int]:
    """How many of ``opt``'s steps the trainer sent each owner through the locked path."""
    return [
        sum(
            1 for to, func, args in rpc_calls
            if func is owner.step_local_optimizer and to.name == p.name and args[0] == p.id
        )
        for p in opt.owners
    ]


def exclusive_on_owners(opt: DistributedOptimizer) -> List[bool]:
    return [rpc.rpc_sync(p.info, remote.is_exclusive, args=(p.rref,)) for p in opt.owners]


def train(opt: DistributedOptimizer, rrefs: List[rpc.RRef], steps: int) -> None:
    for _ in range(steps):
        remote.sum_step(opt, rrefs)


def test_unshared_compiled_optimizer_runs_no_python_step(world, rpc_calls):
    rrefs = ones_on("worker1", "worker2")
    opt = DistributedOptimizer(torch.optim.SGD, rrefs, lr=1.0)
    assert exclusive_on_owners(opt) == [True, True]
    train(opt, rrefs, STEPS)
    assert python_steps(rpc_calls, opt) == [0, 0]
    for r in rrefs:
        assert torch.equal(value(r), torch.full(SHAPE, 1.0 - STEPS))

    # A hyper-parameter change travels with the next step, through the Python path.
    opt.param_groups[0]["lr"] = 0.5
    train(opt, rrefs, 2)
    assert python_steps(rpc_calls, opt) == [1, 1]
    for r in rrefs:
        assert torch.equal(value(r), torch.full(SHAPE, 1.0 - STEPS - 1.0))


def test_eager_and_shared_optimizers_are_not_exclusive(world, rpc_calls):
    [rref] = ones_on("worker1")
    eager = DistributedOptimizer(remote.PlainSGD, [rref], lr=1.0)
    assert exclusive_on_owners(eager) == [False]
    compiled = DistributedOptimizer(torch.optim.SGD, [rref], lr=1.0)
    assert exclusive_on_owners(compiled) == [False]
    train(compiled, [rref], 2)
    assert python_steps(rpc_calls, compiled) == [2]


@pytest.mark.parametrize("second_trainer", ["here", "worker2"])
def test_sharing_optimizer_revokes_and_no_update_is_lost(world, rpc_calls, second_trainer):
    p, q = ones_on("worker1", "worker1")
    first = DistributedOptimizer(torch.optim.SGD, [p, q], lr=1.0)
    train(first, [p, q], 1)
    assert python_steps(rpc_calls, first) == [0]

    def second() -> None:
        if second_trainer == "here":
            train(DistributedOptimizer(torch.optim.SGD, [p], lr=1.0), [p], STEPS)
        else:
            rpc.rpc_sync(
                second_trainer, remote.train_sum_steps,
                args=(torch.optim.SGD, [p], STEPS, {"lr": 1.0}),
            )

    # Concurrent: the second optimizer may be created while the first one steps.
    run_in_threads([lambda: train(first, [p, q], STEPS), second])

    assert first.owners[0].script is None
    assert exclusive_on_owners(first) == [False]
    assert torch.equal(value(p), torch.full(SHAPE, 1.0 - 1 - 2 * STEPS))
    assert torch.equal(value(q), torch.full(SHAPE, 1.0 - 1 - STEPS))


@pytest.mark.parametrize("sharer", [torch.optim.SGD, remote.PlainSGD], ids=["compiled", "eager"])
def test_revocation_while_the_first_trainer_steps_in_a_loop(world, rpc_calls, sharer):
    [p] = ones_on("worker1")
    first = DistributedOptimizer(torch.optim.SGD, [p], lr=1.0)
    stepped = threading.Condition()
    counts = {"first": 0}
    stop = threading.Event()

    def loop() -> None:
        while not stop.is_set():
            remote.sum_step(first, [p])
            with stepped:
                counts["first"] += 1
                stepped.notify_all()

    def wait_for(n: int) -> None:
        with stepped:
            stepped.wait_for(lambda: counts["first"] >= n)

    looper = threading.Thread(target=loop)
    looper.start()
    try:
        wait_for(3)  # the loop runs on the exclusive path
        second = DistributedOptimizer(sharer, [p], lr=1.0)
        with stepped:
            switched_at = counts["first"]
        wait_for(switched_at + 3)  # and goes on, through the locks
        train(second, [p], STEPS)
    finally:
        stop.set()
        looper.join()

    total = counts["first"]
    assert torch.equal(value(p), torch.full(SHAPE, 1.0 - total - STEPS))
    # At most the step in flight during the switch went unlocked after it began.
    assert total - switched_at - 1 <= python_steps(rpc_calls, first)[0] <= total - 3
    assert python_steps(rpc_calls, second)[0] == STEPS


def test_replacing_an_optimizer_keeps_the_exclusive_path(world, rpc_calls):
    [p] = ones_on("worker1")
    first = DistributedOptimizer(torch.optim.SGD, [p], lr=1.0)
    train(first, [p], 1)
    # Its local optimizer outlives it here, so the owner finds a sharer whose trainer
    # has collected it: that one is released, and the new one is alone again.
    first_local = first.owners[0].rref
    del first
    second = DistributedOptimizer(torch.optim.SGD, [p], lr=1.0)
    assert exclusive_on_owners(second) == [True]
    assert rpc.rpc_sync("worker1", remote.live_count_for, args=(p,)) == 1
    assert not rpc.rpc_sync("worker1", remote.is_exclusive, args=(first_local,))
    train(second, [p], 2)
    assert python_steps(rpc_calls, second) == [0]
    assert torch.equal(value(p), torch.full(SHAPE, -2.0))


def test_unreachable_trainer_is_passed_over_and_its_unlocked_steps_refused(world):
    [p] = ones_on("worker1")
    orphan, script = rpc.rpc_sync("worker1", remote.orphan_exclusive, args=(p,))
    assert script is not None and rpc.rpc_sync("worker1", remote.is_exclusive, args=(orphan,))

    opt = DistributedOptimizer(torch.optim.SGD, [p], lr=1.0)  # logs on worker1, goes on
    assert not rpc.rpc_sync("worker1", remote.is_exclusive, args=(orphan,))
    with pytest.raises(Exception, match="Invalid step: local optimizer"):
        rpc.rpc_sync("worker1", exclusive.script_step, args=(script, 0))
    train(opt, [p], 2)
    assert torch.equal(value(p), torch.full(SHAPE, -1.0))


def test_failure_on_the_exclusive_path_names_the_worker(world):
    rrefs = ones_on("worker1", "worker2")
    opt = DistributedOptimizer(torch.optim.SGD, rrefs, lr=1.0)
    part = opt.owners[1]
    rpc.rpc_sync(part.info, remote.refuse_unlocked_steps, args=(part.rref, "Invalid step: test"))
    with pytest.raises(DistributedOptimizerError) as info:
        remote.sum_step(opt, rrefs)
    assert info.value.failures == {"worker2": "RuntimeError: Invalid step: test"}
    assert str(info.value).splitlines()[1] == "  worker2: RuntimeError: Invalid step: test"
    assert info.value.succeeded == ["worker1"]  # worker1 applied the step, as its value shows
    assert torch.equal(value(rrefs[0]), torch.zeros(SHAPE))
    assert torch.equal(value(rrefs[1]), torch.ones(SHAPE))
