"""torch.optim.lr_scheduler drives a DistributedOptimizer unchanged, step for step.

Each case builds the same scheduler over a DistributedOptimizer and over a local torch.optim
optimizer on copies of the parameters (two param groups, each spanning both owners), and
checks every step that the learning rates (and cycled momentum) and the parameters agree.
"""
from typing import Any, Dict

import pytest
import torch
import torch.distributed.autograd as dist_autograd
from torch.optim import lr_scheduler as sched

from distopt import DistributedOptimizer
from functional import functional_optim_map
from tests.distopt import harness

STEPS = 8
SGD = (torch.optim.SGD, {"lr": 0.1, "momentum": 0.9})
ADAM = (torch.optim.Adam, {"lr": 0.01})

# name -> (optimizer, scheduler factory)
CASES: Dict[str, Any] = {
    "StepLR": (SGD, lambda o: sched.StepLR(o, step_size=2, gamma=0.5)),
    "MultiStepLR": (ADAM, lambda o: sched.MultiStepLR(o, milestones=[2, 5], gamma=0.3)),
    "ExponentialLR": (SGD, lambda o: sched.ExponentialLR(o, gamma=0.8)),
    "CosineAnnealingLR": (ADAM, lambda o: sched.CosineAnnealingLR(o, T_max=5, eta_min=1e-3)),
    "LambdaLR": (SGD, lambda o: sched.LambdaLR(o, [lambda e: 1 / (e + 1), lambda e: 0.9 ** e])),
    "OneCycleLR-Adam": (
        ADAM, lambda o: sched.OneCycleLR(o, max_lr=[0.05, 0.02], total_steps=STEPS + 1)
    ),
    "OneCycleLR-SGD": (
        SGD, lambda o: sched.OneCycleLR(o, max_lr=0.3, total_steps=STEPS + 1, pct_start=0.4)
    ),
    "CyclicLR-SGD": (
        SGD, lambda o: sched.CyclicLR(o, base_lr=0.01, max_lr=0.2, step_size_up=3)
    ),
    "CyclicLR-Adam": (
        ADAM, lambda o: sched.CyclicLR(o, base_lr=0.001, max_lr=0.05, step_size_up=2,
                                       mode="triangular2")
    ),
    "SequentialLR": (
        SGD,
        lambda o: sched.SequentialLR(
            o,
            [sched.LinearLR(o, start_factor=0.2, total_iters=3), sched.ExponentialLR(o, 0.7)],
            milestones=[3],
        ),
    ),
    "ReduceLROnPlateau": (
        ADAM, lambda o: sched.ReduceLROnPlateau(o, mode="max", factor=0.5, patience=0)
    ),
}
GROUP_OPTIONS = [{}, {"lr": 0.05}]


def run(name: str) -> None:
    (cls, kwargs), make = CASES[name]
    rrefs, local = harness.make_params()
    dist_opt = DistributedOptimizer(cls, harness.grouped(rrefs, GROUP_OPTIONS), **kwargs)
    ref = cls(harness.grouped(local, GROUP_OPTIONS), **kwargs)
    dist_sched, ref_sched = make(dist_opt), make(ref)
    momentum_key = "betas" if "betas" in ref.defaults else "momentum"
    seen = {tuple(g["lr"] for g in dist_opt.param_groups)}
    for step in range(STEPS):
        with dist_autograd.context() as ctx:
            loss = harness.backward(step, rrefs, local, ctx)
            dist_opt.step(ctx)
        ref.step()
        if isinstance(ref_sched, sched.ReduceLROnPlateau):
            dist_sched.step(loss)  # "max": the loss rises, so the lr is cut
            ref_sched.step(loss)
        else:
            dist_sched.step()
            ref_sched.step()
        for key in ("lr", momentum_key):
            got = [g[key] for g in dist_opt.param_groups]
            want = [g[key] for g in ref.param_groups]
            assert got == want, (step, key, got, want)
        harness.assert_params_equal(rrefs, local, f"{name} step {step}:")
        seen.add(tuple(g["lr"] for g in dist_opt.param_groups))
    assert len(seen) > 2, seen  # the schedule did change the learning rates
    assert dist_sched.get_last_lr() == ref_sched.get_last_lr()


@pytest.mark.parametrize("name", list(CASES))
def test_scheduler_matches_torch_optim(world, name):
    run(name)


@pytest.mark.parametrize("name", ["StepLR", "OneCycleLR-SGD"])
def test_scheduler_on_the_eager_path(world, monkeypatch, name):
    monkeypatch.delitem(functional_optim_map, torch.optim.SGD)
    run(name)


def test_scheduler_state_dict_round_trip(world):
    (cls, kwargs), make = CASES["OneCycleLR-SGD"]
    rrefs, local = harness.make_params()
    dist_opt = DistributedOptimizer(cls, harness.grouped(rrefs, GROUP_OPTIONS), **kwargs)
    s = make(dist_opt)
    with dist_autograd.context() as ctx:
        harness.backward(0, rrefs, local, ctx)
        dist_opt.step(ctx)
    s.step()
    again = make(dist_opt)
    again.load_state_dict(s.state_dict())
    assert again.last_epoch == s.last_epoch


def test_step_hooks_run_around_every_step(world):
    """register_step_pre_hook / post_hook, as on torch.optim (they failed before: the hook
    dicts must be weak-referenceable, as torch's OrderedDicts are)."""
    rrefs, local = harness.make_params()
    dist_opt = DistributedOptimizer(torch.optim.SGD, rrefs, lr=0.1)
    calls = []
    pre = dist_opt.register_step_pre_hook(lambda o, args, kwargs: calls.append(("pre", args)))
    dist_opt.register_step_post_hook(lambda o, args, kwargs: calls.append(("post", args)))
    for step in range(2):
        with dist_autograd.context() as ctx:
            harness.backward(step, rrefs, local, ctx)
            dist_opt.step(ctx)
        pre.remove()
    assert [c[0] for c in calls] == ["pre", "post", "post"]
    assert calls[0][1][0] == calls[1][1][0]  # the context id, as the step got it
