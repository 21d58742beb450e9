"""DistributedOptimizer's results equal torch.optim's, on both paths, with None gradients.

Four parameters live on two owners. Each step leaves some parameters out of the loss (their
gradient is None) and one step leaves out all of worker2's, so worker2 takes no part in
that backward pass. The same steps run locally with torch.optim on copies.
"""
from typing import Any, Dict, List, Tuple

import pytest
import torch
import torch.distributed.autograd as dist_autograd
import torch.distributed.rpc as rpc

from distopt import DistributedOptimizer, owner
from functional import functional_optim_map, register_functional_optimizer
from tests.distopt import remote
from tests.functional.test_complex import COMPLEX_OPTIONS

SHAPES = ((5, 3), (4, 2), (6, 3), (3, 2))
OWNERS = ("worker1", "worker1", "worker2", "worker2")
# Parameters in each step's loss: step 2 leaves worker2 out of the context entirely.
STEP_USES = ((0, 1, 2, 3), (1, 3), (0, 1), (0, 2, 3), (0, 1, 2, 3))


def parity_args(torch_cls: type) -> Tuple[Dict[str, Any], Dict[str, Any], bool]:
    """(kwargs, reference kwargs, sparse) from the functional parity table's richest case.

    Dense float32 cases are preferred; a class with only sparse cases (SparseAdam) gets its
    sparse one; a class with no case (a user's registration) runs on its defaults.
    """
    from tests.functional.cases import ALL_CASES  # here: a broken table fails only these tests

    rows = [
        c for c in ALL_CASES
        if c.torch_cls is torch_cls and c.dtype == torch.float32 and c.torch_kwargs is None
    ]
    dense = [c for c in rows if not c.sparse]
    pool = dense or rows
    if not pool:
        return {}, {}, False
    case = max(pool, key=lambda c: len(c.kwargs))
    return case.kwargs_copy(), case.torch_kwargs_copy(), case.sparse


def step_data(step: int, shape: Tuple[int, ...], sparse: bool) -> torch.Tensor:
    gen = torch.Generator().manual_seed(100 + step * 7 + shape[0])
    if sparse:
        rows = shape[0]
        return torch.tensor([step % rows, (step + 2) % rows, step % rows])
    return torch.randn(shape, generator=gen)


def run_parity(
    optimizer_class: type,
    kwargs: Dict[str, Any],
    torch_kwargs: Dict[str, Any],
    sparse: bool,
    expect_functional: bool,
) -> None:
    rrefs = [
        rpc.remote(o, remote.make_param, args=(s, i))
        for i, (o, s) in enumerate(zip(OWNERS, SHAPES))
    ]
    local: List[torch.Tensor] = [r.to_here().detach().clone().requires_grad_(True) for r in rrefs]
    dist_opt = DistributedOptimizer(optimizer_class, rrefs, **kwargs)
    assert dist_opt.is_functional_optim is expect_functional
    reference = optimizer_class(local, **torch_kwargs)

    for step, uses in enumerate(STEP_USES):
        data = [step_data(step, s, sparse) for s in SHAPES]
        with dist_autograd.context() as ctx:
            terms = [
                rpc.rpc_sync(OWNERS[i], remote.remote_term, args=(rrefs[i], data[i], sparse))
                for i in uses
            ]
            dist_autograd.backward(ctx, [torch.stack(terms).sum()])
            dist_opt.step(ctx)

        reference.zero_grad(set_to_none=True)
        torch.stack([remote.term(local[i], data[i], sparse) for i in uses]).sum().backward()
        reference.step()

    for i, rref in enumerate(rrefs):
        torch.testing.assert_close(
            rpc.rpc_sync(OWNERS[i], remote.value, args=(rref,)), local[i].detach(),
            msg=lambda m, i=i: f"parameter {i} on {OWNERS[i]}: {m}",
        )


@pytest.mark.parametrize("optimizer_class", list(functional_optim_map), ids=lambda c: c.__name__)
def test_functional_path_matches_torch_optim(world, optimizer_class):
    kwargs, torch_kwargs, sparse = parity_args(optimizer_class)
    run_parity(optimizer_class, kwargs, torch_kwargs, sparse, expect_functional=True)


@pytest.mark.parametrize("dtype", [torch.complex64, torch.complex128], ids=str)
@pytest.mark.parametrize("name", sorted(COMPLEX_OPTIONS))
def test_complex_parameters_match_torch_optim(world, name, dtype):
    """Complex parameters on two owners (beside a real one) step as torch.optim steps them,
    with gradients read from the dist_autograd context."""
    optimizer_class = getattr(torch.optim, name)
    kwargs = COMPLEX_OPTIONS[name]
    rrefs = [
        rpc.remote(o, remote.make_complex_param, args=(s, i, dtype))
        for i, (o, s) in enumerate(zip(OWNERS[:3], SHAPES[:3]))
    ]
    rrefs.append(rpc.remote(OWNERS[3], remote.make_param, args=(SHAPES[3], 3)))
    local = [r.to_here().detach().clone().requires_grad_(True) for r in rrefs]
    dist_opt = DistributedOptimizer(optimizer_class, rrefs, **kwargs)
    assert dist_opt.is_functional_optim
    reference = optimizer_class(local, **kwargs)
    for step, uses in enumerate(STEP_USES):
        gen = torch.Generator().manual_seed(200 + step)
        data = [torch.randn(s, generator=gen, dtype=p.dtype) for s, p in zip(SHAPES, local)]
        with dist_autograd.context() as ctx:
            terms = [
                rpc.rpc_sync(OWNERS[i], remote.remote_complex_term, args=(rrefs[i], data[i]))
                for i in uses
            ]
            dist_autograd.backward(ctx, [torch.stack(terms).sum()])
            dist_opt.step(ctx)
        reference.zero_grad(set_to_none=True)
        torch.stack([remote.complex_term(local[i], data[i]) for i in uses]).sum().backward()
        reference.step()
    for i, rref in enumerate(rrefs):
        torch.testing.assert_close(
            rpc.rpc_sync(OWNERS[i], remote.value, args=(rref,)), local[i].detach(),
            msg=lambda m, i=i: f"parameter {i} on {OWNERS[i]}: {m}",
        )


def test_eager_path_matches_torch_optim(world, monkeypatch):
    # Without a functional stand-in, torch.optim.SGD itself runs on the owners.
    monkeypatch.delitem(functional_optim_map, torch.optim.SGD)
    kwargs = {"lr": 0.1, "momentum": 0.9, "weight_decay": 0.01}
    run_parity(torch.optim.SGD, kwargs, dict(kwargs), False, expect_functional=False)


def test_eager_path_runs_custom_optimizer(world):
    run_parity(remote.PlainSGD, {"lr": 0.2}, {"lr": 0.2}, False, expect_functional=False)


def test_eager_path_with_sparse_gradients(world, monkeypatch):
    monkeypatch.delitem(functional_optim_map, torch.optim.SGD)
    kwargs = {"lr": 0.1, "momentum": 0.9}
    run_parity(torch.optim.SGD, kwargs, dict(kwargs), True, expect_functional=False)


def test_users_registration_takes_the_functional_path(world, monkeypatch):
    # Registered on the trainer only: owners receive the functional class itself.
    monkeypatch.setitem(functional_optim_map, remote.PlainSGD, remote.FunctionalPlainSGD)
    register_functional_optimizer(remote.PlainSGD, remote.FunctionalPlainSGD)
    run_parity(remote.PlainSGD, {"lr": 0.2}, {"lr": 0.2}, False, expect_functional=True)


@pytest.mark.parametrize(
    "optimizer_class", [torch.optim.SGD, remote.PlainSGD], ids=["compiled", "eager"]
)
def test_parameters_owned_by_the_trainer_itself(world, optimizer_class):
    mine = rpc.RRef(torch.ones(4, requires_grad=True))
    [theirs] = [rpc.remote("worker1", remote.make_ones, args=((4,),))]
    optimizer = DistributedOptimizer(optimizer_class, [mine, theirs], lr=1.0)
    remote.sum_step(optimizer, [mine, theirs])
    assert torch.equal(mine.local_value().detach(), torch.zeros(4))
    assert torch.equal(rpc.rpc_sync("worker1", remote.value, args=(theirs,)), torch.zeros(4))


def test_set_hyperparameter_reaches_the_compiled_optimizer(world):
    [rref] = [rpc.remote("worker1", remote.make_ones, args=((4,),))]
    optimizer = DistributedOptimizer(torch.optim.SGD, [rref], lr=1.0)
    local_optimizer = optimizer.remote_optimizers[0]
    rpc.rpc_sync("worker1", owner.set_local_hyperparameter, args=(local_optimizer, "lr", [0.25]))
    remote.sum_step(optimizer, [rref])
    assert torch.equal(rpc.rpc_sync("worker1", remote.value, args=(rref,)), torch.full((4,), 0.75))
    # a float alone stands for [0.5], as the functional classes take it
    rpc.rpc_sync("worker1", owner.set_local_hyperparameter, args=(local_optimizer, "lr", 0.5))
    remote.sum_step(optimizer, [rref])
    assert torch.equal(rpc.rpc_sync("worker1", remote.value, args=(rref,)), torch.full((4,), 0.25))
