"""DistributedDataParallel and a DataParallelOptimizer over the same parameters: refused,
whichever of the two is built second.

Both average every gradient over the ranks, so together they would average each one twice:
twice the traffic, and ``.grad`` rewritten by DDP after the optimizer's own reduction. The
optimizer refuses at construction a parameter that a DDP built earlier averages; a DDP built
later (nanoGPT builds its optimizer before it wraps the model) is refused from inside its
constructor, before it starts any collective, by a module registration hook that this module
installs when imported. Parameters a DDP does not average (frozen ones, and those in the
module's ``_ddp_params_and_buffers_to_ignore``) may go to a DataParallelOptimizer.
"""
import weakref
from typing import Any, Iterable, List, Optional, Tuple

import torch
from torch import Tensor
from torch.nn.modules.module import register_module_module_registration_hook
from torch.nn.parallel import DistributedDataParallel

from distopt import _torch

__all__ = ["check_not_wrapped", "register"]

#: The open DataParallelOptimizers, and the DDPs built since this module was imported.
_OPTIMIZERS: "weakref.WeakSet[Any]" = weakref.WeakSet()
_WRAPPERS: "weakref.WeakSet[DistributedDataParallel]" = weakref.WeakSet()


def _averaged(inner: torch.nn.Module, ignored: Iterable[str]) -> List[Tuple[str, Tensor]]:
    """The parameters of ``inner`` that a DDP around it averages."""
    skipped = set(ignored)
    return [(n, p) for n, p in inner.named_parameters() if n not in skipped and p.requires_grad]


def _refusal(names: List[str], second: str) -> RuntimeError:
    shown = ", ".join(repr(n) for n in names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")
    return RuntimeError(
        f"{second}: DistributedDataParallel and a DataParallelOptimizer would both average the "
        f"gradients of parameters {shown}, each gradient twice. A DataParallelOptimizer does "
        f"DDP's work itself: drop the DDP wrapper and pass the model's parameters (with "
        f"module=model for the buffers DDP broadcast); or keep DDP and step with a "
        f"torch.optim optimizer, or with distopt.parallel.optimizer_hook(ddp_model, ...)"
    )


def _shared(opt: Any, named: List[Tuple[str, Tensor]]) -> List[str]:
    mine = {id(p) for g in opt.param_groups for p in g["params"] if p.requires_grad}
    return [n for n, p in named if id(p) in mine]


def check_not_wrapped(params: List[Tensor], module: Optional[torch.nn.Module]) -> None:
    """Refuse ``params`` if a DistributedDataParallel averages any of them: ``module`` itself
    or one built since this module was imported."""
    wrappers = list(_WRAPPERS)
    if isinstance(module, DistributedDataParallel) and module not in wrappers:
        wrappers.append(module)
    mine = {id(p) for p in params if p.requires_grad}
    for ddp in wrappers:
        named = _averaged(ddp.module, _torch.ddp_ignored_names(ddp))
        names = [n for n, p in named if id(p) in mine]
        if names:
            raise _refusal(names, "Invalid params of DataParallelOptimizer")


def register(opt: Any) -> None:
    """Watch ``opt`` (until it is closed or collected) for a DDP built over its parameters."""
    _OPTIMIZERS.add(opt)


def _on_registration(parent: torch.nn.Module, name: str, submodule: Any) -> None:
    """(every module's ``__setattr__`` of a submodule) DDP's ``self.module = module``."""
    if name != "module" or not isinstance(parent, DistributedDataParallel):
        return None
    _WRAPPERS.add(parent)
    if submodule is None:
        return None
    named = None
    for opt in list(_OPTIMIZERS):
        if getattr(opt, "_closed", False):
            continue
        if named is None:
            named = _averaged(submodule, _torch.ddp_ignored_names(parent))
        names = _shared(opt, named)
        if names:
            raise _refusal(names, "Invalid module of DistributedDataParallel")
    return None


register_module_module_registration_hook(_on_registration)
