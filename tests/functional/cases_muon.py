"""Parity cases for FunctionalMuon: every option of torch.optim.Muon (2-D parameters only)."""
import torch

from functional.muon import FunctionalMuon

from .case import Case

_A = torch.optim.Muon
_F = FunctionalMuon
# Tall, wide and square matrices: the Newton-Schulz iteration transposes tall ones.
_SHAPES = ((5, 3), (4, 6), (8, 8), (7, 2))

CASES = [
    Case(_A, _F, {}, shapes=_SHAPES),
    Case(_A, _F, {"lr": 0.02}, shapes=_SHAPES),
    Case(_A, _F, {"lr": 0.02, "weight_decay": 0.0}, shapes=_SHAPES),
    Case(_A, _F, {"lr": 0.02, "momentum": 0.9, "nesterov": False}, shapes=_SHAPES),
    Case(_A, _F, {"lr": 0.02, "momentum": 0.0}, shapes=_SHAPES),
    Case(_A, _F, {"lr": 0.02, "ns_coefficients": (2.0, -1.5, 0.5)}, shapes=_SHAPES),
    Case(_A, _F, {"lr": 0.02, "eps": 1e-3}, shapes=_SHAPES),
    Case(_A, _F, {"lr": 0.02, "ns_steps": 2}, shapes=_SHAPES),
    Case(_A, _F, {"lr": 0.02, "ns_steps": 0}, shapes=_SHAPES),
    Case(_A, _F, {"lr": 0.02, "adjust_lr_fn": "original"}, shapes=_SHAPES),
    Case(_A, _F, {"lr": 0.02, "adjust_lr_fn": "match_rms_adamw"}, shapes=_SHAPES),
    Case(_A, _F, {"lr": 0.02, "weight_decay": 0.2, "nesterov": False,
                  "adjust_lr_fn": "match_rms_adamw"}, shapes=_SHAPES),
    Case(_A, _F, {"lr": 0.02}, shapes=_SHAPES, dtype=torch.float64),
]
