"""Parity cases for FunctionalRprop: every option of torch.optim.Rprop."""
import torch

from functional.rprop import FunctionalRprop

from .case import Case

_R = torch.optim.Rprop
_F = FunctionalRprop

CASES = [
    Case(_R, _F, {}),
    Case(_R, _F, {"lr": 0.05}),
    Case(_R, _F, {"lr": 0.05, "etas": (0.3, 1.5)}),
    # Tight bounds, so that clamping happens at both ends.
    Case(_R, _F, {"lr": 0.05, "step_sizes": (0.03, 0.08)}),
    Case(_R, _F, {"lr": 0.05, "maximize": True}),
    Case(_R, _F, {"lr": 0.05, "etas": (0.4, 1.3), "step_sizes": (1e-3, 0.1), "maximize": True}),
    Case(_R, _F, {"lr": 0.05, "foreach": True}),
    Case(_R, _F, {"lr": 0.05, "maximize": True, "foreach": True}),
    Case(_R, _F, {"lr": 0.05, "foreach": False}),
    # torch.optim's differentiable=True update of leaf parameters that require grad is
    # refused by autograd; its plain run is the reference. (capturable=True, which torch.optim
    # runs on the CPU only with its device check patched, is in test_capturable.py.)
    Case(_R, _F, {"lr": 0.05, "differentiable": True}, torch_kwargs={"lr": 0.05}),
    Case(_R, _F, {"lr": torch.tensor(0.05)}),
    Case(_R, _F, {"lr": torch.tensor(0.05), "maximize": True, "foreach": True}),
    Case(_R, _F, {"lr": 0.05, "etas": (0.3, 1.5), "maximize": True}, dtype=torch.float64),
]
