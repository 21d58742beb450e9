"""Every functional optimizer steps exactly whatever the memory layout of parameters and
gradients: on every kernel path (fused, foreach, single-tensor), eager and compiled.

Each case's parameters are placed in a mix of layouts in one group (contiguous, a slice of a
wider tensor, transposed, as_strided with gaps, channels_last 4-d) and stepped with
gradients whose layout cycles through the parameter's own strides, contiguous, another
dense order and a 0-stride expanded tensor. The reference is torch.optim's for-loop
implementation fed the same values in the parameter's own layout (what local autograd
gives ``.grad``); torch's fused CPU kernels are not used as the reference because they assume
matching layouts themselves.
"""
import copy
from typing import List, Optional

import pytest
import torch

from functional import load_torch_state_dict, script_optimizer, to_torch_state_dict
from tests.helpers import ATOL, RTOL

from .case import Case
from .cases import ALL_CASES
from .layouts import GRAD_LAYOUTS, gradient_in, in_own_layout, layout_for, outside_intact, place

STEPS = 8
CHANNELS_LAST_SHAPE = (2, 3, 2, 3)


def _shapes(case: Case):
    shapes = list(case.shapes)
    if case.torch_cls is not torch.optim.Muon and not any(len(s) == 4 for s in shapes):
        shapes.append(CHANNELS_LAST_SHAPE)
    return shapes


def _params(case: Case, shapes):
    gen = torch.Generator().manual_seed(0)
    mine, bases, ref = [], [], []
    for i, shape in enumerate(shapes):
        values = torch.randn(shape, generator=gen, dtype=case.dtype)
        p, base = place(values, layout_for(tuple(shape), i))
        mine.append(p.requires_grad_())
        bases.append(base)
        # torch.optim's for-loop steps any layout exactly: its state's layout is the target.
        ref.append(place(values, layout_for(tuple(shape), i))[0].requires_grad_())
    return mine, bases, ref


def _gradients(case: Case, shapes, mine, step: int):
    gen = torch.Generator().manual_seed(1000 + step)
    ours: List[Optional[torch.Tensor]] = []
    theirs: List[Optional[torch.Tensor]] = []
    for i, shape in enumerate(shapes):
        values = torch.randn(shape, generator=gen, dtype=case.dtype)
        if (step + i) % 5 == 4:
            ours.append(None)
            theirs.append(None)
        elif case.sparse:
            rows = shape[0]
            idx = torch.tensor([[step % rows, (step + 2) % rows]])
            g = torch.sparse_coo_tensor(idx, values[idx[0]], shape)
            ours.append(g)
            theirs.append(g.clone())
        else:
            g = gradient_in(values, mine[i], GRAD_LAYOUTS[(step + i) % len(GRAD_LAYOUTS)])
            ours.append(g)
            theirs.append(in_own_layout(g, mine[i]))
    return ours, theirs


def _reference_kwargs(case: Case):
    kwargs = case.torch_kwargs_copy()
    kwargs.pop("fused", None)
    kwargs.pop("foreach", None)
    return kwargs


def _assert_state_layouts(state, reference_state) -> None:
    """Every state tensor is laid out as torch.optim's for the same parameter layout."""
    for i, entry in reference_state.items():
        for key, value in entry.items():
            if isinstance(value, torch.Tensor) and value.dim() > 1:
                assert state[i][key].stride() == value.stride(), (
                    f"state[{i}][{key!r}] strides {state[i][key].stride()} "
                    f"(torch.optim's: {value.stride()})"
                )


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
@pytest.mark.parametrize("case", ALL_CASES, ids=[c.id for c in ALL_CASES])
def test_every_layout_steps_exactly(case: Case, compiled: bool) -> None:
    shapes = _shapes(case)
    mine, bases, ref = _params(case, shapes)
    ref_opt = case.torch_cls(ref, **_reference_kwargs(case))
    optim = case.functional_cls(mine, **case.kwargs_copy())
    opt = script_optimizer(optim) if compiled else optim
    for step in range(STEPS):
        ours, theirs = _gradients(case, shapes, mine, step)
        for p, g in zip(ref, theirs):
            p.grad = g
        ref_opt.step()
        opt.step(ours)
        for i, (a, e) in enumerate(zip(mine, ref)):
            torch.testing.assert_close(
                a.detach(), e.detach(), rtol=RTOL, atol=ATOL,
                msg=lambda m, i=i: f"params[{i}] ({layout_for(tuple(shapes[i]), i)}) "
                                   f"after step {step}: {m}",
            )
        assert all(outside_intact(p) for p in mine), f"a step wrote outside a parameter at step {step}"
    state = opt.get_state() if compiled else opt.state
    _assert_state_layouts(state, {i: ref_opt.state[p]
                                  for i, p in enumerate(ref) if p in ref_opt.state})
    ours_sd = to_torch_state_dict(opt, case.torch_cls)
    for i, entry in ref_opt.state_dict()["state"].items():
        for key, value in entry.items():
            torch.testing.assert_close(ours_sd["state"][i][key], value, rtol=RTOL, atol=ATOL,
                                       msg=f"state[{i}][{key!r}]")


@pytest.mark.parametrize("case", [c for c in ALL_CASES if not c.sparse][::7],
                         ids=[c.id for c in ALL_CASES if not c.sparse][::7])
def test_loaded_state_takes_the_parameters_layout(case: Case) -> None:
    """torch.optim state kept in another layout (contiguous, here) loads and steps exactly."""
    shapes = _shapes(case)
    mine, bases, ref = _params(case, shapes)
    ref_opt = case.torch_cls(ref, **_reference_kwargs(case))
    for step in range(2):
        _, theirs = _gradients(case, shapes, mine, step)
        for p, g in zip(ref, theirs):
            p.grad = g
        ref_opt.step()
    with torch.no_grad():
        for p, r in zip(mine, ref):
            p.copy_(r)
    sd = copy.deepcopy(ref_opt.state_dict())
    for entry in sd["state"].values():
        for key in list(entry):
            entry[key] = entry[key].contiguous()
    opt = script_optimizer(case.functional_cls(mine, **case.kwargs_copy()))
    for key in ("foreach", "fused", "differentiable"):
        if key in case.kwargs:
            sd["param_groups"][0][key] = case.kwargs[key]
    load_torch_state_dict(opt, case.torch_cls, sd)
    _assert_state_layouts(opt.get_state(), {i: ref_opt.state[p] for i, p in enumerate(ref)
                                            if p in ref_opt.state})
    for step in range(2, 5):
        ours, theirs = _gradients(case, shapes, mine, step)
        for p, g in zip(ref, theirs):
            p.grad = g
        ref_opt.step()
        opt.step(ours)
    for i, (a, e) in enumerate(zip(mine, ref)):
        torch.testing.assert_close(a.detach(), e.detach(), rtol=RTOL, atol=ATOL,
                                   msg=f"params[{i}]")
    assert all(outside_intact(p) for p in mine)


RELAYOUTS = {
    "contiguous to transposed": (lambda t: t, lambda t: t.t().contiguous().t()),
    "transposed to contiguous": (lambda t: t.t().contiguous().t(), lambda t: t.contiguous()),
    "contiguous to channels_last": (lambda t: t, lambda t: t.contiguous(memory_format=torch.channels_last)),
}


@pytest.mark.parametrize("flat", [False, True], ids=["per-parameter", "flat"])
@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
@pytest.mark.parametrize(
    "torch_cls,kwargs",
    [(torch.optim.Adam, {"lr": 0.1}), (torch.optim.SGD, {"lr": 0.1, "momentum": 0.9}),
     (torch.optim.Adagrad, {"lr": 0.1})],
    ids=["Adam", "SGD-momentum", "Adagrad"],
)
@pytest.mark.parametrize("change", list(RELAYOUTS))
def test_a_parameter_relaid_after_its_state_was_made(change, torch_cls, kwargs, compiled, flat):
    """``p.data`` given the same values in another dense layout after the state exists (a
    module moved to channels_last mid-run): the fused kernels still step it as torch.optim's
    for-loop does (torch's own fused kernel does not)."""
    from functional import flatten_parameters, functional_optim_map

    before, after = RELAYOUTS[change]
    shape = (2, 3, 2, 2) if "channels_last" in change else (3, 4)
    gen = torch.Generator().manual_seed(0)
    init = [before(torch.randn(shape, generator=gen)), torch.randn(5, generator=gen)]
    params = [p.clone(memory_format=torch.preserve_format) for p in init]
    ref = [p.clone(memory_format=torch.preserve_format).requires_grad_() for p in init]
    opt = functional_optim_map[torch_cls](params, **kwargs)
    if flat:
        flatten_parameters(opt)
    if compiled:
        opt = script_optimizer(opt)
    ref_opt = torch_cls(ref, foreach=False, **kwargs)
    for step in range(4):
        if step == 2:
            with torch.no_grad():
                params[0].data = after(params[0].detach().clone())
                ref[0].data = after(ref[0].detach().clone())
        grads = [torch.randn(p.shape, generator=gen) for p in init]
        for p, g in zip(ref, grads):
            p.grad = g.clone()
        ref_opt.step()
        opt.step([g.clone() for g in grads])
        for p, r in zip(params, ref):
            torch.testing.assert_close(p, r.detach(), rtol=1e-5, atol=1e-6)
