"""Param groups as torch.optim's: per-group options, ``param_groups``, changes at the next step."""

import pytest
import torch
import torch.distributed.autograd as dist_autograd
import torch.distributed.rpc as rpc

from distopt import DistributedOptimizer, owner
from functional import functional_optim_map
from tests.distopt import harness, remote

# (class, defaults, options of group 0, options of group 1, changes made after step 2)
CASES = [
    (torch.optim.SGD, {"lr": 0.1, "momentum": 0.9}, {}, {"lr": 0.05, "weight_decay": 0.01},
     {"lr": 0.02, "momentum": 0.5, "weight_decay": 0.1}),
    (torch.optim.Adam, {"lr": 0.01}, {"betas": (0.8, 0.99)}, {"lr": 0.02, "weight_decay": 0.1},
     {"lr": 0.005, "betas": (0.5, 0.9), "weight_decay": 0.0, "eps": 1e-6}),
    (torch.optim.AdamW, {"lr": 0.01, "amsgrad": True}, {}, {"lr": 0.03},
     {"lr": 0.001, "betas": (0.7, 0.95), "weight_decay": 0.5}),
    (torch.optim.RMSprop, {"lr": 0.01, "momentum": 0.5}, {"alpha": 0.9}, {"lr": 0.005},
     {"lr": 0.02, "momentum": 0.1, "weight_decay": 0.01}),
]
IDS = [c[0].__name__ for c in CASES]


def run_case(case, monkeypatch, functional: bool) -> None:
    cls, defaults, opts0, opts1, changes = case
    if not functional:
        monkeypatch.delitem(functional_optim_map, cls)
    rrefs, local = harness.make_params()
    dist_opt = DistributedOptimizer(cls, harness.grouped(rrefs, [opts0, opts1]), **defaults)
    ref = cls(harness.grouped(local, [opts0, opts1]), **defaults)
    assert dist_opt.is_functional_optim is functional

    # The same keys and values as torch.optim's groups.
    for got, want in zip(dist_opt.param_groups, ref.param_groups):
        for key, value in want.items():
            if key == "params":
                continue
            if key == "decoupled_weight_decay" and functional:
                continue  # functional AdamW does not carry torch's internal flag
            assert key in got, key
            assert tuple(got[key]) == tuple(value) if isinstance(value, (tuple, list)) else (
                got[key] == value), (key, got[key], value)
    assert dist_opt.defaults.keys() >= {"lr"}

    def change(step: int, ctx: int) -> None:
        if step == 2:
            for group in (dist_opt.param_groups[1], ref.param_groups[1]):
                group.update(changes)
            dist_opt.param_groups[0]["lr"] *= 0.5
            ref.param_groups[0]["lr"] *= 0.5

    harness.train(dist_opt, ref, rrefs, local, 5, before_step=change)
    harness.assert_params_equal(rrefs, local, cls.__name__)


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_groups_match_torch_optim_compiled(world, monkeypatch, case):
    run_case(case, monkeypatch, functional=True)


@pytest.mark.parametrize("case", CASES[:2], ids=IDS[:2])
def test_groups_match_torch_optim_eager(world, monkeypatch, case):
    run_case(case, monkeypatch, functional=False)


def test_change_costs_no_extra_round(world, rpc_calls):
    rrefs = [rpc.remote(o, remote.make_ones, args=((4,),)) for o in ("worker1", "worker2")]
    opt = DistributedOptimizer(torch.optim.SGD, rrefs, lr=1.0)
    remote.sum_step(opt, rrefs)
    del rpc_calls[:]
    opt.param_groups[0]["lr"] = 0.25
    remote.sum_step(opt, rrefs)
    assert [c[1] for c in rpc_calls] == [owner.step_local_optimizer] * 2
    assert all(c[2][2] == [(0, "lr", 0.25)] for c in rpc_calls)
    for r in rrefs:  # 1 - 1.0 - 0.25
        got = rpc.rpc_sync(r.owner(), remote.value, args=(r,))
        assert torch.equal(got, torch.full((4,), -0.25))
    del rpc_calls[:]
    remote.sum_step(opt, rrefs)  # nothing changed: nothing piggybacked
    assert all(len(c[2]) == 2 for c in rpc_calls)


def test_fixed_hyperparameter_change_fails_before_any_owner(world, rpc_calls):
    [rref] = [rpc.remote("worker1", remote.make_ones, args=((4,),))]
    opt = DistributedOptimizer(torch.optim.Adam, [rref], lr=1.0)
    opt.param_groups[0]["amsgrad"] = True
    del rpc_calls[:]
    with dist_autograd.context() as ctx:
        with pytest.raises(ValueError, match=r"Invalid param_groups\[0\]\['amsgrad'\]: True"):
            opt.step(ctx)
    assert rpc_calls == []


@pytest.mark.parametrize(
    "params, error, match",
    [
        ([{"lr": 0.1}], ValueError, r"Invalid params_rref\[0\]: keys \['lr'\]"),
        ([{"params": []}], ValueError, r"Invalid params_rref\[0\]\['params'\]: \[\]"),
        ([{"params": [torch.ones(2)]}], TypeError, r"Invalid params_rref\[0\]\['params'\]\[0\]"),
    ],
    ids=["no-params", "empty", "tensor"],
)
def test_bad_groups_fail_before_any_owner(world, rpc_calls, params, error, match):
    with pytest.raises(error, match=match):
        DistributedOptimizer(torch.optim.SGD, params, lr=0.1)
    assert rpc_calls == []


def test_positional_arguments_and_group_options(world):
    # lr given positionally is the default; a group's own lr wins.
    rrefs, local = harness.make_params()
    opt = DistributedOptimizer(
        torch.optim.SGD, harness.grouped(rrefs, [{}, {"lr": 0.5}]), 0.1, 0.9
    )
    ref = torch.optim.SGD(harness.grouped(local, [{}, {"lr": 0.5}]), 0.1, 0.9)
    assert [g["lr"] for g in opt.param_groups] == [0.1, 0.5]
    assert [g["momentum"] for g in opt.param_groups] == [0.9, 0.9]
    harness.train(opt, ref, rrefs, local, 2)
    harness.assert_params_equal(rrefs, local)


def test_is_a_torch_optimizer_and_zero_grad_does_nothing(world):
    [rref] = [rpc.remote("worker1", remote.make_ones, args=((4,),))]
    opt = DistributedOptimizer(torch.optim.SGD, [rref], lr=1.0)
    assert isinstance(opt, torch.optim.Optimizer)
    opt.zero_grad()
    opt.zero_grad(set_to_none=False)
    remote.sum_step(opt, [rref])
    assert torch.equal(rpc.rpc_sync("worker1", remote.value, args=(rref,)), torch.zeros(4))
    with pytest.raises(NotImplementedError):
        opt.add_param_group({"params": [rref]})
