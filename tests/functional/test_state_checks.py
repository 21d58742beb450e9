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

import numpy as np
import pytest
import torch

from functional import (
    FunctionalAdam,
    functional_optim_map,
    load_torch_state_dict,
    script_optimizer,
    to_torch_state_dict,
)
from tests.helpers import assert_identical

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


def _sparse_buffer(entry, param) -> str:
    key = next(k for k, v in entry.items() if v.dim() > 0)
    entry[key] = entry[key].to_sparse()
    return rf"Invalid state\[\d+\]\['{key}'\]: a sparse tensor \(expected a dense one"


def _extra_scalar(entry, param) -> str:
    # An int 0-dim tensor under a key the class does not keep (RMSprop's momentum_buffer with
    # momentum=0 was let through when 0-dim); only a buffer shaped like the parameter may be.
    entry["stray"] = torch.tensor(3)
    return r"Invalid state\[\d+\]\['stray'\]: shape \[\] \(expected \[.*\] for params"


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
    "sparse-buffer": _sparse_buffer,
    "extra-scalar": _extra_scalar,
}
#: SGD keeps its momentum sparse for sparse gradients, as torch.optim does (checked below).
SPARSE_STATE = (torch.optim.SGD,)


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


def _raises(compiled: bool, pattern: str):
    # A compiled method re-raises the ValueError as torch.jit.Error ("builtins.ValueError: ").
    if compiled:
        return pytest.raises(torch.jit.Error, match=r"builtins\.ValueError: " + pattern)
    return pytest.raises(ValueError, match=pattern)


def _table(hows):
    rows = [(c, h) for c in CLASS_CASES for h in hows
            if not (c.torch_cls in ONE_KEY and h in ("missing-key", "step-not-a-scalar"))
            and not (c.torch_cls in SPARSE_STATE and h == "sparse-buffer")]
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
    assert_identical(_state(opt, compiled), before)
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
    assert_identical(_state(opt, compiled), before)
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


def _sgd_sparse(compiled: bool):
    case = next(c for c in ALL_CASES if c.torch_cls is torch.optim.SGD and c.sparse
                and c.kwargs.get("momentum", 0) > 0)
    return case, _trained(case, compiled)


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_sparse_momentum_is_kept_and_its_indices_checked(compiled: bool) -> None:
    """SGD's sparse momentum (torch.optim's own form for sparse gradients) loads; one whose
    indices point outside the parameter, which a step would write through, is refused."""
    case, (opt, params) = _sgd_sparse(compiled)
    good = {i: dict(e) for i, e in _state(opt, compiled).items()}
    assert all(e["momentum_buffer"].is_sparse for e in good.values())
    opt.set_state(good)
    before = _snapshot(_state(opt, compiled))
    last = max(good)
    buf = good[last]["momentum_buffer"].coalesce().clone()
    buf._indices()[0, -1] = case.shapes[last][0] + 6
    bad = {i: dict(e) for i, e in good.items()}
    bad[last]["momentum_buffer"] = buf
    pattern = (rf"Invalid state\[{last}\]\['momentum_buffer'\]: index {case.shapes[last][0] + 6} "
               rf"in dimension 0 \(expected 0\.\.{case.shapes[last][0] - 1}\)")
    with _raises(compiled, pattern):
        opt.set_state(bad)
    assert_identical(_state(opt, compiled), before)


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_hyperparameter_of_the_wrong_kind_is_refused_on_load(compiled: bool) -> None:
    """A state_dict whose betas is one number (torch.optim would fail at the next step) is
    refused by name before the state or any other hyper-parameter changes."""
    case = next(c for c in CLASS_CASES if c.torch_cls is torch.optim.Adam)
    opt, params = _trained(case, compiled)
    before = _snapshot(_state(opt, compiled))
    sd = copy.deepcopy(to_torch_state_dict(opt, case.torch_cls))
    sd["param_groups"][0]["lr"] = 0.5
    sd["param_groups"][0]["betas"] = 0.9
    with pytest.raises(ValueError, match=r"Invalid state_dict: betas: 0\.9 \(expected a tuple of 2"):
        load_torch_state_dict(opt, case.torch_cls, sd)
    assert_identical(_state(opt, compiled), before)
    assert to_torch_state_dict(opt, case.torch_cls)["param_groups"][0]["lr"] == case.kwargs["lr"]


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
@pytest.mark.parametrize("saved", [{"foreach": True}, {"foreach": False}, {"fused": True}],
                         ids=["foreach", "for-loop", "fused"])
def test_a_state_dict_saved_with_other_kernels_loads(saved, compiled: bool) -> None:
    """foreach / fused choose kernels, not numbers: a torch.optim state_dict saved with any of
    them loads into our (fused by default) Adam, which keeps its own kernels and steps on
    equal to the torch.optim that saved it."""
    gen = torch.Generator().manual_seed(0)
    start = [torch.randn(5, 3, generator=gen), torch.randn(4, generator=gen)]
    theirs = [s.clone().requires_grad_() for s in start]
    reference = torch.optim.Adam(theirs, lr=0.01, **saved)
    grads = [[torch.randn(s.shape, generator=gen) for s in start] for _ in range(4)]
    for step in range(2):
        for t, g in zip(theirs, grads[step]):
            t.grad = g.clone()
        reference.step()
    ours = [t.detach().clone() for t in theirs]
    optim = FunctionalAdam(ours, lr=0.3)
    opt = script_optimizer(optim) if compiled else optim
    load_torch_state_dict(opt, torch.optim.Adam, reference.state_dict())
    after = to_torch_state_dict(opt, torch.optim.Adam)["param_groups"][0]
    assert (after["lr"], after["foreach"], after["fused"]) == (0.01, None, None)
    for step in range(2, 4):
        for t, g in zip(theirs, grads[step]):
            t.grad = g.clone()
        reference.step()
        opt.step([g.clone() for g in grads[step]])
    for a, b in zip(ours, theirs):
        torch.testing.assert_close(a, b.detach())


def _continue_both(torch_cls, ours_kwargs, sd, theirs_kwargs, compiled: bool, before_load=None):
    """A torch.optim ``torch_cls`` and our twin both load ``sd`` over the same parameters and
    take two more steps; ours must step as torch.optim's. ``before_load(optim)`` runs first
    on ours (an edit torch.optim's load must undo too)."""
    gen = torch.Generator().manual_seed(3)
    start = [torch.randn(5, 3, generator=gen), torch.randn(4, generator=gen)]
    grads = [[torch.randn(s.shape, generator=gen) for s in start] for _ in range(2)]
    theirs = [s.clone().requires_grad_() for s in start]
    reference = torch_cls(theirs, **theirs_kwargs)
    reference.load_state_dict(copy.deepcopy(sd))
    ours = [s.clone() for s in start]
    optim = functional_optim_map[torch_cls](ours, **_fresh(ours_kwargs))
    opt = script_optimizer(optim) if compiled else optim
    if before_load is not None:
        before_load(optim)
    load_torch_state_dict(opt, torch_cls, copy.deepcopy(sd))
    for step in range(2):
        for t, g in zip(theirs, grads[step]):
            t.grad = g.clone()
        reference.step()
        opt.step([g.clone() for g in grads[step]])
    for a, b in zip(ours, theirs):
        torch.testing.assert_close(a, b.detach(), rtol=1e-5, atol=1e-6)
    return opt


def _fresh(kwargs):
    """``kwargs`` with copies of its Tensors (one optimizer's Tensor lr or betas change)."""
    def copied(v):
        if isinstance(v, tuple):
            return tuple(copied(x) for x in v)
        return v.clone() if isinstance(v, torch.Tensor) else v
    return {k: copied(v) for k, v in kwargs.items()}


def _saved(torch_cls, kwargs):
    """The state_dict of a torch.optim ``torch_cls`` after two steps."""
    gen = torch.Generator().manual_seed(3)
    params = [torch.randn(s, generator=gen).requires_grad_() for s in ((5, 3), (4,))]
    optim = torch_cls(params, **_fresh(kwargs))
    for _ in range(2):
        for p in params:
            p.grad = torch.randn(p.shape, generator=gen)
        optim.step()
    return optim.state_dict()


O = torch.optim
_NEWER = ["maximize", "foreach", "differentiable"]  # options an older torch did not save
# (class, arguments, param-group keys its state_dicts lacked in an older torch)
OLD_FORMAT_ROWS = [
    (O.SGD, {"lr": 0.1, "momentum": 0.9}, _NEWER + ["fused"]),
    (O.Adam, {"lr": 0.01, "weight_decay": 0.1},
     _NEWER + ["capturable", "fused", "decoupled_weight_decay"]),
    (O.AdamW, {"lr": 0.01}, _NEWER + ["capturable", "fused", "decoupled_weight_decay"]),
    (O.Adagrad, {"lr": 0.1}, _NEWER + ["fused"]),
    (O.Adadelta, {"lr": 1.0}, _NEWER + ["capturable"]),
    (O.Adamax, {"lr": 0.01}, _NEWER + ["capturable"]),
    (O.RMSprop, {"lr": 0.01}, _NEWER + ["capturable", "momentum", "centered"]),
    (O.Rprop, {"lr": 0.01}, _NEWER + ["capturable"]),
    (O.NAdam, {"lr": 0.01, "weight_decay": 0.1}, _NEWER + ["capturable", "decoupled_weight_decay"]),
    (O.RAdam, {"lr": 0.01, "weight_decay": 0.1}, _NEWER + ["capturable", "decoupled_weight_decay"]),
    (O.ASGD, {"lr": 0.01}, _NEWER + ["capturable"]),
]


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
@pytest.mark.parametrize("torch_cls, kwargs, lacking", OLD_FORMAT_ROWS,
                         ids=[r[0].__name__ for r in OLD_FORMAT_ROWS])
def test_a_state_dict_of_an_older_torch_loads(torch_cls, kwargs, lacking, compiled) -> None:
    """torch.optim loads a state_dict whose param group lacks options added since it was
    saved (its ``__setstate__`` gives them their defaults); so do ours, and step on equal.
    Ours refused it ("param group lacks [...], so it is not a ... state_dict")."""
    sd = _saved(torch_cls, kwargs)
    for key in lacking:
        del sd["param_groups"][0][key]
    _continue_both(torch_cls, kwargs, sd, kwargs, compiled)


def _lr_changed_in_place(optim) -> None:
    optim.lr_tensor.fill_(0.5)


_TENSOR_BETAS = (torch.tensor(0.8), torch.tensor(0.9))
# (case, torch.optim arguments the state_dict is saved with, our arguments, edit before load)
HELD_ROWS = [
    ("tensor-betas-in-the-state-dict", {"lr": 0.01, "betas": _TENSOR_BETAS}, {"lr": 0.01}, None),
    ("tensor-betas-both", {"lr": 0.01, "betas": _TENSOR_BETAS},
     {"lr": 0.01, "betas": (torch.tensor(0.5), torch.tensor(0.6))}, None),
    ("tensor-lr-changed-in-place", {"lr": torch.tensor(0.01)}, {"lr": torch.tensor(0.01)},
     _lr_changed_in_place),
    ("numpy-lr-in-the-state-dict", {"lr": np.float32(0.02)}, {"lr": 0.01}, None),
]


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
@pytest.mark.parametrize("name, saved, ours, edit", HELD_ROWS, ids=[r[0] for r in HELD_ROWS])
def test_hyperparameters_load_as_torch_holds_them(name, saved, ours, edit, compiled) -> None:
    """A state_dict's Tensor betas or numpy lr load (ours raised TypeError: "Invalid betas:
    tensor(0.8000) (expected a number)", "Invalid lr: np.float32(0.02) ..."), and a Tensor lr
    changed in place since construction takes the state_dict's value (ours kept 0.5: it
    compared the state_dict's lr with the lr it was built with)."""
    sd = _saved(O.Adam, saved)
    opt = _continue_both(O.Adam, ours, sd, {"lr": 0.3}, compiled, edit)
    group = to_torch_state_dict(opt, O.Adam)["param_groups"][0]
    assert float(group["lr"]) == pytest.approx(float(sd["param_groups"][0]["lr"]))
    saved_betas = sd["param_groups"][0]["betas"]
    assert [float(b) for b in group["betas"]] == pytest.approx([float(b) for b in saved_betas])


# (class, arguments the torch.optim state_dict is saved with, ours): options torch.optim
# takes from a state_dict, and ours can take between steps.
OTHER_OPTIONS_ROWS = [
    (O.Adagrad, {"lr": 0.1, "initial_accumulator_value": 0.3, "lr_decay": 0.5}, {"lr": 0.1}),
    (O.RMSprop, {"lr": 0.01, "momentum": 0.9, "centered": True}, {"lr": 0.01, "centered": True}),
    (O.SGD, {"lr": 0.1, "momentum": 0.9}, {"lr": 0.1}),
    (O.Rprop, {"lr": 0.1, "etas": (0.3, 1.5), "step_sizes": (1e-3, 1.0)}, {"lr": 0.1}),
    (O.ASGD, {"lr": 0.1, "t0": 1, "lambd": 0.3, "alpha": 0.5}, {"lr": 0.1}),
]


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
@pytest.mark.parametrize("torch_cls, saved, ours", OTHER_OPTIONS_ROWS,
                         ids=[r[0].__name__ for r in OTHER_OPTIONS_ROWS])
def test_a_state_dict_saved_with_other_options_loads(torch_cls, saved, ours, compiled) -> None:
    """torch.optim adopts a state_dict's options; ours do where they can change between
    steps, and step on equal. Adagrad's initial_accumulator_value (which only starts new
    state, and torch.optim.Adagrad makes all of it at construction) was refused: "cannot
    change after construction"."""
    _continue_both(torch_cls, ours, _saved(torch_cls, saved), ours, compiled)
