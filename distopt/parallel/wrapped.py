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

#: The open DataParallelOptimizers.
_OPTIMIZERS: "weakref.WeakSet[Any]" = weakref.WeakSet()
#: Each DDP built since this module was imported (and not refused): the parameters it
#: averages, with a name of each, as it chose them when built.
_WRAPPERS: "weakref.WeakKeyDictionary[DistributedDataParallel, List[Tuple[str, Tensor]]]" = (
    weakref.WeakKeyDictionary())


def _averaged(ddp: DistributedDataParallel, inner: torch.nn.Module) -> List[Tuple[str, Tensor]]:
    """The parameters of ``inner`` that ``ddp`` averages, as DDP's reducer picks them: each
    module's own parameters that require grad, by the name ``module_name.param_name`` (a
    parameter shared by two modules counts under either name), less the ignored names;
    plus those whose all_reduce it delays to the end of backward."""
    ignored = set(_torch.ddp_ignored_names(ddp))
    found: List[Tuple[str, Tensor]] = []
    seen = set()
    for module_name, module in inner.named_modules():
        for param_name, p in module.named_parameters(recurse=False):
            name = f"{module_name}.{param_name}" if module_name else param_name
            if (p.requires_grad and f"{module_name}.{param_name}" not in ignored
                    and id(p) not in seen):
                seen.add(id(p))
                found.append((name, p))
    for p in _torch.ddp_delayed_params(ddp):
        if id(p) not in seen:
            seen.add(id(p))
            found.append((next((n for n, q in inner.named_parameters() if q is p), "?"), p))
    return found


def _refusal(names: List[str], second: str) -> RuntimeError:
    shown = ", ".join(repr(n) for n in names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")
    return RuntimeError(
        f"{second}: DistributedDataParallel and a DataParallelOptimizer would both average the "
        f"gradients of parameters {shown}, each gradient twice. A DataParallelOptimizer does "
        f"DDP's work itself: drop the DDP wrapper and pass the model's parameters (with "
        f"module=model for the buffers DDP broadcast); or keep DDP and step with a "
        f"torch.optim optimizer, or with distopt.parallel.optimizer_hook(ddp_model, ...)"
    )


def _shared(params: Iterable[Tensor], named: List[Tuple[str, Tensor]]) -> List[str]:
    mine = {id(p) for p in params}
    return [n for n, p in named if id(p) in mine]


def check_not_wrapped(params: List[Tensor], module: Optional[torch.nn.Module]) -> None:
    """Refuse ``params`` (the optimizer's trained parameters) if a DistributedDataParallel
    averages any of them: ``module`` itself, or one built since this module was imported."""
    wrappers = list(_WRAPPERS.items())
    if isinstance(module, DistributedDataParallel) and module not in _WRAPPERS:
        wrappers.append((module, _averaged(module, module.module)))
    for _, named in wrappers:
        names = _shared(params, named)
        if names:
            raise _refusal(names, "Invalid params of DataParallelOptimizer")


def register(opt: Any) -> None:
    """Watch ``opt`` (an engine: until it is closed or collected) for a DDP built over its
    parameters."""
    _OPTIMIZERS.add(opt)


def _on_registration(parent: torch.nn.Module, name: str, submodule: Any) -> None:
    """(every module's ``__setattr__`` of a submodule) DDP's ``self.module = module``: refuse
    it if an open optimizer trains a parameter it would average, else remember it."""
    if name != "module" or not isinstance(parent, DistributedDataParallel):
        return None
    if not isinstance(submodule, torch.nn.Module):
        return None
    named = _averaged(parent, submodule)
    for opt in list(_OPTIMIZERS):
        if opt.status.closed:
            continue
        names = _shared((p for g in opt.param_groups for p in g["params"] if p.requires_grad), named)
        if names:
            raise _refusal(names, "Invalid module of DistributedDataParallel")
    _WRAPPERS[parent] = named
    return None


register_module_module_registration_hook(_on_registration)
