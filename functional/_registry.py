"""Which functional optimizer stands in for which torch.optim class."""
import inspect
from typing import Dict

from functional._compile import ensure_scripted
from functional.adadelta import FunctionalAdadelta
from functional.adafactor import FunctionalAdafactor
from functional.adagrad import FunctionalAdagrad
from functional.adam import FunctionalAdam, FunctionalAdamW
from functional.adamax import FunctionalAdamax
from functional.asgd import FunctionalASGD
from functional.blockwise_adam import (
    Adam8bit,
    AdamW4bit,
    AdamW8bit,
    FunctionalAdam8bit,
    FunctionalAdamW4bit,
    FunctionalAdamW8bit,
)
from functional.muon import FunctionalMuon
from functional.nadam import FunctionalNAdam
from functional.radam import FunctionalRAdam
from functional.rmsprop import FunctionalRMSprop
from functional.rprop import FunctionalRprop
from functional.sgd import FunctionalSGD
from functional.sparse_adam import FunctionalSparseAdam

import torch

#: torch.optim class -> functional class. Users add their own with
#: ``register_functional_optimizer``.
functional_optim_map: Dict[type, type] = {
    torch.optim.SGD: FunctionalSGD,
    torch.optim.Adam: FunctionalAdam,
    torch.optim.AdamW: FunctionalAdamW,
    torch.optim.Adagrad: FunctionalAdagrad,
    torch.optim.Adadelta: FunctionalAdadelta,
    torch.optim.Adamax: FunctionalAdamax,
    torch.optim.RMSprop: FunctionalRMSprop,
    torch.optim.Rprop: FunctionalRprop,
    torch.optim.NAdam: FunctionalNAdam,
    torch.optim.RAdam: FunctionalRAdam,
    torch.optim.ASGD: FunctionalASGD,
    torch.optim.Adafactor: FunctionalAdafactor,
    torch.optim.SparseAdam: FunctionalSparseAdam,
    torch.optim.Muon: FunctionalMuon,
    # distopt's own torch.optim classes (public as distopt.optim.*): 8-bit and 4-bit state
    Adam8bit: FunctionalAdam8bit,
    AdamW8bit: FunctionalAdamW8bit,
    AdamW4bit: FunctionalAdamW4bit,
}

_REQUIRED_METHODS = ("step", "step_param", "set_hyperparameter", "set_state")


def register_functional_optimizer(optim_cls: type, functional_cls: type) -> None:
    """Make ``functional_cls`` the compiled stand-in for ``optim_cls``.

    The class is compiled with TorchScript here, so a class that cannot run GIL-free is
    rejected at once rather than on some worker at the first step.

    Args:
        optim_cls: the class users pass (a torch.optim.Optimizer subclass or any class).
        functional_cls: a class with ``__init__(params: List[Tensor], ...)`` and the methods
            ``step(gradients)``, ``step_param(param, grad)``, ``set_hyperparameter(name,
            value)`` and ``set_state(state)``, whose state is ``self.state``.

    Raises:
        TypeError: if either argument is not a class, a method is missing, or
            ``functional_cls`` does not compile with TorchScript.
    """
    if not inspect.isclass(optim_cls):
        raise TypeError(f"Invalid optim_cls: {optim_cls!r} (expected a class)")
    if not inspect.isclass(functional_cls):
        raise TypeError(f"Invalid functional_cls: {functional_cls!r} (expected a class)")
    missing = [m for m in _REQUIRED_METHODS if not callable(getattr(functional_cls, m, None))]
    if missing:
        raise TypeError(
            f"Invalid functional_cls: {functional_cls.__name__} lacks {missing!r} "
            f"(expected methods {list(_REQUIRED_METHODS)!r})"
        )
    try:
        ensure_scripted(functional_cls)
    except Exception as exc:  # TorchScript raises RuntimeError, NotSupportedError, OSError...
        raise TypeError(
            f"Invalid functional_cls: {functional_cls.__name__} does not compile with "
            f"TorchScript: {exc}"
        ) from exc
    functional_optim_map[optim_cls] = functional_cls
