"""What a ``torch.profiler`` trace shows of an RPC step (``distopt.profiling``).

The trainer's trace holds its fan-out, ``distopt.DistributedOptimizer.step``; each owner's
step, ``distopt.owner.step``, is recorded only by a profiler running in the owner's process
(torch 2.13 does not carry a trainer's profiler to the callee), on the exclusive
(TorchScript) path and on the locked (Python) path alike.
"""
import torch
import torch.distributed.rpc as rpc

from distopt import DistributedOptimizer, owner
from tests.distopt import remote

SHAPE = (64,)


def test_a_trace_shows_the_trainers_fan_out_and_each_owners_step(world, rpc_calls):
    owners = ("worker1", "worker2")
    rrefs = [rpc.remote(o, remote.make_ones, args=(SHAPE,)) for o in owners]
    opt = DistributedOptimizer(torch.optim.SGD, rrefs, lr=1.0)
    remote.sum_step(opt, rrefs)  # compiled before the profile
    for o in owners:
        rpc.rpc_sync(o, remote.start_profile)
    try:
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            del rpc_calls[:]
            remote.sum_step(opt, rrefs)  # exclusive: a TorchScript RPC, no Python there
            assert not any(func is owner.step_local_optimizer for _, func, _ in rpc_calls)
            opt.param_groups[0]["lr"] = 0.5  # the change travels on the locked path
            remote.sum_step(opt, rrefs)
            assert sum(func is owner.step_local_optimizer for _, func, _ in rpc_calls) == 2
    finally:
        on_owners = [rpc.rpc_sync(o, remote.stop_profile) for o in owners]
    trainer = [e.name for e in prof.events() if e.name.startswith("distopt.")]
    assert trainer.count("distopt.DistributedOptimizer.step") == 2, trainer
    assert "distopt.owner.step" not in trainer  # as distopt.profiling says
    for o, names in zip(owners, on_owners):
        assert names.count("distopt.owner.step") == 2, (o, names)
