"""The ranges distopt's work shows under in a user's ``torch.profiler`` trace.

One range per bucket or per owner, never per parameter, each named after what runs:

- ``distopt.DataParallelOptimizer.step``: ``DataParallelOptimizer.step()``, caller's thread.
- ``distopt.dp.reduce[bucket k]``: issuing bucket k's reduction (communication thread).
- ``distopt.dp.reduce.wait[bucket k]``: waiting for it and taking the average out
  (finishing thread).
- ``distopt.dp.step[bucket k]``: bucket k's compiled step (finishing thread, during
  backward, with ``overlap=True``; else inside ``step()``).
- ``distopt.dp.gather[bucket k]``: sharded state, issuing the gather of bucket k's updated
  parameters (communication thread during backward, else inside ``step()``).
- ``distopt.dp.gather.wait[bucket k]``: waiting for that gather and copying the
  parameters out (finishing thread, or inside ``step()``).
- ``distopt.ddp.reduce[bucket k]``, ``distopt.ddp.reduce.wait[bucket k]``,
  ``distopt.ddp.step[bucket k]``: the same in ``distopt.parallel``'s DDP hooks (issued
  on the thread running backward; waited for and stepped on the hook's own thread).
- ``distopt.DistributedOptimizer.step``: the trainer's step (one RPC per owner, the wait).
- ``distopt.owner.step``: an owner's step of one local optimizer, locked (Python) or
  exclusive (TorchScript).

Distopt's communication and finishing threads (and the hooks' thread) are started at the
first backward pass: ``torch.profiler`` records ranges on a thread started before it only
when built with ``experimental_config=distopt.profiling.all_threads_config()`` (torch's
experimental ``profile_all_threads=True``, torch 2.13). An owner's ``distopt.owner.step`` is recorded only by a profiler running in
the owner's process (with ``profile_all_threads=True``: RPC handlers run on the agent's
threads); a trainer's profile, ``torch.profiler`` or ``torch.autograd.profiler``, shows the
RPC calls but nothing of the owners' work (torch 2.13 warns "Profiling a distributed call
with the Kineto profiler will profile the caller, but not the worker").

When no profiler runs a range costs one flag check (about 0.4 us with the call), not the
4.2 to 4.9 us of an idle ``record_function`` (torch 2.13, this project's 2-core machine); the
TorchScript ``distopt.owner.step`` cannot check, and costs 0.9 to 1.7 us per owner step.
With a profiler running a range costs what ``record_function`` costs, about 5 us.
"""
import contextlib
from typing import Any, ContextManager, Optional

from torch.profiler import record_function

from distopt._torch import all_threads_profiler_config, profiler_running

__all__ = ["all_threads_config", "profiler_range"]

#: What a range is when no profiler runs: one reusable no-op context.
_IDLE: ContextManager[Any] = contextlib.nullcontext()


def profiler_range(name: str, bucket: Optional[int] = None) -> ContextManager[Any]:
    """A ``record_function`` range named ``name`` (``name[bucket k]`` for a bucket) while a
    profiler runs; a no-op otherwise.

    Args:
        name: the range's name, one of the table above.
        bucket: the bucket's index, for a per-bucket range.

    Returns:
        A context manager.
    """
    if not profiler_running():
        return _IDLE
    return record_function(name if bucket is None else f"{name}[bucket {bucket}]")


def all_threads_config() -> Any:
    """The ``experimental_config`` with which ``torch.profiler.profile`` records the ranges
    of threads started before it (distopt's communication and finishing threads, RPC's
    agent threads): torch's ``profile_all_threads=True``."""
    return all_threads_profiler_config()
