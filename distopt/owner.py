"""The owner's RPC targets: create, step, change and release local optimizers.

Every locked step of every local optimizer, compiled or eager (``distopt.local_optimizer``),
goes through ``step_local_optimizer``: take the parameters' locks (``distopt.locks``), apply
any hyper-parameter changes the trainer piggybacked, make one call, release. A step that
fails says what it applied here (``LocalOptimizer.describe_failure``); for a failed
exclusive step, which runs no Python here, the trainer asks ``describe_step_failure``.

A compiled optimizer that shares no lock with another is exclusive: its trainer steps it
with ``distopt.exclusive.script_step``, no Python and no lock here. Creating an optimizer
over a lock that an exclusive one uses first switches that one to the locked path
(``_revoke_exclusive``).
"""
import logging
from typing import Any, Dict, List, Optional, Tuple, Union

import torch.distributed.rpc as rpc
from torch import Tensor

from distopt import exclusive
from distopt.context import has_context
from distopt.errors import (
    DistributedOptimizerError,
    RemoteFailure,
    exception_message,
    returns_failure,
)
from distopt.fanout import fan_out
from distopt.local_optimizer import (
    Change,
    CompiledLocalOptimizer,
    EagerLocalOptimizer,
    LocalOptimizer,
    live_by_id,
)
from distopt.locks import holding
from distopt.profiling import profiler_range

#: What the trainer sends for one local param group: (parameter RRefs, their global
#: indices, the group's options as the user gave them, without "params").
GroupSpec = Tuple[List[rpc.RRef], List[int], Dict[str, Any]]

logger = logging.getLogger(__name__)


def _local_groups(specs: List[GroupSpec]) -> Tuple[List[List[Tensor]], List[List[int]]]:
    """Each group's local parameters and global indices.

    Raises:
        ValueError: one tensor is given twice under different indices.
    """
    group_params = [[rref.local_value() for rref in rrefs] for rrefs, _, _ in specs]
    seen: Dict[int, int] = {}
    for (_, indices, _), params in zip(specs, group_params):
        for i, p in zip(indices, params):
            if id(p) in seen and seen[id(p)] != i:
                raise ValueError(
                    f"Invalid params: parameters {seen[id(p)]} and {i} are the same tensor "
                    f"(expected each parameter once, in one param group)"
                )
            seen[id(p)] = i
    return group_params, [list(indices) for _, indices, _ in specs]


@returns_failure
def new_compiled_local_optimizer(
    functional_cls: type,
    optimizer_class: type,
    specs: List[GroupSpec],
    args: tuple,
    kwargs: Dict[str, Any],
    trainer: Optional[Tuple[str, int]] = None,
    flat: bool = False,
    group_numbers: Optional[List[int]] = None,
) -> Tuple[rpc.RRef, Dict[str, Any]]:
    """RPC target: compile functional optimizers, one per group, over the local parameters.

    Args:
        functional_cls: the functional stand-in for ``optimizer_class``.
        optimizer_class: the class the user asked for.
        specs: the local part of each param group that has parameters here.
        args: positional arguments for the optimizer, after the parameters.
        kwargs: keyword arguments shared by every group; a group's own options win.
        trainer: (worker name, key) of the creating DistributedOptimizer; None keeps the
            new optimizer on the locked path.
        flat: put the small parameters into flat buffers (``functional.flatten_parameters``).
        group_numbers: the trainer's number of each spec's group, for messages; None: 0, 1...

    Returns:
        (an RRef to the new ``CompiledLocalOptimizer``, its ``describe()``), or a
        ``RemoteFailure``. The description's ``script`` is an RRef for
        ``distopt.exclusive.script_step`` when the optimizer is exclusive, else None.
    """
    group_params, global_indices = _local_groups(specs)
    local = CompiledLocalOptimizer(
        functional_cls, optimizer_class, group_params, global_indices,
        [options for _, _, options in specs], args, kwargs, trainer=trainer, flat=flat,
        group_numbers=group_numbers,
    )
    _revoke_exclusive(local)
    script = rpc.RRef(local.module, exclusive.ExclusiveStep) if local.exclusive else None
    return rpc.RRef(local), {**local.describe(), "id": local.id, "script": script}


@returns_failure
def new_eager_local_optimizer(
    optim_cls: type,
    specs: List[GroupSpec],
    args: tuple,
    kwargs: Dict[str, Any],
    trainer: Optional[Tuple[str, int]] = None,
    group_numbers: Optional[List[int]] = None,
) -> Tuple[rpc.RRef, Dict[str, Any]]:
    """RPC target: construct a torch.optim optimizer over the local param groups.

    An eager optimizer is never exclusive, but it ends the exclusivity of those it shares
    locks with, as a compiled one does. ``group_numbers``: as for
    ``new_compiled_local_optimizer``.

    Returns:
        (an RRef to the new ``EagerLocalOptimizer``, its ``describe()``), or a
        ``RemoteFailure``.
    """
    group_params, global_indices = _local_groups(specs)
    local = EagerLocalOptimizer(
        optim_cls, group_params, global_indices, [options for _, _, options in specs],
        tuple(args), kwargs, trainer, group_numbers,
    )
    _revoke_exclusive(local)
    return rpc.RRef(local), {**local.describe(), "id": local.id, "script": None}


def _revoke_exclusive(local: LocalOptimizer) -> None:
    """Switch the exclusive optimizers ``local`` shares locks with to the locked path.

    Called by the constructor handlers before ``local`` is handed to its trainer, so it
    cannot step before the switch. For each, a nested RPC to its trainer
    (``distopt.exclusive.switch_to_locked``) returns once that trainer has no operation of
    it in flight and sends every later step through ``step_local_optimizer``. A trainer
    that cannot be reached is logged; the optimizer's unlocked steps are refused from then
    on either way. One whose trainer has collected it is released now, and if that leaves
    ``local`` alone on its locks, ``local`` becomes exclusive (a trainer replacing its
    optimizer keeps the fast path). When a sharer is released later, the survivors stay on
    the locked path: simpler than handing exclusivity back, and always safe.
    """
    doomed, local.to_revoke = local.to_revoke, []
    if not doomed:
        return
    me = rpc.get_worker_info().name
    # Whether each one's trainer still has it: all replies, or those that came on a failure.
    alive: Dict[str, bool] = {}
    try:
        alive = fan_out(
            "switch_to_locked",
            {
                str(other.id): (other.trainer[0], exclusive.switch_to_locked,
                                (other.trainer[1], me))
                for other in doomed
            },
            partial=alive.update,
        )
    except DistributedOptimizerError as exc:  # a dead trainer can no longer step its optimizer
        for other in doomed:
            if str(other.id) in exc.failures:
                logger.warning(
                    "could not switch local optimizer %d of trainer %s to the locked path: %s",
                    other.id, other.trainer[0], exc.failures[str(other.id)],
                )
    gone = []
    for other in doomed:
        other.end_exclusive(
            f"Invalid step: local optimizer {other.id} on {me} now shares parameters "
            f"(expected its trainer to step it through the locks)"
        )
        if not alive.get(str(other.id), True):
            gone.append(other)
    for other in gone:
        other.close()
    if gone:
        local.regain_exclusive()


def step_local_optimizer(
    optimizer: Union[int, rpc.RRef],
    autograd_ctx_id: int,
    changes: Optional[List[Change]] = None,
    empty: Optional[List[List[int]]] = None,
) -> Union[bool, RemoteFailure]:
    """RPC target of every locked step: lock, apply piggybacked changes, one call, unlock.

    An owner that took no part in the backward pass has no such context: it only applies
    the changes, and steps the parameters in ``empty``.

    Args:
        optimizer: the local optimizer's ``id`` (what the trainer sends), or its RRef.
        autograd_ctx_id: the context holding the gradients.
        changes: hyper-parameter changes made on the trainer since the last step, or None.
        empty: for each local group, the positions of the parameters that step even when
            the context holds no gradient for them, with one holding no rows (a sharded
            table whose gradient fell on other owners; see
            ``distopt.local_optimizer.empty_sparse_gradient``).

    Returns:
        Whether the context held a gradient of any of the optimizer's parameters here (the
        trainer warns when no owner found one), or a ``RemoteFailure`` saying what the step
        applied here (``applied``).
    """
    local: Optional[LocalOptimizer] = None
    try:
        if isinstance(optimizer, int):
            local = live_by_id.get(optimizer)
            if local is None:
                raise RuntimeError(
                    f"Invalid local optimizer: id {optimizer!r} was released (expected a live one)"
                )
        else:
            local = optimizer.local_value()
        with profiler_range("distopt.owner.step"), holding(local.locks):
            if changes:
                try:
                    local.apply_changes(changes)
                except Exception as exc:  # reported even when this owner has no gradients
                    return RemoteFailure.from_exception(exc, applied="none")
            local.synchronize()  # the backward pass's gradients are complete
            try:
                if empty:
                    found = local.step_with_empty(autograd_ctx_id, empty)
                else:
                    found = local.step_context(autograd_ctx_id)
            except Exception as exc:
                if not empty and not has_context(autograd_ctx_id):
                    return False  # see below
                # Under the locks: no other step can have changed the record.
                message, applied = local.describe_failure(exception_message(exc), autograd_ctx_id)
                return RemoteFailure.from_exception(exc, applied, message)
            local.synchronize()  # the update is complete before the reply
        return found
    except Exception as exc:
        # Asked only after a failure (one C++ call): an owner outside the context skips.
        if not empty and not has_context(autograd_ctx_id):
            return False
        return RemoteFailure.from_exception(exc, applied="none" if local is None else None)


def describe_step_failure(
    optimizer_id: int, autograd_ctx_id: int, message: str
) -> Tuple[str, str]:
    """RPC target: what an exclusive step (``distopt.exclusive.script_step``) that failed
    with ``message`` applied here: ``LocalOptimizer.describe_failure``'s (message, applied).

    Its trainer asks before any other operation of that optimizer (it holds the
    optimizer's lock meanwhile), so the scripted module's record is still that step's, or,
    when the step was refused before it began (no longer exclusive, released), an older
    one, which ``describe_failure`` tells apart by its context id.
    """
    local = live_by_id.get(optimizer_id)
    if local is None:  # released: its unlocked steps are refused before they begin
        return message, "none"
    return local.describe_failure(message, autograd_ctx_id)


def release_local_optimizer(optimizer_rref: rpc.RRef) -> None:
    """RPC target: free a local optimizer now (its creator is giving up on it)."""
    optimizer_rref.local_value().close()


def set_local_hyperparameter(
    optimizer_rref: rpc.RRef, name: str, value: Any, group: Optional[int] = None
) -> None:
    """RPC target: change a hyper-parameter of a compiled local optimizer, under its locks.

    An exclusive optimizer's steps take no lock: call this between its trainer's steps.

    Args:
        optimizer_rref: the local optimizer.
        name: the hyper-parameter.
        value: its new value: a float, or a list of floats (``[0.9, 0.999]`` for betas).
        group: the local group to change; None changes every group.

    Raises:
        TypeError: the local optimizer is eager.
    """
    local = optimizer_rref.local_value()
    if not isinstance(local, CompiledLocalOptimizer):
        raise TypeError(
            f"Invalid local optimizer: {type(local.optim).__name__} is eager "
            f"(expected a compiled functional optimizer)"
        )
    groups = range(len(local.group_params)) if group is None else [group]
    with holding(local.locks):
        for j in groups:
            local.set_hyperparameter(j, name, value)
