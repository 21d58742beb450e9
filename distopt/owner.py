"""The owner's side: local optimizers over the parameters a worker owns, and their locks.

A local optimizer is either compiled (a functional optimizer inside a TorchScript module,
whose step reads the autograd context's gradients and runs without the GIL) or eager (any
torch.optim class, fed through ``.grad``). Both are stepped by ``step_local_optimizer``,
the function every step RPC calls: take the parameters' locks, make one call, release.

Locks belong to parameters. The first optimizer to touch a parameter gives it, and every
other new parameter in that optimizer, one fresh lock with the next sequence number; later
optimizers reuse the locks already there. An optimizer takes its distinct locks in sequence
order, so trainers over the same parameters serialize, optimizers over disjoint parameters
run in parallel, and overlapping sets cannot deadlock.
"""
import itertools
import logging
import threading
import weakref
from typing import Any, Callable, List, Optional

import torch
import torch.distributed.autograd as dist_autograd
import torch.distributed.rpc as rpc
from torch import Tensor
from torch.utils.weak import WeakIdKeyDictionary

from distopt.errors import RemoteFailure

logger = logging.getLogger(__name__)

# TorchScript's compiler is not thread-safe; owners create optimizers on many RPC threads.
_compile_lock = threading.Lock()


class _ParamLock:
    """A lock shared by a batch of parameters, ordered by when the batch was first seen."""

    __slots__ = ("sequence", "lock")

    def __init__(self, sequence: int) -> None:
        self.sequence = sequence
        self.lock = threading.Lock()


_registry_lock = threading.Lock()
# Keyed by tensor identity: a plain WeakKeyDictionary compares tensors with ``==``.
_param_locks: WeakIdKeyDictionary = WeakIdKeyDictionary()
_sequence = itertools.count()


def locks_for(params: List[Tensor]) -> List[threading.Lock]:
    """The distinct locks of ``params`` in acquisition order, creating one for new params.

    Args:
        params: the parameters an optimizer will update.

    Returns:
        The locks, sorted by sequence number.
    """
    with _registry_lock:
        new = [p for p in params if p not in _param_locks]
        if new:
            shared = _ParamLock(next(_sequence))
            for p in new:
                _param_locks[p] = shared
        distinct = {id(pl): pl for pl in (_param_locks[p] for p in params)}
    return [pl.lock for pl in sorted(distinct.values(), key=lambda pl: pl.sequence)]


def lock_of(param: Tensor) -> Optional[threading.Lock]:
    """The lock guarding ``param``, or None if no optimizer has touched it."""
    with _registry_lock:
        entry = _param_locks.get(param)
    return None if entry is None else entry.lock


class _CompiledLocalOptimizer(torch.nn.Module):
    """A functional optimizer whose step takes an autograd context id, for TorchScript.

    Args:
        functional_cls: the functional optimizer class.
        params: the local parameters, in the order the optimizer sees them.
        *args: positional arguments for ``functional_cls``.
        **kwargs: keyword arguments for ``functional_cls``.
    """

    def __init__(
        self, functional_cls: type, params: List[Tensor], *args: Any, **kwargs: Any
    ) -> None:
        super().__init__()
        self.params = params
        self.optim = functional_cls(params, *args, **kwargs)

    def forward(self, autograd_ctx_id: int) -> None:
        self.step_context(autograd_ctx_id)

    @torch.jit.export
    def step_context(self, autograd_ctx_id: int) -> None:
        """Step with the gradients the context holds; parameters without one are skipped."""
        grads_by_param = dist_autograd.get_gradients(autograd_ctx_id)
        grads: List[Optional[Tensor]] = []
        for p in self.params:
            if p in grads_by_param:
                grads.append(grads_by_param[p])
            else:
                grads.append(None)
        self.optim.step(grads)

    @torch.jit.export
    def set_hyperparameter(self, name: str, value: List[float]) -> None:
        """Change a hyper-parameter (lr, betas, ...) for the following steps."""
        self.optim.set_hyperparameter(name, value)


class _EagerStep:
    """A torch.optim optimizer stepped from an autograd context through ``.grad``."""

    def __init__(self, optim_cls: type, params: List[Tensor], *args: Any, **kwargs: Any) -> None:
        self.params = params
        self.optim = optim_cls(params, *args, **kwargs)

    def __call__(self, autograd_ctx_id: int) -> None:
        grads_by_param = dist_autograd.get_gradients(autograd_ctx_id)
        try:
            for p in self.params:
                p.grad = grads_by_param.get(p)
            self.optim.step()
        finally:
            for p in self.params:
                p.grad = None


class LocalOptimizer:
    """What an owner keeps for one DistributedOptimizer: a step callable and its locks.

    Attributes:
        params: the local parameters.
        locks: the parameters' distinct locks, in acquisition order.
        module: the compiled module (functional path) or None (eager path).
        optim: the torch.optim optimizer (eager path) or None (functional path).
        step_context: ``step_context(autograd_ctx_id)``, unlocked.
    """

    def __init__(
        self,
        params: List[Tensor],
        step_context: Callable[[int], None],
        optim: Any,
        module: Optional[torch.nn.Module] = None,
    ) -> None:
        self.params = params
        self.locks = locks_for(params)
        self.step_context = step_context
        self.optim = optim
        self.module = module
        _live_local_optimizers.add(self)

    def close(self) -> None:
        """Drop the optimizer and its state now, before the RRef protocol frees this object."""
        _live_local_optimizers.discard(self)
        self.step_context = _closed_step
        self.params = []
        self.locks = []
        self.optim = None
        self.module = None


def _closed_step(autograd_ctx_id: int) -> None:
    raise RuntimeError("Invalid local optimizer: it was released (expected a live one)")


_live_local_optimizers: "weakref.WeakSet[LocalOptimizer]" = weakref.WeakSet()


def live_local_optimizers() -> List[LocalOptimizer]:
    """The local optimizers on this worker that are neither released nor freed."""
    return list(_live_local_optimizers)


def _local_params(param_rrefs: List[rpc.RRef]) -> List[Tensor]:
    return [rref.local_value() for rref in param_rrefs]


def new_compiled_local_optimizer(
    functional_cls: type, param_rrefs: List[rpc.RRef], *args: Any, **kwargs: Any
) -> Any:
    """RPC target: compile a functional optimizer over the local parameters.

    Returns:
        An RRef to the new ``LocalOptimizer``, or a ``RemoteFailure``.
    """
    try:
        params = _local_params(param_rrefs)
        with _compile_lock:  # construction may compile the functional class too
            module = _CompiledLocalOptimizer(functional_cls, params, *args, **kwargs)
            scripted = torch.jit.script(module)
        # The scripted module holds its own copy of the optimizer; keep only the module.
        local = LocalOptimizer(params, scripted.step_context, None, scripted)
        return rpc.RRef(local)
    except Exception as exc:
        return RemoteFailure.from_exception(exc)


def new_eager_local_optimizer(
    optim_cls: type, param_rrefs: List[rpc.RRef], *args: Any, **kwargs: Any
) -> Any:
    """RPC target: construct a torch.optim optimizer over the local parameters.

    Returns:
        An RRef to the new ``LocalOptimizer``, or a ``RemoteFailure``.
    """
    try:
        params = _local_params(param_rrefs)
        eager = _EagerStep(optim_cls, params, *args, **kwargs)
        return rpc.RRef(LocalOptimizer(params, eager, eager.optim))
    except Exception as exc:
        return RemoteFailure.from_exception(exc)


def step_local_optimizer(optimizer_rref: rpc.RRef, autograd_ctx_id: int) -> Optional[RemoteFailure]:
    """RPC target of every step: lock, one call into the step, unlock.

    An owner that took no part in the backward pass has no such context: nothing to do.

    Returns:
        None, or a ``RemoteFailure``.
    """
    try:
        local = optimizer_rref.local_value()
        locks = local.locks
        taken = 0
        try:
            for lock in locks:
                lock.acquire()
                taken += 1
            local.step_context(autograd_ctx_id)
        finally:
            for lock in reversed(locks[:taken]):
                lock.release()
        return None
    except Exception as exc:
        if not _has_context(autograd_ctx_id):
            return None
        return RemoteFailure.from_exception(exc)


def _has_context(autograd_ctx_id: int) -> bool:
    # Asked only after a failed step, so the hot path pays nothing for it.
    try:
        dist_autograd._retrieve_context(autograd_ctx_id)
    except RuntimeError:
        return False
    return True


def release_local_optimizer(optimizer_rref: rpc.RRef) -> None:
    """RPC target: free a local optimizer now (its creator is giving up on it)."""
    optimizer_rref.local_value().close()


def set_local_hyperparameter(optimizer_rref: rpc.RRef, name: str, value: List[float]) -> None:
    """RPC target: change a hyper-parameter of a compiled local optimizer, under its locks."""
    local = optimizer_rref.local_value()
    if local.module is None:
        raise TypeError(
            f"Invalid local optimizer: {type(local.optim).__name__} is eager "
            f"(expected a compiled functional optimizer)"
        )
    locks = local.locks
    for lock in locks:
        lock.acquire()
    try:
        local.module.set_hyperparameter(name, value)
    finally:
        for lock in reversed(locks):
            lock.release()
