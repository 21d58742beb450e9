"""State is checked before it is used: a bad state is refused with a ValueError naming the
parameter, the key and both values, on every path (eager, compiled, load_torch_state_dict),
and the optimizer is left exactly as it was, stepping on as if nothing had been offered.

Before these checks, ``script_optimizer(...).set_state`` took a state of any shape and the
next fused step wrote out of bounds (a segfault), and a state lacking a key broke every
later step.
"""
import copy
import re
from typing import Callable, Dict, List

import pytest
import torch

from functional import (
    FunctionalAdam,
    load_torch_state_dict,
    script_optimizer,
    to_torch_state_dict,
)

from .case import Case
from .cases import ALL_CASES

# One case per class with the most state keys: amsgrad, momentum, centered, and so on.
_RICH = {"amsgrad": True, "momentum": 0.9, "centered": True}


def _one_case_per_class() -> List[Case]:
    chosen: Dict[type, Case] = {}
    for case in ALL_CASES:
        if case.dtype != torch.float32:
            continue
        best = chosen.get(case.torch_cls)
        score = sum(case.kwargs.get(k) == v for k, v in _RICH.items())
        if best is None or score > sum(best.kwargs.get(k) == v for k, v in _RICH.items()):
            chosen[case.torch_cls] = case
    return list(chosen.values())


CLASS_CASES = _one_case_per_class()
Corruption = Callable[[Dict[str, torch.Tensor], torch.Tensor], str]


def _missing(entry, param) -> str:
    key = sorted(entry)[-1]
    del entry[key]
    return rf"Invalid state\[\d+\]: no '{key}' \(expected keys \["


def _wrong_shape(entry, param) -> str:
    key = next(k for k, v in entry.items() if v.dim() > 0)
    entry[key] = torch.zeros(3, 7, 5, dtype=entry[key].dtype)
    return rf"Invalid state\[\d+\]\['{key}'\]: shape \[3, 7, 5\] \(expected \[.*\] for params"


def _wrong_dtype(entry, param) -> str:
    key = next(k for k, v in entry.items() if v.dim() > 0)
    entry[key] = entry[key].to(torch.float64)
    return (rf"Invalid state\[\d+\]\['{key}'\]: dtype torch.float64 \(expected torch.float32 "
            rf"for params\[\d+\] of dtype torch.float32\)")


def _wrong_device(entry, param) -> str:
    key = next(k for k, v in entry.items() if v.dim() > 0)
    entry[key] = torch.empty(entry[key].shape, device="meta")
    return rf"Invalid state\[\d+\]\['{key}'\]: device meta \(expected cpu"


def _step_not_a_scalar(entry, param) -> str:
    entry["step"] = torch.tensor([2.0])
    return r"Invalid state\[\d+\]\['step'\]: shape \[1\] \(expected \[\]"


def _stray_buffer(entry, param) -> str:
    entry["stray"] = torch.zeros(11)
    return r"Invalid state\[\d+\]\['stray'\]: shape \[11\] \(expected \[.*\] for params"


#: Classes whose state is one buffer and no step (without it, an entry is "no state yet",
#: as in torch.optim): neither a missing key nor a bad step can be made for them.
ONE_KEY = (torch.optim.SGD, torch.optim.Muon)
CORRUPTIONS = {
    "missing-key": _missing,
    "wrong-shape": _wrong_shape,
    "wrong-dtype": _wrong_dtype,
    "wrong-device": _wrong_device,
    "step-not-a-scalar": _step_not_a_scalar,
    "stray-buffer": _stray_buffer,
}


def _trained(case: Case, compiled: bool):
    params = [p.requires_grad_() for p in case.make_params()]
    optim = case.functional_cls(params, **case.kwargs_copy())
    opt = script_optimizer(optim) if compiled else optim
    for step in range(3):
        opt.step(_full_grads(case, step))
    return opt, params


def _full_grads(case: Case, step: int):
    """Gradients for every parameter (no None), so that every parameter has state."""
    gen = torch.Generator().manual_seed(step)
    grads = []
    for s in case.shapes:
        g = torch.randn(s, generator=gen, dtype=case.dtype)
        if case.sparse:
            idx = torch.tensor([[0, s[0] - 1]])
            g = torch.sparse_coo_tensor(idx, g[idx[0]], s)
        grads.append(g)
    return grads


def _state(opt, compiled: bool):
    return opt.get_state() if compiled else opt.state


def _snapshot(state):
    return {i: {k: v.clone() for k, v in e.items()} for i, e in state.items()}


def _assert_same(a, b) -> None:
    assert sorted(a) == sorted(b)
    for i in a:
        assert sorted(a[i]) == sorted(b[i])
        for k in a[i]:
            torch.testing.assert_close(a[i][k], b[i][k], rtol=0, atol=0)


def _raises(compiled: bool, pattern: str):
    # A compiled method re-raises the ValueError as torch.jit.Error ("builtins.ValueError: ").
    if compiled:
        return pytest.raises(torch.jit.Error, match=r"builtins\.ValueError: " + pattern)
    return pytest.raises(ValueError, match=pattern)


def _table(hows):
    rows = [(c, h) for c in CLASS_CASES for h in hows
            if not (c.torch_cls in ONE_KEY and h in ("missing-key", "step-not-a-scalar"))]
    return pytest.mark.parametrize(
        "case, how", rows, ids=[f"{c.torch_cls.__name__}-{h}" for c, h in rows])


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
@_table(sorted(CORRUPTIONS))
def test_set_state_refuses_and_changes_nothing(case: Case, how: str, compiled: bool) -> None:
    opt, params = _trained(case, compiled)
    twin, twin_params = _trained(case, compiled)
    before = _snapshot(_state(opt, compiled))
    bad = {i: dict(e) for i, e in _state(opt, compiled).items()}
    last = max(bad)
    pattern = CORRUPTIONS[how](bad[last], params[last]).replace(r"\d+", str(last), 1)
    with _raises(compiled, pattern):
        opt.set_state(bad)
    _assert_same(_state(opt, compiled), before)
    # It steps on exactly as an optimizer that was never offered the bad state.
    for step in range(3, 5):
        grads = _full_grads(case, step)
        opt.step(grads)
        twin.step([g.clone() for g in grads])
    for a, b in zip(params, twin_params):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
@_table(["missing-key", "wrong-shape", "step-not-a-scalar"])
def test_load_torch_state_dict_refuses_before_anything_changes(case, how, compiled) -> None:
    """A ValueError on every path; the lr that came with the bad state is not adopted."""
    opt, params = _trained(case, compiled)
    before = _snapshot(_state(opt, compiled))
    lr_before = to_torch_state_dict(opt, case.torch_cls)["param_groups"][0]["lr"]
    sd = copy.deepcopy(to_torch_state_dict(opt, case.torch_cls))
    if case.torch_cls is torch.optim.SparseAdam:
        sd["state"] = {i: {k: (torch.tensor(float(v)) if k == "step" else v)
                           for k, v in e.items()} for i, e in sd["state"].items()}
    sd["param_groups"][0]["lr"] = 0.5
    last = max(sd["state"])
    keys = set(sd["state"][last])
    CORRUPTIONS[how](sd["state"][last], params[last])
    key = (keys ^ set(sd["state"][last]) or {"step"}).pop() if how != "wrong-shape" else next(
        k for k, v in sd["state"][last].items() if v.dim() == 3)
    # The message names the parameter and the key (its wording depends on which check saw it).
    with pytest.raises(ValueError, match=rf"state\[{last}\]\[?.*'{key}'"):
        load_torch_state_dict(opt, case.torch_cls, sd)
    _assert_same(_state(opt, compiled), before)
    assert to_torch_state_dict(opt, case.torch_cls)["param_groups"][0]["lr"] == lr_before


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_out_of_range_index_is_refused(compiled: bool) -> None:
    case = CLASS_CASES[0]
    opt, _ = _trained(case, compiled)
    bad = {i: dict(e) for i, e in _state(opt, compiled).items()}
    bad[len(case.shapes) + 3] = bad[0]
    with _raises(compiled, re.escape(f"Invalid state: an entry for parameter {len(case.shapes) + 3}")):
        opt.set_state(bad)


def test_a_wrong_sized_buffer_no_longer_reaches_the_fused_kernel() -> None:
    """The issue's crash: a 1-element exp_avg for a 4M-element parameter, compiled fused Adam.
    It used to write out of bounds (segfault or hang); now it is refused and nothing runs."""
    params = [torch.zeros(1 << 22)]
    opt = script_optimizer(FunctionalAdam(params, lr=0.1))
    opt.step([torch.ones(1 << 22)])
    state = {0: {k: v for k, v in opt.get_state()[0].items()}}
    state[0]["exp_avg"] = torch.zeros(1)
    state[0]["exp_avg_sq"] = torch.zeros(1)
    with pytest.raises(torch.jit.Error, match=r"state\[0\]\['exp_avg'\]: shape \[1\]"):
        opt.set_state(state)
    opt.step([torch.ones(1 << 22)])
    assert opt.get_state()[0]["exp_avg"].shape == (1 << 22,)
