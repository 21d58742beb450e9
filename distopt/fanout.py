"""Every round of RPCs: one ``rpc_async`` per worker, all in flight at once, one error.

Each round (construct, step, release, state_dict, save, clip, ... on the trainer; an
owner's nested calls to trainers when it revokes exclusivity) sends one ``rpc_async`` per
worker, waits for every future, and turns the failures into one
:class:`~distopt.errors.DistributedOptimizerError` that names each failing worker.
"""
from typing import Any, Callable, Dict, List, Optional, Tuple, Union

import torch.distributed.rpc as rpc
from torch.futures import Future

from distopt.errors import RemoteFailure, compose_error, transport_message

#: One call of a round: (destination, RPC target, positional arguments); the destination
#: is a WorkerInfo or a worker name.
Call = Tuple[Union[rpc.WorkerInfo, str], Callable[..., Any], tuple]


def _call_async(to: Union[rpc.WorkerInfo, str], func: Any, args: tuple) -> Future:
    """``rpc_async``, with an error raised at the call turned into a failed future."""
    try:
        return rpc.rpc_async(to, func, args=args, kwargs={})
    except Exception as exc:
        failed: Future = Future()
        failed.set_exception(exc)
        return failed


def _wait_all(
    futures: Dict[str, Future]
) -> Tuple[Dict[str, Any], Dict[str, str], List[BaseException], Dict[str, str]]:
    """Wait for every future; returns (results, worker -> message, causes in worker order,
    worker -> what a failed step applied there, where the owner said)."""
    results: Dict[str, Any] = {}
    failures: Dict[str, str] = {}
    causes: List[BaseException] = []
    applied: Dict[str, str] = {}
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
            if result.applied is not None:
                applied[name] = result.applied
        else:
            results[name] = result
    return results, failures, causes, applied


def fan_out(
    action: str,
    calls: Dict[str, Call],
    partial: Optional[Callable[[Dict[str, Any]], None]] = None,
) -> Dict[str, Any]:
    """Make every call at once and wait for all of them: one round of RPCs.

    Args:
        action: what the round does, for the error message (``"state_dict"``, ``"save"``...).
        calls: name (a worker's, or any key) -> (destination, RPC target, arguments).
        partial: when some calls fail, called with the results of those that succeeded
            before the error is raised (to release what they created, say).

    Returns:
        name -> the target's result, in the order of ``calls``.

    Raises:
        DistributedOptimizerError: some calls failed or could not be made; every call has
            finished by then.
    """
    futures = {name: _call_async(to, func, args) for name, (to, func, args) in calls.items()}
    results, failures, causes, applied = _wait_all(futures)
    if failures:
        if partial is not None:
            partial(results)
        succeeded = list(results)
        # The traceback keeps this frame: it must not keep the results (RRefs) alive.
        del results, futures
        raise compose_error(action, failures, succeeded, applied) from causes[0]
    return results
