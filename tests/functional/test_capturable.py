"""capturable=True is accepted and changes nothing on the CPU, where torch.optim cannot run it.

torch.optim asserts that a capturable optimizer's parameters live on an accelerator, so these
cases cannot be rows of the parity table (its state_dict round trip hands capturable=True to
torch.optim): each is checked against torch.optim without the flag instead.
"""
import pytest
import torch

from functional import script_optimizer, to_torch_state_dict
from functional.adadelta import FunctionalAdadelta
from functional.asgd import FunctionalASGD
from functional.rmsprop import FunctionalRMSprop
from functional.rprop import FunctionalRprop

from .case import Case

CASES = [
    Case(torch.optim.Adadelta, FunctionalAdadelta, {"lr": 0.5, "capturable": True},
         torch_kwargs={"lr": 0.5}),
    Case(torch.optim.RMSprop, FunctionalRMSprop,
         {"lr": 0.05, "momentum": 0.9, "centered": True, "capturable": True},
         torch_kwargs={"lr": 0.05, "momentum": 0.9, "centered": True}),
    Case(torch.optim.Rprop, FunctionalRprop, {"lr": 0.05, "capturable": True},
         torch_kwargs={"lr": 0.05}),
    Case(torch.optim.ASGD, FunctionalASGD, {"lr": 0.1, "t0": 3.0, "capturable": True},
         torch_kwargs={"lr": 0.1, "t0": 3.0}),
]


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_capturable_matches_torch_optim_without_it(case: Case, compiled: bool) -> None:
    ref = [p.requires_grad_() for p in case.make_params()]
    mine = [p.requires_grad_() for p in case.make_params()]
    ref_opt = case.torch_cls(ref, **case.torch_kwargs_copy())
    optim = case.functional_cls(mine, **case.kwargs_copy())
    opt = script_optimizer(optim) if compiled else optim
    for step in range(case.steps):
        grads = case.make_gradients(step)
        for p, g in zip(ref, grads):
            p.grad = None if g is None else g.clone()
        ref_opt.step()
        opt.step([None if g is None else g.clone() for g in grads])
    for a, e in zip(mine, ref):
        torch.testing.assert_close(a.detach(), e.detach(), rtol=1e-5, atol=1e-6)
    assert to_torch_state_dict(opt, case.torch_cls)["param_groups"][0]["capturable"] is True
