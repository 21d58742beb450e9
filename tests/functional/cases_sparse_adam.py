"""Parity cases for FunctionalSparseAdam: every option of torch.optim.SparseAdam."""
import torch

from functional.sparse_adam import FunctionalSparseAdam

from .case import Case

_A = torch.optim.SparseAdam
_F = FunctionalSparseAdam

CASES = [
    Case(_A, _F, {}, sparse=True),
    Case(_A, _F, {"lr": 0.1}, sparse=True),
    Case(_A, _F, {"lr": 0.1, "betas": (0.5, 0.9)}, sparse=True),
    Case(_A, _F, {"lr": 0.1, "eps": 1e-3}, sparse=True),
    Case(_A, _F, {"lr": 0.1, "maximize": True}, sparse=True),
    Case(_A, _F, {"lr": torch.tensor(0.05)}, sparse=True),
    Case(_A, _F, {"lr": 0.1, "betas": (0.0, 0.99), "maximize": True}, sparse=True),
    Case(_A, _F, {"lr": 0.1}, sparse=True, dtype=torch.float64),
]
