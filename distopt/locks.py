"""The owner's parameter locks: which lock guards each parameter, and who takes it.

Locks belong to parameters. The first local optimizer to touch a parameter gives it, and
every other new parameter in that optimizer, one fresh lock with the next sequence number;
later optimizers reuse the locks already there. An optimizer takes its distinct locks in
sequence order, so trainers over the same parameters serialize, optimizers over disjoint
parameters run in parallel, and overlapping sets cannot deadlock.

Each lock knows the live local optimizers that take it (its ``users``), which is how an
owner tells whether an optimizer shares its parameters (see ``distopt.exclusive``).
"""
import contextlib
import itertools
import threading
import weakref
from typing import Any, Iterator, List, Optional, Sequence

from torch import Tensor

from distopt._torch import WeakIdKeyDictionary

__all__ = ["ParamLock", "holding", "lock_of", "param_locks_for", "registry_lock"]


class ParamLock:
    """A lock shared by a batch of parameters, ordered by when the batch was first seen.

    Attributes:
        sequence: the batch's number; locks are taken in increasing order.
        lock: the lock itself.
        users: the live local optimizers that take it (changed under ``registry_lock``).
    """

    __slots__ = ("sequence", "lock", "users", "__weakref__")

    def __init__(self, sequence: int) -> None:
        self.sequence = sequence
        self.lock = threading.Lock()
        self.users: "weakref.WeakSet[Any]" = weakref.WeakSet()


#: Held while the registry, or the ``users`` of any of its locks, changes.
registry_lock = threading.Lock()
# Keyed by tensor identity, weakly: a lock lives as long as its parameters.
_param_locks: WeakIdKeyDictionary = WeakIdKeyDictionary()
_sequence = itertools.count()


def param_locks_for(params: List[Tensor]) -> List[ParamLock]:
    """The distinct locks of ``params``, in acquisition order; new params get one new lock.

    The caller holds ``registry_lock``.
    """
    new = [p for p in params if p not in _param_locks]
    if new:
        shared = ParamLock(next(_sequence))
        for p in new:
            _param_locks[p] = shared
    distinct = {id(pl): pl for pl in (_param_locks[p] for p in params)}
    return sorted(distinct.values(), key=lambda pl: pl.sequence)


@contextlib.contextmanager
def holding(locks: Sequence[threading.Lock]) -> Iterator[None]:
    """Take ``locks`` in the order given; release them in reverse, whatever happens."""
    taken = 0
    try:
        for lock in locks:
            lock.acquire()
            taken += 1
        yield
    finally:
        for lock in reversed(locks[:taken]):
            lock.release()


def lock_of(param: Tensor) -> Optional[threading.Lock]:
    """The lock guarding ``param``, or None if no optimizer has touched it."""
    with registry_lock:
        entry = _param_locks.get(param)
    return None if entry is None else entry.lock
