"""Adam-family options the parity table cannot check against torch.optim on CPU."""
import pytest
import torch

from functional import script_optimizer
from functional.adam import FunctionalAdam, FunctionalAdamW
from functional.adamax import FunctionalAdamax
from functional.nadam import FunctionalNAdam
from functional.radam import FunctionalRAdam

CLASSES = [FunctionalAdam, FunctionalAdamW, FunctionalAdamax, FunctionalNAdam, FunctionalRAdam]


def _run(cls, compiled: bool, **kwargs):
    params = [torch.ones(3, 2), torch.ones(4)]
    optim = cls(params, lr=0.01, **kwargs)
    if compiled:
        optim = script_optimizer(optim)
    gen = torch.Generator().manual_seed(0)
    for _ in range(8):
        optim.step([torch.randn(3, 2, generator=gen), torch.randn(4, generator=gen)])
    return params


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
@pytest.mark.parametrize("cls", CLASSES, ids=lambda c: c.__name__)
def test_capturable_is_accepted_and_changes_nothing(cls, compiled: bool) -> None:
    # torch.optim(capturable=True) refuses CPU parameters, so it cannot be the reference.
    for a, b in zip(_run(cls, compiled, capturable=True), _run(cls, compiled)):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


@pytest.mark.parametrize("cls", CLASSES, ids=lambda c: c.__name__)
def test_sparse_gradients_are_rejected_like_torch(cls) -> None:
    p = torch.zeros(3, 2)
    with pytest.raises(RuntimeError, match="does not support sparse gradients"):
        cls([p]).step([torch.ones(3, 2).to_sparse()])


@pytest.mark.parametrize("cls", [FunctionalAdam, FunctionalAdamW], ids=lambda c: c.__name__)
def test_adam_flag_rules_match_torch(cls) -> None:
    torch_cls = getattr(torch.optim, cls.__name__[len("Functional"):])
    p = [torch.zeros(2, requires_grad=True)]
    for kwargs, error in [
        ({"lr": torch.tensor(0.1), "foreach": True}, ValueError),
        ({"betas": (torch.tensor(0.9), 0.999)}, ValueError),
        ({"betas": (torch.tensor(0.9), torch.tensor(0.99)), "foreach": True}, ValueError),
        ({"fused": True, "differentiable": True}, RuntimeError),
        ({"fused": True, "foreach": True}, RuntimeError),
    ]:
        with pytest.raises(error):
            torch_cls(p, **kwargs)
        with pytest.raises(error):
            cls(p, **kwargs)


def test_adam_tensor_betas_become_floats() -> None:
    optim = FunctionalAdam([torch.zeros(2)], betas=(torch.tensor(0.8), torch.tensor(0.9)))
    assert optim.betas == pytest.approx((0.8, 0.9))
