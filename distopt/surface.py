"""What the three optimizers over torch.optim classes share as torch.optim optimizers.

``DistributedOptimizer`` (RPC owners), ``DataParallelOptimizer`` and ``OptimizerInBackward``
(``distopt.parallel``) each build their own ``state_dict`` and load their own: torch runs
its state-dict hooks only inside ``torch.optim.Optimizer``'s methods, so each of them runs
them here, in torch's order, around its own work. Their param groups are fixed with what
they build at construction, so ``add_param_group`` is refused alike. The two data-parallel
optimizers become torch.optim optimizers without running its constructor
(``become_torch_optimizer``): they build the class the user named, over the same groups,
and take its checked param groups and defaults.
"""
from typing import Any, Callable, Dict, List

import torch

from distopt import _torch
from distopt.arguments import check_arguments

__all__ = ["become_torch_optimizer", "state_dict_with_hooks", "load_state_dict_with_hooks",
           "refuse_add_param_group", "indexed_groups"]


def become_torch_optimizer(opt: torch.optim.Optimizer, optimizer_class: type,
                           groups: List[Dict[str, Any]], args: Any,
                           kwargs: Dict[str, Any]) -> torch.optim.Optimizer:
    """Check the optimizer's arguments, build ``optimizer_class`` over ``groups``
    (torch.optim's own checks and defaults) and make ``opt`` a torch.optim optimizer over
    its param groups (``optimizer_class``, ``defaults``, ``param_groups``, ``state``, and
    torch's hook dicts). Returns that optimizer, which an eager class steps."""
    check_arguments(optimizer_class, args, kwargs, groups)
    inner = optimizer_class([dict(g) for g in groups], *args, **kwargs)
    opt.optimizer_class = optimizer_class
    opt.defaults = inner.defaults
    opt.param_groups = inner.param_groups
    opt.state = inner.state
    _torch.init_optimizer_internals(opt)
    return inner


def indexed_groups(param_groups: List[Dict[str, Any]]) -> List[Dict[str, Any]]:
    """``param_groups`` as torch.optim's ``state_dict`` writes them: each group's
    hyper-parameters and, under ``"params"``, its parameters' global indices (numbered over
    the groups in order)."""
    out, start = [], 0
    for g in param_groups:
        n = len(g["params"])
        out.append({**{k: v for k, v in g.items() if k != "params"},
                    "params": list(range(start, start + n))})
        start += n
    return out


def state_dict_with_hooks(opt: Any, make: Callable[[], Dict[str, Any]]) -> Dict[str, Any]:
    """``make()`` between ``opt``'s state-dict pre-hooks (``hook(opt)``) and post-hooks
    (``hook(opt, sd)``, whose non-None result replaces ``sd``), as torch.optim runs them."""
    for hook in _torch.optimizer_hooks(opt, "state_dict_pre"):
        hook(opt)
    sd = make()
    for hook in _torch.optimizer_hooks(opt, "state_dict_post"):
        result = hook(opt, sd)
        if result is not None:
            sd = result
    return sd


def load_state_dict_with_hooks(opt: Any, state_dict: Dict[str, Any],
                               load: Callable[[Dict[str, Any]], None]) -> None:
    """``load(state_dict)`` between ``opt``'s load pre-hooks (``hook(opt, sd)``, whose
    non-None result replaces ``sd``) and post-hooks (``hook(opt)``), as torch.optim runs
    them."""
    for hook in _torch.optimizer_hooks(opt, "load_state_dict_pre"):
        result = hook(opt, state_dict)
        if result is not None:
            state_dict = result
    load(state_dict)
    for hook in _torch.optimizer_hooks(opt, "load_state_dict_post"):
        hook(opt)


def refuse_add_param_group(what: str, where: str) -> None:
    """Raise NotImplementedError: ``what`` (e.g. "a DataParallelOptimizer's buckets") are
    fixed at construction; ``where`` says where every group must be given."""
    raise NotImplementedError(
        f"Invalid add_param_group: {what} are fixed at construction (expected every param "
        f"group {where})"
    )
