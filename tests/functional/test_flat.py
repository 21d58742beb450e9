"""Flat parameter buffers (``functional.flatten_parameters``): the same numbers as torch.optim
and as the per-parameter path, with the flat step really taken, and noticed when it cannot be."""
import copy
from typing import Any, List, Optional

import pytest
import torch

from functional import (
    FLAT_CLASSES,
    FunctionalAdafactor,
    FunctionalAdagrad,
    FunctionalAdam,
    FunctionalSGD,
    FunctionalSparseAdam,
    flatten_parameters,
    load_torch_state_dict,
    script_optimizer,
    to_torch_state_dict,
)
from functional._flat import GradientFill
from tests.helpers import ATOL, RTOL

from .case import Case
from .cases import ALL_CASES

FLAT_CASES = [c for c in ALL_CASES if not c.sparse and c.functional_cls.__name__ in FLAT_CLASSES]
#: Steps 0-3 give every gradient (the flat step), step 4 leaves parameter 1 out (its step
#: count falls behind: per parameter from then on), the rest give every gradient again.
DENSE_STEPS = 4


def _grads(case: Case, step: int) -> List[Optional[torch.Tensor]]:
    gen = torch.Generator().manual_seed(1000 + step)
    grads: List[Optional[torch.Tensor]] = [
        torch.randn(s, generator=gen, dtype=case.dtype) for s in case.shapes
    ]
    if step == DENSE_STEPS:
        grads[1] = None
    return grads


def _clone(grads: List[Optional[torch.Tensor]]) -> List[Optional[torch.Tensor]]:
    return [None if g is None else g.clone() for g in grads]


def _make(case: Case, params: List[torch.Tensor], flat: bool, compiled: bool) -> Any:
    optim = case.functional_cls(params, **case.kwargs_copy())
    if flat:
        flatten_parameters(optim)
    return script_optimizer(optim) if compiled else optim


def _stepped_flat(opt: Any, grads: List[Optional[torch.Tensor]]) -> bool:
    """Whether the last step (with ``grads``) stepped the buffer whole: its flat gradient
    buffer holds them, and the members' state entries are views of one buffer per key."""
    groups = opt.optim.groups if isinstance(opt, torch.jit.ScriptModule) else opt.groups
    flat = groups.flats[0]
    if not torch.equal(flat.grad, torch.cat([grads[i].reshape(-1) for i in flat.members])):
        return False
    state = opt.get_state() if isinstance(opt, torch.jit.ScriptModule) else opt.state
    if not state:
        return True  # a class that keeps no state (SGD without momentum)
    tensors = [v for entry in state.values() for v in entry.values() if v.dim() > 0]
    scalars = [v for entry in state.values() for v in entry.values() if v.dim() == 0]
    storages = {t.untyped_storage().data_ptr() for t in tensors + scalars}
    keys = {k for entry in state.values() for k in entry}
    return len(state) > 1 and len(storages) == len(keys)


def _torch_step(opt: torch.optim.Optimizer, params, grads) -> None:
    for p, g in zip(params, grads):
        p.grad = g
    opt.step()


def test_the_flat_classes_are_the_elementwise_ones():
    assert len(FLAT_CASES) > 100
    assert {c.functional_cls.__name__ for c in FLAT_CASES} >= set(FLAT_CLASSES)


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
@pytest.mark.parametrize("case", FLAT_CASES, ids=[c.id for c in FLAT_CASES])
def test_flat_matches_torch_and_the_per_parameter_path(case: Case, compiled: bool) -> None:
    """Flat steps, then a None gradient (per parameter from then on), a hyper-parameter
    change, a state_dict both ways: equal to torch.optim, and to the per-parameter
    functional optimizer, within the parity tolerances. (Not bit for bit: a kernel computes
    the last few elements of a tensor apart from its vector blocks, and a member's last
    elements are inside the buffer's blocks; 1 ulp apart after a step, measured.)"""
    check_flat_matches(case, compiled)


def check_flat_matches(case: Case, compiled: bool) -> None:
    """``test_flat_matches_torch_and_the_per_parameter_path``'s check of one case."""
    ref = [p.requires_grad_() for p in case.make_params()]
    flat = [p.requires_grad_() for p in case.make_params()]
    plain = [p.requires_grad_() for p in case.make_params()]
    ref_opt = case.torch_cls(ref, **case.torch_kwargs_copy())
    opt = _make(case, flat, flat=True, compiled=compiled)
    plain_opt = _make(case, plain, flat=False, compiled=compiled)
    for step in range(case.steps):
        if step == DENSE_STEPS:
            assert _stepped_flat(opt, _grads(case, step - 1)), "the dense steps did not step the buffer whole"
        if step == DENSE_STEPS + 2:
            for group in ref_opt.param_groups:
                group["lr"] = float(group["lr"]) * 0.5
            opt.set_hyperparameter("lr", [float(ref_opt.param_groups[0]["lr"])])
            plain_opt.set_hyperparameter("lr", [float(ref_opt.param_groups[0]["lr"])])
        grads = _grads(case, step)
        _torch_step(ref_opt, ref, _clone(grads))
        opt.step(_clone(grads))
        plain_opt.step(_clone(grads))
        for i, (a, b, r) in enumerate(zip(flat, plain, ref)):
            torch.testing.assert_close(a.detach(), b.detach(), rtol=RTOL, atol=ATOL)
            torch.testing.assert_close(a.detach(), r.detach(), rtol=RTOL, atol=ATOL)
    ours = to_torch_state_dict(opt, case.torch_cls)
    theirs = ref_opt.state_dict()
    assert sorted(ours["state"]) == sorted(theirs["state"])
    for i, entry in theirs["state"].items():
        for key, value in entry.items():
            torch.testing.assert_close(ours["state"][i][key], value, rtol=RTOL, atol=ATOL)

    # torch.optim's state, every step count equal, loads and steps whole again.
    again = [p.detach().clone().requires_grad_() for p in ref]
    back = _make(case, again, flat=True, compiled=compiled)
    equal_steps = case.torch_cls([p.detach().clone().requires_grad_() for p in ref],
                                 **case.torch_kwargs_copy())
    dense = [g for g in _grads(case, 0)]
    _torch_step(equal_steps, equal_steps.param_groups[0]["params"], _clone(dense))
    load_torch_state_dict(back, case.torch_cls, equal_steps.state_dict())
    ref2 = equal_steps.param_groups[0]["params"]
    with torch.no_grad():
        for a, r in zip(again, ref2):
            a.copy_(r)
    for step in range(3):
        grads = _grads(case, 100 + step)
        _torch_step(equal_steps, ref2, _clone(grads))
        back.step(_clone(grads))
    assert _stepped_flat(back, grads)
    for a, r in zip(again, ref2):
        torch.testing.assert_close(a.detach(), r.detach(), rtol=RTOL, atol=ATOL)


def _layer_params() -> List[torch.nn.Parameter]:
    gen = torch.Generator().manual_seed(3)
    return [torch.nn.Parameter(torch.randn(s, generator=gen)) for s in ((4, 3), (3,), (5,), (2, 2))]


def test_flattening_keeps_parameters_and_autograd():
    params = _layer_params()
    before = [p.detach().clone() for p in params]
    ids = [id(p) for p in params]
    opt = flatten_parameters(FunctionalAdam(params, lr=0.1))
    buf = opt.groups.flats[0].param
    for p, b, i in zip(params, before, ids):
        assert id(p) == i and p.is_leaf and p.requires_grad
        assert torch.equal(p, b)
        assert p.untyped_storage().data_ptr() == buf.untyped_storage().data_ptr()
    loss = sum((p * p).sum() for p in params)
    loss.backward()
    for p in params:
        torch.testing.assert_close(p.grad, 2 * p.detach())


@pytest.mark.parametrize("how", ["data", "set_", "load_state_dict(assign=True)"])
@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_a_replaced_parameter_is_noticed(how: str, compiled: bool):
    """After the user replaces a flattened parameter's storage, the step updates the new
    storage (never the buffer nobody reads) and equals torch.optim."""
    mine = _layer_params()
    ref = [torch.nn.Parameter(p.detach().clone()) for p in mine]
    opt = FunctionalAdam(mine, lr=0.1)
    flatten_parameters(opt)
    if compiled:
        opt = script_optimizer(opt)
    ref_opt = torch.optim.Adam(ref, lr=0.1)
    for step in range(5):
        if step == 2:
            new = torch.full((3,), 7.0)
            if how == "data":
                mine[1].data = new.clone()
            elif how == "set_":
                with torch.no_grad():
                    mine[1].set_(new.clone())
            else:
                # A new Parameter object in the module; the optimizer keeps stepping the one
                # it was given, as torch.optim does (so the reference is left alone).
                module = torch.nn.Module()
                module.register_parameter("b", mine[1])
                module.load_state_dict({"b": new.clone()}, assign=True)
                assert module.b is not mine[1]
                replaced = module.b
            if how != "load_state_dict(assign=True)":
                with torch.no_grad():
                    ref[1].copy_(new)
        grads = [torch.full(p.shape, 0.5 + step) for p in mine]
        opt.step([g.clone() for g in grads])
        _torch_step(ref_opt, ref, [g.clone() for g in grads])
    if how == "load_state_dict(assign=True)":
        torch.testing.assert_close(replaced.detach(), torch.full((3,), 7.0))
    for a, r in zip(mine, ref):
        torch.testing.assert_close(a.detach(), r.detach(), rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_parameters_that_cannot_be_flattened_step_beside_the_buffer(compiled: bool):
    gen = torch.Generator().manual_seed(5)
    base = torch.randn(6, 6, generator=gen)
    shared = torch.randn(8, generator=gen)

    def params() -> List[torch.Tensor]:
        return [
            torch.randn(4, 3, generator=torch.Generator().manual_seed(1)),
            base.clone()[:, :3],                       # a view with gaps
            torch.randn(3, dtype=torch.float64, generator=torch.Generator().manual_seed(2)),
            torch.randn(50, generator=torch.Generator().manual_seed(3)),  # over max_numel
            torch.randn(5, generator=torch.Generator().manual_seed(4)),
            shared.clone(),
        ]

    mine = [p.requires_grad_() for p in params()]
    mine.append(mine[-1].detach().view(2, 4).requires_grad_())  # shares storage with the last
    ref = [p.detach().clone().requires_grad_() for p in params()]
    ref.append(ref[-1].detach().view(2, 4).requires_grad_())
    opt = flatten_parameters(FunctionalAdam(mine, lr=0.05), max_numel=40)
    flats = opt.groups.flats
    assert [f.members for f in flats] == [[0, 4]]
    if compiled:
        opt = script_optimizer(opt)
    ref_opt = torch.optim.Adam(ref, lr=0.05, foreach=False)
    for step in range(4):
        gen = torch.Generator().manual_seed(step)
        grads = [torch.randn(p.shape, generator=gen, dtype=p.dtype) for p in mine]
        opt.step([g.clone() for g in grads])
        _torch_step(ref_opt, ref, [g.clone() for g in grads])
        for a, r in zip(mine, ref):
            torch.testing.assert_close(a.detach(), r.detach(), rtol=RTOL, atol=ATOL)


def test_bad_gradients_get_the_per_parameter_errors_and_change_nothing():
    params = _layer_params()
    opt = flatten_parameters(FunctionalAdam(params, lr=0.1))
    grads = [torch.ones_like(p) for p in params]
    opt.step(grads)
    before = [p.detach().clone() for p in params]
    with pytest.raises(ValueError, match=r"Invalid gradients\[2\]: shape"):
        opt.step(grads[:2] + [torch.ones(4)] + grads[3:])
    with pytest.raises(ValueError, match=r"Invalid gradients\[0\]: dtype"):
        opt.step([grads[0].double()] + grads[1:])
    for p, b in zip(params, before):
        assert torch.equal(p, b)
    assert all(float(e["step"]) == 1.0 for e in opt.state.values())


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_gradients_from_backward(compiled: bool):
    """On gradients from backward the flat step matches torch.optim, and a None gradient
    still steps per parameter."""
    mine = _layer_params()
    ref = [torch.nn.Parameter(p.detach().clone()) for p in mine]
    opt = flatten_parameters(FunctionalAdam(mine, lr=0.1))
    if compiled:
        opt = script_optimizer(opt)
    ref_opt = torch.optim.Adam(ref, lr=0.1)
    for step in range(4):
        used = [0, 2, 3] if step == 2 else [0, 1, 2, 3]
        for params in (mine, ref):
            for p in params:
                p.grad = None
            sum(((params[i] * (step + 1)).tanh()).sum() for i in used).backward()
        grads = [p.grad for p in mine]
        opt.step(grads)
        ref_opt.step()
        if step == 1:
            assert _stepped_flat(opt, grads)
    for a, r in zip(mine, ref):
        torch.testing.assert_close(a.detach(), r.detach(), rtol=RTOL, atol=ATOL)


def test_flatten_parameters_refuses_what_it_cannot_do():
    params = _layer_params()
    with pytest.raises(ValueError, match="Invalid optim: FunctionalAdafactor"):
        flatten_parameters(FunctionalAdafactor(params))
    with pytest.raises(ValueError, match="Invalid optim: FunctionalSparseAdam"):
        flatten_parameters(FunctionalSparseAdam(params))
    with pytest.raises(ValueError, match="Invalid optim: a compiled optimizer"):
        flatten_parameters(script_optimizer(FunctionalAdam(params)))
    with pytest.raises(ValueError, match="Invalid max_numel: -1"):
        flatten_parameters(FunctionalAdam(params), max_numel=-1)


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
@pytest.mark.parametrize(
    "cls,torch_cls,kwargs",
    [(FunctionalSGD, torch.optim.SGD, {"lr": 0.5}),
     (FunctionalSGD, torch.optim.SGD, {"lr": 0.5, "momentum": 0.9}),
     (FunctionalAdagrad, torch.optim.Adagrad, {"lr": 0.5})],
    ids=["SGD", "SGD-momentum", "Adagrad"],
)
def test_sparse_gradients_on_flat_members(cls, torch_cls, kwargs, compiled: bool):
    """A member stepped alone with a sparse gradient: torch's sparse add into a view that
    does not start its storage writes at the storage's start (and past its end); ours must
    land on the member, as torch.optim's on a parameter of its own. Dense steps (flat) before
    and after."""
    mine = [torch.zeros(4), torch.zeros(4), torch.zeros(100)]
    ref = [p.clone().requires_grad_() for p in mine]
    opt = flatten_parameters(cls(mine, **kwargs))
    if compiled:
        opt = script_optimizer(opt)
    ref_opt = torch_cls(ref, **kwargs)
    sparse = torch.arange(100.0).to_sparse()
    dense = [torch.ones(4), torch.ones(4), torch.ones(100)]
    for grads in (dense, [None, None, sparse], [None, sparse.to_dense()[:4].to_sparse(), sparse],
                  dense):
        opt.step([None if g is None else g.clone() for g in grads])
        _torch_step(ref_opt, ref, [None if g is None else g.clone() for g in grads])
    for a, r in zip(mine, ref):
        torch.testing.assert_close(a, r.detach(), rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_a_refused_first_step_makes_no_flat_state(compiled: bool):
    """SGD with momentum: a bad gradient for a parameter that is not flattened refuses the
    step before the flat members' momentum buffers exist."""
    mine = [torch.zeros(3), torch.zeros(4), torch.zeros(50)]
    ref = [p.clone().requires_grad_() for p in mine]
    opt = flatten_parameters(FunctionalSGD(mine, lr=0.1, momentum=0.9, dampening=0.5), max_numel=40)
    if compiled:
        opt = script_optimizer(opt)
    with pytest.raises(Exception, match=r"Invalid gradients\[2\]: shape"):
        opt.step([torch.ones(3), torch.ones(4), torch.ones(7)])
    assert (opt.get_state() if compiled else opt.state) == {}
    ref_opt = torch.optim.SGD(ref, lr=0.1, momentum=0.9, dampening=0.5)
    for _ in range(2):
        grads = [torch.ones(3), torch.ones(4), torch.ones(50)]
        opt.step([g.clone() for g in grads])
        _torch_step(ref_opt, ref, [g.clone() for g in grads])
    for a, r in zip(mine, ref):
        torch.testing.assert_close(a, r.detach(), rtol=RTOL, atol=ATOL)


FILLS = [
    ("1-D members: one cat", [(32,), (5,), (7,)], GradientFill.CAT),
    ("any shapes: one _chunk_cat", [(5, 3), (4,), (2, 3, 2)], GradientFill.CHUNK_CAT),
    ("a 0-dim member: foreach copy", [(5, 3), (), (4,)], GradientFill.COPY),
]


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
@pytest.mark.parametrize(
    "cls,torch_cls,kwargs",
    [(FunctionalAdam, torch.optim.Adam, {"lr": 0.1}),
     (FunctionalSGD, torch.optim.SGD, {"lr": 0.1, "momentum": 0.9}),
     (FunctionalAdagrad, torch.optim.Adagrad, {"lr": 0.1})],
    ids=["Adam", "SGD-momentum", "Adagrad"],
)
@pytest.mark.parametrize("fill", FILLS, ids=[f[0] for f in FILLS])
def test_each_way_of_filling_the_flat_gradient(fill, cls, torch_cls, kwargs, compiled: bool):
    """The flat gradient buffer is filled by one cat, one _chunk_cat or a foreach copy,
    by the members' shapes; each gives torch.optim's numbers, also with strided gradients."""
    _, shapes, expected = fill
    gen = torch.Generator().manual_seed(0)
    init = [torch.randn(s, generator=gen) for s in shapes]
    params = [p.clone() for p in init]
    ref = [p.clone().requires_grad_() for p in init]
    opt = flatten_parameters(cls(params, **kwargs))
    assert opt.groups.flats[0].fill == expected
    if compiled:
        opt = script_optimizer(opt)
    ref_opt = torch_cls(ref, **kwargs)
    for step in range(4):
        grads = [torch.randn(s, generator=gen) for s in shapes]
        if step == 2:  # a transposed (non-contiguous) gradient for the first member
            grads[0] = grads[0].t().contiguous().t() if grads[0].dim() == 2 else grads[0]
        _torch_step(ref_opt, ref, _clone(grads))
        opt.step(_clone(grads))
        assert _stepped_flat(opt, grads)
        for p, r in zip(params, ref):
            torch.testing.assert_close(p, r.detach(), rtol=RTOL, atol=ATOL)


IN_PLACE = ["step of params[1] set in place", "step of params[0] set in place"]
#: (edit, compiled): a compiled optimizer's get_state() is a copy of its dict, so entries can
#: be cleared or deleted only in eager code; tensors are shared, so in-place edits reach both.
EDITS = [("state.clear()", False), ("del state[1]", False)] + [
    (edit, compiled) for edit in IN_PLACE for compiled in (False, True)
]


@pytest.mark.parametrize(
    "edit,compiled", EDITS, ids=[f"{e}-{'compiled' if c else 'eager'}" for e, c in EDITS]
)
def test_state_edited_between_steps_is_noticed(edit: str, compiled: bool):
    """Changes to ``state`` between steps take effect as on torch.optim's state: a cleared
    or deleted entry starts fresh, a step count set in place is the one stepped with."""
    gen = torch.Generator().manual_seed(0)
    init = [torch.randn(s, generator=gen) for s in [(3,), (2, 2), (5,)]]
    params = [p.clone() for p in init]
    ref = [p.clone().requires_grad_() for p in init]
    opt = flatten_parameters(FunctionalAdam(params, lr=0.1))
    if compiled:
        opt = script_optimizer(opt)
    ref_opt = torch.optim.Adam(ref, lr=0.1)
    for step in range(5):
        if step == 2:
            state = opt.get_state() if compiled else opt.state
            ref_state = ref_opt.state
            if edit == "state.clear()":
                state.clear()
                ref_state.clear()
            elif edit == "del state[1]":
                del state[1]
                del ref_state[ref[1]]
            else:
                i = int(edit.split("[")[1][0])
                state[i]["step"].fill_(7.0)
                ref_state[ref[i]]["step"].fill_(7.0)
        grads = [torch.randn(p.shape, generator=gen) for p in init]
        _torch_step(ref_opt, ref, _clone(grads))
        opt.step(_clone(grads))
        for p, r in zip(params, ref):
            torch.testing.assert_close(p, r.detach(), rtol=RTOL, atol=ATOL)
    ours = to_torch_state_dict(opt, torch.optim.Adam)["state"]
    theirs = ref_opt.state_dict()["state"]
    assert sorted(ours) == sorted(theirs)
    for i in theirs:
        for key, value in theirs[i].items():
            torch.testing.assert_close(ours[i][key], value, rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize("holder", ["view", "numpy", "tied parameter of another module"])
def test_a_storage_held_elsewhere_is_not_flattened(holder: str):
    """Flattening would cut such a holder off from the parameter's values: the parameter
    keeps its storage and steps per parameter, and the holder keeps seeing it."""
    enc = torch.nn.Linear(4, 4)
    params = [enc.weight, enc.bias, torch.nn.Parameter(torch.randn(3)), torch.nn.Parameter(torch.randn(5))]
    if holder == "view":
        other = enc.weight[0]
    elif holder == "numpy":
        other = enc.weight.detach().numpy()
    else:
        other = torch.nn.Parameter(enc.weight.data)  # e.g. a decoder tied by data, frozen
    opt = flatten_parameters(FunctionalAdam(params, lr=0.1))
    assert [f.members for f in opt.groups.flats] == [[1, 2, 3]]
    opt.step([torch.ones_like(p) for p in params])
    seen = torch.as_tensor(other)
    assert torch.equal(seen, enc.weight.detach()[0] if holder == "view" else enc.weight.detach())


def test_memory_torch_does_not_own_is_not_flattened():
    import numpy as np

    array = np.zeros(3, dtype=np.float32)
    params = [torch.from_numpy(array), torch.randn(4), torch.randn(5)]
    opt = flatten_parameters(FunctionalAdam(params, lr=0.1))
    assert [f.members for f in opt.groups.flats] == [[1, 2]]
    opt.step([torch.ones(3), torch.ones(4), torch.ones(5)])
    assert np.array_equal(array, params[0].numpy()) and array[0] != 0.0


@pytest.mark.parametrize("what", ["a new exp_avg", "a new step", "a new entry"])
def test_new_tensors_put_into_state_are_used(what: str):
    """Eager code may put new tensors into ``state`` between steps, as with torch.optim."""
    gen = torch.Generator().manual_seed(0)
    init = [torch.randn(s, generator=gen) for s in [(3,), (5,), (4,)]]
    params = [p.clone() for p in init]
    ref = [p.clone().requires_grad_() for p in init]
    opt = flatten_parameters(FunctionalAdam(params, lr=0.1))
    ref_opt = torch.optim.Adam(ref, lr=0.1)
    for step in range(5):
        if step == 2:
            for state, key in ((opt.state, 1), (ref_opt.state, ref[1])):
                if what == "a new exp_avg":
                    state[key]["exp_avg"] = torch.zeros(5)
                elif what == "a new step":
                    state[key]["step"] = torch.tensor(0.0)
                else:
                    state[key] = {"step": torch.tensor(0.0), "exp_avg": torch.zeros(5),
                                  "exp_avg_sq": torch.zeros(5)}
        grads = [torch.randn(p.shape, generator=gen) for p in init]
        _torch_step(ref_opt, ref, _clone(grads))
        opt.step(_clone(grads))
        for p, r in zip(params, ref):
            torch.testing.assert_close(p, r.detach(), rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_frozen_parameters_stay_out_of_the_buffers(compiled: bool):
    """A frozen parameter passed with trained ones gets no gradient from autograd; kept out
    of the buffer, it does not hold the others on the per-parameter path."""
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
    model[0].bias.requires_grad_(False)
    ref_model = copy.deepcopy(model)
    opt = flatten_parameters(FunctionalAdam(list(model.parameters()), lr=0.1))
    assert [f.members for f in opt.groups.flats] == [[0, 2, 3]]
    if compiled:
        opt = script_optimizer(opt)
    ref_opt = torch.optim.Adam(ref_model.parameters(), lr=0.1)
    gen = torch.Generator().manual_seed(0)
    for step in range(3):
        x = torch.randn(8, 4, generator=gen)
        model(x).square().sum().backward()
        ref_model(x).square().sum().backward()
        grads = [p.grad for p in model.parameters()]
        opt.step(grads)
        ref_opt.step()
        assert _stepped_flat(opt, grads)
        for m in (model, ref_model):
            m.zero_grad(set_to_none=True)
    for p, r in zip(model.parameters(), ref_model.parameters()):
        torch.testing.assert_close(p.detach(), r.detach(), rtol=RTOL, atol=ATOL)
