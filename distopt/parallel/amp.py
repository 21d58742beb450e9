"""GradScaler and the data-parallel optimizers.

``GradScaler.step(opt)`` hands an optimizer that declares ``_step_supports_amp_scaling``
(as torch.optim's fused classes do) its ``grad_scale`` and ``found_inf`` as attributes,
instead of unscaling ``.grad`` itself and skipping ``step()`` after an inf: ``amp_scaling``
reads them, ``drop_amp_scaling`` removes them, and ``eager_step`` steps an eager torch.optim
optimizer as the scaler would have stepped it.
"""
from typing import Any, Optional

import torch
from torch import Tensor

from functional._kernels import unscale_gradients

__all__ = ["amp_scaling", "drop_amp_scaling", "eager_step"]


def amp_scaling(opt: Any) -> Optional[Any]:
    """``(grad_scale, found_inf)`` that ``GradScaler.step`` set on ``opt`` for this step
    (``grad_scale`` None once ``scaler.unscale_(opt)`` ran), or None without a scaler."""
    if not hasattr(opt, "found_inf"):
        return None
    found_inf = opt.found_inf
    if not isinstance(found_inf, Tensor):  # 0: the scaler found no gradient to check
        found_inf = torch.tensor(float(found_inf))
    return getattr(opt, "grad_scale", None), found_inf


def drop_amp_scaling(opt: Any) -> None:
    """Remove what ``GradScaler.step`` set on ``opt``."""
    for name in ("grad_scale", "found_inf"):
        if name in vars(opt):
            delattr(opt, name)


def eager_step(inner: torch.optim.Optimizer, scaling: Optional[Any] = None) -> None:
    """``inner.step()``; under a GradScaler's ``scaling``, as the scaler would step it:
    handed the scale where the class takes it, else with its gradients unscaled in place
    and no step after an inf or NaN."""
    if scaling is None:
        inner.step()
    elif getattr(inner, "_step_supports_amp_scaling", False):
        inner.grad_scale, inner.found_inf = scaling
        try:
            inner.step()
        finally:
            drop_amp_scaling(inner)
    elif not unscale_gradients(
        [p.grad for g in inner.param_groups for p in g["params"]], scaling[0], scaling[1]
    ):
        inner.step()
