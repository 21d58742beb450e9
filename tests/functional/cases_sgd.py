"""Parity cases for FunctionalSGD: every option of torch.optim.SGD."""
import torch

from functional.sgd import FunctionalSGD

from .case import Case

CASES = [
    Case(torch.optim.SGD, FunctionalSGD, {}),
    Case(torch.optim.SGD, FunctionalSGD, {"lr": 0.1}),
    Case(torch.optim.SGD, FunctionalSGD, {"lr": 0.1, "momentum": 0.9}),
    Case(torch.optim.SGD, FunctionalSGD, {"lr": 0.1, "momentum": 0.9, "dampening": 0.3}),
    Case(torch.optim.SGD, FunctionalSGD, {"lr": 0.1, "momentum": 0.9, "nesterov": True}),
    Case(torch.optim.SGD, FunctionalSGD, {"lr": 0.1, "weight_decay": 0.1}),
    Case(torch.optim.SGD, FunctionalSGD, {"lr": 0.1, "momentum": 0.5, "weight_decay": 0.1, "maximize": True}),
    Case(torch.optim.SGD, FunctionalSGD, {"lr": 0.1, "momentum": 0.9, "fused": False}),
    Case(torch.optim.SGD, FunctionalSGD, {"lr": 0.1, "momentum": 0.9, "foreach": True}),
    # torch.optim.SGD(fused=True) itself fails when some parameters have a momentum buffer and
    # others do not yet (a None gradient earlier); its for-loop implementation is the reference.
    Case(torch.optim.SGD, FunctionalSGD, {"lr": 0.1, "momentum": 0.9, "fused": True},
         torch_kwargs={"lr": 0.1, "momentum": 0.9}),
    Case(torch.optim.SGD, FunctionalSGD, {"lr": 0.1, "momentum": 0.9, "foreach": False}),
    Case(torch.optim.SGD, FunctionalSGD, {"lr": torch.tensor(0.05), "momentum": 0.9}),
    Case(torch.optim.SGD, FunctionalSGD, {"lr": 0.1, "momentum": 0.9}, dtype=torch.float64),
    Case(torch.optim.SGD, FunctionalSGD, {"lr": 0.1}, sparse=True),
    Case(torch.optim.SGD, FunctionalSGD, {"lr": 0.1, "momentum": 0.9, "nesterov": True}, sparse=True),
]
