"""Argument checks run when a functional optimizer is constructed (always in Python).

Constructors are compiled by TorchScript but only ever executed eagerly, so they call these
checks under ``if not torch.jit.is_scripting():``, which the compiler skips: the checks stay
plain Python and keep ``!r`` formatting, which TorchScript f-strings lack.
"""
from typing import List, Optional, Tuple, Union

import torch
from torch import Tensor


def check_params(params: List[Tensor]) -> None:
    """``params`` must be a non-empty list of tensors."""
    if not isinstance(params, (list, tuple)):
        raise TypeError(f"Invalid params: {type(params).__name__} (expected a list of Tensors)")
    if len(params) == 0:
        raise ValueError("Invalid params: [] (expected at least one Tensor)")
    for i, p in enumerate(params):
        if not isinstance(p, Tensor):
            raise TypeError(f"Invalid params[{i}]: {type(p).__name__} (expected a Tensor)")


def check_lr(lr: Union[float, Tensor]) -> None:
    """``lr`` must be >= 0; a Tensor lr must hold one element."""
    if isinstance(lr, Tensor):
        if lr.numel() != 1:
            raise ValueError(f"Invalid lr: Tensor of shape {tuple(lr.shape)} (expected 1 element)")
        value = float(lr.item())
    else:
        value = float(lr)
    if not value >= 0.0:
        raise ValueError(f"Invalid lr: {lr!r} (expected >= 0)")


def check_at_least(name: str, value: float, low: float) -> None:
    """``value`` must be >= ``low``."""
    if not value >= low:
        raise ValueError(f"Invalid {name}: {value!r} (expected >= {low!r})")


def check_in_range(name: str, value: float, low: float, high: float, high_open: bool) -> None:
    """``low <= value < high`` (or ``<= high`` when ``high_open`` is False)."""
    ok = low <= value < high if high_open else low <= value <= high
    if not ok:
        bracket = ")" if high_open else "]"
        raise ValueError(f"Invalid {name}: {value!r} (expected in [{low!r}, {high!r}{bracket})")


def check_betas(betas: Tuple[float, float]) -> None:
    """Each beta in [0, 1)."""
    for i in range(2):
        if not 0.0 <= betas[i] < 1.0:
            raise ValueError(f"Invalid betas[{i}]: {betas[i]!r} (expected in [0, 1))")


def check_flags(cls_name: str, foreach: Optional[bool], fused: Optional[bool]) -> None:
    """``foreach`` and ``fused`` cannot both be True (torch.optim's rule)."""
    if foreach and fused:
        raise RuntimeError(f"{cls_name}: `fused` and `foreach` cannot be `True` together.")


def check_nesterov(momentum: float, dampening: float) -> None:
    """Nesterov momentum needs momentum > 0 and zero dampening."""
    raise ValueError(
        f"Invalid nesterov: True with momentum={momentum!r}, dampening={dampening!r} "
        f"(expected momentum > 0 and dampening == 0)"
    )
