"""Parity cases for FunctionalAdam and FunctionalAdamW: every option of torch.optim.Adam/AdamW."""
import torch

from functional.adam import FunctionalAdam, FunctionalAdamW

from .case import Case

_A, _FA = torch.optim.Adam, FunctionalAdam
_W, _FW = torch.optim.AdamW, FunctionalAdamW

CASES = [
    Case(_A, _FA, {}),
    Case(_A, _FA, {"lr": 0.01}),
    Case(_A, _FA, {"lr": 0.01, "betas": (0.8, 0.99), "eps": 1e-6}),
    Case(_A, _FA, {"lr": 0.01, "amsgrad": True}),
    Case(_A, _FA, {"lr": 0.01, "maximize": True}),
    Case(_A, _FA, {"lr": 0.01, "weight_decay": 0.1}),
    Case(_A, _FA, {"lr": 0.01, "weight_decay": 0.1, "decoupled_weight_decay": True}),
    Case(_A, _FA, {"lr": 0.01, "weight_decay": 0.1, "amsgrad": True, "maximize": True}),
    Case(_A, _FA, {"lr": 0.01, "weight_decay": 0.1, "decoupled_weight_decay": True,
                   "amsgrad": True, "maximize": True}),
    Case(_A, _FA, {"lr": 0.01, "fused": True}),
    Case(_A, _FA, {"lr": 0.01, "weight_decay": 0.1, "amsgrad": True, "fused": True}),
    Case(_A, _FA, {"lr": 0.01, "fused": False}),
    Case(_A, _FA, {"lr": 0.01, "foreach": True}),
    Case(_A, _FA, {"lr": 0.01, "foreach": False}),
    Case(_A, _FA, {"lr": 0.01, "weight_decay": 0.1, "amsgrad": True, "maximize": True,
                   "foreach": True}),
    Case(_A, _FA, {"lr": 0.01, "weight_decay": 0.1, "decoupled_weight_decay": True,
                   "amsgrad": True, "maximize": True, "foreach": True}),
    Case(_A, _FA, {"lr": torch.tensor(0.01)}),
    Case(_A, _FA, {"lr": torch.tensor(0.01), "amsgrad": True, "fused": False}),
    Case(_A, _FA, {"lr": 0.01, "amsgrad": True}, dtype=torch.float64),
    Case(_A, _FA, {"lr": 0.01, "weight_decay": 0.1, "foreach": True}, dtype=torch.float64),
    # torch.optim.Adam(differentiable=True) cannot step leaf parameters (an in-place update
    # of a leaf that requires grad); its plain step is the reference.
    Case(_A, _FA, {"lr": 0.01, "differentiable": True}, torch_kwargs={"lr": 0.01}),
    Case(_W, _FW, {}),
    Case(_W, _FW, {"lr": 0.01}),
    Case(_W, _FW, {"lr": 0.01, "betas": (0.8, 0.99), "eps": 1e-6, "weight_decay": 0.1}),
    Case(_W, _FW, {"lr": 0.01, "weight_decay": 0.0}),
    Case(_W, _FW, {"lr": 0.01, "amsgrad": True}),
    Case(_W, _FW, {"lr": 0.01, "maximize": True}),
    Case(_W, _FW, {"lr": 0.01, "amsgrad": True, "maximize": True, "weight_decay": 0.1}),
    Case(_W, _FW, {"lr": 0.01, "fused": True}),
    Case(_W, _FW, {"lr": 0.01, "amsgrad": True, "fused": True}),
    Case(_W, _FW, {"lr": 0.01, "fused": False}),
    Case(_W, _FW, {"lr": 0.01, "foreach": True}),
    Case(_W, _FW, {"lr": 0.01, "amsgrad": True, "maximize": True, "foreach": True}),
    Case(_W, _FW, {"lr": torch.tensor(0.01)}),
    Case(_W, _FW, {"lr": torch.tensor(0.01), "fused": False}),
    Case(_W, _FW, {"lr": 0.01, "amsgrad": True}, dtype=torch.float64),
    Case(_W, _FW, {"lr": 0.01, "foreach": True}, dtype=torch.float64),
    # See the Adam case above.
    Case(_W, _FW, {"lr": 0.01, "differentiable": True}, torch_kwargs={"lr": 0.01}),
]
