"""functional_optim_map and register_functional_optimizer."""
import pytest
import torch

import functional
from functional import functional_optim_map, register_functional_optimizer, script_optimizer

from .user_optimizers import FunctionalSignSGD, NotScriptable, SignSGD


@pytest.fixture
def restore_map():
    saved = dict(functional_optim_map)
    yield
    functional_optim_map.clear()
    functional_optim_map.update(saved)


def test_registered_class_is_mapped_and_compiles(restore_map) -> None:
    register_functional_optimizer(SignSGD, FunctionalSignSGD)
    assert functional_optim_map[SignSGD] is FunctionalSignSGD
    p = torch.zeros(3)
    compiled = script_optimizer(FunctionalSignSGD([p], lr=0.5))
    compiled.step([torch.tensor([1.0, -2.0, 0.0])])
    assert torch.equal(p, torch.tensor([-0.5, 0.5, 0.0]))
    ref = torch.zeros(3, requires_grad=True)
    ref.grad = torch.tensor([1.0, -2.0, 0.0])
    SignSGD([ref], lr=0.5).step()
    assert torch.equal(p, ref.detach())


def test_class_that_does_not_compile_is_rejected(restore_map) -> None:
    with pytest.raises(TypeError, match=r"NotScriptable does not compile with TorchScript"):
        register_functional_optimizer(SignSGD, NotScriptable)
    assert SignSGD not in functional_optim_map


def test_class_missing_methods_is_rejected(restore_map) -> None:
    class NoStep:
        pass

    with pytest.raises(TypeError, match=r"NoStep lacks \['step', 'step_param'"):
        register_functional_optimizer(SignSGD, NoStep)


def test_arguments_must_be_classes(restore_map) -> None:
    with pytest.raises(TypeError, match=r"Invalid optim_cls: 'SGD'"):
        register_functional_optimizer("SGD", FunctionalSignSGD)
    with pytest.raises(TypeError, match=r"Invalid functional_cls: 3"):
        register_functional_optimizer(SignSGD, 3)


def test_public_names_are_exported() -> None:
    for name in functional.__all__:
        assert hasattr(functional, name), name
    assert "FunctionalAdam" in functional.__all__
