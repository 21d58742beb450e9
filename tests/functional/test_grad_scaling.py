"""Functional optimizers stepped by a ``torch.amp.GradScaler``, against torch.optim stepped by
one, bit for bit: parameters, state and the scale, through skipped (inf) steps.

The classes with a fused kernel (Adam, AdamW, SGD, Adagrad) take the scaler's
``grad_scale`` and ``found_inf`` in ``step_scaled``, as torch.optim's ``fused=True`` classes
do; the others (and the foreach paths) are unscaled in place and skipped after an inf by
``unscale_gradients``, as ``GradScaler.unscale_`` and ``step`` treat torch.optim's. Both go
through ``_FunctionalGroups.step_group_scaled`` compiled (what DataParallelOptimizer runs)
and through the same dispatch in eager Python. ``check_against_torch`` is shared with the
CUDA tests (tests/cuda/test_functional.py).
"""
from typing import Any, List

import pytest
import torch

from distopt.local_optimizer import CompiledLocalOptimizer
from functional import functional_optim_map, to_torch_state_dict
from functional._kernels import unscale_gradients
from tests.helpers import assert_identical

STEPS = 6

#: (id, torch.optim class, keyword arguments for both, the steps whose gradients hold an
#: inf). SGD with momentum on the fused kernel does not skip its first step: torch 2.13's
#: fused SGD keeps the unwritten buffer it made for it (ours keeps none; tested apart).
CASES = [
    ("Adam-fused", torch.optim.Adam, {"lr": 1e-2, "fused": True}, (0, 3)),
    ("AdamW-amsgrad-fused", torch.optim.AdamW,
     {"lr": 1e-2, "amsgrad": True, "fused": True}, (0, 3)),
    ("SGD-momentum-fused", torch.optim.SGD, {"lr": 0.1, "momentum": 0.9, "fused": True}, (2, 3)),
    ("SGD-fused", torch.optim.SGD, {"lr": 0.1, "weight_decay": 0.01, "fused": True}, (0, 3)),
    ("Adagrad-fused", torch.optim.Adagrad, {"lr": 0.1, "fused": True}, (0, 3)),
    ("Adam-foreach", torch.optim.Adam, {"lr": 1e-2, "foreach": True}, (0, 3)),
    ("SGD-momentum-foreach", torch.optim.SGD,
     {"lr": 0.1, "momentum": 0.9, "foreach": True}, (0, 3)),
    ("RMSprop", torch.optim.RMSprop, {"lr": 1e-2, "momentum": 0.5, "foreach": True}, (0, 3)),
    ("NAdam", torch.optim.NAdam, {"lr": 1e-2, "foreach": True}, (0, 3)),
]


class _Stepper:
    """What GradScaler needs of an optimizer whose step takes ``grad_scale`` and
    ``found_inf``: ``param_groups`` and ``step``, here one scaled step of ours."""

    _step_supports_amp_scaling = True

    def __init__(self, params: List[torch.Tensor], step: Any) -> None:
        self.param_groups = [{"params": params}]
        self._scaled_step = step

    def step(self) -> None:
        grads = [p.grad for p in self.param_groups[0]["params"]]
        self._scaled_step(grads, getattr(self, "grad_scale", None), self.found_inf)


def _eager_step(optim: Any) -> Any:
    """``step_group_scaled``'s dispatch, in eager Python."""
    def step(grads, grad_scale, found_inf):
        if hasattr(optim, "step_scaled"):
            optim.step_scaled(grads, grad_scale, found_inf)
        elif not unscale_gradients(grads, grad_scale, found_inf):
            optim.step(grads)
    return step


def check_against_torch(torch_cls: type, kwargs: dict, overflows: Any, compiled: bool,
                        unscale_first: bool, device: torch.device, exact: bool = True) -> None:
    """``STEPS`` steps of ours and of torch.optim, each stepped by a GradScaler of its own
    (``scaler.unscale_(opt)`` first when ``unscale_first``); asserts equal scales, that the
    overflowing steps were skipped, and equal parameters and state (bit for bit when
    ``exact``, else within 1e-5 relative and 1e-6 absolute)."""
    torch.manual_seed(0)
    shapes = [(40,), (3, 5)]
    start = [torch.randn(s, device=device) for s in shapes]
    ref = [p.clone().requires_grad_() for p in start]
    mine = [p.clone().requires_grad_() for p in start]
    ropt = torch_cls(ref, **kwargs)
    if compiled:
        local = CompiledLocalOptimizer(functional_optim_map[torch_cls], torch_cls, [mine],
                                       [[0, 1]], [{}], (), kwargs)

        def step(grads, grad_scale, found_inf):
            local.module.step_group_scaled(0, grads, grad_scale, found_inf)

        def state():
            return local.torch_state(copy=False)
    else:
        optim = functional_optim_map[torch_cls](mine, **kwargs)
        step = _eager_step(optim)

        def state():
            return to_torch_state_dict(optim, torch_cls)["state"]
    ours = _Stepper(mine, step)
    scalers = [torch.amp.GradScaler(device.type, init_scale=1024.0, growth_interval=2)
               for _ in range(2)]
    scales = [[], []]
    for s in range(STEPS):
        scale = scalers[0].get_scale()
        grads = [torch.randn(p.shape, device=device) * scale for p in start]
        if s in overflows:
            grads[1][1, 2] = float("inf")
        for params, opt, scaler, out in zip((ref, mine), (ropt, ours), scalers, scales):
            scaler.scale(torch.ones((), device=device))  # makes the scale, as scale(loss)
            for p, g in zip(params, grads):
                p.grad = g.clone()
            if unscale_first:
                scaler.unscale_(opt)
            scaler.step(opt)
            scaler.update()
            out.append(scaler.get_scale())
    assert scales[0] == scales[1]
    previous = [1024.0] + scales[0][:-1]
    assert [s for s, (a, b) in enumerate(zip(previous, scales[0])) if b < a] == list(overflows)
    if exact:
        for got, want in zip(mine, ref):
            assert torch.equal(got.detach(), want.detach())
        assert_identical(state(), ropt.state_dict()["state"], "state")
        return
    torch.testing.assert_close([p.detach() for p in mine], [p.detach() for p in ref],
                               rtol=1e-5, atol=1e-6)
    want = ropt.state_dict()["state"]
    got = state()
    assert sorted(got) == sorted(want)
    for i in want:
        assert sorted(got[i]) == sorted(want[i])
        torch.testing.assert_close(got[i], want[i], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("unscale_first", [False, True], ids=["step", "unscale_-then-step"])
@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
@pytest.mark.parametrize("name, torch_cls, kwargs, overflows", CASES, ids=[c[0] for c in CASES])
def test_scaled_steps_equal_torch_optim_under_a_grad_scaler(name, torch_cls, kwargs, overflows,
                                                            compiled, unscale_first):
    check_against_torch(torch_cls, kwargs, overflows, compiled, unscale_first,
                        torch.device("cpu"))


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_a_skipped_first_momentum_step_keeps_no_buffer(compiled):
    """Fused SGD with momentum whose first step is skipped: no momentum buffer is kept, so
    the next step is a first one (b_1 = g), as torch.optim's foreach SGD under a GradScaler
    leaves it (its fused SGD keeps the uninitialized buffer it made)."""
    from functional import FunctionalSGD

    params = [torch.ones(40), torch.ones(3, 5)]
    grads = [torch.full((40,), 2.0), torch.full((3, 5), 2.0)]
    if compiled:
        local = CompiledLocalOptimizer(FunctionalSGD, torch.optim.SGD, [params], [[0, 1]], [{}],
                                       (), {"lr": 0.1, "momentum": 0.9})
        step = local.module.step_group_scaled
        state = local.torch_state
    else:
        optim = FunctionalSGD(params, lr=0.1, momentum=0.9)
        step = lambda _, *args: optim.step_scaled(*args)  # noqa: E731
        state = lambda: to_torch_state_dict(optim, torch.optim.SGD)["state"]  # noqa: E731
    step(0, [g.clone() for g in grads], torch.full((), 2.0), torch.ones(()))
    assert state() == {}
    assert all(torch.equal(p, torch.ones_like(p)) for p in params)
    step(0, [g.clone() for g in grads], torch.full((), 2.0), torch.zeros(()))
    assert torch.equal(state()[0]["momentum_buffer"], torch.ones(40))  # b_1 = g / 2
    assert torch.equal(params[0], torch.full((40,), 0.9))
