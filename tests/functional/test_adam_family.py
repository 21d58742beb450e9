"""Adam-family options the parity table cannot check against torch.optim on CPU."""
import pytest
import torch

from functional import script_optimizer, to_torch_state_dict
from functional.adam import FunctionalAdam, FunctionalAdamW
from functional.adamax import FunctionalAdamax
from functional.nadam import FunctionalNAdam
from functional.radam import FunctionalRAdam

CLASSES = [FunctionalAdam, FunctionalAdamW, FunctionalAdamax, FunctionalNAdam, FunctionalRAdam]


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
@pytest.mark.parametrize("cls", CLASSES, ids=lambda c: c.__name__)
def test_capturable_is_recorded_in_the_state_dict(cls, compiled: bool) -> None:
    """capturable, True or False, is kept and handed on in the param group, as torch.optim's
    state_dict has it (the capturable steps' numbers are checked in test_capturable.py)."""
    torch_cls = getattr(torch.optim, cls.__name__[len("Functional"):])
    for capturable in (True, False):
        optim = cls([torch.ones(3, 2)], lr=0.01, capturable=capturable)
        if compiled:
            optim = script_optimizer(optim)
        optim.step([torch.ones(3, 2)])
        group = to_torch_state_dict(optim, torch_cls)["param_groups"][0]
        assert group["capturable"] is capturable


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
