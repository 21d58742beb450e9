"""The trainer's side of every round: one RPC per owner, all in flight at once, one error.

Each round (construct, step, state_dict, save, clip, ...) sends one ``rpc_async`` per owner,
waits for every future, and turns the owners' failures into one
:class:`~distopt.errors.DistributedOptimizerError` that names each failing worker.
"""
import logging
from typing import Any, Callable, Dict, List, Tuple

import torch.distributed.rpc as rpc
from torch.futures import Future

from distopt.errors import RemoteFailure, compose_error, transport_message

logger = logging.getLogger(__name__)

#: One call of a round: (destination, RPC target, positional arguments).
Call = Tuple[rpc.WorkerInfo, Callable[..., Any], tuple]


def call_async(to: rpc.WorkerInfo, func: Any, args: tuple, kwargs: Dict[str, Any]) -> Future:
    """``rpc_async``, with an error raised at the call turned into a failed future."""
    try:
        return rpc.rpc_async(to, func, args=args, kwargs=kwargs)
    except Exception as exc:
        failed: Future = Future()
        failed.set_exception(exc)
        return failed


def wait_all(
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


def fan_out(action: str, calls: Dict[str, Call]) -> Dict[str, Any]:
    """Make every call at once and wait for all of them.

    Args:
        action: what the round does, for the error message (``"state_dict"``, ``"save"``...).
        calls: worker name -> (destination, RPC target, arguments).

    Returns:
        worker name -> the target's result, in the order of ``calls``.

    Raises:
        DistributedOptimizerError: some workers failed or could not be reached; every call
            has finished by then.
    """
    futures = {name: call_async(to, func, args, {}) for name, (to, func, args) in calls.items()}
    results, failures, causes = wait_all(futures)
    if failures:
        raise compose_error(action, failures) from causes[0]
    return results
