"""Parity cases for FunctionalAdagrad: every option of torch.optim.Adagrad."""
import torch

from functional.adagrad import FunctionalAdagrad

from .case import Case

_A = torch.optim.Adagrad
_F = FunctionalAdagrad

CASES = [
    Case(_A, _F, {}),
    Case(_A, _F, {"lr": 0.1}),
    Case(_A, _F, {"lr": 0.1, "lr_decay": 0.05}),
    Case(_A, _F, {"lr": 0.1, "weight_decay": 0.1}),
    Case(_A, _F, {"lr": 0.1, "initial_accumulator_value": 0.5}),
    Case(_A, _F, {"lr": 0.1, "eps": 1e-3}),
    Case(_A, _F, {"lr": 0.1, "maximize": True}),
    Case(_A, _F, {"lr": 0.1, "weight_decay": 0.1, "maximize": True, "lr_decay": 0.01}),
    Case(_A, _F, {"lr": 0.1, "weight_decay": 0.1, "foreach": True}),
    Case(_A, _F, {"lr": 0.1, "weight_decay": 0.1, "maximize": True, "foreach": True}),
    Case(_A, _F, {"lr": 0.1, "lr_decay": 0.05, "foreach": True, "initial_accumulator_value": 0.2}),
    Case(_A, _F, {"lr": 0.1, "foreach": False}),
    Case(_A, _F, {"lr": 0.1, "weight_decay": 0.1, "fused": True}),
    Case(_A, _F, {"lr": 0.1, "lr_decay": 0.05, "maximize": True, "fused": True}),
    Case(_A, _F, {"lr": 0.1, "weight_decay": 0.1, "fused": False}),
    Case(_A, _F, {"lr": torch.tensor(0.05), "lr_decay": 0.01}),
    Case(_A, _F, {"lr": torch.tensor(0.05), "foreach": True}),
    # torch.optim with differentiable=True updates leaf parameters that require grad in place,
    # which autograd refuses; its differentiable=False run is the reference.
    Case(_A, _F, {"lr": 0.1, "differentiable": True}, torch_kwargs={"lr": 0.1}),
    Case(_A, _F, {"lr": 0.1, "weight_decay": 0.1, "lr_decay": 0.01}, dtype=torch.float64),
    Case(_A, _F, {"lr": 0.1, "fused": True}, dtype=torch.float64),
    Case(_A, _F, {"lr": 0.1}, sparse=True),
    Case(_A, _F, {"lr": 0.1, "lr_decay": 0.05, "maximize": True, "initial_accumulator_value": 0.1},
         sparse=True),
    Case(_A, _F, {"lr": 0.1, "foreach": True}, sparse=True),
    Case(_A, _F, {"lr": 0.1}, sparse=True, dtype=torch.float64),
]
