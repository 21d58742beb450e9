"""A module's buffers (and its parameters outside the optimizer), kept alike as DDP keeps them.

DDP broadcasts its module's parameters and buffers from the group's first rank at
construction, and the buffers again before each forward that follows a synchronising
forward (its ``require_forward_param_sync``: a forward with gradients on, outside
``no_sync``; so the first forward of each step, but not one after a forward under
``no_sync`` or ``torch.no_grad``), so that every rank's forward starts from the first rank's
BatchNorm running statistics. ``DataParallelOptimizer(..., module=model)`` does the same
with a forward pre-hook on the module; ``broadcast_buffers=False`` turns both buffer
broadcasts off, as DDP's does. Under ``torch.distributed.algorithms.Join`` the source is
the highest rank not yet joined, as DDP's (``distopt.parallel.join``).

The broadcast writes through ``.data``: autograd does not see it, as DDP hides its own, so
a buffer that an earlier forward saved for its backward (BatchNorm in eval mode) does not
make that backward raise.
"""
from typing import Any, List, Optional, Sequence

import torch
import torch.distributed as dist
from torch import Tensor

from distopt.arguments import check_bool
from distopt.parallel.sync import global_rank, through_flat

__all__ = ["broadcast", "check_module"]


def check_module(module: Optional[torch.nn.Module], params: Sequence[Tensor],
                 broadcast_buffers: Any) -> List[Tensor]:
    """Check ``module=`` against the optimizer's ``params``; return the module's other
    parameters (all frozen), broadcast at construction with the buffers, as DDP
    broadcasts every parameter."""
    check_bool("broadcast_buffers", broadcast_buffers)
    if module is None:
        return []
    if not isinstance(module, torch.nn.Module):
        raise TypeError(
            f"Invalid module: a {type(module).__name__} (expected None or the torch.nn.Module "
            f"whose parameters the optimizer trains)"
        )
    named = list(module.named_parameters())
    theirs = {id(p) for _, p in named}
    for i, p in enumerate(params):
        if id(p) not in theirs:
            raise ValueError(
                f"Invalid module: parameter {i} (shape {tuple(p.shape)}) is not one of the "
                f"{type(module).__name__}'s parameters (expected module= the model whose "
                f"parameters the optimizer trains)"
            )
    mine = {id(p) for p in params}
    outside = []
    for name, p in named:
        if id(p) in mine:
            continue
        if p.requires_grad:
            raise ValueError(
                f"Invalid module: its parameter {name!r} requires grad but is not one of the "
                f"optimizer's, so its gradient would never be averaged (expected it in "
                f"params, or requires_grad=False)"
            )
        outside.append(p)
    return outside


def broadcast(tensors: Sequence[Tensor], source: int, group: Any) -> None:
    """Copy group rank ``source``'s ``tensors`` (alike on every rank) into every rank's:
    one broadcast per (dtype, device), written through ``.data`` (no autograd version
    change)."""
    if tensors:
        src = global_rank(group, source)
        through_flat([t.data for t in tensors], lambda t: dist.broadcast(t, src, group=group))
