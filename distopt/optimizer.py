"""The trainer's side: DistributedOptimizer groups parameters by owner and fans steps out."""
import inspect
import logging
import operator
from typing import Any, Dict, Iterable, List, Tuple

import torch
import torch.distributed.autograd as dist_autograd
import torch.distributed.rpc as rpc
from torch._C._distributed_rpc import PyRRef
from torch.futures import Future

from distopt import owner
from distopt.errors import RemoteFailure, compose_error, transport_message
from functional import functional_optim_map

logger = logging.getLogger(__name__)


class DistributedOptimizer:
    r"""An optimizer over parameters held by several RPC workers, each updating its own.

    A drop-in for :class:`torch.distributed.optim.DistributedOptimizer`: same arguments,
    same ``step(context_id)``, same ``is_functional_optim``. Each owner gets one local
    optimizer over its parameters. When ``optimizer_class`` has a functional stand-in in
    ``functional.functional_optim_map`` the local optimizer is compiled with TorchScript and
    steps without the GIL, reading the gradients straight from the autograd context;
    otherwise ``optimizer_class`` itself runs eagerly, fed through ``.grad``.

    Every step of every local optimizer holds the locks of the parameters it updates, so any
    number of trainers, each with its own DistributedOptimizer over the same parameters,
    lose no update, while optimizers over disjoint parameters step in parallel. As with
    torch's version, nothing orders one trainer's forward, backward and step against
    another's.

    Args:
        optimizer_class: a :class:`torch.optim.Optimizer` subclass, or any class registered in
            ``functional.functional_optim_map``.
        params_rref: RRefs to the parameters to optimize, local or remote.
        *args: positional arguments for the optimizer, given after the parameters.
        **kwargs: keyword arguments for the optimizer.

    Raises:
        TypeError: ``optimizer_class`` is not an optimizer class, or an item of
            ``params_rref`` is not an RRef.
        ValueError: ``params_rref`` is empty.
        DistributedOptimizerError: some owners failed to create their optimizer (for
            instance they rejected the arguments); those created elsewhere are released.

    Example::

        >>> with dist_autograd.context() as context_id:
        ...     loss = rpc.rpc_sync("worker1", forward, args=(param_rref, x))
        ...     dist_autograd.backward(context_id, [loss])
        ...     opt = DistributedOptimizer(torch.optim.Adam, [param_rref], lr=1e-3)
        ...     opt.step(context_id)
    """

    def __init__(
        self, optimizer_class: type, params_rref: Iterable[rpc.RRef], *args: Any, **kwargs: Any
    ) -> None:
        _check_optimizer_class(optimizer_class)
        rrefs = _check_params_rref(params_rref)

        functional_cls = functional_optim_map.get(optimizer_class)
        # Mirror torch: with TorchScript disabled, torch.optim classes run eagerly.
        jit_enabled = bool(torch.jit._state._enabled)
        self.is_functional_optim = functional_cls is not None and (
            jit_enabled or not issubclass(optimizer_class, torch.optim.Optimizer)
        )
        if self.is_functional_optim:
            new_local, ctor = owner.new_compiled_local_optimizer, functional_cls
        else:
            logger.info("%s runs eagerly on its owners (no functional stand-in)", optimizer_class)
            new_local, ctor = owner.new_eager_local_optimizer, optimizer_class

        by_owner: Dict[str, Tuple[rpc.WorkerInfo, List[rpc.RRef]]] = {}
        for rref in rrefs:
            info = rref.owner()
            by_owner.setdefault(info.name, (info, []))[1].append(rref)

        futures = {
            name: _call_async(info, new_local, (ctor, params) + args, kwargs)
            for name, (info, params) in by_owner.items()
        }
        results, failures, causes = _wait_all(futures)
        created = [r for r in results.values() if isinstance(r, PyRRef)]
        if failures:
            _release(created)
            del created, results, futures  # the traceback must not keep the RRefs alive
            raise compose_error("construction", failures) from causes[0]
        self.remote_optimizers: List[rpc.RRef] = created

    def step(self, context_id: int) -> None:
        """Step every owner's local optimizer with the gradients of ``context_id``.

        Blocks until every owner has replied. Owners that received no gradient in this
        context leave their parameters as they are.

        Args:
            context_id: the id of the live distributed autograd context whose backward pass
                computed the gradients.

        Raises:
            TypeError: ``context_id`` is not an integer.
            ValueError: no such context is alive on this worker (checked before any owner is
                contacted).
            DistributedOptimizerError: some owners failed, or could not be reached.
        """
        try:
            context_id = operator.index(context_id)
        except TypeError:
            raise TypeError(
                f"Invalid context_id: {context_id!r} (expected an int, the id of a "
                f"dist_autograd.context())"
            ) from None
        try:
            dist_autograd._retrieve_context(context_id)
        except RuntimeError as exc:
            raise ValueError(
                f"Invalid context_id: {context_id!r} (expected the id of a live "
                f"dist_autograd.context() on this worker)"
            ) from exc

        futures = {
            optim.owner_name(): _call_async(
                optim.owner(), owner.step_local_optimizer, (optim, context_id), {}
            )
            for optim in self.remote_optimizers
        }
        _, failures, causes = _wait_all(futures)
        if failures:
            raise compose_error("step", failures) from causes[0]


def _check_optimizer_class(optimizer_class: Any) -> None:
    if not inspect.isclass(optimizer_class):
        raise TypeError(
            f"Invalid optimizer_class: {optimizer_class!r} (expected a torch.optim.Optimizer "
            f"subclass or a class in functional.functional_optim_map)"
        )
    if not issubclass(optimizer_class, torch.optim.Optimizer) and (
        optimizer_class not in functional_optim_map
    ):
        raise TypeError(
            f"Invalid optimizer_class: {optimizer_class.__qualname__} (expected a "
            f"torch.optim.Optimizer subclass or a class in functional.functional_optim_map)"
        )


def _check_params_rref(params_rref: Iterable[rpc.RRef]) -> List[rpc.RRef]:
    try:
        rrefs = list(params_rref)
    except TypeError:
        raise TypeError(
            f"Invalid params_rref: {type(params_rref).__name__} (expected a list of RRefs)"
        ) from None
    if not rrefs:
        raise ValueError("Invalid params_rref: [] (expected at least one RRef)")
    for i, rref in enumerate(rrefs):
        if not isinstance(rref, PyRRef):  # rpc.remote returns the base, not rpc.RRef
            raise TypeError(
                f"Invalid params_rref[{i}]: {type(rref).__name__} (expected an RRef to a "
                f"parameter)"
            )
    return rrefs


def _call_async(to: rpc.WorkerInfo, func: Any, args: tuple, kwargs: Dict[str, Any]) -> Future:
    """``rpc_async``, with an error raised at the call turned into a failed future."""
    try:
        return rpc.rpc_async(to, func, args=args, kwargs=kwargs)
    except Exception as exc:
        failed: Future = Future()
        failed.set_exception(exc)
        return failed


def _wait_all(
    futures: Dict[str, Future]
) -> Tuple[Dict[str, Any], Dict[str, str], List[BaseException]]:
    """Wait for every future; returns (results, worker -> message, causes in worker order)."""
    results: Dict[str, Any] = {}
    failures: Dict[str, str] = {}
    causes: List[BaseException] = []
    for name, fut in futures.items():
        try:
            result = fut.wait()
        except Exception as exc:  # transport: dead owner, timeout, unpicklable arguments
            failures[name] = transport_message(exc)
            causes.append(exc)
            continue
        if isinstance(result, RemoteFailure):
            failures[name] = result.message
            causes.append(result.as_exception())
        else:
            results[name] = result
    return results, failures, causes


def _release(optimizer_rrefs: List[rpc.RRef]) -> None:
    """Ask each owner to free a local optimizer now; failures are logged, not raised."""
    futures = {
        f"{rref.owner_name()}#{i}": _call_async(
            rref.owner(), owner.release_local_optimizer, (rref,), {}
        )
        for i, rref in enumerate(optimizer_rrefs)
    }
    _, failures, _ = _wait_all(futures)
    for name, message in failures.items():
        logger.warning("could not release local optimizer %s: %s", name, message)
