"""Gradient clipping across owners: the gradients stay in the autograd context, on their owners.

``clip_grad_norm_`` takes two parallel rounds: every owner returns the norm of each of its
gradients in the context (one number per parameter), the trainer combines them into the
total norm exactly as :func:`torch.nn.utils.clip_grad_norm_` does, and every owner then
scales its gradients in place. ``clip_grad_value_`` takes one round.

``dist_autograd.get_gradients`` returns the context's own gradient tensors (not copies), so
scaling them in place is what the next ``step(context_id)`` reads.
"""
import threading
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed.autograd as dist_autograd
import torch.distributed.rpc as rpc
from torch import Tensor

from distopt.context import check_context_id, has_context
from distopt.errors import returns_failure
from distopt.fanout import fan_out
from distopt.placement import OwnerPart
from functional._compile import script
from functional._flat import device_dtype_groups


# ---------------------------------------------------------------- trainer side


def clip_grad_norm_(
    owners: Sequence[OwnerPart],
    context_id: int,
    max_norm: float,
    norm_type: float = 2.0,
    error_if_nonfinite: bool = False,
    foreach: Optional[bool] = None,
) -> Tensor:
    r"""Scale the context's gradients of the owners' parameters to a total norm <= ``max_norm``.

    .. math::
        \|g\|_p = \Big(\sum_i \|g_i\|_p^p\Big)^{1/p}, \qquad
        g_i \leftarrow g_i \cdot \min\Big(1, \frac{\text{max\_norm}}{\|g\|_p + 10^{-6}}\Big)

    (the largest element's magnitude for ``p = inf``). Parameters without a gradient in the
    context are left out, as ``.grad = None`` is by torch.

    Args:
        owners: the local optimizers whose parameters' gradients to clip.
        context_id: the live autograd context holding the gradients.
        max_norm: the largest total norm allowed.
        norm_type: ``p`` of the p-norm; ``float("inf")`` for the largest magnitude.
        error_if_nonfinite: raise instead of scaling when the total norm is nan or inf.
        foreach: ``False`` computes and scales one gradient at a time on the owners;
            otherwise the foreach kernels are used (same values).

    Returns:
        The total norm of the gradients before clipping, a 0-dim tensor.

    Raises:
        TypeError, ValueError: a bad ``context_id`` (before any owner is contacted).
        RuntimeError: ``error_if_nonfinite`` and the total norm is nan or inf; no gradient
            is changed.
        DistributedOptimizerError: some owners failed or could not be reached.
    """
    context_id = check_context_id(context_id)
    norm_type = float(norm_type)
    use_foreach = foreach is not False
    replies = fan_out(
        "clip_grad_norm_",
        {
            part.name: (
                part.info, local_grad_norms, (part.rref, context_id, norm_type, use_foreach)
            )
            for part in owners
        },
    )
    indexed: List[Tuple[int, Tensor]] = []
    for indices, norms in replies.values():
        indexed.extend(zip(indices, norms))
    if not indexed:
        return torch.tensor(0.0)
    indexed.sort(key=lambda pair: pair[0])
    total_norm = torch.linalg.vector_norm(torch.stack([n for _, n in indexed]), norm_type)
    if error_if_nonfinite and (total_norm.isnan() or total_norm.isinf()):
        # torch.nn.utils.clip_grad_norm_'s own words, kept for code that matches them.
        raise RuntimeError(
            f"The total norm of order {norm_type} for gradients from `parameters` is "
            f"non-finite, so it cannot be clipped. To disable this error and scale the "
            f"gradients by the non-finite norm anyway, set `error_if_nonfinite=False`"
        )
    clip_coef = torch.clamp(max_norm / (total_norm + 1e-6), max=1.0)
    if bool(clip_coef == 1.0):
        return total_norm  # multiplying by one changes nothing: skip the second round
    fan_out(
        "clip_grad_norm_",
        {
            part.name: (
                part.info, scale_local_grads, (part.rref, context_id, clip_coef, use_foreach)
            )
            for part in owners
            if replies[part.name][0]  # owners with no gradient have nothing to scale
        },
    )
    return total_norm


def clip_grad_value_(
    owners: Sequence[OwnerPart],
    context_id: int,
    clip_value: float,
    foreach: Optional[bool] = None,
) -> None:
    """Clamp the context's gradients of the owners' parameters to ``[-clip_value, clip_value]``.

    One round of RPCs, in parallel; as :func:`torch.nn.utils.clip_grad_value_`.

    Args:
        owners: the local optimizers whose parameters' gradients to clip.
        context_id: the live autograd context holding the gradients.
        clip_value: the largest magnitude allowed.
        foreach: ``False`` clamps one gradient at a time; otherwise the foreach kernels.

    Raises:
        TypeError, ValueError: a bad ``context_id`` (before any owner is contacted).
        DistributedOptimizerError: some owners failed or could not be reached.
    """
    context_id = check_context_id(context_id)
    clip_value = float(clip_value)
    use_foreach = foreach is not False
    fan_out(
        "clip_grad_value_",
        {
            part.name: (
                part.info, clamp_local_grads, (part.rref, context_id, clip_value, use_foreach)
            )
            for part in owners
        },
    )


# ---------------------------------------------------------------- owner side
# The owner's math runs in TorchScript, compiled on first use (not at import), so that the
# gradients are gathered, measured and scaled without a Python call per parameter.

_scripted: Dict[str, Callable[..., Any]] = {}
_script_lock = threading.Lock()


def _compiled(fn: Callable[..., Any]) -> Callable[..., Any]:
    found = _scripted.get(fn.__name__)
    if found is None:
        with _script_lock:  # TorchScript's compiler is not thread-safe
            found = _scripted.get(fn.__name__)
            if found is None:
                found = script(fn)
                _scripted[fn.__name__] = found
    return found


def _context_grads(autograd_ctx_id: int, params: List[Tensor]) -> Tuple[List[int], List[Tensor]]:
    """(positions, gradients) of the parameters that have a gradient in the context."""
    grads_by_param = dist_autograd.get_gradients(autograd_ctx_id)
    positions: List[int] = []
    grads: List[Tensor] = []
    for k in range(len(params)):
        p = params[k]
        if p in grads_by_param:
            positions.append(k)
            grads.append(grads_by_param[p])
    return positions, grads


def _grad_norms(grads: List[Tensor], norm_type: float, foreach: bool) -> Tensor:
    """Each gradient's norm, in one float32-or-wider CPU tensor: one copy to the host per
    (device, dtype) group (foreach ops take one device per call), not one per parameter."""
    dense: List[Tensor] = []
    for g in grads:
        dense.append(g.coalesce().values() if g.is_sparse else g)
    out: List[Tensor] = [torch.empty(0) for _ in dense]
    for group in device_dtype_groups(dense).dense:
        members = [dense[k] for k in group]
        if foreach:
            norms = torch._foreach_norm(members, norm_type)
        else:
            norms = [torch.linalg.vector_norm(g, norm_type) for g in members]
        on_host = torch.stack(norms).cpu()
        for j in range(len(group)):
            out[group[j]] = on_host[j]
    return torch.stack(out)


def _scale(grads: List[Tensor], coef: Tensor, foreach: bool) -> None:
    """Multiply by ``coef`` (a CPU scalar from the trainer), copied once to each group's
    device."""
    for group in device_dtype_groups(grads).dense:
        members = [grads[k] for k in group]
        here = coef.to(members[0].device)
        if foreach:
            torch._foreach_mul_(members, here)
        else:
            for g in members:
                g.mul_(here)


def _clamp(grads: List[Tensor], clip_value: float, foreach: bool) -> None:
    for group in device_dtype_groups(grads).dense:
        members = [grads[k] for k in group]
        if foreach:
            torch._foreach_clamp_min_(members, -clip_value)
            torch._foreach_clamp_max_(members, clip_value)
        else:
            for g in members:
                g.clamp_(min=-clip_value, max=clip_value)


def _local_grads(optimizer_rref: rpc.RRef, autograd_ctx_id: int) -> Tuple[List[int], List[Tensor]]:
    """(global indices, gradients) of this owner's parameters with a gradient in the context."""
    local = optimizer_rref.local_value()
    if not has_context(autograd_ctx_id):
        return [], []  # this owner took no part in the backward pass
    local.synchronize()  # the backward pass's gradients are complete
    flat = [i for indices in local.global_indices for i in indices]
    positions, grads = _compiled(_context_grads)(autograd_ctx_id, local.params)
    return [flat[k] for k in positions], grads


@returns_failure
def local_grad_norms(
    optimizer_rref: rpc.RRef, autograd_ctx_id: int, norm_type: float, foreach: bool
) -> Tuple[List[int], Tensor]:
    """RPC target: each local gradient's ``norm_type``-norm, with its global index; the
    norms in one CPU tensor (a GPU owner's needs no TensorPipe device map)."""
    indices, grads = _local_grads(optimizer_rref, autograd_ctx_id)
    if not grads:
        return [], torch.empty(0)
    return indices, _compiled(_grad_norms)(grads, norm_type, foreach)


@returns_failure
def scale_local_grads(
    optimizer_rref: rpc.RRef, autograd_ctx_id: int, coef: Tensor, foreach: bool
) -> None:
    """RPC target: multiply the local gradients in the context by ``coef``, in place."""
    _, grads = _local_grads(optimizer_rref, autograd_ctx_id)
    if grads:
        _compiled(_scale)(grads, coef, foreach)


@returns_failure
def clamp_local_grads(
    optimizer_rref: rpc.RRef, autograd_ctx_id: int, clip_value: float, foreach: bool
) -> None:
    """RPC target: clamp the local gradients in the context to ``[-clip_value, clip_value]``."""
    _, grads = _local_grads(optimizer_rref, autograd_ctx_id)
    if grads:
        _compiled(_clamp)(grads, clip_value, foreach)
