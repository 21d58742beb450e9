"""Complex parameters: every class torch.optim steps them with gives torch.optim's numbers
(eager, compiled, flat, any layout, state_dict both ways); the others, and ``fused=True``,
refuse them at construction, naming complex and the parameter."""
from typing import Any, Dict, List

import pytest
import torch

from functional.blockwise_adam import Adam8bit, AdamW4bit, AdamW8bit

from functional import (
    FunctionalAdafactor,
    FunctionalMuon,
    FunctionalSparseAdam,
    flatten_parameters,
    functional_optim_map,
    script_optimizer,
)
from tests.helpers import ATOL, RTOL

from .case import Case
from .test_parity import check_matches_torch_optim, check_state_dict_round_trip


#: Per class, the options that touch the most code (torch.optim steps each of them on the
#: complex parameter's ``view_as_real``); each runs on both complex dtypes and on foreach.
COMPLEX_OPTIONS: Dict[str, Dict[str, Any]] = {
    "SGD": {"lr": 0.05, "momentum": 0.9, "weight_decay": 0.1, "nesterov": True},
    "Adam": {"lr": 0.05, "amsgrad": True, "weight_decay": 0.1, "maximize": True},
    "AdamW": {"lr": 0.05, "weight_decay": 0.1},
    "Adagrad": {"lr": 0.05, "lr_decay": 0.01, "initial_accumulator_value": 0.3,
                "weight_decay": 0.1},
    "Adadelta": {"lr": 0.5, "rho": 0.8, "weight_decay": 0.1},
    "Adamax": {"lr": 0.05, "weight_decay": 0.1},
    "RMSprop": {"lr": 0.05, "momentum": 0.5, "centered": True, "weight_decay": 0.1},
    "Rprop": {"lr": 0.05, "etas": (0.4, 1.3)},
    "NAdam": {"lr": 0.05, "weight_decay": 0.1, "decoupled_weight_decay": True},
    "RAdam": {"lr": 0.05, "weight_decay": 0.1},
    "ASGD": {"lr": 0.05, "t0": 3, "weight_decay": 0.1},
}
_DTYPES = (torch.complex64, torch.complex128)

COMPLEX_CASES: List[Case] = []
for _name, _kwargs in COMPLEX_OPTIONS.items():
    _torch_cls = getattr(torch.optim, _name)
    for _dtype in _DTYPES:
        for _foreach in (None, True):
            kwargs = dict(_kwargs) if _foreach is None else {**_kwargs, "foreach": True}
            COMPLEX_CASES.append(
                Case(_torch_cls, functional_optim_map[_torch_cls], kwargs, dtype=_dtype, steps=8)
            )
# The classes with a fused kernel run it by default: also the foreach path they leave.
for _name in ("SGD", "Adam", "AdamW", "Adagrad"):
    _torch_cls = getattr(torch.optim, _name)
    COMPLEX_CASES.append(Case(_torch_cls, functional_optim_map[_torch_cls],
                              {**COMPLEX_OPTIONS[_name], "fused": False}, dtype=torch.complex64, steps=8))
# capturable=True (graph-safe updates; torch.optim refuses it on the CPU, so its plain run
# is the reference).
for _name in ("Adam", "Adamax", "NAdam", "RAdam", "ASGD", "Rprop", "RMSprop", "Adadelta"):
    _torch_cls = getattr(torch.optim, _name)
    COMPLEX_CASES.append(Case(_torch_cls, functional_optim_map[_torch_cls],
                              {**COMPLEX_OPTIONS[_name], "capturable": True}, dtype=torch.complex64,
                              steps=8, torch_kwargs=COMPLEX_OPTIONS[_name]))


def test_every_class_torch_steps_with_complex_parameters_is_in_the_table():
    classes = {c.torch_cls for c in COMPLEX_CASES}
    # torch refuses these with complex parameters; distopt's blockwise classes too (below)
    refused = {torch.optim.Adafactor, torch.optim.Muon, torch.optim.SparseAdam,
               Adam8bit, AdamW8bit, AdamW4bit}
    assert classes | refused == set(functional_optim_map)


@pytest.mark.parametrize("cls", [Adam8bit, AdamW8bit, AdamW4bit], ids=lambda c: c.__name__)
def test_blockwise_classes_refuse_complex_parameters_by_name(cls):
    with pytest.raises(ValueError, match=r"params\[0\]: torch.complex64"):
        functional_optim_map[cls]([torch.zeros(3, dtype=torch.complex64)])
    with pytest.raises(ValueError, match=r"\['params'\]\[0\] is torch.complex64"):
        cls([torch.nn.Parameter(torch.zeros(3, dtype=torch.complex64))])


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
@pytest.mark.parametrize("case", COMPLEX_CASES, ids=[c.id for c in COMPLEX_CASES])
def test_complex_parameters_match_torch_optim(case: Case, compiled: bool) -> None:
    """Parameters, and the state torch.optim keeps (complex, as torch's), step for step."""
    opt = check_matches_torch_optim(case, compiled)
    state = opt.get_state() if compiled else opt.state
    for entry in state.values():
        for key, value in entry.items():
            if value.dim() > 0:
                assert value.dtype == case.dtype, key


#: torch.optim runs capturable=True on the CPU only with its device check patched
#: (test_capturable.py): the round trip takes the other rows.
_ROUND_TRIP = [c for c in COMPLEX_CASES if "capturable" not in c.kwargs]


@pytest.mark.parametrize("case", _ROUND_TRIP, ids=[c.id for c in _ROUND_TRIP])
def test_complex_state_dict_round_trip_with_torch_optim(case: Case) -> None:
    check_state_dict_round_trip(case)


def _mixed_params(dtype: torch.dtype) -> List[torch.Tensor]:
    """Real and complex parameters side by side, one complex one transposed (a layout the
    fused kernels must be staged for) and one a slice with gaps."""
    gen = torch.Generator().manual_seed(3)
    wide = torch.randn(4, 10, generator=gen, dtype=dtype)
    return [
        torch.randn(6, generator=gen),
        torch.randn(3, 5, generator=gen, dtype=dtype),
        torch.randn(5, 3, generator=gen, dtype=dtype).t(),
        torch.randn(7, generator=gen),
        wide[:, ::2],
        torch.randn(2, 2, generator=gen),
    ]


@pytest.mark.parametrize("flat", [False, True], ids=["per-parameter", "flat"])
@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
@pytest.mark.parametrize("name", sorted(COMPLEX_OPTIONS))
def test_complex_beside_real_parameters_in_any_layout(name: str, compiled: bool, flat: bool):
    """One optimizer over real (flattened, with ``flat``) and complex parameters, the
    complex ones transposed and sliced: torch.optim's numbers for all of them."""
    torch_cls = getattr(torch.optim, name)
    ref = [p.clone().requires_grad_() for p in _mixed_params(torch.complex128)]
    mine = [p.clone() for p in _mixed_params(torch.complex128)]
    # The clones above are contiguous: lay the mine's like the originals (transposed, sliced).
    mine[2] = torch.randn(5, 3, dtype=torch.complex128).t()
    mine[2].copy_(ref[2].detach())
    wide = torch.zeros(4, 10, dtype=torch.complex128)
    mine[4] = wide[:, ::2]
    mine[4].copy_(ref[4].detach())
    assert not mine[2].is_contiguous() and not mine[4].is_contiguous()
    ref_opt = torch_cls(ref, **COMPLEX_OPTIONS[name])
    opt = functional_optim_map[torch_cls](mine, **COMPLEX_OPTIONS[name])
    if flat:
        flatten_parameters(opt)
        assert [sorted(f.members) for f in opt.groups.flats] == [[0, 3, 5]]
    if compiled:
        opt = script_optimizer(opt)
    gen = torch.Generator().manual_seed(4)
    for step in range(5):
        grads = [torch.randn(p.shape, generator=gen, dtype=p.dtype) for p in ref]
        if step == 2:
            grads[1] = None
        for p, g in zip(ref, grads):
            p.grad = None if g is None else g.clone()
        ref_opt.step()
        opt.step([None if g is None else g.clone() for g in grads])
        for i, (a, e) in enumerate(zip(mine, ref)):
            torch.testing.assert_close(a, e.detach(), rtol=RTOL, atol=ATOL,
                                       msg=f"params[{i}] after step {step}")
    assert wide[:, 1::2].abs().sum() == 0, "the slice's gaps were written"


@pytest.mark.parametrize("cls,algorithm,kwargs", [
    (FunctionalAdafactor, "Adafactor", {}),
    (FunctionalMuon, "Muon", {}),
    (FunctionalSparseAdam, "SparseAdam", {}),
], ids=["Adafactor", "Muon", "SparseAdam"])
def test_classes_torch_refuses_complex_for_refuse_at_construction(cls, algorithm, kwargs):
    params = [torch.zeros(3, 2), torch.zeros(2, 2, dtype=torch.complex64)]
    with pytest.raises(ValueError, match=(
        rf"Invalid params\[1\]: complex dtype torch.complex64 \(expected a real dtype: "
        rf"{algorithm} does not support complex parameters")):
        cls(params, **kwargs)


@pytest.mark.parametrize("name", ["SGD", "Adam", "AdamW", "Adagrad"])
def test_fused_true_refuses_complex_at_construction(name: str):
    """torch.optim refuses ``fused=True`` with complex parameters (at its first step); the
    twin refuses at construction, naming the parameter; unset, it steps them."""
    torch_cls = getattr(torch.optim, name)
    params = [torch.zeros(2), torch.zeros(2, dtype=torch.complex128)]
    with pytest.raises(RuntimeError, match=r"Invalid fused: True with params\[1\] of complex dtype"):
        functional_optim_map[torch_cls](params, fused=True)
    with pytest.raises(RuntimeError, match="floating point"):
        p = torch.zeros(2, dtype=torch.complex128, requires_grad=True)
        p.grad = torch.ones_like(p)
        torch_cls([p], fused=True).step()


@pytest.mark.parametrize("name", ["SGD", "Adagrad"])
def test_sparse_gradients_of_complex_parameters(name: str):
    """The classes that take sparse gradients step a complex parameter's sparse gradient as
    torch.optim does (on the complex values: torch does not view them as real there)."""
    torch_cls = getattr(torch.optim, name)
    kwargs = {"lr": 0.1, "momentum": 0.9} if name == "SGD" else {"lr": 0.1}
    gen = torch.Generator().manual_seed(5)
    start = torch.randn(5, 3, generator=gen, dtype=torch.complex64)
    ref = start.clone().requires_grad_()
    mine = start.clone()
    ref_opt = torch_cls([ref], **kwargs)
    opt = script_optimizer(functional_optim_map[torch_cls]([mine], **kwargs))
    for step in range(3):
        rows = torch.tensor([[step % 5, (step + 2) % 5]])
        values = torch.randn(2, 3, generator=gen, dtype=torch.complex64)
        g = torch.sparse_coo_tensor(rows, values, (5, 3))
        ref.grad = g.clone()
        ref_opt.step()
        opt.step([g.clone()])
        torch.testing.assert_close(mine, ref.detach(), rtol=RTOL, atol=ATOL)
