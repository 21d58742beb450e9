r"""``DataParallelOptimizer``: a torch.optim optimizer whose gradients are averaged over ranks.

Every rank holds the whole model and runs forward and backward on its own batch; the
optimizer averages the gradients over the process group while backward runs (see
``distopt.parallel.reducer``) and steps. The step is a compiled functional optimizer, one
per (bucket, param group), so that with ``overlap=True`` a bucket's parameters are updated
as soon as its reduction has arrived, without the GIL, while backward computes the rest;
stepping bucket by bucket equals one step over everything, bit for bit, because no
torch.optim algorithm couples parameters. Classes with no functional twin run eagerly,
once every bucket has arrived.
"""
import contextlib
import gc
import logging
import math
import warnings
import weakref
import zlib
from typing import Any, Callable, Dict, Iterable, Iterator, List, Optional, Union

import torch
import torch.distributed as dist
from torch import Tensor

from distopt import _torch
from distopt.arguments import check_arguments, check_optimizer_class
from distopt.local_optimizer import CompiledLocalOptimizer
from distopt.param_groups import (
    as_keywords,
    built_groups,
    check_groups,
    pending_changes,
    snapshot,
)
from distopt.parallel import checkpoint as _checkpoint
from distopt.parallel import shard as _shard
from distopt.parallel.buckets import Bucket, assign_buckets
from distopt.parallel.compression import Compression, TopK, dense_reduction
from distopt.parallel.reducer import GradientReducer
from distopt.parallel.sync import RoundRobin, average_, collective_device, partition
from functional import functional_optim_map
from functional._state import check_hyperparameter
from functional._validation import duplicate_pair

logger = logging.getLogger(__name__)

__all__ = ["DataParallelOptimizer"]


class DataParallelOptimizer(torch.optim.Optimizer):
    r"""Data-parallel training with any torch.optim algorithm, on torch.distributed.

    Use it where you would wrap the model in DDP and build a torch.optim optimizer: the
    model stays a plain module on every rank; gradients are averaged over ``process_group``
    (as DDP averages them) in flat buckets, overlapped with backward, and then stepped::

        opt = DataParallelOptimizer(torch.optim.AdamW, model.parameters(), lr=1e-3)
        for x, y in loader:
            loss_fn(model(x), y).backward()
            opt.step()
            opt.zero_grad()

    It is a :class:`torch.optim.Optimizer`: param groups, every lr scheduler, step hooks,
    ``state_dict`` / ``load_state_dict`` in torch.optim's format (plus ``"residuals"`` with
    error feedback and ``"sync"`` with ``RoundRobin``), ``zero_grad``. When the reducing
    backward pass returns, each parameter's ``.grad`` holds the averaged gradient (a view of
    its bucket), as with DDP. Hyper-parameters in ``param_groups`` may change between steps;
    the groups, their ``params`` and their keys are fixed with the buckets: an edit raises
    ValueError, naming the group and the change, at the next backward, ``step``,
    ``clip_grad_norm_`` or state round, before anything is sent or stepped.

    At construction every rank's buckets are checked to be alike (one all_gather) and the
    parameters are broadcast from the group's first rank, as DDP does. ``close()`` (or a
    ``with`` block) removes the hooks; a newer DataParallelOptimizer over the same
    parameters closes this one.

    Args:
        optimizer_class: a torch.optim class. Those in ``functional.functional_optim_map``
            (all of torch.optim's but LBFGS) step compiled, bucket by bucket; any other
            :class:`torch.optim.Optimizer` subclass steps eagerly after the last bucket.
        params: parameters or param group dicts, as torch.optim takes them.
        *args: the optimizer's positional arguments after the parameters.
        process_group: the group to average over (None: the default group); any group this
            rank belongs to.
        bucket_cap_mb: the most gradient megabytes (2**20 bytes) in one bucket.
        compression: None, ``Cast(dtype)``, ``TopK(ratio)``, ``Threshold(value)`` or
            ``PowerSGD(...)`` (the last three for real parameters only: a complex one is
            refused, named).
        backward_passes_per_step: backward passes whose gradients accumulate (summed, as
            under DDP's ``no_sync``) before one reduction; ``step()`` after fewer passes
            reduces what accumulated.
        sync: None (average gradients) or ``RoundRobin(k)`` (step locally, average a
            partition of the parameters per step).
        overlap: step each bucket as soon as its reduction arrives, during backward
            (compiled classes; eager ones overlap only the reduction). Set False to step
            after the last bucket, for instance to clip gradients first.
        shard: None (every rank holds all the optimizer state), ``"param"`` (each rank
            holds the state of whole parameters, about 1/W of it: the choice for
            Adafactor and Muon) or ``"flat"`` (1/W of each bucket's elements; elementwise
            classes): each rank steps its share and the parameters are all-gathered, bucket
            by bucket (``distopt.parallel.shard``). An eager class takes ``"param"``: it
            steps this rank's parameters after the last bucket.
        **kwargs: the optimizer's keyword arguments.

    Raises:
        TypeError / ValueError: a bad argument, named, before any collective (and
            torch.optim's own checks of the optimizer's arguments).
    """

    def __init__(
        self,
        optimizer_class: type,
        params: Iterable[Union[Tensor, Dict[str, Any]]],
        *args: Any,
        process_group: Any = None,
        bucket_cap_mb: float = 25.0,
        compression: Optional[Compression] = None,
        backward_passes_per_step: int = 1,
        sync: Optional[RoundRobin] = None,
        overlap: bool = True,
        shard: Optional[str] = None,
        **kwargs: Any,
    ) -> None:
        eager = optimizer_class not in functional_optim_map or not _torch.jit_enabled()
        check_optimizer_class(optimizer_class, eager)
        if isinstance(optimizer_class, type) and issubclass(optimizer_class, torch.optim.SparseAdam):
            raise TypeError(
                f"Invalid optimizer_class: {optimizer_class.__name__} steps only sparse "
                f"gradients (expected a class for dense ones: DataParallelOptimizer reduces "
                f"dense buckets)"
            )
        _check_options(bucket_cap_mb, compression, backward_passes_per_step, sync, overlap)
        _check_shard(shard, optimizer_class, eager, sync)
        group, rank, world_size = _group_info(process_group)
        groups = _param_groups(params)
        check_arguments(optimizer_class, args, kwargs, groups)
        options = [{k: v for k, v in g.items() if k != "params"} for g in groups]
        # torch.optim's own checks and defaults, and (eager) the optimizer that steps.
        inner = optimizer_class([dict(g) for g in groups], *args, **kwargs)
        self.optimizer_class = optimizer_class
        self.process_group = group
        self.rank = rank
        self.world_size = world_size
        self.compression = compression
        self.sync = sync
        self.overlap = overlap
        self.shard = shard
        self.backward_passes_per_step = backward_passes_per_step
        self.is_functional_optim = not eager
        self.defaults = inner.defaults
        self.param_groups = inner.param_groups
        self.state = inner.state
        _torch.init_optimizer_internals(self)
        self._eager = inner if eager else None

        all_params = [p for g in self.param_groups for p in g["params"]]
        group_of = [j for j, g in enumerate(self.param_groups) for _ in g["params"]]
        trained = [i for i, p in enumerate(all_params) if p.requires_grad]
        self._untrained = [(i, p) for i, p in enumerate(all_params) if not p.requires_grad]
        self._closed = False
        self._comm_group: Any = None  # where the communication thread issues
        _take_over(all_params)
        codec = dense_reduction() if compression is None else compression
        if isinstance(codec, TopK) and codec.ratio == 1.0:
            codec = dense_reduction()
        self._codec = codec
        self._buckets = assign_buckets(
            [all_params[i] for i in trained], trained, max(1, int(bucket_cap_mb * 2**20))
        )
        #: Global index -> parameter, for every parameter in a bucket.
        self._bucketed = {i: p for b in self._buckets for i, p in zip(b.positions, b.params)}
        if compression is not None:
            compression.check_params(
                (f"parameter {i} (shape {tuple(all_params[i].shape)})", all_params[i])
                for i in trained
            )
        for bucket in self._buckets:
            if compression is not None:
                compression.check_bucket(bucket)
            if codec.error_feedback:
                bucket.residual = torch.zeros_like(bucket.buffer[:bucket.numel])
        self._check_same_everywhere(all_params, group_of, bucket_cap_mb)
        self._broadcast_parameters(all_params)
        if shard is not None:
            adafactor = getattr(torch.optim, "Adafactor", None)
            name = "Adafactor" if adafactor and issubclass(optimizer_class, adafactor) else ""
            pieces = _shard.split(self._buckets, world_size, shard, [
                [_shard.state_size(name, p) * p.element_size() for p in b.params]
                for b in self._buckets
            ])
            for bucket, parts in zip(self._buckets, pieces):
                bucket.shard = _shard.Shard(bucket, parts, rank, whole=shard == "param")

        # One functional optimizer per (bucket, param group): a bucket steps on its own.
        self._units_of_group: List[List[int]] = [[] for _ in self.param_groups]
        unit_params: List[List[Tensor]] = []
        unit_indices: List[List[int]] = []
        unit_options: List[Dict[str, Any]] = []
        for bucket in self._buckets:
            bucket.units = []
            if shard is None:
                members = list(zip(range(len(bucket.params)), bucket.params, bucket.grads))
            else:  # this rank's pieces: views of the shard's buffer
                sh = bucket.shard
                members = [(pc.slot, v, g) for pc, v, g in zip(sh.own, sh.views, sh.grads)]
            by_group: Dict[int, List[Any]] = {}
            for member in members:
                by_group.setdefault(group_of[bucket.positions[member[0]]], []).append(member)
            for j, ms in sorted(by_group.items()):
                u = len(unit_params)
                unit_params.append([t for _, t, _ in ms])
                unit_indices.append([bucket.positions[slot] for slot, _, _ in ms])
                unit_options.append(options[j])
                self._units_of_group[j].append(u)
                bucket.units.append((u, [slot for slot, _, _ in ms], [g for _, _, g in ms]))
        self._local: Optional[CompiledLocalOptimizer] = None
        if not eager and unit_params:
            fargs, fkwargs = as_keywords(optimizer_class, args, kwargs)
            self._local = CompiledLocalOptimizer(
                functional_optim_map[optimizer_class], optimizer_class, unit_params,
                unit_indices, unit_options, fargs, fkwargs,
            )
        self._hyper_keys = [k for k in self.param_groups[0] if k != "params"]
        self._sent = [{k: snapshot(g[k]) for k in self._hyper_keys} for g in self.param_groups]
        self._settable = (
            self._local.settable(self._hyper_keys) if self._local is not None else None
        )
        #: What ``param_groups`` must keep: the buckets and compiled steps are built once.
        self._built = built_groups(
            type(self).__name__, self.param_groups, self._hyper_keys, optimizer_class
        )

        self._round = 0
        self._partitions: List[List[int]] = []
        self._reducer: Optional[GradientReducer] = None
        if sync is not None:
            self._trained = [all_params[i] for i in trained]
            self._partitions = partition(self._trained, sync.k)
        elif self._buckets:
            # Weak: the hooks must not keep an optimizer the user dropped alive.
            # The communication thread issues on a group of its own, so that collectives of
            # other threads (another optimizer, SyncBatchNorm's backward) cannot interleave;
            # a group the user gives must be this optimizer's alone.
            if group is None and world_size > 1:
                self._comm_group = _torch.private_group()
            else:
                _check_group_unshared(group)
                self._comm_group = group
            self._codec = codec.bound(self._comm_group, rank, world_size, self._buckets)
            gathers = shard is not None and overlap and not eager
            self._reducer = GradientReducer(
                self._buckets, self._codec, self._comm_group, rank, world_size,
                backward_passes_per_step,
                _weak_call(self._before_reduction), _weak_call(self._on_reduced),
                _gather_on(self._comm_group) if gathers else None,
                _store if gathers else None,
            )
        _claim(all_params, self)
        self._warned_late_change = False
        logger.info(
            "rank %d of %d: %d parameters in %d buckets, %s, compression=%r, sync=%r",
            rank, world_size, len(trained), len(self._buckets),
            "compiled" if self._local is not None else "eager", compression, sync,
        )

    # ------------------------------------------------------------ stepping

    def step(self, closure: Optional[Any] = None) -> Optional[Any]:  # type: ignore[override]
        """Finish averaging this step's gradients and update the parameters.

        Waits for every bucket (with ``overlap=True`` most were stepped during backward).
        A parameter no rank gave a gradient since the last step keeps the ``.grad`` it had,
        as under DDP with ``find_unused_parameters=True``: None, and it is left untouched;
        a tensor (zeros after ``zero_grad(set_to_none=False)``), and it is stepped with it,
        as torch.optim steps it.

        Args:
            closure: as torch.optim's: reevaluates the model and returns the loss.

        Raises:
            RuntimeError: a collective failed (another rank died, raised or timed out),
                naming this rank and the bucket; every later step raises it again. Or, with
                ``overlap=True`` and a compiled class, a ``.grad`` was replaced, set to None
                or changed in place after backward had stepped its bucket (with
                ``overlap=False`` the step takes what ``.grad`` holds, as torch.optim).
            ValueError: ``param_groups`` were edited in a way the buckets cannot follow
                (``distopt.param_groups.check_groups``: a group's ``params`` replaced or
                changed in place, a group added or removed, a key deleted), before
                anything is stepped (the reducing backward refused it already).
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if self._untrained:
            # Also here: the reduction's own check, at its start, precedes the gradients of
            # the parameters backward reaches last.
            self._check_untrained()
        if self._closed:
            raise RuntimeError(
                "Invalid step: this DataParallelOptimizer is closed (by close(), its `with` "
                "block, or a newer DataParallelOptimizer over the same parameters)"
            )
        # Before anything is completed or stepped: restored, the next step() finishes this one.
        check_groups(self.param_groups, self._built)
        if self.sync is not None:
            self._local_step_and_average()
            return loss
        if self._reducer is None:
            return loss
        self._reducer.complete()
        try:
            stepped = self.overlap and self._eager is None
            poisoned = self._reducer.poisoned
            if poisoned is not None and not stepped:
                raise RuntimeError(
                    f"Invalid step: a backward pass refused since the last step had already "
                    f"added its gradient to parameter {poisoned}'s .grad before it was "
                    f"refused, so this step's gradients are no longer the averages; the step "
                    f"is dropped (expected zero_grad() and this step's backward again)"
                )
            if stepped and poisoned is None and not self._reducer.broken:
                self._check_grads_kept()
            if self._apply_changes() and stepped and not self._warned_late_change:
                self._warned_late_change = True
                warnings.warn(
                    "DataParallelOptimizer: param_groups changed after this step's "
                    "reduction began; with overlap=True its buckets were stepped during "
                    "backward with the previous values, and the new ones apply from the next "
                    "step (change hyper-parameters before backward, e.g. scheduler.step() "
                    "after opt.step(), or build with overlap=False)",
                    stacklevel=2,
                )
            if not stepped:
                self._step_all()
        finally:
            self._reducer.reset()
        return loss

    def _check_grads_kept(self) -> None:
        """With overlap=True the buckets were stepped during backward: a ``.grad`` changed
        after that (DDP + torch.optim would step the change) cannot be applied any more."""
        changed = sorted(i for b in self._buckets if b.changed_since_step() for i in b.positions)
        if changed:
            raise RuntimeError(
                f"Invalid step: the .grad of parameters {changed[:10]}"
                f"{'...' if len(changed) > 10 else ''} changed between backward and step() "
                f"(replaced, set to None, or changed in place: torch.nn.utils.clip_grad_norm_,"
                f" zero_grad(), a scaling), but with overlap=True their buckets were stepped "
                f"during backward with the averaged gradients, so the change is not applied "
                f"(expected DataParallelOptimizer(..., overlap=False) to change gradients "
                f"before step())"
            )

    def _check_untrained(self) -> None:
        late = [i for i, p in self._untrained if p.requires_grad and p.grad is not None]
        if late:
            raise RuntimeError(
                f"Invalid step: parameters {late} have gradients but had requires_grad=False "
                f"when this DataParallelOptimizer was built, so they are in no bucket and "
                f"would never be averaged or stepped (expected a new DataParallelOptimizer, "
                f"after close() of this one, once they are unfrozen)"
            )

    def _before_reduction(self) -> None:
        if self._untrained:
            self._check_untrained()  # before any bucket is sent or stepped
        check_groups(self.param_groups, self._built)
        self._apply_changes()

    def _apply_changes(self) -> bool:
        """Send hyper-parameters changed in ``param_groups`` to the compiled steps; whether
        there were any."""
        if self._local is None:
            return False
        changes = pending_changes(
            self.param_groups, self._sent, self._settable, self.optimizer_class.__name__
        )
        for j, values in changes.items():
            self._local.apply_changes(
                [(u, key, value) for u in self._units_of_group[j] for key, value in values.items()]
            )
            self._sent[j].update({k: snapshot(v) for k, v in values.items()})
        return bool(changes)

    def _on_reduced(self, bucket: Bucket, unused: List[int]) -> None:
        bucket.unused = unused
        if self.overlap and self._eager is None:
            self._step_bucket(bucket)
            bucket.mark_stepped()

    def _step_bucket(self, bucket: Bucket) -> None:
        unused = set(getattr(bucket, "unused", ()))
        if self.shard is not None:
            bucket.shard.load()
            if not bucket.units:
                return
        step = self._local.module.step_group
        for u, slots, grads in bucket.units:
            if unused:
                grads = [None if s in unused else g for s, g in zip(slots, grads)]
            step(u, grads)

    def _step_all(self) -> None:
        if self._eager is None:
            for bucket in self._buckets:
                self._take_user_grads(bucket)
                self._step_bucket(bucket)
        elif self.shard is None:
            self._eager.step()
        else:
            self._eager_step_own()
        if self.shard is not None:
            self._gather_all()

    def _take_user_grads(self, bucket: Bucket) -> None:
        """Step the ``.grad`` the user left after backward, as torch.optim would: one set
        to None is skipped, one replaced (``p.grad = p.grad * c``) is copied into the
        bucket, where the compiled step reads it."""
        skipped = []
        for slot, (p, view) in enumerate(zip(bucket.params, bucket.grads)):
            if p.grad is view:
                continue
            grad = _dense_grad(bucket, slot)
            if grad is None:
                skipped.append(slot)
            else:
                with torch.no_grad():  # a gradient made with create_graph=True has a history
                    view.copy_(grad)
        if skipped:
            bucket.unused = sorted(set(getattr(bucket, "unused", ())) | set(skipped))

    def _eager_step_own(self) -> None:
        """Sharded eager step: the other ranks' parameters are hidden from the eager
        optimizer (``.grad`` None: torch.optim skips them and makes no state for them)."""
        hidden = []
        for bucket in self._buckets:
            own = {pc.slot for pc in bucket.shard.own}
            hidden.extend((p, p.grad) for k, p in enumerate(bucket.params) if k not in own)
        for p, _ in hidden:
            p.grad = None
        try:
            self._eager.step()
        finally:
            for p, grad in hidden:
                p.grad = grad
        for bucket in self._buckets:
            bucket.shard.load()

    def _gather_all(self) -> None:
        """Gather every bucket's updated pieces (after a step outside backward)."""
        gather = _gather_on(self._comm_group)
        works = [gather(bucket) for bucket in self._buckets]
        for bucket, work in zip(self._buckets, works):
            _store(bucket, work)

    def _local_step_and_average(self) -> None:
        """``RoundRobin``: step on this rank's gradients, then average one partition."""
        if self._eager is not None:
            self._eager.step()
        else:
            self._apply_changes()
            step = self._local.module.step_group
            for bucket in self._buckets:
                for u, slots, _ in bucket.units:
                    step(u, [_dense_grad(bucket, s) for s in slots])
        members = self._partitions[self._round % self.sync.k]
        self._round += 1
        if not members:
            return
        params = [self._trained[m] for m in members]
        tensors = [p.data for p in params] + self._shaped_state(params)
        average_(tensors, self.process_group, self.world_size)

    def _shaped_state(self, params: List[Tensor]) -> List[Tensor]:
        """The state tensors shaped like their parameter (the step count is not one)."""
        if self._eager is not None:
            entries = [self._eager.state.get(p, {}) for p in params]
        else:
            wanted = {id(p) for p in params}
            state = self._local.torch_state(copy=False)
            position = {id(p): i for b in self._buckets for p, i in zip(b.params, b.positions)}
            entries = [state.get(position[id(p)], {}) for p in params if id(p) in wanted]
        out = []
        for p, entry in zip(params, entries):
            for key, value in entry.items():
                if (key != "step" and isinstance(value, Tensor) and value.shape == p.shape
                        and (value.is_floating_point() or value.is_complex())):
                    out.append(value)
        return out

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Backward passes inside accumulate gradients without reducing, as DDP's
        ``no_sync``; the first pass outside (or ``step()``) reduces the sum."""
        if self._reducer is None:
            yield
            return
        previous = self._reducer.no_sync
        self._reducer.no_sync = True
        try:
            yield
        finally:
            self._reducer.no_sync = previous

    def clip_grad_norm_(
        self,
        max_norm: float,
        norm_type: float = 2.0,
        error_if_nonfinite: bool = False,
        foreach: Optional[bool] = None,
    ) -> Tensor:
        """Clip the averaged gradients by their global norm, as
        ``torch.nn.utils.clip_grad_norm_``; call it between backward and ``step()``.

        The averaged gradients are equal on every rank, so the norm is too, with no extra
        collective. With ``RoundRobin`` the gradients are each rank's own: the norm is that
        of all ranks' gradients together (one scalar all_reduce).

        Returns:
            The total norm (before clipping).

        Raises:
            RuntimeError: buckets step during backward (``overlap=True`` with a compiled
                class), so there is nothing left to clip: build with ``overlap=False``.
            ValueError: ``param_groups`` no longer hold the parameters it was built with
                (``distopt.param_groups.check_groups``).
        """
        check_groups(self.param_groups, self._built)
        params = [p for b in self._buckets for p in b.params]
        if self.sync is not None:
            grads = [p.grad for p in params if p.grad is not None]
            local = torch.nn.utils.get_total_norm(grads, norm_type, error_if_nonfinite, foreach)
            total = local.detach().clone().to(torch.float64)
            if math.isinf(norm_type):
                dist.all_reduce(total, op=dist.ReduceOp.MAX, group=self.process_group)
            else:
                total.pow_(norm_type)
                dist.all_reduce(total, group=self.process_group)
                total.pow_(1.0 / norm_type)
            total = total.to(local.dtype)
            torch.nn.utils.clip_grads_with_norm_(params, max_norm, total, foreach)
            return total
        if self.overlap and self._eager is None:
            raise RuntimeError(
                "Invalid clip_grad_norm_: with overlap=True each bucket is stepped as soon as "
                "its gradients are averaged, during backward, before any clipping (expected "
                "DataParallelOptimizer(..., overlap=False) to clip)"
            )
        if self._reducer is not None:
            self._reducer.complete()
        return torch.nn.utils.clip_grad_norm_(
            params, max_norm, norm_type, error_if_nonfinite, foreach
        )

    # ------------------------------------------------------------ state

    def state_dict(self) -> Dict[str, Any]:  # type: ignore[override]
        """The state in torch.optim's format; with error feedback also ``"residuals"``
        (global index -> this rank's residual), with ``RoundRobin`` ``"sync"``, with
        PowerSGD ``"compression"``. Sharded, every rank's pieces are gathered first (a
        collective: every rank of ``process_group`` calls it, between steps)."""
        return self._state_dict(gather=True)

    def _state_dict(self, gather: bool) -> Dict[str, Any]:
        """``state_dict``; without ``gather`` (sharded) this rank's pieces only, under
        ``"state"``, and where they lie under ``"pieces"`` (global index -> (start, stop))."""
        check_groups(self.param_groups, self._built)
        for hook in self._optimizer_state_dict_pre_hooks.values():
            hook(self)
        if self._eager is not None:
            sd = self._eager.state_dict()
            if gather and self.shard is not None:
                sd["state"] = dict(sorted(self._gathered_state(sd["state"]).items()))
        else:
            indices, start = [], 0
            for g in self.param_groups:
                indices.append(list(range(start, start + len(g["params"]))))
                start += len(g["params"])
            state = self._local.torch_state(copy=gather) if self._local is not None else {}
            if gather and self.shard is not None:
                state = self._gathered_state(state)
            sd = {
                "state": dict(sorted(state.items())),
                "param_groups": [
                    {**{k: v for k, v in g.items() if k != "params"}, "params": idx}
                    for g, idx in zip(self.param_groups, indices)
                ],
            }
        if self._codec.error_feedback:
            sd["residuals"] = {
                i: getattr(b, "residual")[o:o + p.numel()].view(p.shape).clone()
                for b in self._buckets
                for i, p, o in zip(b.positions, b.params, b.offsets)
            }
        if not gather and self.shard is not None:
            sd["pieces"] = {i: (a, b) for i, (a, b, _) in self._piece_index().items()}
        extra = self._codec.state_dict()
        if extra is not None:
            sd["compression"] = extra
        if self.sync is not None:
            sd["sync"] = {"round": self._round}
        for hook in self._optimizer_state_dict_post_hooks.values():
            result = hook(self, sd)
            if result is not None:
                sd = result
        return sd

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:  # type: ignore[override]
        """Load a state_dict of this class (a local torch.optim one too); everything is
        checked before anything changes.

        Raises:
            ValueError: another class, group count, parameter count, shape, or a state entry
                that does not fit, named.
        """
        for hook in self._optimizer_load_state_dict_pre_hooks.values():
            result = hook(self, state_dict)
            if result is not None:
                state_dict = result
        self._checked_loader(state_dict)()
        for hook in self._optimizer_load_state_dict_post_hooks.values():
            hook(self)

    def _checked_loader(self, state_dict: Dict[str, Any]) -> Callable[[], None]:
        """Check ``state_dict`` against this optimizer; return what loads it (no check left
        to fail but the eager optimizer's own)."""
        check_groups(self.param_groups, self._built)
        saved_groups, saved_ids = saved_layout(state_dict, self.param_groups)
        residuals = self._check_residuals(state_dict, saved_ids)
        load_codec = self._codec.checked_loader(state_dict.get("compression"))
        rounds = state_dict.get("sync", {}).get("round", self._round) if self.sync else 0
        if isinstance(rounds, bool) or not isinstance(rounds, int) or rounds < 0:
            raise ValueError(f"Invalid state_dict['sync']['round']: {rounds!r} (expected an int >= 0)")
        if self._eager is not None:
            eager_state = state_dict["state"]
            if self.shard is not None:  # "param": whole parameters, this rank's only
                own = set(self._piece_index())
                order = {saved: i for i, saved in enumerate(saved_ids)}
                eager_state = {k: v for k, v in eager_state.items() if order.get(k) in own}

            def load_eager() -> None:
                self._eager.load_state_dict(
                    {"state": eager_state, "param_groups": saved_groups}
                )
                self.param_groups = self._eager.param_groups
                self.state = self._eager.state
                self._load_extras(residuals, rounds)
                load_codec()
            return load_eager
        position = {saved: i for i, saved in enumerate(saved_ids)}
        state = {position[k]: v for k, v in state_dict["state"].items() if k in position}
        for j, saved in enumerate(saved_groups):
            for key in self._hyper_keys:
                if key in saved:
                    check_hyperparameter(
                        self.optimizer_class, key, saved[key], f"state_dict param group {j}"
                    )
        if self.shard is not None:
            state = self._own_pieces_of(state, saved_ids)
        if self._local is not None:
            self._local.check_torch_state(state)

        def load_compiled() -> None:
            if self._local is not None:
                unit_group = {u: j for j, us in enumerate(self._units_of_group) for u in us}
                hyper = [
                    {k: v for k, v in saved_groups[unit_group[u]].items() if k != "params"}
                    for u in range(len(self._local.group_params))
                ]
                self._local.load_torch_state(hyper, state)
            for group, saved in zip(self.param_groups, saved_groups):
                group.update({k: v for k, v in saved.items() if k != "params"})
            self._sent = [
                {k: snapshot(g[k]) for k in self._hyper_keys} for g in self.param_groups
            ]
            self._load_extras(residuals, rounds)
            load_codec()
        return load_compiled

    def _gathered_state(self, mine: Dict[int, Dict[str, Any]]) -> Dict[int, Dict[str, Any]]:
        """The whole state in torch.optim's format, keyed by global index, from every
        rank's pieces ``mine`` (one all_gather_object), joined."""
        pieces = self._piece_index()
        mine = {i: (pieces[i][0], pieces[i][1], entry) for i, entry in mine.items()}
        every: List[Any] = [mine]
        if self.world_size > 1:
            every = [None] * self.world_size
            dist.all_gather_object(every, mine, group=self.process_group)
        parts: Dict[int, List[Any]] = {}
        for theirs in every:
            for i, part in theirs.items():
                parts.setdefault(i, []).append(part)
        flat = self.shard == "flat"
        return {
            i: _shard.merge_pieces(ps, self._bucketed[i].shape, flat) for i, ps in parts.items()
        }

    def _piece_index(self) -> Dict[int, Any]:
        """Global index -> (start, stop, shape of its state tensors) of this rank's pieces."""
        return {
            b.positions[pc.slot]: (pc.start, pc.stop, v.shape)
            for b in self._buckets for pc, v in zip(b.shard.own, b.shard.views)
        }

    def _own_pieces_of(self, state: Dict[int, Dict[str, Any]], saved_ids: List[Any]) -> Dict[int, Dict[str, Any]]:
        """This rank's pieces of a whole state (torch.optim's format, global index keys)."""
        out = {}
        for i, want in self._piece_index().items():
            if i in state:
                p = self._bucketed[i]
                out[i] = _shard.cut_state(state[i], (0, p.numel(), p.shape), want,
                                          f"state_dict['state'][{saved_ids[i]!r}]")
        return out

    def state_bytes(self) -> int:
        """The bytes of optimizer state this rank holds (its shard, when sharded): every
        state tensor, step counts included; not the gradient buckets or residuals."""
        if self._eager is not None:
            entries = list(self._eager.state.values())
        else:
            entries = list(self._local.torch_state(copy=False).values()) if self._local else []
        return sum(v.numel() * v.element_size() for e in entries for v in e.values()
                   if isinstance(v, Tensor))

    def bytes_per_step(self) -> float:
        """The payload bytes this rank sends per step: the reduction's model
        (``Compression.bytes_per_step``) plus, sharded, the gathers of the parameters.

        Raises:
            ValueError: the compression's bytes depend on the gradients (Threshold).
        """
        total = 0.0
        by_dtype: Dict[torch.dtype, List[Any]] = {}
        for b in self._buckets:
            by_dtype.setdefault(b.dtype, []).append((b.numel, len(b.params)))
        for dtype, numels in by_dtype.items():
            total += self._codec.bytes_per_step(numels, dtype, self.world_size)
        if self.shard is not None:
            total += sum(b.shard.gathered_bytes(self.world_size) for b in self._buckets)
        return total

    def _load_extras(self, residuals: Dict[int, Tensor], rounds: int) -> None:
        for b in self._buckets:
            for i, p, o in zip(b.positions, b.params, b.offsets):
                if i in residuals:
                    b.residual[o:o + p.numel()].copy_(residuals[i].reshape(-1))
        self._round = rounds

    def save(self, path: str) -> Dict[str, Any]:
        """Write a checkpoint into the directory ``path``; every rank calls it.

        The first rank writes the optimizer state once (it is the same on every rank; with
        ``RoundRobin`` each rank writes its own), each rank its error-feedback residuals,
        then the first rank the manifest (``distopt.checkpoint.write_atomic``: temporary
        file, fsync, rename). Until the new manifest is in place the previous checkpoint is
        intact. ``path`` must be on a filesystem every rank shares.

        Returns:
            The manifest.

        Raises:
            RuntimeError: some rank could not write (on every rank; nothing of this save is
                left behind).
        """
        return _checkpoint.save(self, path)

    def load(self, path: str) -> None:
        """Load a checkpoint written by ``save``; every rank calls it.

        Every rank reads and checks its part first; only when all have accepted does any
        change (one collective decides).

        Raises:
            ValueError: the manifest is not one of this optimizer's (class, world size),
                or some rank's part does not fit (on every rank, naming the rank).
        """
        _checkpoint.load(self, path)

    def _check_residuals(self, state_dict: Dict[str, Any], saved_ids: List[Any]) -> Dict[int, Tensor]:
        if not self._codec.error_feedback:
            return {}
        position = {saved: i for i, saved in enumerate(saved_ids)}
        out = {}
        params = self._bucketed
        for saved, value in state_dict.get("residuals", {}).items():
            i = position.get(saved)
            if i is None or i not in params:
                raise ValueError(f"Invalid state_dict['residuals']: parameter {saved!r} (expected "
                                 f"one of the trained parameters)")
            if not isinstance(value, Tensor) or value.shape != params[i].shape:
                got = tuple(value.shape) if isinstance(value, Tensor) else type(value).__name__
                raise ValueError(
                    f"Invalid state_dict['residuals'][{saved!r}]: {got} (expected a tensor of "
                    f"shape {tuple(params[i].shape)})"
                )
            out[i] = value
        return out

    def add_param_group(self, param_group: Dict[str, Any]) -> None:
        """Not supported: the buckets are fixed at construction.

        Raises:
            NotImplementedError: always.
        """
        raise NotImplementedError(
            "Invalid add_param_group: a DataParallelOptimizer's buckets are fixed at "
            "construction (expected every param group in the constructor)"
        )

    def close(self) -> None:
        """Remove the gradient hooks and stop the communication threads, after the
        collectives in flight. Call it before building another DataParallelOptimizer over
        the same parameters (or use the optimizer as a context manager); an optimizer that
        is no longer referenced closes itself."""
        self._closed = True
        _OPEN.discard(self)
        if self._reducer is not None:
            self._reducer.close()
            comm = self._comm_group
            if comm is not None and comm is not self.process_group:
                self._comm_group = None
                with contextlib.suppress(Exception):  # a peer already gone
                    _torch.destroy_private_group(comm)

    def __enter__(self) -> "DataParallelOptimizer":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # ------------------------------------------------------------ construction

    def _check_same_everywhere(
        self, params: List[Tensor], group_of: List[int], bucket_cap_mb: float
    ) -> None:
        """Every rank must build the same buckets (one all_gather of a signature), or the
        collectives would pair unlike buckets: DDP refuses mismatched models too."""
        if self.world_size == 1:
            return
        layout = repr((
            [(tuple(p.shape), str(p.dtype), p.requires_grad, str(p.device.type), j)
             for p, j in zip(params, group_of)],
            [sorted((k, repr(v)) for k, v in g.items() if k != "params")
             for g in self.param_groups],
            float(bucket_cap_mb), repr(self.compression), repr(self.sync), self.shard,
            self.backward_passes_per_step, self.optimizer_class.__name__,
        ))
        mine = torch.tensor([len(params), zlib.crc32(layout.encode())], dtype=torch.int64,
                            device=collective_device(self.process_group))
        every = [torch.empty_like(mine) for _ in range(self.world_size)]
        dist.all_gather(every, mine, group=self.process_group)
        first = every[0].tolist()
        for r, theirs in enumerate(every):
            theirs = theirs.tolist()
            if theirs != first:
                raise ValueError(
                    f"Invalid params: rank {r} of the process group built its "
                    f"DataParallelOptimizer from {theirs[0]} parameters, rank 0 from "
                    f"{first[0]}, and their shapes, dtypes, requires_grad, param groups, "
                    f"hyper-parameters (lr, momentum, ...) or options (bucket_cap_mb, "
                    f"compression, sync, shard, backward_passes_per_step, optimizer class) differ "
                    f"(expected the same model and arguments on every rank)"
                )

    def _broadcast_parameters(self, params: List[Tensor]) -> None:
        """Every rank starts from the group's first rank's parameters, as under DDP."""
        if self.world_size == 1 or not params:
            return
        source = dist.get_global_rank(self.process_group, 0) if self.process_group else 0
        average = [p.data for p in params]
        by_kind: Dict[Any, List[Tensor]] = {}
        for t in average:
            by_kind.setdefault((t.dtype, t.device), []).append(t)
        with torch.no_grad():
            for members in by_kind.values():
                flat = torch.cat([t.reshape(-1) for t in members])
                dist.broadcast(flat, source, group=self.process_group)
                offset = 0
                for t in members:
                    t.copy_(flat[offset:offset + t.numel()].view_as(t))
                    offset += t.numel()


# id(parameter) -> (weak parameter, weak optimizer) for parameters that some open
# DataParallelOptimizer averages and steps; and the open optimizers.
_CLAIMS: Dict[int, Any] = {}
_OPEN: "weakref.WeakSet[DataParallelOptimizer]" = weakref.WeakSet()


def _claimant(p: Tensor) -> Any:
    entry = _CLAIMS.get(id(p))
    if entry is None or entry[0]() is not p:
        return None
    opt = entry[1]()
    return opt if opt is not None and not opt._closed else None


def _take_over(params: List[Tensor]) -> None:
    """Two optimizers over one parameter would both average and step it: the newer one
    takes the parameters and the older one is closed (``opt = DataParallelOptimizer(...)``
    again builds the new one while the old is still bound)."""
    if not any(_claimant(p) is not None for p in params):
        return
    gc.collect()  # an optimizer the user dropped may only be waiting for the collector
    older: Dict[int, Any] = {}
    for i, p in enumerate(params):
        opt = _claimant(p)
        if opt is not None:
            older.setdefault(id(opt), (opt, []))[1].append(i)
    for opt, taken in older.values():
        warnings.warn(
            f"DataParallelOptimizer: parameters {taken[:10]}{'...' if len(taken) > 10 else ''}"
            f" belonged to another DataParallelOptimizer, which is now closed (its step() "
            f"raises); close() it before building a new one over the same parameters",
            stacklevel=3,
        )
        opt.close()


def _check_group_unshared(group: Any) -> None:
    """Two communication threads on one group would issue in a different order per rank."""
    if group is not None and any(opt._comm_group is group for opt in list(_OPEN)):
        raise ValueError(
            f"Invalid process_group: {group!r} already carries the reductions of another "
            f"open DataParallelOptimizer, whose collectives would interleave with this "
            f"one's in a different order on each rank (expected a group of its own for "
            f"each, e.g. dist.new_group(ranks), or process_group=None, which makes one)"
        )


def _claim(params: List[Tensor], opt: "DataParallelOptimizer") -> None:
    _OPEN.add(opt)
    for p in params:
        _CLAIMS[id(p)] = (weakref.ref(p), weakref.ref(opt))
    for key in [k for k, (wp, wo) in _CLAIMS.items() if wp() is None or wo() is None]:
        del _CLAIMS[key]


def _weak_call(method: Any) -> Callable[..., Any]:
    """``method`` without a strong reference to its object (a no-op once it is gone)."""
    ref = weakref.WeakMethod(method)

    def call(*args: Any) -> Any:
        bound = ref()
        return None if bound is None else bound(*args)

    return call


def saved_layout(state_dict: Any, param_groups: List[Dict[str, Any]]) -> Any:
    """A state_dict's param groups and its ids of the parameters, in order, checked to
    match ``param_groups`` in number.

    Raises:
        ValueError: not a state_dict, another group count or parameter count, named.
    """
    if not isinstance(state_dict, dict) or "state" not in state_dict or (
        "param_groups" not in state_dict
    ):
        got = sorted(state_dict) if isinstance(state_dict, dict) else type(state_dict).__name__
        raise ValueError(
            f"Invalid state_dict: {got!r} (expected a dict with 'state' and 'param_groups')"
        )
    saved_groups = state_dict["param_groups"]
    if len(saved_groups) != len(param_groups):
        raise ValueError(
            f"Invalid state_dict: {len(saved_groups)} param groups (expected "
            f"{len(param_groups)})"
        )
    saved_ids: List[Any] = []
    for j, (saved, group) in enumerate(zip(saved_groups, param_groups)):
        if len(saved["params"]) != len(group["params"]):
            raise ValueError(
                f"Invalid state_dict: param group {j} holds {len(saved['params'])} "
                f"parameters (expected {len(group['params'])})"
            )
        saved_ids.extend(saved["params"])
    return saved_groups, saved_ids


def _gather_on(group: Any) -> Callable[[Bucket], Any]:
    def gather(bucket: Bucket) -> Any:
        return bucket.shard.gather(group)

    return gather


def _store(bucket: Bucket, work: Any) -> None:
    work.wait()
    bucket.shard.store()


def _check_shard(shard: Any, optimizer_class: type, eager: bool, sync: Any) -> None:
    if shard is None:
        return
    if shard not in _shard.MODES:
        raise ValueError(f"Invalid shard: {shard!r} (expected None, 'param' or 'flat')")
    if sync is not None:
        raise ValueError(
            f"Invalid shard: {shard!r} with sync={sync!r} (expected None: RoundRobin steps "
            f"every parameter on every rank)"
        )
    if eager and shard == "flat":
        raise ValueError(
            f"Invalid shard: 'flat' for {getattr(optimizer_class, '__name__', optimizer_class)}"
            f", which has no functional twin and steps whole parameters (expected "
            f"shard='param', or a class of functional_optim_map with TorchScript on)"
        )
    if shard == "flat" and optimizer_class.__name__ in _shard.SHAPED:
        raise ValueError(
            f"Invalid shard: 'flat' for {optimizer_class.__name__}, whose update depends on "
            f"each parameter's shape (expected shard='param', which keeps parameters whole)"
        )


def _dense_grad(bucket: Bucket, slot: int) -> Optional[Tensor]:
    grad = bucket.params[slot].grad
    if grad is not None and grad.layout != torch.strided:
        raise ValueError(
            f"Invalid gradient of parameter {bucket.positions[slot]}: {grad.layout} "
            f"(expected a dense gradient)"
        )
    return grad


def _check_options(
    bucket_cap_mb: Any, compression: Any, passes: Any, sync: Any, overlap: Any
) -> None:
    if isinstance(bucket_cap_mb, bool) or not isinstance(bucket_cap_mb, (int, float)) or not (
        math.isfinite(bucket_cap_mb) and bucket_cap_mb > 0
    ):
        raise ValueError(f"Invalid bucket_cap_mb: {bucket_cap_mb!r} (expected a finite float > 0)")
    if compression is not None and not isinstance(compression, Compression):
        raise TypeError(
            f"Invalid compression: {compression!r} (expected None, Cast, TopK, Threshold or "
            f"PowerSGD)"
        )
    if isinstance(passes, bool) or not isinstance(passes, int) or passes < 1:
        raise ValueError(f"Invalid backward_passes_per_step: {passes!r} (expected an int >= 1)")
    if sync is not None and not isinstance(sync, RoundRobin):
        raise TypeError(f"Invalid sync: {sync!r} (expected None or RoundRobin(k))")
    if sync is not None and compression is not None:
        raise ValueError(
            f"Invalid compression: {compression!r} with sync={sync!r} (expected None: "
            f"RoundRobin averages parameters, not gradients)"
        )
    if not isinstance(overlap, bool):
        raise TypeError(f"Invalid overlap: {overlap!r} (expected a bool)")


def _group_info(process_group: Any) -> Any:
    if not dist.is_available() or not dist.is_initialized():
        raise ValueError(
            f"Invalid process_group: {process_group!r} (expected torch.distributed to be "
            f"initialized first: torch.distributed.init_process_group)"
        )
    if process_group is dist.GroupMember.NON_GROUP_MEMBER or (
        isinstance(process_group, int) and process_group == dist.GroupMember.NON_GROUP_MEMBER
    ):
        raise ValueError(
            f"Invalid process_group: this rank ({dist.get_rank()}) is not one of its members "
            f"(expected a group this rank belongs to)"
        )
    if process_group is not None and not isinstance(process_group, dist.ProcessGroup):
        raise TypeError(
            f"Invalid process_group: {process_group!r} (expected None or a "
            f"torch.distributed ProcessGroup)"
        )
    rank = dist.get_rank(process_group)
    if rank < 0:
        raise ValueError(
            f"Invalid process_group: this rank ({dist.get_rank()}) is not one of its members "
            f"(expected a group this rank belongs to)"
        )
    return process_group, rank, dist.get_world_size(process_group)


def _param_groups(params: Any) -> List[Dict[str, Any]]:
    """The constructor's parameters as new group dicts (torch.optim's rules for the rest)."""
    if isinstance(params, Tensor):
        raise TypeError(
            f"Invalid params: a {type(params).__name__} (expected an iterable of Tensors or "
            f"of param group dicts, e.g. model.parameters())"
        )
    items = list(params)
    if not items:
        raise ValueError("Invalid params: [] (expected at least one parameter)")
    if not isinstance(items[0], dict):
        groups = [{"params": items}]
    else:
        groups = []
        for j, g in enumerate(items):
            if not isinstance(g, dict) or "params" not in g:
                raise TypeError(f"Invalid params[{j}]: {g!r} (expected a dict with 'params')")
            ps = g["params"]
            groups.append({**g, "params": [ps] if isinstance(ps, Tensor) else list(ps)})
    # As DistributedOptimizer refuses it (distopt.owner), numbered over the groups: torch.optim
    # only warns of a tensor given twice and steps it twice (functional.check_params).
    pair = duplicate_pair([p for g in groups for p in g["params"]])
    if pair is not None:
        raise ValueError(
            f"Invalid params: parameters {pair[0]} and {pair[1]} are the same tensor "
            f"(expected each parameter once, in one param group)"
        )
    return groups
