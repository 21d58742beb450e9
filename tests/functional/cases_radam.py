"""Parity cases for FunctionalRAdam: every option of torch.optim.RAdam.

With the default betas rho_t first exceeds 5 at step 6, so 12 steps cover both the
unrectified and the rectified update; betas[1] = 0.5 keeps it unrectified throughout.
"""
import torch

from functional.radam import FunctionalRAdam

from .case import Case

_T, _F = torch.optim.RAdam, FunctionalRAdam

CASES = [
    Case(_T, _F, {}),
    Case(_T, _F, {"lr": 0.01}),
    Case(_T, _F, {"lr": 0.01, "betas": (0.8, 0.99), "eps": 1e-6}),
    Case(_T, _F, {"lr": 0.01, "betas": (0.9, 0.5)}),
    Case(_T, _F, {"lr": 0.01, "maximize": True}),
    Case(_T, _F, {"lr": 0.01, "weight_decay": 0.1}),
    Case(_T, _F, {"lr": 0.01, "weight_decay": 0.1, "decoupled_weight_decay": True}),
    Case(_T, _F, {"lr": 0.01, "weight_decay": 0.1, "maximize": True}),
    Case(_T, _F, {"lr": 0.01, "weight_decay": 0.1, "decoupled_weight_decay": True,
                  "maximize": True}),
    Case(_T, _F, {"lr": 0.01, "foreach": True}),
    Case(_T, _F, {"lr": 0.01, "weight_decay": 0.1, "maximize": True, "foreach": True}),
    Case(_T, _F, {"lr": 0.01, "weight_decay": 0.1, "decoupled_weight_decay": True,
                  "foreach": True}),
    Case(_T, _F, {"lr": 0.01, "foreach": False}),
    Case(_T, _F, {"lr": torch.tensor(0.01)}),
    Case(_T, _F, {"lr": torch.tensor(0.01), "weight_decay": 0.1, "decoupled_weight_decay": True,
                  "foreach": True}),
    Case(_T, _F, {"lr": 0.01, "weight_decay": 0.1}, dtype=torch.float64),
    Case(_T, _F, {"lr": 0.01, "maximize": True, "foreach": True}, dtype=torch.float64),
    # torch.optim.RAdam(differentiable=True) cannot step leaf parameters (an in-place update
    # of a leaf that requires grad); its plain step is the reference.
    Case(_T, _F, {"lr": 0.01, "differentiable": True}, torch_kwargs={"lr": 0.01}),
]
