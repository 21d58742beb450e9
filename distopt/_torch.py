"""Every private torch API distopt calls, each behind one name that says why it is needed.

A torch release that moves or renames one of these should change this file only (distopt
runs on torch 2.11 and 2.13). Not here: torch's ``_foreach_*`` kernels, which torch.optim
itself runs and which distopt calls from TorchScript functions (``distopt.clipping``) by
name; and the functional package's own, in ``functional/_torch.py`` (functional never
imports distopt). ``tests/test_private_torch.py`` fails on a private torch name anywhere else.
"""
import sys
import time
from collections import OrderedDict
from typing import Any, Callable, List

import torch
import torch.distributed as dist
import torch.distributed.autograd as dist_autograd
import torch.distributed.rpc as rpc
from torch._C._distributed_rpc import PyRRef
from torch.utils.weak import WeakIdKeyDictionary

__all__ = [
    "PyRRef",
    "WeakIdKeyDictionary",
    "all_gather_flat",
    "all_threads_profiler_config",
    "current_context_id",
    "ddp_delayed_params",
    "ddp_ignored_names",
    "destroy_private_group",
    "init_optimizer_internals",
    "DDP_FIRST_BUCKET_BYTES",
    "end_join",
    "is_first_joinable",
    "jit_enabled",
    "join_enabled",
    "notify_join_context_as_first",
    "optimizer_hooks",
    "profiler_running",
    "known_worker_ids",
    "queue_end_of_backward",
    "release_retired_groups",
    "retrieve_context",
    "rpc_initialized",
    "version",
]

# ``PyRRef``: what ``rpc.remote`` returns is this base class, not ``rpc.RRef``, so an
# isinstance check against ``rpc.RRef`` would refuse every RRef.
# ``WeakIdKeyDictionary`` (torch.utils.weak, undocumented): keys held weakly and compared by
# identity; a ``weakref.WeakKeyDictionary`` compares tensors with ``==``.


def retrieve_context(context_id: int) -> Any:
    """The live distributed autograd context ``context_id``; RuntimeError when there is none.

    Needed because dist_autograd has no public lookup: ``get_gradients`` raises the same
    way, but copies every gradient of the context into a new dict first.
    """
    return dist_autograd._retrieve_context(context_id)


def current_context_id() -> int:
    """The id of the distributed autograd context this thread is in; RuntimeError outside one.

    Needed because ``dist_autograd.context()`` gives the id only to the code that opened it,
    while an RPC target runs inside the caller's context without being told its id.
    """
    return dist_autograd._current_context()._context_id()


def known_worker_ids(context: Any) -> Any:
    """The ids of the workers ``context`` (from ``retrieve_context``) sent RPCs to.

    Needed to know which owners surely hold the context: no public API tells.
    """
    return context._known_worker_ids()


def ddp_ignored_names(ddp: Any) -> Any:
    """The names of the parameters and buffers a DistributedDataParallel leaves alone.

    Needed because DDP documents no accessor: it keeps the names it read from the module's
    ``_ddp_params_and_buffers_to_ignore`` in its undocumented ``parameters_to_ignore``, set
    before it assigns ``self.module``.
    """
    return getattr(ddp, "parameters_to_ignore", ())


def ddp_delayed_params(ddp: Any) -> List[Any]:
    """The parameters whose all_reduce a DistributedDataParallel delays to the end of
    backward (its ``delay_all_reduce_named_params``): averaged by it, though their names are
    among ``ddp_ignored_names``.

    Needed because DDP keeps them only in its private ``_delay_all_reduce_params``, set
    before it assigns ``self.module``.
    """
    return list(getattr(ddp, "_delay_all_reduce_params", ()))


#: DDP's first bucket once it rebuilds its buckets (bytes), with its default cap.
#: Needed so that a DataParallelOptimizer's rebuilt first bucket starts its reduction as
#: early as DDP's; torch names it ``torch.distributed._DEFAULT_FIRST_BUCKET_BYTES`` only
#: (1 MiB where it is missing).
DDP_FIRST_BUCKET_BYTES: int = int(getattr(dist, "_DEFAULT_FIRST_BUCKET_BYTES", 1 << 20))


def join_enabled(joinable: Any) -> bool:
    """Whether ``joinable`` is inside a ``Join`` block that is enabled (its ``JoinConfig``).

    Needed because a Joinable's collectives outside backward start a Join round only under
    Join, and torch keeps the flag in the Joinable's private ``_join_config``.
    """
    return bool(joinable._join_config.enable)


def is_first_joinable(joinable: Any) -> bool:
    """Whether ``joinable`` is the first one given to its ``Join`` (whose hook runs the
    joined rank's iterations, and which notifies the Join context).

    Needed because torch keeps it in the Joinable's private ``_join_config``.
    """
    return bool(joinable._join_config.is_first_joinable)


def notify_join_context_as_first(joinable: Any) -> None:
    """``Join.notify_join_context(joinable)`` as if it were the first Joinable of its Join.

    Needed because a second DataParallelOptimizer in one Join starts Join iterations of its
    own, and torch's notify does its all_reduce for the first Joinable only; its
    ``_join_config`` is set for the call and restored.
    """
    from torch.distributed.algorithms.join import Join

    config = joinable._join_config
    if config.is_first_joinable:
        Join.notify_join_context(joinable)
        return
    joinable._join_config = config._replace(is_first_joinable=True)
    try:
        Join.notify_join_context(joinable)
    finally:
        joinable._join_config = config


def end_join(joinable: Any) -> None:
    """Mark ``joinable``'s Join as over (``post_hook``): its collectives go back to normal.

    Needed because a Join's config stays on the Joinable until the next Join replaces it;
    torch keeps it in the private ``_join_config``.
    """
    joinable._join_config = joinable._join_config._replace(enable=False)


def all_threads_profiler_config() -> Any:
    """``torch.profiler``'s experimental config with ``profile_all_threads=True``.

    Needed because a profiler records ranges on threads started before it (distopt's
    communication and finishing threads, RPC's agent threads) only with it, and torch 2.13
    offers it only as ``torch.profiler._ExperimentalConfig``.
    """
    return torch.profiler._ExperimentalConfig(profile_all_threads=True)


def jit_enabled() -> bool:
    """Whether TorchScript is on (``PYTORCH_JIT=0`` turns it off).

    Needed to fall back to eager torch.optim classes as torch's DistributedOptimizer does;
    torch exposes the flag only as ``torch.jit._state._enabled``.
    """
    return bool(torch.jit._state._enabled)


def rpc_initialized() -> bool:
    """Whether ``rpc.init_rpc`` has run in this process.

    Needed to refuse early with a clear message; torch.distributed.rpc has no public query.
    """
    return rpc.api._is_current_rpc_agent_set()


def init_optimizer_internals(optimizer: torch.optim.Optimizer) -> None:
    """Set the private fields ``torch.optim.Optimizer.__init__`` would set on ``optimizer``.

    Needed because a DistributedOptimizer's parameters are RRefs, which
    ``Optimizer.__init__`` refuses, while its step hooks, state_dict hooks and lr
    schedulers read these fields (and ``step`` must be wrapped as torch wraps it).
    """
    # OrderedDicts, as torch's: a hook's RemovableHandle keeps a weak reference to its dict.
    optimizer._optimizer_step_pre_hooks = OrderedDict()
    optimizer._optimizer_step_post_hooks = OrderedDict()
    optimizer._optimizer_state_dict_pre_hooks = OrderedDict()
    optimizer._optimizer_state_dict_post_hooks = OrderedDict()
    optimizer._optimizer_load_state_dict_pre_hooks = OrderedDict()
    optimizer._optimizer_load_state_dict_post_hooks = OrderedDict()
    optimizer._patch_step_function()
    # No capturable (CUDA graph) state here: torch's warning about it does not apply.
    optimizer._warned_capturable_if_run_uncaptured = True


#: The hooks ``optimizer_hooks`` reads: torch.optim.Optimizer's ``register_<kind>_hook``.
_HOOK_KINDS = ("state_dict_pre", "state_dict_post", "load_state_dict_pre",
               "load_state_dict_post")


def optimizer_hooks(optimizer: torch.optim.Optimizer, kind: str) -> List[Callable[..., Any]]:
    """The hooks registered on ``optimizer`` by ``register_<kind>_hook``, in order; ``kind``
    one of "state_dict_pre", "state_dict_post", "load_state_dict_pre", "load_state_dict_post".

    Needed by optimizers that build their own ``state_dict`` / ``load_state_dict`` (the
    data-parallel ones): torch runs these hooks only inside its own methods and keeps them in
    private dicts (``_optimizer_<kind>_hooks``), with no public way to read them.
    """
    if kind not in _HOOK_KINDS:
        raise ValueError(f"Invalid kind: {kind!r} (expected one of {_HOOK_KINDS})")
    return list(getattr(optimizer, f"_optimizer_{kind}_hooks").values())


def queue_end_of_backward(callback: Any) -> None:
    """Run ``callback()`` once the backward pass now running has finished; call it from a
    hook inside that pass.

    Needed by ``distopt.parallel`` to find the parameters a backward pass gave no gradient
    (the end of backward is where DDP's reducer finds them too); torch exposes the autograd
    engine's callback queue only through ``Variable._execution_engine``.
    """
    torch.autograd.Variable._execution_engine.queue_callback(callback)


def profiler_running() -> bool:
    """Whether a profiler may record a range opened on this thread now.

    Needed because ``torch.profiler.record_function`` costs about 4 us even when nothing
    records (measured on torch 2.13), and torch exposes no public query: ``torch.profiler``
    sets the Python flag ``torch.autograd.profiler._is_profiler_enabled`` (seen on every
    thread, as ``profile_all_threads`` needs: the thread-local state stays off on threads
    started before the profiler), and RPC's propagation of a caller's profiler into the
    callee's handler sets only the thread-local ``torch.autograd._profiler_enabled()``.
    Both together cost about 0.05 us.
    """
    return bool(torch.autograd.profiler._is_profiler_enabled) or torch.autograd._profiler_enabled()


def all_gather_flat(output: Any, tensor: Any, group: Any = None, async_op: bool = False) -> Any:
    """Every rank's ``tensor``, concatenated in rank order into the 1-D ``output``.

    Needed because torch 2.13 renamed ``all_gather_into_tensor`` to ``all_gather_single``
    (the old name warns), while torch 2.11 has only the old name.
    """
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    return gather(output, tensor, group=group, async_op=async_op)


def version(tensor: Any) -> int:
    """How many in-place changes ``tensor``'s storage has seen (shared by its views).

    Needed by ``distopt.parallel`` to notice a ``.grad`` changed in place between backward
    and ``step()`` (``clip_grad_norm_``, ``zero_grad(set_to_none=False)``) after its bucket
    was reduced, and by ``distopt.local_optimizer`` to tell which parameters a step has
    bumped already; torch exposes the autograd version counter only as
    ``Tensor._version``. Changes made through ``.data`` do not count.
    """
    return tensor._version


def backward_depth() -> int:
    """How many backward passes this thread's Python stack is inside (2 or more: a nested,
    reentrant one, as ``torch.utils.checkpoint(..., use_reentrant=True)`` runs).

    Needed by ``distopt.parallel`` to refuse nested passes clearly: torch does not expose the
    autograd engine's reentrant depth, so this counts the frames of
    ``torch.autograd.graph._engine_run_backward`` (0 where torch lacks it).
    """
    run = getattr(torch.autograd.graph, "_engine_run_backward", None)
    code = getattr(run, "__code__", None)
    depth = 0
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_code is code:
            depth += 1
        frame = frame.f_back
    return depth


def private_group() -> Any:
    """A new process group of every rank, with the default group's backend and timeout, for
    collectives issued from a thread of their own; every rank must call it, in the same
    order (as ``torch.distributed.new_group`` requires).

    Needed by ``distopt.parallel``: collectives issued on one group from two threads (two
    optimizers' communication threads, or one and SyncBatchNorm's backward) can pair up in a
    different order on each rank, which gloo answers by aborting the process. The timeout is
    read from the backend's options, which torch does not expose otherwise.
    """
    _drop_retired()
    parent = dist.group.WORLD
    backend = dist.get_backend(parent)
    device = torch.device("cuda" if backend == "nccl" else "cpu")
    timeout = None
    try:
        timeout = parent._get_backend(device).options._timeout
    except (AttributeError, RuntimeError):
        pass
    return dist.new_group(timeout=timeout, backend=backend)


#: Groups made by ``private_group`` and destroyed since, kept until nothing else holds them.
_RETIRED: list = []


def destroy_private_group(group: Any) -> None:
    """Destroy a group made by ``private_group`` (every rank must call it), and make sure
    its last reference is dropped on the calling thread.

    Needed because torch's PowerSGD hook chains ``future.then`` callbacks whose closures
    hold the group; gloo runs and releases them on the group's own worker threads. A callback released
    there after everything else let go would run the group's destructor on a worker
    thread, which joins itself: ``std::system_error: Resource deadlock avoided`` aborts
    the process. So destroyed groups wait here, and each call drops those that nothing
    else references any more (sys.getrefcount: this list's and the call's own).
    """
    try:
        dist.destroy_process_group(group)
    finally:
        _RETIRED.append(group)
        del group
        _drop_retired()


def _drop_retired() -> None:
    # 3 references: the list's, the loop variable's and getrefcount's argument.
    _RETIRED[:] = [g for g in _RETIRED if sys.getrefcount(g) > 3]


def release_retired_groups(timeout_s: float) -> bool:
    """Drop, on the calling thread, every group ``destroy_private_group`` kept, waiting up
    to ``timeout_s`` for the others holding one to let go; True when none is left.

    Needed at interpreter exit: the last reference to a gloo group, dropped, joins the
    group's worker threads (torch releases the GIL there), and only then have they stopped
    touching Python objects. Until then a worker still releasing a finished work (its
    tensors' Python objects) or torch's PowerSGD callbacks takes the GIL, and once
    finalization has begun Python 3.11 ends such a thread with ``pthread_exit``, which
    inside C++ code aborts the process ("terminate called without an active exception").
    Nothing tells when a worker has released those callbacks but the group's reference
    count, so this polls it (every millisecond, GIL released).
    """
    deadline = time.monotonic() + timeout_s
    _drop_retired()
    while _RETIRED and time.monotonic() < deadline:
        time.sleep(0.001)
        _drop_retired()
    return not _RETIRED
