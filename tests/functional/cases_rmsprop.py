"""Parity cases for FunctionalRMSprop: every option of torch.optim.RMSprop."""
import torch

from functional.rmsprop import FunctionalRMSprop

from .case import Case

_R = torch.optim.RMSprop
_F = FunctionalRMSprop

CASES = [
    Case(_R, _F, {}),
    Case(_R, _F, {"lr": 0.05}),
    Case(_R, _F, {"lr": 0.05, "alpha": 0.5}),
    Case(_R, _F, {"lr": 0.05, "eps": 1e-3}),
    Case(_R, _F, {"lr": 0.05, "weight_decay": 0.1}),
    Case(_R, _F, {"lr": 0.05, "momentum": 0.9}),
    Case(_R, _F, {"lr": 0.05, "centered": True}),
    Case(_R, _F, {"lr": 0.05, "momentum": 0.9, "centered": True}),
    Case(_R, _F, {"lr": 0.05, "maximize": True}),
    Case(_R, _F, {"lr": 0.05, "momentum": 0.5, "centered": True, "weight_decay": 0.1,
                  "maximize": True}),
    Case(_R, _F, {"lr": 0.05, "weight_decay": 0.1, "foreach": True}),
    Case(_R, _F, {"lr": 0.05, "momentum": 0.9, "centered": True, "weight_decay": 0.1,
                  "maximize": True, "foreach": True}),
    Case(_R, _F, {"lr": 0.05, "momentum": 0.9, "foreach": False}),
    # torch.optim's differentiable=True update of leaf parameters that require grad is
    # refused by autograd; its plain run is the reference. (capturable=True, which torch.optim
    # runs on the CPU only with its device check patched, is in test_capturable.py.)
    Case(_R, _F, {"lr": 0.05, "centered": True, "differentiable": True},
         torch_kwargs={"lr": 0.05, "centered": True}),
    Case(_R, _F, {"lr": torch.tensor(0.05), "momentum": 0.9}),
    Case(_R, _F, {"lr": torch.tensor(0.05), "centered": True, "foreach": True}),
    Case(_R, _F, {"lr": 0.05, "momentum": 0.9, "centered": True, "weight_decay": 0.1},
         dtype=torch.float64),
]
