"""Parity cases for FunctionalAdadelta: every option of torch.optim.Adadelta."""
import torch

from functional.adadelta import FunctionalAdadelta

from .case import Case

_A = torch.optim.Adadelta
_F = FunctionalAdadelta

CASES = [
    Case(_A, _F, {}),
    Case(_A, _F, {"lr": 0.5}),
    Case(_A, _F, {"lr": 0.5, "rho": 0.5}),
    Case(_A, _F, {"lr": 0.5, "rho": 1.0}),
    Case(_A, _F, {"lr": 0.5, "eps": 1e-3}),
    Case(_A, _F, {"lr": 0.5, "weight_decay": 0.1}),
    Case(_A, _F, {"lr": 0.5, "maximize": True}),
    Case(_A, _F, {"lr": 0.5, "weight_decay": 0.1, "maximize": True, "rho": 0.8}),
    Case(_A, _F, {"lr": 0.5, "weight_decay": 0.1, "foreach": True}),
    Case(_A, _F, {"lr": 0.5, "weight_decay": 0.1, "maximize": True, "foreach": True}),
    Case(_A, _F, {"lr": 0.5, "foreach": False}),
    # torch.optim's differentiable=True update of leaf parameters that require grad is
    # refused by autograd; its plain run is the reference. (capturable=True, which torch.optim
    # runs on the CPU only with its device check patched, is in test_capturable.py.)
    Case(_A, _F, {"lr": 0.5, "differentiable": True}, torch_kwargs={"lr": 0.5}),
    Case(_A, _F, {"lr": torch.tensor(0.5), "weight_decay": 0.1}),
    Case(_A, _F, {"lr": torch.tensor(0.5), "foreach": True}),
    Case(_A, _F, {"lr": 0.5, "weight_decay": 0.1, "maximize": True}, dtype=torch.float64),
]
