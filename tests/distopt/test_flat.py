"""Flat parameter buffers on the owners: on by default for the elementwise compiled
optimizers, off with ``flat=False``; the same numbers as torch.optim either way."""
from typing import List

import pytest
import torch
import torch.distributed.autograd as dist_autograd
import torch.distributed.rpc as rpc

from distopt import DistributedOptimizer
from tests.distopt import remote

SHAPES = [(3, 4), (5,), (2, 2, 2), (7,), (4, 3), (6,)]
OWNERS = ["worker1", "worker1", "worker1", "worker2", "worker2", "worker2"]
#: Every parameter in the loss (a flat step), then parameter 1 left out (worker1's buffer
#: falls back to per-parameter steps), then every parameter again.
STEP_USES = [range(6), range(6), [0, 2, 3, 4, 5], range(6), range(6)]


def data(step: int, shape) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(50 + step))


def train(optimizer_class: type, rrefs: List[rpc.RRef], local: List[torch.Tensor], **kwargs):
    opt = DistributedOptimizer(optimizer_class, rrefs, **kwargs)
    reference = optimizer_class(local, **{k: v for k, v in kwargs.items() if k != "flat"})
    for step, uses in enumerate(STEP_USES):
        with dist_autograd.context() as ctx:
            terms = [
                rpc.rpc_sync(OWNERS[i], remote.remote_term, args=(rrefs[i], data(step, SHAPES[i]), False))
                for i in uses
            ]
            dist_autograd.backward(ctx, [torch.stack(terms).sum()])
            opt.step(ctx)
        reference.zero_grad(set_to_none=True)
        torch.stack([remote.term(local[i], data(step, SHAPES[i]), False) for i in uses]).sum().backward()
        reference.step()
    for i, rref in enumerate(rrefs):
        torch.testing.assert_close(rpc.rpc_sync(OWNERS[i], remote.value, args=(rref,)), local[i].detach())


def make(seed: int):
    rrefs = [rpc.remote(o, remote.make_param, args=(s, seed + i)) for i, (o, s) in enumerate(zip(OWNERS, SHAPES))]
    local = [r.to_here().detach().clone().requires_grad_(True) for r in rrefs]
    return rrefs, local


def storages(rrefs: List[rpc.RRef]) -> List[int]:
    return [rpc.rpc_sync(r.owner(), remote.storage_of, args=(r,)) for r in rrefs]


@pytest.mark.parametrize(
    "optimizer_class,kwargs",
    [(torch.optim.Adam, {"lr": 0.05, "weight_decay": 0.1}), (torch.optim.RAdam, {"lr": 0.05}),
     (torch.optim.Adagrad, {"lr": 0.1, "lr_decay": 0.01}),
     (torch.optim.SGD, {"lr": 0.1, "momentum": 0.9})],
    ids=["Adam", "RAdam", "Adagrad", "SGD"],
)
def test_owners_flatten_by_default_and_match_torch(world, optimizer_class, kwargs):
    rrefs, local = make(0)
    train(optimizer_class, rrefs, local, **kwargs)
    found = storages(rrefs)
    assert len(set(found[:3])) == 1 and len(set(found[3:])) == 1 and found[0] != found[3]


def test_flat_false_keeps_every_parameter_on_its_own(world):
    rrefs, local = make(10)
    train(torch.optim.Adam, rrefs, local, lr=0.05, flat=False)
    assert len(set(storages(rrefs))) == len(rrefs)


def test_flat_must_be_a_bool(world):
    rrefs, _ = make(20)
    with pytest.raises(TypeError, match="Invalid flat: 'yes' \\(expected True or False\\)"):
        DistributedOptimizer(torch.optim.Adam, rrefs, lr=0.1, flat="yes")
