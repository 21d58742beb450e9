"""Parity cases for FunctionalAdafactor: every option of torch.optim.Adafactor."""
import torch

from functional.adafactor import FunctionalAdafactor

from .case import Case

_A = torch.optim.Adafactor
_F = FunctionalAdafactor
# A 0-dim parameter (kept unfactored, like a vector) and a 4-D one (factored over its last two).
_ODD_SHAPES = ((), (3, 2, 4, 5), (7,), (1, 6))

CASES = [
    Case(_A, _F, {}),
    Case(_A, _F, {"lr": 0.1}),
    Case(_A, _F, {"lr": 0.1, "foreach": True}),
    Case(_A, _F, {"lr": 0.1, "foreach": False}),
    Case(_A, _F, {"lr": 0.1, "beta2_decay": -0.5}),
    Case(_A, _F, {"lr": 0.1, "eps": (1e-4, 1e-2)}),
    Case(_A, _F, {"lr": 0.1, "eps": (None, 0.5), "foreach": True}),
    Case(_A, _F, {"lr": 0.1, "d": 2.0}),
    Case(_A, _F, {"lr": 0.1, "weight_decay": 0.1}),
    Case(_A, _F, {"lr": 0.1, "weight_decay": 0.1, "foreach": True}),
    Case(_A, _F, {"lr": 0.1, "maximize": True}),
    Case(_A, _F, {"lr": 0.1, "maximize": True, "weight_decay": 0.05, "foreach": True}),
    Case(_A, _F, {"lr": torch.tensor(0.05)}),
    Case(_A, _F, {"lr": torch.tensor(0.05), "weight_decay": 0.1, "foreach": True}),
    Case(_A, _F, {"lr": 0.1, "weight_decay": 0.1}, dtype=torch.float64),
    Case(_A, _F, {"lr": 0.1, "foreach": True}, dtype=torch.float64),
    Case(_A, _F, {"lr": 0.1, "weight_decay": 0.1}, shapes=_ODD_SHAPES),
    Case(_A, _F, {"lr": 0.1, "foreach": True, "d": 1.5}, shapes=_ODD_SHAPES),
]
