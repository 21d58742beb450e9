"""Closing the optimizers still open when the interpreter exits, before it tears down.

A script that ends without ``close()`` (as most do, or with an exception escaping the
training loop) leaves the optimizers' threads and gloo groups running into interpreter
finalization. From then on Python 3.11 ends any thread but the main one that takes the GIL
with ``pthread_exit``, and inside C++ code, which cannot be unwound that way, that aborts the
process ("terminate called without an active exception", SIGABRT: torchrun reports the rank
as failed). Three kinds of thread take the GIL late: distopt's communication and finishing
threads, releasing the last step's work (its tensors) or bucket; gloo's worker threads,
releasing a finished work, whose tensors' Python objects are released under the GIL in
torch 2.13 (``intrusive_ptr`` drops them when its count falls to one); and the same workers
disposing of torch's PowerSGD callbacks. ``step()`` returns as soon as the last reduction
is complete, before any of that has happened. Measured with ``tests/parallel/exit_stress.py``
(3 steps on 2 ranks, plain, PowerSGD and the DDP hook optimizer, ending cleanly, raising or
after ``dist.destroy_process_group()``): 28 aborts in 200 runs before, 0 in 200 since.

So the first optimizer built registers one ``atexit`` handler for the process. It runs on
the main thread before finalization (after the handlers registered later, such as one of
the user's that saves a checkpoint) and, while every thread can still take the GIL:

1. collects garbage, so that optimizers nobody references any more (a ``main()`` that has
   returned; some sit in reference cycles) go now: each one's finalizer stops its threads
   and retires its private group (``distopt._torch.destroy_private_group``);
2. closes every optimizer still open, in the order they were built, as ``close()`` would;
3. joins every distopt thread still running;
4. drops every retired group, which joins its gloo worker threads (waiting first, a few
   milliseconds at most, for the workers to let go of PowerSGD's callbacks).

Each wait is bounded by ``EXIT_TIMEOUT_S``: a collective stuck on a lost peer leaves its
optimizer, thread or group as it is, as before.
"""
import atexit
import gc
import itertools
import logging
import threading
import weakref
from typing import Any, Dict

from distopt import _torch

logger = logging.getLogger(__name__)

__all__ = ["EXIT_TIMEOUT_S", "close_at_exit", "join_at_exit"]

#: The longest the exit waits for one optimizer's threads, then for every retired group's
#: workers to let go (a collective whose peer is gone waits for the group's timeout).
EXIT_TIMEOUT_S = 10.0

_lock = threading.Lock()
_order = itertools.count()
#: Registration order -> the object, held weakly: one the user dropped closes itself.
_open: Dict[int, "weakref.ref[Any]"] = {}
_threads: "weakref.WeakSet[threading.Thread]" = weakref.WeakSet()
_registered = False


def close_at_exit(closable: Any) -> None:
    """Have ``closable._close(EXIT_TIMEOUT_S)`` called at interpreter exit if it is still
    alive then (``_close`` returns whether everything stopped; calling it twice is
    harmless)."""
    with _lock:
        _register()
        for key in [k for k, ref in _open.items() if ref() is None]:
            del _open[key]
        _open[next(_order)] = weakref.ref(closable)


def join_at_exit(thread: threading.Thread) -> None:
    """Have ``thread`` (a daemon thread that ends once told to) joined at exit."""
    with _lock:
        _register()
        _threads.add(thread)


def _register() -> None:
    global _registered
    if not _registered:
        atexit.register(_at_exit)
        _registered = True


def _at_exit() -> None:
    gc.collect()
    with _lock:
        refs = [_open.pop(key) for key in sorted(_open)]
    for ref in refs:
        closable = ref()
        if closable is None:
            continue
        try:
            if not closable._close(EXIT_TIMEOUT_S):
                logger.warning("%s did not stop within %.0f s at exit (a collective in "
                               "flight, or one that failed)", type(closable).__name__,
                               EXIT_TIMEOUT_S)
        except Exception:  # noqa: B902 - the exit goes on; the rest still need closing
            logger.exception("closing %s at exit failed", type(closable).__name__)
        del closable
    with _lock:
        threads = list(_threads)
    for thread in threads:
        if thread is not threading.current_thread():
            thread.join(EXIT_TIMEOUT_S)
    del threads
    if not _torch.release_retired_groups(EXIT_TIMEOUT_S):
        logger.warning("a destroyed process group was still referenced %.0f s into the "
                       "exit; its worker threads were left running", EXIT_TIMEOUT_S)
