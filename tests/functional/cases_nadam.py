"""Parity cases for FunctionalNAdam: every option of torch.optim.NAdam."""
import torch

from functional.nadam import FunctionalNAdam

from .case import Case

_T, _F = torch.optim.NAdam, FunctionalNAdam

CASES = [
    Case(_T, _F, {}),
    Case(_T, _F, {"lr": 0.01}),
    Case(_T, _F, {"lr": 0.01, "betas": (0.8, 0.99), "eps": 1e-6}),
    Case(_T, _F, {"lr": 0.01, "momentum_decay": 0.1}),
    Case(_T, _F, {"lr": 0.01, "maximize": True}),
    Case(_T, _F, {"lr": 0.01, "weight_decay": 0.1}),
    Case(_T, _F, {"lr": 0.01, "weight_decay": 0.1, "decoupled_weight_decay": True}),
    Case(_T, _F, {"lr": 0.01, "weight_decay": 0.1, "maximize": True}),
    Case(_T, _F, {"lr": 0.01, "weight_decay": 0.1, "decoupled_weight_decay": True,
                  "maximize": True, "momentum_decay": 0.01}),
    Case(_T, _F, {"lr": 0.01, "foreach": True}),
    Case(_T, _F, {"lr": 0.01, "weight_decay": 0.1, "maximize": True, "foreach": True}),
    Case(_T, _F, {"lr": 0.01, "weight_decay": 0.1, "decoupled_weight_decay": True,
                  "foreach": True}),
    Case(_T, _F, {"lr": 0.01, "foreach": False}),
    Case(_T, _F, {"lr": torch.tensor(0.01)}),
    Case(_T, _F, {"lr": torch.tensor(0.01), "weight_decay": 0.1, "foreach": True}),
    Case(_T, _F, {"lr": 0.01, "weight_decay": 0.1}, dtype=torch.float64),
    Case(_T, _F, {"lr": 0.01, "decoupled_weight_decay": True, "weight_decay": 0.1,
                  "foreach": True}, dtype=torch.float64),
    # torch.optim.NAdam(differentiable=True) cannot step leaf parameters (an in-place update
    # of a leaf that requires grad); its plain step is the reference.
    Case(_T, _F, {"lr": 0.01, "differentiable": True}, torch_kwargs={"lr": 0.01}),
]
