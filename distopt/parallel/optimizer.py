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
from typing import Any, Callable, Dict, Iterable, Iterator, List, Optional, Tuple, Union

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.algorithms.join import JoinHook, Joinable

from distopt import _torch
from distopt.arguments import check_arguments, check_optimizer_class
from distopt.local_optimizer import CompiledSteps
from distopt.param_groups import (
    as_keywords,
    built_groups,
    check_groups,
    pending_changes,
    snapshot,
)
from distopt.parallel import buffers as _buffers
from distopt.parallel import checkpoint as _checkpoint
from distopt.parallel import join as _join
from distopt.parallel import shard as _shard
from distopt.parallel.buckets import Bucket, assign_buckets
from distopt.parallel.compression import Compression, TopK, dense_reduction
from distopt.parallel.reducer import GradientReducer
from distopt.parallel.sync import RoundRobin, average_, collective_device, partition
from distopt.parallel.teardown import close_at_exit
from distopt.shell import (
    indexed_groups,
    load_state_dict_with_hooks,
    refuse_add_param_group,
    state_dict_with_hooks,
)
from distopt.profiling import profiler_range
from functional import functional_optim_map
from functional._kernels import unscale_gradients
from functional._state import check_hyperparameter
from functional._validation import duplicate_pair

logger = logging.getLogger(__name__)

__all__ = ["DataParallelOptimizer"]

#: The default ``bucket_cap_mb``, DDP's.
_DEFAULT_BUCKET_CAP_MB = 25.0
#: The first bucket's cap once the buckets are rebuilt, with the default cap: DDP's
#: (``torch.distributed._DEFAULT_FIRST_BUCKET_BYTES``), so that the first reduction starts
#: as early as DDP's.
_FIRST_BUCKET_BYTES = 1 << 20


class DataParallelOptimizer(torch.optim.Optimizer, Joinable):
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

    With ``module=model`` the model's buffers (BatchNorm's running statistics) are
    broadcast from the first rank before each forward, as DDP's ``broadcast_buffers=True``
    does. It is a :class:`torch.distributed.algorithms.Joinable`: under
    ``with Join([opt]):`` ranks with fewer batches finish first and shadow the others'
    collectives, contributing zero gradients and stepping as they do
    (``distopt.parallel.join``).

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
            (compiled classes; eager ones overlap only the reduction), from the second step
            on and in no step a ``GradScaler`` takes: those wait for ``step()``, after the
            scaler's inf/NaN check (see ``_next_plan``). Set False to step after the last
            bucket, for instance to clip gradients first.
        shard: None (every rank holds all the optimizer state), ``"param"`` (each rank
            holds the state of whole parameters, about 1/W of it: the choice for
            Adafactor and Muon) or ``"flat"`` (1/W of each bucket's elements; elementwise
            classes): each rank steps its share and the parameters are all-gathered, bucket
            by bucket (``distopt.parallel.shard``). An eager class takes ``"param"``: it
            steps this rank's parameters after the last bucket.
        module: None, or the model whose parameters ``params`` are: its buffers are
            broadcast from the group's first rank at construction and before each forward,
            as DDP's ``broadcast_buffers=True`` does, and its parameters outside ``params``
            (frozen ones) at construction (``distopt.parallel.buffers``).
        broadcast_buffers: False: ``module``'s buffers are never broadcast (DDP's
            ``broadcast_buffers=False``).
        rebuild_buckets: True (default): at the end of the first ``step()`` the buckets are
            cut again in the order the gradients arrived on the group's first rank, as DDP
            rebuilds its buckets (with DDP's 1 MiB first bucket under the default
            ``bucket_cap_mb``), so that each later step's first reduction starts as early
            as the gradients allow; state, residuals and ``.grad`` are carried over
            unchanged (``bucket_layout()``). False: the construction's buckets (reverse
            registration order) stay.
        **kwargs: the optimizer's keyword arguments.

    Raises:
        TypeError / ValueError: a bad argument, named, before any collective (and
            torch.optim's own checks of the optimizer's arguments).
    """

    #: ``GradScaler.step(opt)`` hands ``step()`` its ``grad_scale`` and ``found_inf``
    #: instead of unscaling ``.grad`` itself and skipping ``step()`` after an inf: ``step()``
    #: then steps as torch.optim steps under a scaler (and a skipped step still ends the step).
    _step_supports_amp_scaling = True

    def __init__(
        self,
        optimizer_class: type,
        params: Iterable[Union[Tensor, Dict[str, Any]]],
        *args: Any,
        process_group: Any = None,
        bucket_cap_mb: float = _DEFAULT_BUCKET_CAP_MB,
        compression: Optional[Compression] = None,
        backward_passes_per_step: int = 1,
        sync: Optional[RoundRobin] = None,
        overlap: bool = True,
        shard: Optional[str] = None,
        module: Optional[torch.nn.Module] = None,
        broadcast_buffers: bool = True,
        rebuild_buckets: bool = True,
        **kwargs: Any,
    ) -> None:
        Joinable.__init__(self)  # no Join yet: ``join_hook`` is called by Join
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
        outside = _buffers.check_module(
            module, [p for g in groups for p in g["params"]], broadcast_buffers
        )
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
        self.module = module
        self.broadcast_buffers = broadcast_buffers
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
        self._cap_bytes = max(1, int(bucket_cap_mb * 2**20))
        # DDP's rebuilt buckets start with a small one, with the default cap only.
        self._first_cap_bytes = (
            min(self._cap_bytes, _FIRST_BUCKET_BYTES)
            if bucket_cap_mb == _DEFAULT_BUCKET_CAP_MB else None
        )
        self._buckets = assign_buckets(
            [all_params[i] for i in trained], trained, self._cap_bytes
        )
        #: Global index -> parameter, for every parameter in a bucket.
        self._bucketed = {i: p for b in self._buckets for i, p in zip(b.positions, b.params)}
        if compression is not None:
            compression.check_params(
                (f"parameter {i} (shape {tuple(all_params[i].shape)})", all_params[i])
                for i in trained
            )
        self._prepare_buckets()
        self._check_same_everywhere(all_params, group_of, bucket_cap_mb, outside)
        # As DDP at construction: the module's other parameters and its buffers too.
        self._broadcast_parameters(all_params + outside + (
            list(module.buffers()) if module is not None and broadcast_buffers else []
        ))
        self._group_of = group_of
        self._ctor = (args, kwargs, options)
        self._hyper_keys = [k for k in self.param_groups[0] if k != "params"]
        self._local: Optional[CompiledSteps] = None
        self._plan_units()
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
            self._codec_config = codec
            self._codec = codec.bound(self._comm_group, rank, world_size, self._buckets)
            self._reducer = self._new_reducer(record=rebuild_buckets)
        #: Whether the buckets are cut again, in the order of the first step's gradients,
        #: at the end of that step (``_rebuild_at_first_step``).
        self._rebuild_pending = rebuild_buckets and self._reducer is not None
        #: No step taken and no state loaded yet: there is no optimizer state anywhere.
        self._fresh = True
        _claim(all_params, self)
        self._abandoned: Optional[weakref.finalize] = None
        if self._reducer is not None:
            close_at_exit(self)
            # Dropped without close(): stop the threads, retire the private group (its last
            # reference must go where it can join its workers: distopt.parallel.teardown).
            private = self._comm_group if self._comm_group is not group else None
            self._abandoned = weakref.finalize(self, _abandon, self._reducer, private)
            self._abandoned.atexit = False  # the exit closes what is left, waiting
        #: Where this optimizer's collectives outside backward go (buffers, Join's rounds):
        #: the communication thread's group, idle between steps (``distopt.parallel.join``).
        self._forward_group = self._comm_group if self._comm_group is not None else group
        #: Whether the next forward broadcasts the buffers (DDP's require_forward_param_sync).
        self._sync_next_forward = True
        #: Join's ``divide_by_initial_world_size`` (set by ``join_hook``), the source of
        #: its last round, and whether this step must send what it reads to joined ranks.
        self._join_divide = True
        self._join_source = 0
        self._join_packet = False
        self._forward_hook: Any = None
        if module is not None:
            self._forward_hook = module.register_forward_pre_hook(
                _forward_pre_hook(_weak_call(self._before_forward))
            )
            weakref.finalize(self, self._forward_hook.remove)
        self._warned_late_change = False
        #: Whether the last step() came without a GradScaler (see ``_next_plan``).
        self._last_step_unscaled = False
        #: Whether this window's buckets step as they arrive (decided as it begins).
        self._in_backward = False
        logger.info(
            "rank %d of %d: %d parameters in %d buckets, %s, compression=%r, sync=%r",
            rank, world_size, len(trained), len(self._buckets),
            "compiled" if self._local is not None else "eager", compression, sync,
        )

    # ------------------------------------------------------------ the plan

    def _prepare_buckets(self) -> None:
        """What each bucket needs of the compression: its check, its residual."""
        for bucket in self._buckets:
            if self.compression is not None:
                self.compression.check_bucket(bucket)
            if self._codec.error_feedback:
                bucket.residual = torch.zeros_like(bucket.buffer[:bucket.numel])

    def _plan_units(self) -> None:
        """The shards (sharded state) and one compiled step per (bucket, param group), from
        the buckets and the groups' current hyper-parameters."""
        shard, group_of = self.shard, self._group_of
        if shard is not None:
            adafactor = getattr(torch.optim, "Adafactor", None)
            name = ("Adafactor" if adafactor and issubclass(self.optimizer_class, adafactor)
                    else "")
            pieces = _shard.split(self._buckets, self.world_size, shard, [
                [_shard.state_size(name, p) * p.element_size() for p in b.params]
                for b in self._buckets
            ])
            for bucket, parts in zip(self._buckets, pieces):
                bucket.shard = _shard.Shard(bucket, parts, self.rank, whole=shard == "param")
        args, kwargs, options = self._ctor
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
        if self._local is not None:
            self._local.close()
            self._local = None
        if self._eager is None and unit_params:
            fargs, fkwargs = as_keywords(self.optimizer_class, args, kwargs)
            self._local = CompiledSteps(
                functional_optim_map[self.optimizer_class], self.optimizer_class, unit_params,
                unit_indices, unit_options, fargs, fkwargs,
            )
        self._sent = [{k: snapshot(g[k]) for k in self._hyper_keys} for g in self.param_groups]
        self._settable = (
            self._local.settable(self._hyper_keys) if self._local is not None else None
        )

    def _new_reducer(self, record: bool = False) -> GradientReducer:
        gathers = self.shard is not None and self.overlap and self._eager is None
        return GradientReducer(
            self._buckets, self._codec, self._comm_group, self.rank, self.world_size,
            self.backward_passes_per_step,
            _weak_call(self._before_reduction), _weak_call(self._on_reduced),
            _weak_call(self._gather_stepped) if gathers else None,
            _store if gathers else None,
            record_arrival=record,
        )

    def bucket_layout(self) -> List[List[int]]:
        """The buckets, in reduction order, as the global indices of their parameters (in
        each bucket's buffer order): reverse registration order at construction, the order
        the first step's gradients arrived after it (``rebuild_buckets``)."""
        return [list(b.positions) for b in self._buckets]

    def _arrival_order(self) -> List[int]:
        """The first step's arrival order (global indices) on the group's first rank, taken
        by every rank (one broadcast). The parameters whose gradient did not arrive follow
        in the present order."""
        present = [i for b in self._buckets for i in b.positions]
        order = list(dict.fromkeys(self._reducer.take_arrivals()))
        got = set(order)
        order += [i for i in present if i not in got]
        if self.world_size > 1:
            box = torch.tensor(order, dtype=torch.int64,
                               device=collective_device(self._forward_group))
            _buffers.broadcast([box], 0, self._forward_group)
            order = box.tolist()
        return order

    def _layout_buckets(self, layout: Any, where: str) -> List[Bucket]:
        """New buckets cut as ``layout`` (bucket -> global indices) says; ValueError naming
        ``where`` unless it holds every bucketed parameter once, one dtype and device a
        bucket."""
        trained = self._bucketed
        flat = [i for ps in layout for i in ps] if isinstance(layout, list) and all(
            isinstance(ps, list) and ps for ps in layout) else None
        if flat is None or sorted(flat) != sorted(trained) or any(
            len({(trained[i].dtype, trained[i].device) for i in ps}) != 1 for ps in layout
        ):
            raise ValueError(
                f"Invalid {where}: {layout!r} (expected a list of non-empty buckets of "
                f"global indices, holding each of the parameters {sorted(trained)} once, one "
                f"dtype and device a bucket)"
            )
        new = [Bucket(k, [trained[i] for i in ps], list(ps)) for k, ps in enumerate(layout)]
        new[-1].last = True
        return new

    def _rebuild_at_first_step(self) -> None:
        """The end of the first step (every rank alike): cut the buckets again in the order
        the gradients arrived on the group's first rank, as DDP does, with DDP's small
        first bucket (also where the order is the construction's, as DDP); a compression
        whose state cannot follow keeps them."""
        self._rebuild_pending = False
        carried = self._codec.carried_state()
        if carried is False:  # the same on every rank: its state is the same shape
            logger.info("rank %d: buckets kept in registration order (%r holds state per "
                        "bucket)", self.rank, self._codec)
            return
        order = self._arrival_order()
        new = assign_buckets([self._bucketed[i] for i in order], order, self._cap_bytes,
                             order, self._first_cap_bytes)
        if [b.positions for b in new] == self.bucket_layout():
            return
        codec = self._codec_config.bound(self._comm_group, self.rank, self.world_size, new)
        if carried is not None:
            codec.checked_loader(carried)()
        self._rebuild_buckets(new, codec)
        logger.info("rank %d: buckets rebuilt in gradient arrival order: %d buckets, the "
                    "first of %d parameters", self.rank, len(new), len(new[0].params))

    def _rebuild_buckets(self, new: List[Bucket], codec: Compression) -> None:
        """Replace the buckets by ``new`` (reduced by ``codec``), carrying the optimizer
        state (gathered and cut again, when sharded) and the residuals over unchanged; each
        ``.grad`` that was a view of its bucket keeps its values, as a view of the new one.
        Between steps only (a collective, when sharded)."""
        state: Dict[int, Dict[str, Any]] = {}
        if self._fresh:
            pass  # no state on any rank: nothing to gather
        elif self._local is not None:
            state = self._local.torch_state(copy=False)
            if self.shard is not None:
                state = self._gathered_state(state)
        elif self._eager is not None and self.shard is not None:
            ids = {id(p): i for i, p in self._bucketed.items()}
            state = self._gathered_state(
                {ids[id(p)]: dict(v) for p, v in self._eager.state.items() if id(p) in ids}
            )
        residuals = {}
        if self._codec.error_feedback:
            residuals = {
                i: b.residual[o:o + p.numel()].clone()
                for b in self._buckets for i, p, o in zip(b.positions, b.params, b.offsets)
            }
        views = {id(g) for b in self._buckets for g in b.grads}
        self._reducer.close()
        self._abandoned.detach()
        self._buckets = new
        self._codec = codec
        self._prepare_buckets()
        for b in new:
            for p, view in zip(b.params, b.grads):
                if p.grad is not None and id(p.grad) in views:
                    with torch.no_grad():
                        view.copy_(p.grad)
                    p.grad = view
            for i, p, o in zip(b.positions, b.params, b.offsets):
                if i in residuals:
                    b.residual[o:o + p.numel()].copy_(residuals[i].reshape(-1))
        self._plan_units()
        if self._local is not None:
            if self.shard is not None:
                state = self._own_pieces_of(state, list(range(max(self._bucketed) + 1)))
            unit_group = {u: j for j, us in enumerate(self._units_of_group) for u in us}
            hyper = [
                {k: v for k, v in self.param_groups[unit_group[u]].items() if k != "params"}
                for u in range(len(self._local.group_params))
            ]
            self._local.load_torch_state(hyper, state)
        elif self._eager is not None and self.shard is not None:
            own = set(self._piece_index())
            for i, p in self._bucketed.items():
                self._eager.state.pop(p, None)
                if i in own and i in state:
                    self._eager.state[p] = {
                        k: v.to(p.device) if isinstance(v, Tensor) else v
                        for k, v in state[i].items()
                    }
        self._reducer = self._new_reducer()
        private = self._comm_group if self._comm_group is not self.process_group else None
        self._abandoned = weakref.finalize(self, _abandon, self._reducer, private)
        self._abandoned.atexit = False

    # ------------------------------------------------------------ stepping

    def step(self, closure: Optional[Any] = None) -> Optional[Any]:  # type: ignore[override]
        """Finish averaging this step's gradients and update the parameters.

        Waits for every bucket (with ``overlap=True`` most were stepped during backward).
        A parameter no rank gave a gradient since the last step keeps the ``.grad`` it had,
        as under DDP with ``find_unused_parameters=True``: None, and it is left untouched;
        a tensor (zeros after ``zero_grad(set_to_none=False)``), and it is stepped with it,
        as torch.optim steps it.

        Called by ``GradScaler.step(opt)`` (``_step_supports_amp_scaling``), it steps as
        torch.optim steps under the scaler: the scaler's ``grad_scale`` and ``found_inf`` go
        to the fused kernels, which unscale and skip the update after an inf or NaN; other
        classes' gradients are unscaled in place and their step skipped then. The buckets
        of a step that a GradScaler takes wait for it (see ``_next_plan``).

        Args:
            closure: as torch.optim's: reevaluates the model and returns the loss.

        Raises:
            RuntimeError: a collective failed (another rank died, raised or timed out),
                naming this rank and the bucket; every later step raises it again. Or, with
                ``overlap=True`` and a compiled class, a ``.grad`` was replaced, set to None
                or changed in place after backward had stepped its bucket (with
                ``overlap=False`` the step takes what ``.grad`` holds, as torch.optim). Or,
                under a GradScaler: the scaler checked the gradients before they were
                averaged, or this step's buckets were stepped during backward (the step
                before it came without a scaler).
            ValueError: ``param_groups`` were edited in a way the buckets cannot follow
                (``distopt.param_groups.check_groups``: a group's ``params`` replaced or
                changed in place, a group added or removed, a key deleted), before
                anything is stepped (the reducing backward refused it already).
        """
        scaling = _amp_scaling(self)
        try:
            with profiler_range("distopt.DataParallelOptimizer.step"):
                return self._step(closure, scaling)
        except BaseException:
            if scaling is not None:
                # GradScaler.step deletes them after a step that returns; after one that
                # raised, a later step() without the scaler must not find them.
                _drop_amp_scaling(self)
            raise

    def _step(self, closure: Optional[Any], scaling: Optional[Any]) -> Optional[Any]:
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
            self._local_step_and_average(scaling)
            self._last_step_unscaled = scaling is None
            return loss
        if self._reducer is None:
            return loss
        if scaling is not None and not self._reducer.reducing:
            # The scaler looked for inf/NaN in this rank's own gradients: its verdict, and
            # so its next scale, may differ between ranks. Nothing is changed.
            raise RuntimeError(
                "Invalid step: a GradScaler checked this step's gradients for inf/NaN before "
                "they were averaged (fewer than backward_passes_per_step backward passes, or "
                "passes only inside no_sync(), since the last step), so its verdict and its "
                "next scale may differ between ranks; nothing was stepped (expected the "
                "reducing backward pass before scaler.step(opt): the "
                "backward_passes_per_step-th, or the last one outside no_sync())"
            )
        self._reducer.complete()
        try:
            stepped = self._in_backward
            poisoned = self._reducer.poisoned
            if stepped and scaling is not None:
                self._last_step_unscaled = False  # the next step waits for the scaler
                raise RuntimeError(
                    "Invalid step: a GradScaler steps this DataParallelOptimizer, but the step "
                    "before this one came without it, so this step's buckets were stepped "
                    "during backward with the scaled gradients (overlap=True steps buckets "
                    "during backward once a step() without a GradScaler has shown the "
                    "gradients unscaled); from the next step on the step waits for the "
                    "scaler (expected the GradScaler from the first step on, or "
                    "overlap=False)"
                )
            if scaling is not None and self._reducer.broken:
                raise RuntimeError(
                    "Invalid step: a backward pass raised after this step's reduction had "
                    "begun, and a GradScaler checked the gradients for inf/NaN before the "
                    "rest of them were averaged, so its verdict may differ between ranks; "
                    "the step is dropped (expected zero_grad() and this step's backward "
                    "again)"
                )
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
                    stacklevel=3,
                )
            if not stepped:
                if self._join_packet:  # some rank has joined: what this step reads
                    _join.send_step(self, scaling)
                self._step_all(scaling)
            self._last_step_unscaled = scaling is None
        finally:
            self._reducer.reset()
        self._fresh = False
        if self._rebuild_pending:
            if self._join_packet:  # a rank has joined: it cannot follow; every rank keeps them
                self._rebuild_pending = False
            else:
                self._rebuild_at_first_step()
        return loss

    def _next_plan(self) -> bool:
        """Whether the next window's buckets step as they arrive, during backward.

        A GradScaler's ``scale(loss)`` cannot be seen from here, and a bucket stepped before
        the scaler's inf/NaN check would apply scaled gradients. So they do only with
        ``overlap=True``, a compiled class, and after a ``step()`` that came without a
        GradScaler (``GradScaler.step`` hands this optimizer ``grad_scale`` and
        ``found_inf``): the first step, and every step a scaler takes, wait for ``step()``,
        while the reductions still overlap backward.
        """
        return self.overlap and self._eager is None and self._last_step_unscaled

    def _steps_in_backward(self) -> bool:
        """Whether this window's buckets step (or will step) during backward."""
        if self._reducer is not None and self._reducer.reducing:
            return self._in_backward
        return self._next_plan()

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
        self._in_backward = self._next_plan()  # before the window's first bucket is sent
        # Under Join: the round that tells joined ranks to shadow this reduction.
        divisor, self._join_packet = None, False
        if self._join_config.enable:
            divisor, self._join_packet = _join.reduction_round(self, self._in_backward)
        for bucket in self._buckets:
            bucket.divisor = divisor

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
        if self._in_backward:
            self._step_bucket(bucket)
            bucket.mark_stepped()

    def _gather_stepped(self, bucket: Bucket) -> Any:
        """Start the gather of a bucket stepped during backward (sharded); None in a window
        that steps in ``step()``, which gathers every bucket after its step."""
        if not self._in_backward:
            return None
        return _gather(bucket, self._comm_group)

    def _step_bucket(self, bucket: Bucket, scaling: Optional[Any] = None) -> None:
        with profiler_range("distopt.dp.step", bucket.index):
            unused = set(bucket.unused)
            if self.shard is not None:
                bucket.shard.load()
                if not bucket.units:
                    return
            for u, slots, grads in bucket.units:
                if unused:
                    grads = [None if s in unused else g for s, g in zip(slots, grads)]
                self._step_unit(u, grads, scaling)

    def _step_unit(self, unit: int, grads: List[Optional[Tensor]], scaling: Optional[Any]) -> None:
        """One compiled step of one (bucket, param group); under a GradScaler (``scaling``:
        its ``grad_scale`` and ``found_inf``) as torch.optim steps under one."""
        if scaling is None:
            self._local.module.step_group(unit, grads)
        else:
            self._local.module.step_group_scaled(unit, grads, scaling[0], scaling[1])

    def _step_all(self, scaling: Optional[Any] = None) -> None:
        if self._eager is None:
            for bucket in self._buckets:
                self._take_user_grads(bucket)
                self._step_bucket(bucket, scaling)
        elif self.shard is None:
            self._eager_step(scaling)
        else:
            self._eager_step_own(scaling)
        if self.shard is not None:
            self._gather_all()  # after a skipped step too: every rank gathers alike

    def _eager_step(self, scaling: Optional[Any] = None) -> None:
        """The eager optimizer's step; under a GradScaler as the scaler would step it: its
        own ``grad_scale`` / ``found_inf`` where it takes them (``fused=True``), else its
        gradients unscaled in place and no step after an inf or NaN."""
        inner = self._eager
        if scaling is None:
            inner.step()
        elif getattr(inner, "_step_supports_amp_scaling", False):
            inner.grad_scale, inner.found_inf = scaling
            try:
                inner.step()
            finally:
                _drop_amp_scaling(inner)
        elif not unscale_gradients(
            [p.grad for g in inner.param_groups for p in g["params"]], scaling[0], scaling[1]
        ):
            inner.step()

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
            bucket.unused = sorted(set(bucket.unused) | set(skipped))

    def _eager_step_own(self, scaling: Optional[Any] = None) -> None:
        """Sharded eager step: the other ranks' parameters are hidden from the eager
        optimizer (``.grad`` None: torch.optim skips them and makes no state for them)."""
        hidden = []
        for bucket in self._buckets:
            own = {pc.slot for pc in bucket.shard.own}
            hidden.extend((p, p.grad) for k, p in enumerate(bucket.params) if k not in own)
        for p, _ in hidden:
            p.grad = None
        try:
            self._eager_step(scaling)
        finally:
            for p, grad in hidden:
                p.grad = grad
        for bucket in self._buckets:
            bucket.shard.load()

    def _gather_all(self) -> None:
        """Gather every bucket's updated pieces (after a step outside backward)."""
        works = [_gather(bucket, self._comm_group) for bucket in self._buckets]
        for bucket, work in zip(self._buckets, works):
            _store(bucket, work)

    def _local_step_and_average(self, scaling: Optional[Any] = None) -> None:
        """``RoundRobin``: step on this rank's gradients (under a GradScaler, each rank's
        scaler checks its own), then average one partition."""
        if self._eager is not None:
            self._eager_step(scaling)
        else:
            self._apply_changes()
            for bucket in self._buckets:
                with profiler_range("distopt.dp.step", bucket.index):
                    for u, slots, _ in bucket.units:
                        self._step_unit(u, [_dense_grad(bucket, s) for s in slots], scaling)
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
        # In torch.optim's order (the param groups'), not the buckets': the norm is summed in
        # the order torch.nn.utils.clip_grad_norm_(model.parameters()) sums it, bit for bit.
        params = [self._bucketed[i] for i in sorted(self._bucketed)]
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
        if self._steps_in_backward():
            raise RuntimeError(
                "Invalid clip_grad_norm_: with overlap=True each bucket is stepped as soon as "
                "its gradients are averaged, during backward, before any clipping (expected "
                "DataParallelOptimizer(..., overlap=False) to clip; under a GradScaler, whose "
                "steps wait for its inf/NaN check, clip after scaler.unscale_(opt))"
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
        return state_dict_with_hooks(self, lambda: self._make_state_dict(gather))

    def _make_state_dict(self, gather: bool) -> Dict[str, Any]:
        if self._eager is not None:
            sd = self._eager.state_dict()
            if gather and self.shard is not None:
                sd["state"] = dict(sorted(self._gathered_state(sd["state"]).items()))
        else:
            state = self._local.torch_state(copy=gather) if self._local is not None else {}
            if gather and self.shard is not None:
                state = self._gathered_state(state)
            sd = {"state": dict(sorted(state.items())),
                  "param_groups": indexed_groups(self.param_groups)}
        if self._codec.error_feedback:
            sd["residuals"] = {
                i: b.residual[o:o + p.numel()].view(p.shape).clone()
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
        return sd

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:  # type: ignore[override]
        """Load a state_dict of this class (a local torch.optim one too); everything is
        checked before anything changes.

        Raises:
            ValueError: another class, group count, parameter count, shape, or a state entry
                that does not fit, named.
        """
        load_state_dict_with_hooks(self, state_dict, lambda sd: self._checked_loader(sd)())

    def _checked_loader(self, state_dict: Dict[str, Any]) -> Callable[[], None]:
        """Check ``state_dict`` against this optimizer; return what loads it (no check left
        to fail but the eager optimizer's own). A compression state saved with other buckets
        (``PowerSGD``'s ``layout``: the saving optimizer had rebuilt them) is loaded after
        this optimizer's buckets are cut as it says."""
        check_groups(self.param_groups, self._built)
        saved_groups, saved_ids = saved_layout(state_dict, self.param_groups)
        residuals = self._check_residuals(state_dict, saved_ids)
        relayout = self._saved_buckets(state_dict.get("compression"))
        codec = self._codec if relayout is None else relayout[1]
        load_codec = codec.checked_loader(state_dict.get("compression"))
        rounds = state_dict.get("sync", {}).get("round", self._round) if self.sync else 0
        if isinstance(rounds, bool) or not isinstance(rounds, int) or rounds < 0:
            raise ValueError(f"Invalid state_dict['sync']['round']: {rounds!r} (expected an int >= 0)")

        def adopt_layout() -> None:
            if relayout is not None:
                self._rebuild_buckets(*relayout)
                self._rebuild_pending = False

        def own_of(whole: Dict[Any, Any], keyed_by_saved: bool) -> Dict[Any, Any]:
            """This rank's part of a whole state (the pieces of the present buckets)."""
            if keyed_by_saved:  # "param": whole parameters, this rank's only
                own = set(self._piece_index())
                order = {saved: i for i, saved in enumerate(saved_ids)}
                return {k: v for k, v in whole.items() if order.get(k) in own}
            return self._own_pieces_of(whole, saved_ids)

        if self._eager is not None:
            eager_state = state_dict["state"]

            def load_eager() -> None:
                adopt_layout()
                chosen = own_of(eager_state, True) if self.shard is not None else eager_state
                self._eager.load_state_dict({"state": chosen, "param_groups": saved_groups})
                self.param_groups = self._eager.param_groups
                self.state = self._eager.state
                self._load_extras(residuals, rounds)
                load_codec()
                self._fresh = False
            return load_eager
        position = {saved: i for i, saved in enumerate(saved_ids)}
        whole = {position[k]: v for k, v in state_dict["state"].items() if k in position}
        for j, saved in enumerate(saved_groups):
            for key in self._hyper_keys:
                if key in saved:
                    check_hyperparameter(
                        self.optimizer_class, key, saved[key], f"state_dict param group {j}"
                    )
        state = own_of(whole, False) if self.shard is not None else whole
        if self._local is not None:
            self._local.check_torch_state(state)

        def load_compiled() -> None:
            adopt_layout()
            mine = own_of(whole, False) if self.shard is not None else whole
            if self._local is not None:
                unit_group = {u: j for j, us in enumerate(self._units_of_group) for u in us}
                hyper = [
                    {k: v for k, v in saved_groups[unit_group[u]].items() if k != "params"}
                    for u in range(len(self._local.group_params))
                ]
                self._local.load_torch_state(hyper, mine)
            for group, saved in zip(self.param_groups, saved_groups):
                group.update({k: v for k, v in saved.items() if k != "params"})
            self._sent = [
                {k: snapshot(g[k]) for k in self._hyper_keys} for g in self.param_groups
            ]
            self._load_extras(residuals, rounds)
            load_codec()
            self._fresh = False
        return load_compiled

    def _saved_buckets(self, compression: Any) -> Optional[Tuple[List[Bucket], Compression]]:
        """The buckets (and the scheme bound to them) a compression state was saved with,
        where they differ from this optimizer's; None where they do not (or it names none).

        Raises:
            ValueError: the layout does not fit this optimizer's parameters, or this
                optimizer is sharded and has state already (cutting its state again needs
                every rank: a rebuild happens at the end of a step, or before the first).
        """
        layout = compression.get("layout") if isinstance(compression, dict) else None
        if layout is None or self._reducer is None or layout == self.bucket_layout():
            return None
        where = "state_dict['compression']['layout']"
        buckets = self._layout_buckets(layout, where)
        if self.shard is not None and not self._fresh:
            raise ValueError(
                f"Invalid {where}: {layout!r} (expected this optimizer's buckets "
                f"{self.bucket_layout()!r}: a sharded optimizer that has stepped or loaded "
                f"state cuts its buckets again only at the end of its first step; load such "
                f"a state into a new DataParallelOptimizer before its first step)"
            )
        codec = self._codec_config.bound(self._comm_group, self.rank, self.world_size, buckets)
        return buckets, codec

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
        refuse_add_param_group("a DataParallelOptimizer's buckets", "in the constructor")

    def close(self) -> None:
        """Remove the gradient hooks (and ``module``'s forward pre-hook) and stop the
        communication threads, after the collectives in flight. Call it before building
        another DataParallelOptimizer over the same parameters (or use the optimizer as a
        context manager); an optimizer that is no longer referenced closes itself, and one
        still open when the interpreter exits is closed then (``distopt.parallel.teardown``)."""
        self._close(None)

    def _close(self, timeout_s: Optional[float]) -> bool:
        """``close()``, waiting up to ``timeout_s`` for each thread; whether they stopped
        with no collective failed. Only then is the private group destroyed, and every
        reference to it let go, so that the last one stops its gloo worker threads (after a
        failure a worker may be stuck in a collective: the group is left as it is)."""
        self._closed = True
        _OPEN.discard(self)
        if self._forward_hook is not None:
            self._forward_hook.remove()
        if self._reducer is None:
            return True
        self._abandoned.detach()
        stopped = self._reducer.close(timeout_s)
        comm = self._comm_group
        if stopped and comm is not None and comm is not self.process_group:
            self._comm_group = None
            self._forward_group = self.process_group
            self._codec.release_group()
            with contextlib.suppress(Exception):  # a peer already gone
                _torch.destroy_private_group(comm)
        return stopped

    def __enter__(self) -> "DataParallelOptimizer":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # ------------------------------------------------------------ buffers and Join

    def _before_forward(self) -> None:
        """``module``'s forward pre-hook: broadcast its buffers from the group's first rank
        (under Join, the highest rank not joined) when the last forward was a synchronising
        one, as DDP does (``distopt.parallel.buffers``)."""
        sync = self._sync_next_forward
        self._sync_next_forward = torch.is_grad_enabled() and (
            self._reducer is None or self._reducer.next_pass_reduces()
        )
        if not (sync and self.broadcast_buffers and self.world_size > 1):
            return
        buffers = list(self.module.buffers())
        if not buffers:
            return
        if self._reducer is not None and self._reducer.broken:
            # Its gathers may still be in flight on the group the broadcast would use.
            raise RuntimeError(
                "Invalid forward: the previous backward pass raised after the reduction of "
                "this step's gradients had begun on this rank, so the module's buffers "
                "cannot be broadcast yet (expected step() first: it reduces and applies "
                "the gradients that pass reached, on every rank alike)"
            )
        source = _join.buffers_round(self) if self._join_config.enable else 0
        _buffers.broadcast(buffers, source, self._forward_group)

    def join_hook(self, **kwargs: Any) -> JoinHook:
        """What this optimizer does on a rank that has run out of batches, under
        ``torch.distributed.algorithms.Join([opt])`` (``distopt.parallel.join``): it
        shadows the others' buffer broadcasts and reductions, contributing zero gradients,
        and steps as they do.

        Args:
            divide_by_initial_world_size: True (default): gradients are divided by the world
                size; False: by the number of ranks not yet joined (as DDP's).

        Raises:
            ValueError: the optimizer is closed, or uses ``RoundRobin``, or PowerSGD with
                ``divide_by_initial_world_size=False``.
        """
        return _join.join_hook(self, **kwargs)

    @property
    def join_device(self) -> torch.device:
        """Where Join's own collectives put their tensors."""
        return collective_device(self._forward_group)

    @property
    def join_process_group(self) -> Any:
        """The group of Join's own collectives: this optimizer's, so that they are
        ordered with its reductions."""
        return self._forward_group

    def _shadow_reduction(self, divisor: Optional[int], in_backward: bool) -> None:
        """A joined rank's share of the active ranks' reduction (``distopt.parallel.join``),
        with zero gradients from here: stepping during backward as they do
        (``in_backward``), or leaving the window for ``_shadow_step``."""
        if self._reducer is None:
            return
        if self._closed:
            raise RuntimeError(
                "Invalid Join: this DataParallelOptimizer was closed while the other ranks "
                "still train (expected close() after the Join block)"
            )
        if self._untrained:
            self._check_untrained()
        check_groups(self.param_groups, self._built)
        self._apply_changes()  # the active ranks' hyper-parameters (join._round)
        self._in_backward = in_backward
        self._join_packet = False
        self._rebuild_pending = False  # the active ranks keep theirs while a rank has joined
        for bucket in self._buckets:
            bucket.divisor = divisor
        try:
            self._reducer.shadow()
        finally:
            if in_backward:
                self._reducer.reset()

    def _shadow_step(self, scaling: Optional[Any]) -> None:
        """A joined rank's share of the active ranks' ``step()`` after a shadowed reduction:
        the step, on what they sent (``distopt.parallel.join``), with the GradScaler's
        ``scaling`` or None."""
        try:
            self._apply_changes()
            self._step_all(scaling)
            self._last_step_unscaled = scaling is None
            self._fresh = False
        finally:
            self._reducer.reset()

    # ------------------------------------------------------------ construction

    def _check_same_everywhere(
        self, params: List[Tensor], group_of: List[int], bucket_cap_mb: float,
        outside: List[Tensor],
    ) -> None:
        """Every rank must build the same buckets (one all_gather of a signature), or the
        collectives would pair unlike buckets: DDP refuses mismatched models too. With
        ``module=``, its other parameters and its buffers must match as well (they are
        broadcast)."""
        if self.world_size == 1:
            return
        module = None
        if self.module is not None:
            module = ([(tuple(t.shape), str(t.dtype)) for t in outside],
                      [(tuple(b.shape), str(b.dtype)) for b in self.module.buffers()],
                      self.broadcast_buffers)
        layout = repr((
            [(tuple(p.shape), str(p.dtype), p.requires_grad, str(p.device.type), j)
             for p, j in zip(params, group_of)],
            [sorted((k, repr(v)) for k, v in g.items() if k != "params")
             for g in self.param_groups],
            float(bucket_cap_mb), repr(self.compression), repr(self.sync), self.shard,
            self.backward_passes_per_step, self.optimizer_class.__name__, module,
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
                    f"compression, sync, shard, backward_passes_per_step, optimizer class, "
                    f"module's buffers) differ (expected the same model and arguments on "
                    f"every rank)"
                )

    def _broadcast_parameters(self, tensors: List[Tensor]) -> None:
        """Every rank starts from the group's first rank's parameters (and, with
        ``module=``, buffers), as under DDP."""
        if self.world_size > 1:
            _buffers.broadcast(tensors, 0, self.process_group)


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


def _amp_scaling(opt: Any) -> Optional[Any]:
    """``(grad_scale, found_inf)`` that ``GradScaler.step`` set on ``opt`` for this step
    (``grad_scale`` None once ``scaler.unscale_(opt)`` ran), or None without a scaler."""
    if not hasattr(opt, "found_inf"):
        return None
    found_inf = opt.found_inf
    if not isinstance(found_inf, Tensor):  # 0: the scaler found no gradient to check
        found_inf = torch.tensor(float(found_inf))
    return getattr(opt, "grad_scale", None), found_inf


def _drop_amp_scaling(opt: Any) -> None:
    for name in ("grad_scale", "found_inf"):
        if name in vars(opt):
            delattr(opt, name)


def _forward_pre_hook(call: Callable[[], None]) -> Callable[..., None]:
    def hook(module: torch.nn.Module, args: Any) -> None:
        call()

    return hook


def _abandon(reducer: GradientReducer, private_group: Any) -> None:
    """An optimizer was freed without ``close()``: stop its threads without waiting (the
    exit joins them) and retire its private group, if nothing failed on it."""
    reducer.close(0.0)
    if private_group is not None and reducer._error is None:
        with contextlib.suppress(Exception):  # a peer already gone
            _torch.destroy_private_group(private_group)


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


def _gather(bucket: Bucket, group: Any) -> Any:
    """Start the gather of ``bucket``'s updated pieces on ``group``."""
    with profiler_range("distopt.dp.gather", bucket.index):
        return bucket.shard.gather(group)


def _store(bucket: Bucket, work: Any) -> None:
    if work is None:  # a window that steps in step(), which gathers then
        return
    with profiler_range("distopt.dp.gather.wait", bucket.index):
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
