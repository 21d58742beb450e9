r"""Hooks for models that stay wrapped in torch's ``DistributedDataParallel``.

DDP buckets gradients and calls a communication hook once per bucket, in bucket order,
from the thread running backward. Two hooks run distopt's machinery there:

- ``compression_hook(compression)``: each bucket is averaged with ``Cast``, ``TopK``,
  ``Threshold`` (or no compression), as ``DataParallelOptimizer`` averages its own buckets.
- ``optimizer_hook(ddp_model, optimizer_class, params, ...)``: the same, and each bucket's
  parameters are then stepped at once, during backward, by a compiled functional optimizer,
  for the 13 dense torch.optim classes in ``functional.functional_optim_map`` and any number
  of param groups (torch's ``_register_fused_optim`` takes 8 classes and one group).

Each DDP bucket is copied into a ``buckets.Bucket`` (``Bucket.of_ddp``), rebuilt whenever
DDP's parameters under its index change (DDP rebuilds its buckets after the first
iteration); error-feedback residuals are kept per parameter across the change.

Every collective is issued by the hook itself, on the thread DDP calls it from, in bucket
order, so every rank issues the same collectives in the same order (gloo aborts otherwise).
One thread per hook then waits for each reduction, decodes it, steps (``optimizer_hook``) and
completes the future DDP waits for at the end of backward; it issues no collective.
"""
import logging
import queue
import threading
from typing import Any, Callable, Dict, Iterable, List, NamedTuple, Optional, Set, Tuple, Union

import torch
import torch.distributed as dist
from torch import Tensor
from torch.nn.parallel import DistributedDataParallel

from distopt import _torch
from distopt.param_groups import built_groups, check_groups
from distopt.parallel import arguments as _arguments
from distopt.parallel import teardown
from distopt.parallel.buckets import Bucket
from distopt.parallel.compression import Compression, reduction_for
from distopt.parallel import state as _state
from distopt.parallel.amp import amp_scaling, drop_amp_scaling
from distopt.parallel.state import foreign_residuals
from distopt.parallel.units import CompiledUnits, Unit
from distopt.profiling import profiler_range
from distopt.saved_state import check_state_dict
from distopt.surface import (
    become_torch_optimizer,
    indexed_groups,
    load_state_dict_with_hooks,
    refuse_add_param_group,
    state_dict_with_hooks,
)
from functional import functional_optim_map

logger = logging.getLogger(__name__)

__all__ = ["CompressionHookState", "OptimizerInBackward", "compression_hook", "optimizer_hook"]

class _Where(NamedTuple):
    """Who reduces a bucket, for messages."""

    rank: int
    world_size: int
    compression: Any

    def describe(self, bucket: Bucket) -> str:
        return (f"DDP communication hook on rank {self.rank} of {self.world_size}: the "
                f"reduction of DDP bucket {bucket.index} ({bucket.numel} {bucket.dtype} "
                f"gradient elements, compression={self.compression!r})")


class _Job(NamedTuple):
    """A reduction for the finishing thread."""

    reduction: Compression  #: the scheme that issued it, bound to the hook's group
    pending: Any  #: what completing it needs
    bucket: Bucket
    future: Any  #: completed with the averaged bucket, or failed
    where: _Where


class CompressionHookState:
    """What a DDP communication hook keeps between calls: the scheme, the process group, one
    adapted bucket per DDP bucket index, the residuals, and the finishing thread.

    Build it with ``compression_hook``; pass it to ``ddp.register_comm_hook`` with the hook.

    Args:
        compression: None, ``Cast(dtype)``, ``TopK(ratio)`` or ``Threshold(value)``.
        process_group: the group DDP averages over (None: the default group).

    Attributes:
        compression: the scheme as given.
        process_group: the group DDP reduces over (the collectives go to a copy of it of
            this state's own when it is the default group: see ``close``).
        rank: this process's rank in it.
        world_size: its size; the gradients are divided by it.
        buckets: DDP bucket index -> the adapted bucket DDP's last call under that index
            used.
        rebuilds: how many times an index's parameters changed (DDP rebuilds its buckets
            once, after the first iteration).

    Raises:
        TypeError / ValueError: a bad ``compression`` or ``process_group``.
    """

    def __init__(
        self,
        compression: Optional[Compression],
        process_group: Any = None,
    ) -> None:
        _arguments.check_compression(compression)
        group, rank, world_size = _arguments.group_info(process_group)
        # The collectives go to a copy of the default group, of this state's own, when DDP
        # reduces over the default group: a group that can be destroyed and dropped when
        # the state closes (at exit, too), which stops its gloo worker threads before the
        # interpreter tears down (``distopt.parallel.teardown``). Over a group of the user's
        # own, that group (a copy would need every rank of the default group).
        self.comm_group = group
        if world_size > 1 and (group is None or group is dist.group.WORLD):
            self.comm_group = _torch.private_group()
        # DDP's buckets are not known before its first backward pass (``bucket.last`` is
        # set from DDP's own at each call).
        self.reduction = reduction_for(compression).bound(self.comm_group, rank, world_size, [])
        self.compression = compression
        self.process_group = group
        self.rank = rank
        self.world_size = world_size
        self.buckets: Dict[int, Bucket] = {}
        self.rebuilds = 0
        # id(parameter) -> (parameter, its flat residual: a view of its bucket's, or a tensor
        # loaded before the bucket was built).
        self._residuals: Dict[int, Tuple[Tensor, Tensor]] = {}
        self._tracked: Optional[set] = None
        self._used: set = set()
        self._handles: List[Any] = []
        self._jobs: "queue.SimpleQueue[Optional[_Job]]" = queue.SimpleQueue()
        self._threads: List[threading.Thread] = []  # the finishing thread, once started
        self.closed = False
        # Dropped without close(): stop the thread, retire the private group (the exit joins
        # and drops them, waiting; ``distopt.parallel.teardown``).
        private = self.comm_group if self.comm_group is not group else None
        self.dropped = teardown.on_drop(self, _abandon, self._jobs, private)
        teardown.close_at_exit(self._close)

    def __repr__(self) -> str:
        return (f"CompressionHookState(compression={self.compression!r}, rank={self.rank}, "
                f"world_size={self.world_size})")

    @property
    def error_feedback(self) -> bool:
        """Whether each rank keeps residuals (``TopK`` / ``Threshold`` with error feedback)."""
        return self.reduction.error_feedback

    # ------------------------------------------------------------ the hook's thread

    def reduce(self, grad_bucket: Any,
               then: Optional[Callable[[Bucket], None]] = None) -> "torch.futures.Future[Tensor]":
        """Start averaging one DDP bucket; what the hook returns to DDP.

        Args:
            grad_bucket: DDP's ``GradBucket``.
            then: chained onto the returned future before the reduction can complete: called
                on the finishing thread with the averaged bucket (distopt's copy of DDP's
                bucket, whose ``grads`` are views of the averages), before DDP sees the
                value; what it raises fails the future.

        Returns:
            A future whose value is the averaged gradients, laid out as
            ``grad_bucket.buffer()``.

        Raises:
            ValueError: a sparse or integer gradient, a complex one the compression cannot
                carry (TopK, Threshold, PowerSGD; named); RuntimeError: a collective could not be issued (naming this rank and
                the bucket).
        """
        if self.closed:
            raise RuntimeError(
                f"Invalid backward pass: the {type(self).__name__} of this DDP model's "
                f"communication hook is closed (expected a new DDP model and hook: DDP "
                f"cannot remove a hook)"
            )
        index = grad_bucket.index()
        ddp_buffer = grad_bucket.buffer()
        bucket = self._bucket(index, grad_bucket.parameters(), ddp_buffer)
        bucket.ddp_buffer().copy_(ddp_buffer)
        if self._tracked is not None:
            bucket.used = [id(p) in self._used or id(p) not in self._tracked
                           for p in bucket.params]
        bucket.fill_flags()
        bucket.last = grad_bucket.is_last()
        where = _Where(self.rank, self.world_size, self.compression)
        try:
            with profiler_range("distopt.ddp.reduce", index):
                pending = self.reduction.issue(bucket, self.comm_group, self.world_size)
        except RuntimeError as exc:
            raise RuntimeError(f"{where.describe(bucket)} could not be issued: {exc}") from exc
        finally:
            if grad_bucket.is_last():
                self._used.clear()
        future: "torch.futures.Future[Tensor]" = torch.futures.Future()
        if not self._threads:
            self._threads.append(teardown.start_thread(_finish_in_order, (self._jobs,),
                                                       f"distopt-ddp-hook-{self.rank}"))
        # DDP reads the value in C++, where an exception set from Python is only a value;
        # raised in a callback, it marks the chained future failed, which DDP does raise.
        # Chained before the job is queued: the callbacks run on the finishing thread.
        result = future.then(lambda done: done.wait())
        if then is not None:
            result = result.then(lambda done: _then(done, then, bucket, where))
        self._jobs.put(_Job(self.reduction, pending, bucket, future, where))
        return result

    def _bucket(self, index: int, params: List[Tensor], ddp_buffer: Tensor) -> Bucket:
        """The adapted bucket for DDP's bucket ``index``, new if its parameters changed."""
        current = self.buckets.get(index)
        if current is not None and len(current.params) == len(params) and all(
            a is b for a, b in zip(current.params, params)
        ):
            return current
        bucket = Bucket.of_ddp(index, params, ddp_buffer)
        if self.compression is not None:
            self.compression.check_params(
                (f"the parameter of shape {tuple(p.shape)} in DDP bucket {index}", p)
                for p in bucket.params
            )
            self.compression.check_bucket(bucket)
        if self.reduction.error_feedback:
            bucket.residual = torch.zeros_like(bucket.buffer[:bucket.numel])
            for p, o in zip(bucket.params, bucket.offsets):
                part = bucket.residual[o:o + p.numel()]
                kept = self._residuals.get(id(p))
                if kept is not None and kept[0] is p:
                    part.copy_(kept[1])
                self._residuals[id(p)] = (p, part)
        if current is not None:
            self.rebuilds += 1
            logger.info("rank %d: DDP bucket %d now holds %d parameters (DDP rebuilt its "
                        "buckets)", self.rank, index, len(params))
        self.buckets[index] = bucket
        return bucket

    # ------------------------------------------------------------ closing

    def close(self) -> None:
        """Stop the finishing thread, after the reductions in flight, and destroy the group
        of this state's own; a backward pass through the hook raises from then on (DDP
        cannot remove a hook). A state still open when the interpreter exits is closed
        then (``distopt.parallel.teardown``), one no longer referenced stops by itself."""
        self._close(None)

    def _close(self, timeout_s: Optional[float]) -> bool:
        """``close()``, waiting up to ``timeout_s`` for the thread; whether it stopped."""
        self.closed = True
        self.dropped.detach()
        self._jobs.put(None)
        self._threads = teardown.joined(self._threads, timeout_s)
        if self._threads:
            return False
        teardown.release_private(self)  # every reduction issued was waited for
        return True

    # ------------------------------------------------------------ residuals, usage

    def residual(self, param: Tensor) -> Optional[Tensor]:
        """This rank's error-feedback residual of ``param`` (shaped like it; a view, not a
        copy), or None: no error feedback, or no bucket of ``param`` reduced or loaded yet."""
        kept = self._residuals.get(id(param))
        if kept is None or kept[0] is not param:
            return None
        return kept[1].view(param.shape)

    def set_residual(self, param: Tensor, value: Tensor) -> None:
        """Replace the residual of ``param`` (before its bucket is built, it waits there).

        Raises:
            ValueError: no error feedback, or ``value`` not shaped like ``param``.
        """
        if not self.reduction.error_feedback:
            raise ValueError(
                f"Invalid set_residual: {self.compression!r} keeps no residuals (expected "
                f"TopK or Threshold with error_feedback=True)"
            )
        if tuple(value.shape) != tuple(param.shape):
            raise ValueError(
                f"Invalid residual: shape {tuple(value.shape)} (expected "
                f"{tuple(param.shape)}, the parameter's)"
            )
        kept = self._residuals.get(id(param))
        flat = value.detach().reshape(-1).to(param.dtype)
        if kept is not None and kept[0] is param:
            kept[1].copy_(flat)
        else:
            self._residuals[id(param)] = (param, flat.clone())

    def track_usage(self, params: Iterable[Tensor]) -> None:
        """Flag, from now on, which of ``params`` a backward pass gave a gradient on this
        rank (one post-accumulate-grad hook each), so that a parameter no rank used reads 0
        in its bucket's reduced flags. The others always read as used; DDP's own bucket
        carries zeros for an unused parameter when ``find_unused_parameters=True``."""
        params = list(params)
        used = self._used
        self._tracked = set(self._tracked or ()) | {id(p) for p in params}
        for p in params:
            self._handles.append(p.register_post_accumulate_grad_hook(lambda q: used.add(id(q))))


def _abandon(jobs: "queue.SimpleQueue[Optional[_Job]]", private_group: Any) -> None:
    """A state was freed without ``close()``: stop its thread, retire its private group."""
    jobs.put(None)
    if private_group is not None:
        teardown.retire(private_group)


def _finish_in_order(jobs: "queue.SimpleQueue[Optional[_Job]]") -> None:
    """Wait for each reduction in the order issued, decode it, and complete its future."""
    while True:
        job = jobs.get()
        if job is None:
            return
        bucket = job.bucket
        try:
            with profiler_range("distopt.ddp.reduce.wait", bucket.index):
                job.reduction.finish(job.pending, bucket, job.where.world_size)
        except BaseException as exc:  # noqa: B902 - handed to DDP, which raises it in backward
            job.future.set_exception(_failed(job.where, bucket, exc))
            continue
        # A view at storage offset 0: DDP reads its parameters' gradients from the value
        # with as_strided at their offsets in the bucket.
        job.future.set_result(bucket.ddp_buffer())


def _then(done: Any, then: Callable[[Bucket], None], bucket: Bucket, where: _Where) -> Tensor:
    """A reduced bucket's value once ``then(bucket)`` has run on it (``reduce(then=...)``)."""
    value = done.value()  # the reduction's own error, already named, if it failed
    try:
        then(bucket)
    except BaseException as exc:  # noqa: B902 - DDP raises it in backward
        raise _failed(where, bucket, exc) from exc
    return value


def _failed(where: _Where, bucket: Bucket, exc: BaseException) -> RuntimeError:
    """The error DDP raises in backward when a bucket's reduction (or step) failed; logged."""
    error = RuntimeError(f"{where.describe(bucket)} failed: {type(exc).__name__}: {exc}")
    error.__cause__ = exc
    logger.error("%s", error)
    return error


def _reduce_bucket(state: CompressionHookState, bucket: dist.GradBucket
                   ) -> torch.futures.Future[torch.Tensor]:
    """The communication hook: average ``bucket`` with ``state``'s compression."""
    return state.reduce(bucket)


def compression_hook(
    compression: Optional[Compression] = None, process_group: Any = None
) -> Tuple[CompressionHookState, Callable[..., Any]]:
    r"""A DDP communication hook that averages each bucket with distopt's compression::

        state, hook = compression_hook(TopK(0.01), process_group=None)
        ddp.register_comm_hook(state, hook)

    - None: the bucket is divided by the world size and all-reduced (SUM), as DDP's own
      reduction: the same gradients, bit for bit, at 2 ranks.
    - ``Cast(torch.float16)`` / ``Cast(torch.bfloat16)``: divided, cast, all-reduced, cast
      back; bfloat16 works on CPU (gloo), where torch's ``bf16_compress_hook`` is refused.
    - ``TopK(ratio, error_feedback)`` / ``Threshold(value, error_feedback)``: chosen (index,
      value) pairs of gradient + residual, all-gathered; with error feedback each rank keeps
      per parameter what it did not send, :math:`r \leftarrow g + r - \text{sent}`, through
      DDP's rebuild of its buckets (``state.residual(param)``).

    Complex gradients travel as their real and imaginary parts with None and ``Cast``; the
    other schemes carry real gradients only, and the first backward pass that hands one of
    them a complex parameter's bucket raises ValueError naming it (the hook does not know the
    model before).

    The gradients travel with one flag per parameter, always "used" (DDP itself leaves the
    parameters no rank used alone, with ``find_unused_parameters=True``); with error
    feedback there, ``state.track_usage(model.parameters())`` makes a parameter this rank did
    not use keep its residual. Every collective is issued from the thread DDP calls the hook
    from, in bucket order.

    Args:
        compression: the scheme; None averages without compression.
        process_group: the group the DDP model averages over (None: the default group);
            the gradients are divided by its size.

    Returns:
        ``(state, hook)`` for ``ddp.register_comm_hook``.

    Raises:
        TypeError / ValueError: a bad argument, named.
    """
    return CompressionHookState(compression, process_group), _reduce_bucket


class OptimizerInBackward(torch.optim.Optimizer):
    r"""A torch.optim optimizer that steps each DDP bucket's parameters as soon as DDP has
    averaged it, during backward. Build it with ``optimizer_hook``.

    It registers a communication hook on the DDP model that averages each bucket (with
    ``compression``, as ``compression_hook``) and then steps the bucket's parameters with one
    compiled functional optimizer per param group, passing None for the group's parameters
    in other buckets: stepping bucket by bucket equals one step over everything, bit for bit.
    So ``loss.backward()`` is the whole step; ``step()`` does nothing (but evaluate a
    closure) and exists so that training loops and lr schedulers written for torch.optim run
    unchanged. Zero the gradients as usual: DDP still writes the averages into ``.grad``.

    Hyper-parameters: change ``param_groups`` (by hand or with any lr scheduler) between
    backward passes; the change reaches the compiled steps when DDP hands over the first
    bucket of the next backward pass, before any collective. A key the compiled class cannot
    change (``amsgrad``...) raises ValueError there. The groups, their ``params`` and their
    keys are fixed at construction: an edit (a parameter appended, removed or replaced, a
    group added or removed, a key deleted) raises ValueError there too, naming the group and
    the change, and at ``step``, ``state_dict`` and ``load_state_dict``.

    With ``find_unused_parameters=True`` a parameter that no rank gave a gradient (one
    post-accumulate-grad hook per parameter tells) steps with the ``.grad`` DDP leaves it,
    as torch.optim would: left alone when it is None, stepped when it is a tensor (zeros
    after ``zero_grad(set_to_none=False)``: momentum and weight decay still move it).

    ``state_dict`` / ``load_state_dict`` are torch.optim's format (they move to and from a
    local torch.optim optimizer), plus ``"residuals"`` (global index -> this rank's residual)
    with error feedback.

    Args:
        ddp_model: the ``DistributedDataParallel`` model; it must have no communication hook
            yet.
        optimizer_class: a class in ``functional.functional_optim_map`` but SparseAdam.
        params: parameters of ``ddp_model`` or param group dicts, as torch.optim takes them;
            a subset of the model's is fine (the others are averaged, not stepped).
        *args: the optimizer's positional arguments after the parameters.
        compression: None, ``Cast(dtype)``, ``TopK(ratio)`` or ``Threshold(value)``.
        **kwargs: the optimizer's keyword arguments.

    Raises:
        TypeError: ``ddp_model`` is not a DistributedDataParallel; a class with no
            functional twin, or SparseAdam; a bad argument (torch.optim's checks too).
        ValueError: a parameter DDP does not reduce (not in ``ddp_model.module``, frozen,
            or one DDP was told to ignore); a complex parameter
            of the model with a compression that carries real gradients only (TopK,
            Threshold, PowerSGD), named.
    """

    #: So that ``GradScaler.step(opt)`` calls ``step()``, which refuses it: every bucket was
    #: stepped during backward, before the scaler could unscale or look for inf/NaN.
    _step_supports_amp_scaling = True

    def __init__(
        self,
        ddp_model: DistributedDataParallel,
        optimizer_class: type,
        params: Iterable[Union[Tensor, Dict[str, Any]]],
        *args: Any,
        compression: Optional[Compression] = None,
        **kwargs: Any,
    ) -> None:
        if not isinstance(ddp_model, DistributedDataParallel):
            raise TypeError(
                f"Invalid ddp_model: {type(ddp_model).__name__} (expected a "
                f"torch.nn.parallel.DistributedDataParallel)"
            )
        _arguments.check_class(optimizer_class, False, "DDP's buckets hold dense gradients")
        if optimizer_class not in functional_optim_map:
            names = sorted(c.__name__ for c in functional_optim_map
                           if c is not torch.optim.SparseAdam)
            raise TypeError(
                f"Invalid optimizer_class: {optimizer_class.__qualname__} has no functional "
                f"twin in functional.functional_optim_map, and the hook steps each bucket with "
                f"a compiled functional optimizer (expected one of {', '.join(names)})"
            )
        groups = _arguments.param_groups(params)
        # torch.optim's own checks and defaults (the step is the compiled one).
        become_torch_optimizer(self, optimizer_class, groups, args, kwargs)
        reduced = _reduced_by(ddp_model)
        _check_reduced(self.param_groups, {id(p) for _, p in reduced})
        if isinstance(compression, Compression):  # every parameter DDP reduces goes through it
            compression.check_params(reduced)
        self.compression = compression
        self.hook_state = CompressionHookState(compression, ddp_model.process_group)

        self._slot: Dict[int, Tuple[int, int]] = {
            id(p): (j, k)
            for j, g in enumerate(self.param_groups) for k, p in enumerate(g["params"])
        }
        group_params = [list(g["params"]) for g in self.param_groups]
        indices = [g["params"] for g in indexed_groups(self.param_groups)]
        hyper_keys = [k for k in self.param_groups[0] if k != "params"]
        #: The compiled steps: one unit per param group.
        self._units = CompiledUnits(optimizer_class, hyper_keys)
        self._units.compile([Unit(ps, ix, {k: v for k, v in g.items() if k != "params"})
                             for ps, ix, g in zip(group_params, indices, groups)],
                            [[j] for j in range(len(groups))], args, kwargs, self.param_groups)
        self._step_group = self._units.steps.module.step_group
        self._warned_residuals = False
        #: What ``param_groups`` must keep: the compiled steps and bucket plans are built once.
        self._built = built_groups(type(self).__name__, self.param_groups, hyper_keys,
                                   optimizer_class)
        self._stepped = False  # a bucket stepped since the last step()
        self._skips_unused = bool(getattr(ddp_model, "find_unused_parameters", False))
        if self._skips_unused:
            self.hook_state.track_usage([p for ps in group_params for p in ps])
        ddp_model.register_comm_hook(self.hook_state, self._reduce_then_step())
        logger.info(
            "rank %d of %d: %s steps %d parameters in %d groups during DDP's backward, "
            "compression=%r", self.hook_state.rank, self.hook_state.world_size,
            optimizer_class.__name__, sum(map(len, group_params)), len(group_params), compression,
        )

    # ------------------------------------------------------------ stepping

    def step(  # type: ignore[override]
        self, closure: Optional[Callable[[], Any]] = None
    ) -> Optional[Any]:
        """Nothing to do: backward stepped every bucket. Evaluates ``closure`` (which runs
        forward and backward, and so the step) if one is given.

        Returns:
            The closure's loss, or None.

        Raises:
            RuntimeError: no backward pass stepped since the last ``step()`` and some
                parameter has a ``.grad`` (a second ``step()``, or passes only inside
                ``no_sync``), which torch.optim would step; nothing is stepped. Or a
                ``GradScaler`` calls it (``scaler.step(opt)``): backward has stepped every
                bucket with the scaled gradients already.
        """
        if amp_scaling(self) is not None:
            drop_amp_scaling(self)  # GradScaler.step deletes them only after a step that returns
            raise RuntimeError(
                "Invalid step: a GradScaler steps this OptimizerInBackward, but every bucket "
                "was stepped during backward, as soon as DDP had averaged it, with the scaled "
                "gradients and before the scaler could unscale them or look for inf/NaN "
                "(expected DataParallelOptimizer, whose steps wait for the scaler, or DDP "
                "with a torch.optim optimizer)"
            )
        check_groups(self.param_groups, self._built)
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        stepped, self._stepped = self._stepped, False
        if not stepped and any(p.grad is not None for g in self.param_groups for p in g["params"]):
            raise RuntimeError(
                "Invalid step: no backward pass has stepped this OptimizerInBackward since the "
                "last step(), but its parameters have gradients, which torch.optim would step "
                "(again); here each bucket steps once, when DDP averages it during backward "
                "(expected one backward pass outside no_sync() per step(), or zero_grad() "
                "before a step() without one)"
            )
        return loss

    def _reduce_then_step(self) -> Callable[..., Any]:
        """DDP's communication hook for this optimizer: the hook state's reduction of each
        bucket with this optimizer's step of it chained onto the reduction's future (as
        torch's ``_hook_then_optimizer`` composes a hook and an optimizer), so DDP sees the
        bucket once it is stepped; the checks of a backward pass before its bucket 0."""

        def reduce_then_step(state: CompressionHookState, bucket: dist.GradBucket
                             ) -> torch.futures.Future[torch.Tensor]:
            # (DDP checks that the hook's second argument is named ``bucket``.)
            if bucket.index() == 0:
                self._before_backward()  # may raise: then nothing of this pass is sent
            return state.reduce(bucket, then=self._step_bucket)

        return reduce_then_step

    def close(self) -> None:
        """Close the hook's state (``CompressionHookState.close``): its finishing thread
        stops and its group is destroyed; a later backward pass through the DDP model
        raises. An open one is closed when the interpreter exits."""
        self.hook_state.close()

    def _before_backward(self) -> None:
        """Changed hyper-parameters reach the compiled steps (before bucket 0 is sent)."""
        check_groups(self.param_groups, self._built)
        self._units.apply_changes(self.param_groups)

    def _step_bucket(self, bucket: Bucket) -> None:
        """Step the parameters of one averaged bucket (finishing thread)."""
        self._stepped = True
        if not bucket.units:  # a bucket new to this optimizer (DDP rebuilds them once)
            by_group: Dict[int, Tuple[List[Any], List[Any]]] = {}
            for s, p in enumerate(bucket.params):
                if id(p) in self._slot:  # else averaged by DDP, stepped by nobody here
                    j, k = self._slot[id(p)]
                    n = len(self.param_groups[j]["params"])
                    slots, grads = by_group.setdefault(j, ([None] * n, [None] * n))
                    slots[k], grads[k] = s, bucket.grads[s]
            bucket.units = [(j, slots, grads) for j, (slots, grads) in sorted(by_group.items())]
        unused = set()
        if self._skips_unused:
            unused = {s for s, f in enumerate(bucket.flags.tolist()) if f == 0}
        with profiler_range("distopt.ddp.step", bucket.index):
            for j, slots, grads in bucket.units:
                if unused:  # DDP leaves its .grad as it is: None, or a tensor torch.optim steps
                    grads = [bucket.params[s].grad if s in unused else g
                             for s, g in zip(slots, grads)]
                self._step_group(j, grads)

    # ------------------------------------------------------------ state

    def state_dict(self) -> Dict[str, Any]:  # type: ignore[override]
        """The state in torch.optim's format; with error feedback also ``"residuals"``
        (global index -> this rank's residual, for the parameters this rank has one of)."""
        check_groups(self.param_groups, self._built)
        return state_dict_with_hooks(self, self._make_state_dict)

    def _make_state_dict(self) -> Dict[str, Any]:
        sd = _state.compiled_state_dict(self._units, self.param_groups)
        if self.hook_state.error_feedback:
            params = [p for g in self.param_groups for p in g["params"]]
            residuals = {i: self.hook_state.residual(p) for i, p in enumerate(params)}
            sd["residuals"] = {i: r.clone() for i, r in residuals.items() if r is not None}
            # whose they are: loaded on another rank, they warn (``foreign_residuals``)
            sd["residuals_of"] = {"rank": self.hook_state.rank,
                                  "world_size": self.hook_state.world_size}
        return sd

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:  # type: ignore[override]
        """Load a state_dict of this class or of a local torch.optim optimizer of
        ``optimizer_class`` over the same groups; everything is checked before anything
        changes. Call it between backward passes.

        Raises:
            ValueError: another group count, parameter count, shape, a hyper-parameter of
                the wrong kind, or a state entry that does not fit, named; or
                ``param_groups`` were edited since construction.
        """
        check_groups(self.param_groups, self._built)
        load_state_dict_with_hooks(self, state_dict, self._load)

    def _load(self, state_dict: Dict[str, Any]) -> None:
        checked = check_state_dict(_state.spec_for(
            self.optimizer_class, self.param_groups, self._units.hyper_keys, self._units),
            state_dict)
        saved_groups, position = state_dict["param_groups"], checked.id_map
        state = checked.by_index
        self._units.check_state(state)
        params = [p for g in self.param_groups for p in g["params"]]
        residuals = _state.checked_residuals(state_dict, position, dict(enumerate(params)))
        if residuals and not self.hook_state.error_feedback:
            raise ValueError(
                f"Invalid state_dict['residuals']: {len(residuals)} residuals, and "
                f"compression={self.compression!r} keeps none (expected no 'residuals')"
            )

        foreign = foreign_residuals(
            state_dict, type(self).__name__, self.hook_state.rank, self.hook_state.world_size,
            "each rank's own state_dict(), saved by every rank: "
            "torch.save(opt.state_dict(), f'opt-rank{rank}.pt')")
        self._units.load(saved_groups, state)
        _state.adopt_groups(self.param_groups, saved_groups, self._units)
        for i, value in residuals.items():
            self.hook_state.set_residual(params[i], value)
        self._warned_residuals = _state.warn_residuals_once(foreign, self._warned_residuals, 5)

    def add_param_group(self, param_group: Dict[str, Any]) -> None:
        """Not supported: the compiled optimizers are built once.

        Raises:
            NotImplementedError: always.
        """
        refuse_add_param_group("an OptimizerInBackward's groups", "in optimizer_hook")


def optimizer_hook(
    ddp_model: DistributedDataParallel,
    optimizer_class: type,
    params: Iterable[Union[Tensor, Dict[str, Any]]],
    *args: Any,
    compression: Optional[Compression] = None,
    **kwargs: Any,
) -> OptimizerInBackward:
    """Step ``ddp_model``'s parameters during backward, each bucket as soon as DDP has
    averaged it::

        ddp = DistributedDataParallel(model)
        opt = optimizer_hook(ddp, torch.optim.AdamW, groups, lr=1e-3)
        sched = torch.optim.lr_scheduler.StepLR(opt, 10)
        for x, y in loader:
            loss_fn(ddp(x), y).backward()   # averages and steps
            opt.step()                      # nothing left to do; keeps the scheduler happy
            opt.zero_grad()
            sched.step()

    Returns:
        The :class:`OptimizerInBackward`, with its hook registered on ``ddp_model``. The
        arguments and errors are its constructor's.
    """
    return OptimizerInBackward(ddp_model, optimizer_class, params, *args,
                               compression=compression, **kwargs)


def _check_reduced(param_groups: List[Dict[str, Any]], reduced: Set[int]) -> None:
    """Refuse a parameter DDP does not reduce (``reduced``: their ids), naming it."""
    for j, g in enumerate(param_groups):  # tensors: torch.optim checked them
        for k, p in enumerate(g["params"]):
            if id(p) not in reduced:
                why = ("has requires_grad=False" if not p.requires_grad else
                       "is not one DDP reduces (not in ddp_model.module, or ignored)")
                raise ValueError(
                    f"Invalid params: param group {j}, parameter {k} (shape "
                    f"{tuple(p.shape)}) {why} (expected parameters of ddp_model.module "
                    f"that DDP averages: the hook steps only what DDP's buckets bring)"
                )


def _reduced_by(ddp_model: DistributedDataParallel) -> List[Tuple[str, Tensor]]:
    """The parameters DDP reduces, with their names (DDP's own rule: the module's
    parameters that require grad and are not ignored)."""
    ignored = getattr(ddp_model, "parameters_to_ignore", set())
    return [
        (f"{module_name}.{name}" if module_name else name, p)
        for module_name, module in ddp_model.module.named_modules()
        for name, p in module.named_parameters(recurse=False)
        if p.requires_grad and f"{module_name}.{name}" not in ignored
    ]

