"""Every functional optimizer equals torch.optim, eager and compiled, option by option."""
from typing import Any, Dict, List, Optional

import pytest
import torch

from functional import (
    FunctionalAdam, ScriptedOptimizer, load_torch_state_dict, script_optimizer, to_torch_state_dict,
)
from tests.helpers import ATOL, RTOL, assert_all_close

from .case import Case
from .cases import ALL_CASES

SCHEDULE_STEP = 6


def _clone(grads: List[Optional[torch.Tensor]]) -> List[Optional[torch.Tensor]]:
    return [None if g is None else g.clone() for g in grads]


def _schedule(ref_opt: torch.optim.Optimizer) -> Dict[str, List[float]]:
    """What a scheduler might change mid-training: lr always; momentum, weight_decay and
    beta1 where the optimizer has them and they are non-zero."""
    group = ref_opt.param_groups[0]
    changes = {"lr": [float(group["lr"]) * 0.5]}
    for key in ("momentum", "weight_decay"):
        if isinstance(group.get(key), float) and group[key] != 0.0:
            changes[key] = [group[key] * 0.5]
    if "betas" in group and all(isinstance(b, float) for b in group["betas"]):
        changes["betas"] = [group["betas"][0] * 0.9, group["betas"][1]]
    return changes


def _apply_to_torch(ref_opt: torch.optim.Optimizer, changes: Dict[str, List[float]]) -> None:
    for group in ref_opt.param_groups:
        for key, value in changes.items():
            if key == "lr" and isinstance(group["lr"], torch.Tensor):
                group["lr"].fill_(value[0])
            elif key == "betas":
                group["betas"] = tuple(value)
            else:
                group[key] = value[0]


def _torch_step(opt: torch.optim.Optimizer, params, grads) -> None:
    for p, g in zip(params, grads):
        p.grad = g
    opt.step()


def _make(case: Case, params, compiled: bool) -> Any:
    optim = case.functional_cls(params, **case.kwargs_copy())
    return script_optimizer(optim) if compiled else optim


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
@pytest.mark.parametrize("case", ALL_CASES, ids=[c.id for c in ALL_CASES])
def test_matches_torch_optim(case: Case, compiled: bool) -> None:
    """Steps with None gradients interspersed, and hyper-parameters changed half-way."""
    check_matches_torch_optim(case, compiled)


@pytest.mark.parametrize("case", ALL_CASES, ids=[c.id for c in ALL_CASES])
def test_state_dict_round_trip_with_torch_optim(case: Case) -> None:
    """Functional -> torch.optim and torch.optim -> functional, mid-training, lose nothing."""
    check_state_dict_round_trip(case)


def check_matches_torch_optim(case: Case, compiled: bool) -> Any:
    """``test_matches_torch_optim``'s check of one case; returns the functional optimizer."""
    ref = [p.requires_grad_() for p in case.make_params()]
    mine = [p.requires_grad_() for p in case.make_params()]
    ref_opt = case.torch_cls(ref, **case.torch_kwargs_copy())
    opt = _make(case, mine, compiled)
    for step in range(case.steps):
        if step == SCHEDULE_STEP:
            changes = _schedule(ref_opt)
            _apply_to_torch(ref_opt, changes)
            for key, value in changes.items():
                opt.set_hyperparameter(key, value)
        grads = case.make_gradients(step)
        _torch_step(ref_opt, ref, _clone(grads))
        opt.step(_clone(grads))
        assert_all_close(mine, ref, f"params after step {step}")
    ours = to_torch_state_dict(opt, case.torch_cls)
    theirs = ref_opt.state_dict()
    assert sorted(ours["state"]) == sorted(theirs["state"])
    for i, entry in theirs["state"].items():
        assert sorted(ours["state"][i]) == sorted(entry), f"state keys of parameter {i}"
        for key, value in entry.items():
            torch.testing.assert_close(ours["state"][i][key], value, rtol=RTOL, atol=ATOL,
                                       check_dtype=True, msg=f"state[{i}][{key!r}]")
    return opt


def check_state_dict_round_trip(case: Case) -> None:
    """``test_state_dict_round_trip_with_torch_optim``'s check of one case."""
    half = case.steps // 2
    a = [p.requires_grad_() for p in case.make_params()]
    opt = _make(case, a, compiled=False)
    for step in range(half):
        opt.step(_clone(case.make_gradients(step)))

    # Functional state continues in torch.optim ...
    b = [p.detach().clone().requires_grad_() for p in a]
    torch_opt = case.torch_cls(b, **case.torch_kwargs_copy())
    torch_opt.load_state_dict(to_torch_state_dict(opt, case.torch_cls))
    # ... and torch.optim's state continues in a fresh compiled functional optimizer.
    c = [p.detach().clone().requires_grad_() for p in a]
    back = _make(case, c, compiled=True)
    load_torch_state_dict(back, case.torch_cls, torch_opt.state_dict())

    for step in range(half, case.steps):
        grads = case.make_gradients(step)
        opt.step(_clone(grads))
        _torch_step(torch_opt, b, _clone(grads))
        back.step(_clone(grads))
    assert_all_close(b, a, "torch.optim after loading functional state")
    assert_all_close(c, a, "compiled functional after loading torch.optim state")


def test_state_dict_of_an_uncompiled_scripted_optimizer() -> None:
    """With TorchScript off (``PYTORCH_JIT=0``), ``script_optimizer`` returns its
    ``ScriptedOptimizer`` module uncompiled: the state conversions reach the optimizer inside
    it, as they do through a compiled one."""
    params = [torch.randn(3, 2), torch.randn(2)]
    module = ScriptedOptimizer(FunctionalAdam(params, lr=0.1))
    module.step([torch.ones(3, 2), torch.ones(2)])
    saved = to_torch_state_dict(module, torch.optim.Adam)
    assert saved["param_groups"][0]["lr"] == 0.1 and sorted(saved["state"]) == [0, 1]
    saved["param_groups"][0]["lr"] = 0.05
    load_torch_state_dict(module, torch.optim.Adam, saved)
    assert module.optim.lr == 0.05
