"""Parity cases for FunctionalASGD: every option of torch.optim.ASGD."""
import torch

from functional.asgd import FunctionalASGD

from .case import Case

_A = torch.optim.ASGD
_F = FunctionalASGD

CASES = [
    Case(_A, _F, {}),
    Case(_A, _F, {"lr": 0.1}),
    # A large lambd and alpha make eta fall fast; a small t0 starts the averaging (mu < 1).
    Case(_A, _F, {"lr": 0.1, "lambd": 0.5}),
    Case(_A, _F, {"lr": 0.1, "lambd": 0.5, "alpha": 1.5}),
    Case(_A, _F, {"lr": 0.1, "t0": 3.0}),
    Case(_A, _F, {"lr": 0.1, "t0": 0.0, "lambd": 0.1}),
    Case(_A, _F, {"lr": 0.1, "weight_decay": 0.1}),
    Case(_A, _F, {"lr": 0.1, "maximize": True}),
    Case(_A, _F, {"lr": 0.1, "weight_decay": 0.1, "maximize": True, "t0": 2.0, "lambd": 0.1}),
    Case(_A, _F, {"lr": 0.1, "weight_decay": 0.1, "t0": 3.0, "foreach": True}),
    Case(_A, _F, {"lr": 0.1, "weight_decay": 0.1, "maximize": True, "t0": 2.0, "foreach": True}),
    Case(_A, _F, {"lr": 0.1, "t0": 3.0, "foreach": False}),
    # torch.optim's differentiable=True update of leaf parameters that require grad is
    # refused by autograd; its plain run is the reference. (capturable=True, which torch.optim
    # runs on the CPU only with its device check patched, is in test_capturable.py.)
    Case(_A, _F, {"lr": 0.1, "differentiable": True}, torch_kwargs={"lr": 0.1}),
    Case(_A, _F, {"lr": torch.tensor(0.1), "t0": 3.0, "lambd": 0.1}),
    Case(_A, _F, {"lr": torch.tensor(0.1), "t0": 3.0, "foreach": True}),
    Case(_A, _F, {"lr": 0.1, "t0": 3.0, "lambd": 0.1, "weight_decay": 0.1}, dtype=torch.float64),
]
