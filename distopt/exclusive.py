"""The exclusive fast path: a compiled local optimizer that nobody shares steps GIL-free.

Every locked step runs Python on the owner (unpickle, take the locks, call), and each time a
Python RPC handler takes the GIL back it can wait a whole switch interval behind a busy
interpreter. TorchScript has no lock, so a step that runs no Python cannot take one. It needs
none while two things hold:

- on the owner, no other live local optimizer shares a lock with this one (the owner's
  lock registry tracks who uses each lock): the optimizer is *exclusive*;
- on the trainer, one DistributedOptimizer never has two operations in flight (each holds
  its own ``threading.Lock`` around every owner-facing operation).

The trainer then steps such an optimizer with ``script_step``, a TorchScript RPC that calls
the scripted module through an RRef, no Python on the owner. When an owner creates a local
optimizer over a lock that an exclusive one uses, it first asks that one's trainer, with a
nested RPC to ``switch_to_locked``, to send its later steps through the locked Python path;
the trainer answers once no operation of that optimizer is in flight. Only then does the
new optimizer exist for anyone to step.
"""
import itertools
import threading
import weakref
from typing import Callable, Dict, List

import torch
from torch.distributed.rpc import RRef

from functional._compile import quiet_scripting, script

__all__ = [
    "ExclusiveStep", "register", "script_step", "script_step_with_empty", "switch_to_locked",
]


class ExclusiveStep:
    """What ``script_step`` calls on the scripted module behind the RRef."""

    def step_exclusive(self, autograd_ctx_id: int) -> bool:
        pass

    def step_exclusive_with_empty(self, autograd_ctx_id: int, empty: List[List[int]]) -> bool:
        pass


with quiet_scripting():  # interface() resolves names from its caller's frame: here
    torch.jit.interface(ExclusiveStep)


@script
def script_step(optimizer: RRef[ExclusiveStep], autograd_ctx_id: int) -> bool:
    """TorchScript RPC target: one unlocked step of an exclusive local optimizer; returns
    whether the context held a gradient of any of its parameters here.

    The RRef, not an int id, names the optimizer: a TorchScript function can reach no
    Python registry. Sent back to its owner it costs one extra message (the owner's child
    accept), sent from C++, which takes no GIL.
    """
    # ``distopt.owner.step`` (distopt.profiling): TorchScript cannot ask whether a profiler
    # runs, and an idle record_function costs 0.9 to 1.7 us here, once per owner step.
    with torch.autograd.profiler.record_function("distopt.owner.step"):
        found = optimizer.local_value().step_exclusive(autograd_ctx_id)
    return found


@script
def script_step_with_empty(
    optimizer: RRef[ExclusiveStep], autograd_ctx_id: int, empty: List[List[int]]
) -> bool:
    """TorchScript RPC target: ``script_step``, where the parameters at positions
    ``empty[j]`` of local group ``j`` step even without a gradient in the context, with one
    holding no rows (see ``distopt.local_optimizer.empty_sparse_gradient``)."""
    with torch.autograd.profiler.record_function("distopt.owner.step"):
        found = optimizer.local_value().step_exclusive_with_empty(autograd_ctx_id, empty)
    return found


# ---------------------------------------------------------------- trainer side

#: Key -> the trainer-side optimizer's method that switches it to the locked path, held
#: weakly (a collected optimizer is never stepped again).
_instances: "Dict[int, weakref.WeakMethod]" = {}
_keys = itertools.count(1)
_instances_lock = threading.Lock()


def register(switch: Callable[[str], None]) -> int:
    """Give a trainer-side optimizer the key its owners use to reach it: ``switch`` (a bound
    method, held weakly) steps its local optimizer on the named owner through the locks."""
    with _instances_lock:
        for key in [k for k, ref in _instances.items() if ref() is None]:
            del _instances[key]
        key = next(_keys)
        _instances[key] = weakref.WeakMethod(switch)
    return key


def switch_to_locked(key: int, owner_name: str) -> bool:
    """RPC target on a trainer: step optimizer ``key`` on ``owner_name`` through the locks.

    Returns:
        True once the optimizer has no operation in flight and every later step to that
        owner takes the locked path; False when it was collected (it will never step again).
    """
    with _instances_lock:
        ref = _instances.get(key)
    switch = ref() if ref is not None else None
    if switch is None:
        return False
    switch(owner_name)
    return True
