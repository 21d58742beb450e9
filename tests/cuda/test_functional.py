"""Functional optimizers on CUDA parameters, against torch.optim on the same device.

The parity table of tests/functional (None gradients, hyper-parameters changed half-way,
state_dict both ways) runs with parameters and gradients on the GPU. torch.optim is given the
kernel ours uses (``fused=True`` where ours is fused, else ``foreach=True``) unless the case
names one, so the comparison is kernel against kernel at the CPU table's tolerances.
"""
import inspect
from typing import Any, Dict, List, Optional

import pytest
import torch

from functional import (
    FunctionalAdagrad,
    FunctionalAdam,
    FunctionalSGD,
    flatten_parameters,
    load_torch_state_dict,
    script_optimizer,
    to_torch_state_dict,
)
from functional._scripted import ScriptedOptimizer

from tests.cuda.conftest import CUDA, DEVICE, gpu_only
from tests.functional.case import Case
from tests.functional.cases import ALL_CASES
from tests.functional.test_grad_scaling import CASES as SCALED_CASES, check_against_torch
from tests.helpers import ATOL, RTOL, assert_all_close

pytestmark = CUDA

SCHEDULE_STEP = 6


def _on(tensors: List[Optional[torch.Tensor]]) -> List[Optional[torch.Tensor]]:
    return [None if t is None else t.to(DEVICE) for t in tensors]


def _params(case: Case) -> List[torch.Tensor]:
    return [p.to(DEVICE).requires_grad_() for p in case.make_params()]


def _instance(opt: Any) -> Any:
    return opt.optim if isinstance(opt, ScriptedOptimizer) else opt


def _torch_kwargs(case: Case, ours: Any) -> Dict[str, Any]:
    """The case's torch.optim arguments, with the kernel ours runs where the case names none."""
    kwargs = case.torch_kwargs_copy()
    if "fused" in kwargs or "foreach" in kwargs or case.sparse:
        return kwargs  # torch.optim fuses no sparse step
    obj = _instance(ours)
    # torch.optim.SGD's fused step fails on a momentum buffer that a None gradient left
    # unmade (torch 2.13): foreach is its reference, the same update.
    if getattr(obj, "use_fused", False) and case.torch_cls is not torch.optim.SGD:
        kwargs["fused"] = True
    elif "foreach" in inspect.signature(case.torch_cls).parameters:
        kwargs["foreach"] = True
    return kwargs


def _step_torch(opt: torch.optim.Optimizer, params, grads) -> None:
    for p, g in zip(params, grads):
        p.grad = g
    opt.step()


def _refusal(make: Any) -> Optional[Exception]:
    """What ``make()`` raised, or None."""
    try:
        make()
    except Exception as exc:  # noqa: B902 - compared by the caller
        return exc
    return None


def _torch_steps(case: Case, params: List[torch.Tensor]) -> None:
    """torch.optim built for ``case`` and one step taken (torch checks a fused kernel's
    devices at construction or at the first step, depending on the class and release)."""
    opt = case.torch_cls(params, **case.torch_kwargs_copy())
    _step_torch(opt, params, [None if g is None else g.to(params[0].device)
                              for g in case.make_gradients(0)])


def assert_same_refusal(case: Case, ours: Exception, theirs: Optional[Exception]) -> None:
    """Ours refused ``case`` on this device: torch.optim must refuse it too, for the same
    reason. The same exception type; each message names the device and an argument of the
    case that both name (the kernel it asks for, as ``fused``); and both take the case on
    the CPU, so the device is what refuses it."""
    assert theirs is not None, f"ours refused {case.id} on {DEVICE.type} ({ours!r}); torch.optim took it"
    assert type(ours) is type(theirs), (ours, theirs)
    said, told = str(ours), str(theirs)
    assert DEVICE.type in said.lower() and DEVICE.type in told.lower(), (said, told)
    named = [k for k in case.kwargs_copy() if k in said and k in told]
    assert named, f"ours and torch.optim name no argument of {case.id} alike: {said!r}, {told!r}"
    cpu = [p.requires_grad_() for p in case.make_params()]
    assert _refusal(lambda: case.functional_cls(cpu, **case.kwargs_copy())) is None
    assert _refusal(lambda: _torch_steps(case, cpu)) is None


def _pair(case: Case, compiled: bool):
    """(torch.optim on the device, its params, ours on the device, its params); None when
    ours refuses the case on this device, as torch.optim does (``assert_same_refusal``)."""
    mine = _params(case)
    ref = _params(case)
    try:
        optim = case.functional_cls(mine, **case.kwargs_copy())
    except RuntimeError as ours:
        # Refused here (Adagrad fused=True on CUDA under torch 2.11): torch.optim must
        # refuse it too, for the same reason, and that is the whole check.
        assert_same_refusal(case, ours, _refusal(lambda: _torch_steps(case, ref)))
        return None
    ref_opt = case.torch_cls(ref, **_torch_kwargs(case, optim))
    return ref_opt, ref, (script_optimizer(optim) if compiled else optim), mine


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
@pytest.mark.parametrize("case", ALL_CASES, ids=[c.id for c in ALL_CASES])
def test_matches_torch_optim_on_the_device(case: Case, compiled: bool) -> None:
    pair = _pair(case, compiled)
    if pair is None:
        return
    ref_opt, ref, opt, mine = pair
    for step in range(case.steps):
        if step == SCHEDULE_STEP:
            group = ref_opt.param_groups[0]
            new_lr = float(group["lr"]) * 0.5
            if isinstance(group["lr"], torch.Tensor):
                group["lr"].fill_(new_lr)
            else:
                group["lr"] = new_lr
            opt.set_hyperparameter("lr", [new_lr])
        grads = _on(case.make_gradients(step))
        _step_torch(ref_opt, ref, [None if g is None else g.clone() for g in grads])
        opt.step([None if g is None else g.clone() for g in grads])
        assert_all_close(mine, ref, f"params after step {step}")
    ours = to_torch_state_dict(opt, case.torch_cls)
    theirs = ref_opt.state_dict()
    assert sorted(ours["state"]) == sorted(theirs["state"])
    for i, entry in theirs["state"].items():
        assert sorted(ours["state"][i]) == sorted(entry)
        for key, value in entry.items():
            got = ours["state"][i][key]
            if isinstance(value, torch.Tensor):
                # Where torch.optim keeps it: the same device for every key, step included.
                assert got.device == value.device, f"state[{i}][{key!r}] on {got.device}"
            torch.testing.assert_close(got, value, rtol=RTOL, atol=ATOL, msg=f"state[{i}][{key!r}]")


@pytest.mark.parametrize("case", ALL_CASES, ids=[c.id for c in ALL_CASES])
def test_state_dict_both_ways_on_the_device(case: Case) -> None:
    """Ours -> torch.optim -> a fresh compiled one of ours, mid-training, on the device."""
    pair = _pair(case, compiled=False)
    if pair is None:
        return
    _, _, opt, a = pair
    half = case.steps // 2
    for step in range(half):
        opt.step(_on(case.make_gradients(step)))
    b = [p.detach().clone().requires_grad_() for p in a]
    torch_opt = case.torch_cls(b, **_torch_kwargs(case, opt))
    torch_opt.load_state_dict(to_torch_state_dict(opt, case.torch_cls))
    c = [p.detach().clone().requires_grad_() for p in a]
    back = script_optimizer(case.functional_cls(c, **case.kwargs_copy()))
    load_torch_state_dict(back, case.torch_cls, torch_opt.state_dict())
    for step in range(half, case.steps):
        grads = _on(case.make_gradients(step))
        opt.step([None if g is None else g.clone() for g in grads])
        _step_torch(torch_opt, b, [None if g is None else g.clone() for g in grads])
        back.step([None if g is None else g.clone() for g in grads])
    assert_all_close(b, a, "torch.optim after loading functional state")
    assert_all_close(c, a, "compiled functional after loading torch.optim state")


# ---------------------------------------------------------------- where step lives

PLACEMENT = [
    # (functional class, kwargs, where torch.optim keeps step with the same kwargs)
    (FunctionalAdam, {"lr": 0.01, "foreach": True}, "cpu"),
    (FunctionalAdam, {"lr": 0.01, "fused": True}, "device"),
    pytest.param(FunctionalAdam, {"lr": 0.01, "foreach": True, "capturable": True}, "device",
                 marks=gpu_only),  # torch.optim refuses capturable=True on the CPU
    (FunctionalAdagrad, {"lr": 0.1, "foreach": True}, "cpu"),
]


@pytest.mark.parametrize("cls, kwargs, where", PLACEMENT)
def test_step_lives_where_torch_optim_keeps_it(cls, kwargs, where) -> None:
    torch_cls = getattr(torch.optim, cls.__name__[len("Functional"):])
    p = torch.randn(4, 3, device=DEVICE)
    optim = cls([p.clone()], **kwargs)
    optim.step([torch.ones(4, 3, device=DEVICE)])
    ref = p.clone().requires_grad_()
    ref_opt = torch_cls([ref], **kwargs)
    ref.grad = torch.ones(4, 3, device=DEVICE)
    ref_opt.step()
    expected = DEVICE if where == "device" else torch.device("cpu")
    assert ref_opt.state[ref]["step"].device.type == expected.type
    assert optim.state[0]["step"].device.type == expected.type
    # A state whose step is on the other side (a state_dict saved with other options) is
    # moved where this optimizer keeps it, as torch.optim's load_state_dict moves it.
    other = torch.device("cpu") if expected.type != "cpu" else DEVICE
    entry = {k: v.clone() for k, v in optim.state[0].items()}
    entry["step"] = entry["step"].to(other)
    optim.set_state({0: entry})
    assert optim.state[0]["step"].device.type == expected.type
    assert float(optim.state[0]["step"]) == 1.0


def test_adam_and_sgd_use_torchs_fused_kernels_by_default() -> None:
    p = [torch.randn(8, device=DEVICE)]
    assert FunctionalAdam(p).use_fused
    assert FunctionalSGD(p, lr=0.1, momentum=0.9).use_fused


# ---------------------------------------------------------------- several devices


@gpu_only
def test_cpu_and_cuda_parameters_in_one_optimizer() -> None:
    """One optimizer over CPU and CUDA parameters steps each group on its own device, equal
    to torch.optim over the same mix."""
    gen = torch.Generator().manual_seed(3)
    values = [torch.randn(5, 3, generator=gen) for _ in range(4)]
    devices = ["cpu", "cuda", "cpu", "cuda"]
    mine = [v.to(d) for v, d in zip(values, devices)]
    ref = [v.to(d).requires_grad_() for v, d in zip(values, devices)]
    opt = script_optimizer(FunctionalAdam(mine, lr=0.01, foreach=True))
    ref_opt = torch.optim.Adam(ref, lr=0.01, foreach=True)
    for step in range(5):
        grads = [torch.randn(5, 3, generator=gen).to(d) for d in devices]
        _step_torch(ref_opt, ref, [g.clone() for g in grads])
        opt.step([g.clone() for g in grads])
    assert_all_close(mine, ref, "mixed-device params")
    assert [p.device.type for p in mine] == devices


@gpu_only
def test_flat_buffers_are_per_device() -> None:
    gen = torch.Generator().manual_seed(4)
    devices = ["cpu", "cuda"] * 4
    values = [torch.randn(6, generator=gen) for _ in devices]
    mine = [v.to(d) for v, d in zip(values, devices)]
    ref = [v.to(d).requires_grad_() for v, d in zip(values, devices)]
    optim = flatten_parameters(FunctionalAdam(mine, lr=0.01))
    assert sorted(f.param.device.type for f in optim.groups.flats) == ["cpu", "cuda"]
    opt = script_optimizer(optim)
    ref_opt = torch.optim.Adam(ref, lr=0.01)
    for step in range(5):
        grads = [torch.randn(6, generator=gen).to(d) for d in devices]
        _step_torch(ref_opt, ref, [g.clone() for g in grads])
        opt.step([g.clone() for g in grads])
    assert_all_close(mine, ref, "flat params on two devices")


# ---------------------------------------------------------------- CUDA graphs and syncs

CAPTURABLE = [
    (torch.optim.Adam, {"lr": 0.01, "capturable": True}),
    (torch.optim.Adam, {"lr": 0.01, "capturable": True, "foreach": True}),
    (torch.optim.AdamW, {"lr": 0.01, "capturable": True, "foreach": True}),
    (torch.optim.Adamax, {"lr": 0.01, "capturable": True}),
    (torch.optim.NAdam, {"lr": 0.01, "capturable": True}),
    (torch.optim.RAdam, {"lr": 0.01, "capturable": True}),
    (torch.optim.RMSprop, {"lr": 0.01, "capturable": True, "momentum": 0.9, "centered": True}),
    (torch.optim.Rprop, {"lr": 0.01, "capturable": True}),
    (torch.optim.Adadelta, {"lr": 0.5, "capturable": True}),
    (torch.optim.ASGD, {"lr": 0.01, "capturable": True}),
]


def _functional(torch_cls: type):
    from functional import functional_optim_map

    return functional_optim_map[torch_cls]


@gpu_only
@pytest.mark.parametrize("torch_cls, kwargs", CAPTURABLE, ids=[f"{c.__name__}-{k}" for c, k in CAPTURABLE])
def test_capturable_step_replays_in_a_cuda_graph(torch_cls, kwargs) -> None:
    """A compiled capturable step recorded once in ``torch.cuda.graph`` and replayed with new
    gradients copied into the captured ones equals torch.optim stepping eagerly."""
    gen = torch.Generator().manual_seed(5)
    shapes = [(16, 8), (32,), (4, 4, 2)]
    values = [torch.randn(s, generator=gen) for s in shapes]
    mine = [v.cuda() for v in values]
    ref = [v.cuda().requires_grad_() for v in values]
    opt = script_optimizer(_functional(torch_cls)(mine, **kwargs))
    ref_opt = torch_cls(ref, **kwargs)
    static = [torch.zeros(s, device="cuda") for s in shapes]
    all_grads = [[torch.randn(s, generator=gen).cuda() for s in shapes] for _ in range(8)]

    # Warm-up on a side stream (state is created here, before capture), as torch documents.
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for s, g in zip(static, all_grads[0]):
            s.copy_(g)
        opt.step(list(static))
    torch.cuda.current_stream().wait_stream(side)
    _step_torch(ref_opt, ref, [g.clone() for g in all_grads[0]])

    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        opt.step(list(static))
    for grads in all_grads[1:]:
        for s, g in zip(static, grads):
            s.copy_(g)
        graph.replay()
        _step_torch(ref_opt, ref, [g.clone() for g in grads])
    torch.cuda.synchronize()
    assert_all_close(mine, ref, f"{torch_cls.__name__} after graph replays")


SYNC_FREE = CAPTURABLE + [
    (torch.optim.Adam, {"lr": 0.01}),
    (torch.optim.AdamW, {"lr": 0.01}),
    (torch.optim.SGD, {"lr": 0.01, "momentum": 0.9}),
    (torch.optim.Adam, {"lr": 0.01, "foreach": True}),
    (torch.optim.RMSprop, {"lr": 0.01}),
    (torch.optim.Adagrad, {"lr": 0.01}),
]


@gpu_only
@pytest.mark.parametrize("torch_cls, kwargs", SYNC_FREE, ids=[f"{c.__name__}-{k}" for c, k in SYNC_FREE])
def test_a_compiled_step_does_not_synchronise_with_the_host(torch_cls, kwargs) -> None:
    """``torch.cuda.set_sync_debug_mode("error")`` raises at any device synchronisation;
    a compiled step over 50 CUDA parameters makes none (step on the CPU, or capturable)."""
    params = [torch.randn(8, 4, device="cuda") for _ in range(50)]
    grads = [torch.randn(8, 4, device="cuda") for _ in range(50)]
    opt = script_optimizer(_functional(torch_cls)(params, **kwargs))
    opt.step(list(grads))  # state made outside the checked region
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        opt.step(list(grads))
    finally:
        torch.cuda.set_sync_debug_mode("default")


@pytest.mark.parametrize("unscale_first", [False, True], ids=["step", "unscale_-then-step"])
@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
@pytest.mark.parametrize("name, torch_cls, kwargs, overflows", SCALED_CASES,
                         ids=[c[0] for c in SCALED_CASES])
def test_grad_scaler_steps_equal_torch_optim_on_the_device(name, torch_cls, kwargs, overflows,
                                                           compiled, unscale_first) -> None:
    """tests/functional/test_grad_scaling.py's table on the device, each side stepped by a
    ``GradScaler`` of the device's: the same scales and skipped steps, the same parameters
    and state (at this module's tolerances: the CPU run is bit for bit)."""
    try:
        torch_cls([torch.zeros(2, device=DEVICE, requires_grad=True)], **kwargs)
    except RuntimeError as exc:
        # A fused kernel this torch lacks on the device (Adagrad on CUDA in 2.11): both sides
        # step on the kernel they take there without fused=True, the foreach one.
        if not (kwargs.get("fused") and "fused" in str(exc) and DEVICE.type in str(exc)):
            raise
        kwargs = {k: v for k, v in kwargs.items() if k != "fused"}
    check_against_torch(torch_cls, kwargs, overflows, compiled, unscale_first, DEVICE,
                        exact=DEVICE.type == "cpu")
