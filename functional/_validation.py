"""Argument checks run when a functional optimizer is constructed (always in Python).

Constructors are compiled by TorchScript but only ever executed eagerly, so they call these
checks under ``if not torch.jit.is_scripting():``, which the compiler skips: the checks stay
plain Python and keep ``!r`` formatting, which TorchScript f-strings lack.
"""
from typing import List, Optional, Sequence, Tuple, Union

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


def check_etas(etas: Tuple[float, float]) -> None:
    """Rprop's ``(etaminus, etaplus)``: ``0 < etaminus < 1 < etaplus``."""
    if not 0.0 < etas[0] < 1.0 < etas[1]:
        raise ValueError(f"Invalid etas: {tuple(etas)!r} (expected 0 < etas[0] < 1 < etas[1])")


def check_fused(
    cls_name: str, params: List[Tensor], fused: Optional[bool], differentiable: bool
) -> None:
    """``fused=True`` needs floating-point parameters and excludes ``differentiable``."""
    if not fused:
        return
    if differentiable:
        raise RuntimeError(f"{cls_name}: `fused` does not support `differentiable`.")
    for i, p in enumerate(params):
        if not torch.is_floating_point(p):
            raise RuntimeError(
                f"{cls_name}: `fused=True` requires floating-point parameters, "
                f"but params[{i}] is {p.dtype}"
            )


def check_no_tensor_lr_with_foreach(
    lr: Union[float, Tensor], foreach: Optional[bool], capturable: bool
) -> None:
    """A Tensor lr cannot go with ``foreach=True`` and ``capturable=False`` (torch.optim.Adam)."""
    if isinstance(lr, Tensor) and foreach and not capturable:
        raise ValueError(
            f"Invalid lr: Tensor with foreach=True, capturable=False (expected a float lr, "
            f"or foreach=False, or capturable=True)"
        )


def check_betas_kind(betas: Tuple[float, float], foreach: Optional[bool], capturable: bool) -> None:
    """Adam's betas: both floats or both 1-element Tensors, and no Tensors with foreach=True."""
    both_floats = isinstance(betas[0], float) and isinstance(betas[1], float)
    both_tensors = isinstance(betas[0], Tensor) and isinstance(betas[1], Tensor)
    if not (both_floats or both_tensors):
        raise ValueError(f"Invalid betas: {betas!r} (expected both floats or both Tensors)")
    for i in range(2):
        beta = betas[i]
        if isinstance(beta, Tensor):
            if foreach and not capturable:
                raise ValueError(
                    f"Invalid betas[{i}]: Tensor with foreach=True, capturable=False "
                    f"(expected a float)"
                )
            if beta.numel() != 1:
                raise ValueError(
                    f"Invalid betas[{i}]: Tensor of shape {tuple(beta.shape)} (expected 1 element)"
                )


def check_fused_differentiable(fused: Optional[bool], differentiable: bool) -> None:
    """A fused kernel cannot record autograd history (torch.optim's rule)."""
    if fused and differentiable:
        raise RuntimeError("`fused` does not support `differentiable`")


def check_at_most(name: str, value: float, high: float) -> None:
    """``value`` must be <= ``high``."""
    if not value <= high:
        raise ValueError(f"Invalid {name}: {value!r} (expected <= {high!r})")


def check_greater(name: str, value: float, low: float) -> None:
    """``value`` must be > ``low`` (strictly)."""
    if not value > low:
        raise ValueError(f"Invalid {name}: {value!r} (expected > {low!r})")


def check_choice(name: str, value: Optional[str], choices: List[Optional[str]]) -> None:
    """``value`` must be one of ``choices``."""
    if value not in choices:
        raise ValueError(f"Invalid {name}: {value!r} (expected one of {choices!r})")


def check_matrix_params(params: List[Tensor]) -> None:
    """Every parameter must be 2-D (Muon orthogonalizes matrices)."""
    for i, p in enumerate(params):
        if p.dim() != 2:
            raise ValueError(
                f"Invalid params[{i}]: shape {tuple(p.shape)} (expected a 2-D parameter)"
            )


def check_dense_real_params(params: List[Tensor]) -> None:
    """Every parameter must be a dense (strided), real tensor."""
    for i, p in enumerate(params):
        if p.is_sparse:
            raise ValueError(f"Invalid params[{i}]: a sparse tensor (expected a dense Tensor)")
        if p.is_complex():
            raise ValueError(f"Invalid params[{i}]: dtype {p.dtype} (expected a real dtype)")


def check_optional_eps_pair(eps: Tuple[Optional[float], float]) -> None:
    """Adafactor's ``eps``: epsilon1 None or >= 0, epsilon2 >= 0."""
    if len(eps) != 2 or (eps[0] is not None and not eps[0] >= 0.0) or not eps[1] >= 0.0:
        raise ValueError(f"Invalid eps: {eps!r} (expected (None or >= 0, >= 0))")


def check_below(name: str, value: float, high: float) -> None:
    """``value`` must be < ``high`` (strictly)."""
    if not value < high:
        raise ValueError(f"Invalid {name}: {value!r} (expected < {high!r})")


def check_length(name: str, value: Sequence[float], length: int) -> None:
    """``value`` must hold exactly ``length`` values."""
    if len(value) != length:
        raise ValueError(f"Invalid {name}: {value!r} (expected {length} values)")
