"""The engine of a DataParallelOptimizer: its buckets, compiled steps and reducer, and one path
through a step.

``DataParallelOptimizer`` is the torch.optim surface (param groups, state_dict, hooks,
Joinable); it holds one ``DataParallelEngine`` and hands it every step. The engine holds:

- the plan: the buckets (``distopt.parallel.buckets``), cut once and again after the first
  step in the order the gradients arrived (``rebuild_at_first_step``), and the compiled
  steps of each (bucket, param group) unit (``distopt.parallel.units``; sharded, of this
  rank's pieces: ``distopt.parallel.shard``);
- the ``GradientReducer`` (``distopt.parallel.reducer``), for which the engine is the one
  sink: ``open_window`` before a window's first bucket is sent, ``reduced`` as each bucket's
  average arrives, and, sharded, ``start_gather`` / ``store_gather``;
- one ``StepStatus`` (``distopt.parallel.status``) in place of flags.

Other modules take the engine, never the optimizer's fields: Join (``shadow_reduction``,
``shadow_step``), the state (``distopt.parallel.state``), checkpoints, teardown.
"""
import logging
import math
import warnings
import weakref
from typing import Any, Dict, List, NamedTuple, Optional

import torch
import torch.distributed as dist
from torch import Tensor

from distopt import _torch
from distopt.param_groups import built_groups, check_groups
from distopt.parallel import buffers as _buffers
from distopt.parallel import join as _join
from distopt.parallel import plan as _plan
from distopt.parallel import shard as _shard
from distopt.parallel import state as _state
from distopt.parallel import teardown
from distopt.parallel import wrapped as _wrapped
from distopt.parallel.amp import eager_step
from distopt.parallel.arguments import check_same_everywhere
from distopt.parallel.buckets import Bucket, assign_buckets, dense_grad
from distopt.parallel.compression import Compression, reduction_for
from distopt.parallel.reducer import GradientReducer
from distopt.parallel.scatter import ReduceScatter
from distopt.parallel.status import StepStatus
from distopt.parallel.sync import RoundRobin, average_, collective_device, partition
from distopt.parallel.units import CompiledUnits
from distopt.profiling import profiler_range

logger = logging.getLogger(__name__)

__all__ = ["DataParallelEngine", "Options"]


class Options(NamedTuple):
    """A DataParallelOptimizer's options, as its constructor checked them."""

    process_group: Any
    rank: int
    world_size: int
    compression: Optional[Compression]
    sync: Optional[RoundRobin]
    overlap: bool
    shard: Optional[str]
    #: Each bucket reduce-scattered into this rank's shard (``distopt.parallel.scatter``).
    shard_gradients: bool
    module: Optional[torch.nn.Module]
    broadcast_buffers: bool
    backward_passes_per_step: int
    cap_bytes: int
    #: The first bucket's cap once the buckets are cut again (DDP's), or None.
    first_cap_bytes: Optional[int]
    rebuild_buckets: bool


#: Where a step is refused before anything changes, in the order they are checked: (what is
#: wrong, as a function of (engine, scaling, stepped in backward, poisoned slot)) -> message.
_REFUSALS = (
    (lambda e, scaling, stepped, poisoned: stepped and scaling is not None,
     "Invalid step: a GradScaler steps this DataParallelOptimizer, but the step before this "
     "one came without it, so this step's buckets were stepped during backward with the "
     "scaled gradients (overlap=True steps buckets during backward once a step() without a "
     "GradScaler has shown the gradients unscaled); from the next step on the step waits for "
     "the scaler (expected the GradScaler from the first step on, or overlap=False)"),
    (lambda e, scaling, stepped, poisoned: scaling is not None and e.reducer.broken,
     "Invalid step: a backward pass raised after this step's reduction had begun, and a "
     "GradScaler checked the gradients for inf/NaN before the rest of them were averaged, so "
     "its verdict may differ between ranks; the step is dropped (expected zero_grad() and "
     "this step's backward again)"),
    (lambda e, scaling, stepped, poisoned: poisoned is not None and not stepped,
     "Invalid step: a backward pass refused since the last step had already added its "
     "gradient to parameter {poisoned}'s .grad before it was refused, so this step's "
     "gradients are no longer the averages; the step is dropped (expected zero_grad() and "
     "this step's backward again)"),
)


class DataParallelEngine:
    """The buckets, compiled steps and reducer of one DataParallelOptimizer (``surface``).

    Args:
        surface: the optimizer, held weakly: its ``param_groups``, ``state`` and hooks are
            the torch.optim surface this engine steps under. When it is freed, its
            finalizers stop the reducer and remove the hooks, and the engine counts as
            closed, though something (a traceback's frames) may still hold the engine.
        options: the checked options.
        eager: the torch.optim optimizer that steps an eager class, else None.
        groups: the param groups as given (each group's options as the user wrote them).
        args, kwargs: the optimizer's arguments.
        outside: ``options.module``'s parameters outside the param groups (broadcast at
            construction, as DDP's).
    """

    def __init__(self, surface: Any, options: Options, eager: Optional[torch.optim.Optimizer],
                 groups: List[Dict[str, Any]], args: Any, kwargs: Dict[str, Any],
                 outside: List[Tensor]) -> None:
        self._surface = weakref.ref(surface)
        self.name = type(surface).__name__
        (self.process_group, self.rank, self.world_size, self.compression, self.sync,
         self.overlap, self.shard, self.shard_gradients, self.module, self.broadcast_buffers,
         self.backward_passes_per_step, self.cap_bytes, self.first_cap_bytes,
         rebuild_buckets) = options
        self.optimizer_class = surface.optimizer_class
        self.hyper_keys = [k for k in surface.param_groups[0] if k != "params"]
        #: A blockwise-quantised class's layout, which the shards' cuts respect (sharded only).
        self.blocks = (_shard.blocks_of(self.optimizer_class, surface.param_groups)
                       if self.shard is not None else None)
        self.eager = eager
        self.status = StepStatus(options.overlap and eager is None)
        self.join = _join.JoinState()
        self.units = CompiledUnits(self.optimizer_class, self.hyper_keys)
        #: What builds the compiled steps: the arguments and each group's options as given.
        self.build_args = (args, kwargs, [{k: v for k, v in g.items() if k != "params"}
                                          for g in groups])
        self.comm_group: Any = None  # where the communication thread issues
        self.reducer: Optional[GradientReducer] = None
        self.consolidated: Optional[Any] = None
        self.warned_late_change = False
        self.warned_residuals = False
        self.round = 0
        self.forward_hook: Any = None
        self.sync_next_forward = True
        self._cut(outside)
        self.built = built_groups(self.name, self.param_groups, self.hyper_keys,
                                  self.optimizer_class)
        self._start(rebuild_buckets)

    # ------------------------------------------------------------ construction

    def _cut(self, outside: List[Tensor]) -> None:
        """The buckets, checked alike on every rank, and the parameters broadcast."""
        all_params = [p for g in self.param_groups for p in g["params"]]
        self.group_of = [j for j, g in enumerate(self.param_groups) for _ in g["params"]]
        trained = [i for i, p in enumerate(all_params) if p.requires_grad]
        self.untrained = [(i, p) for i, p in enumerate(all_params) if not p.requires_grad]
        teardown.take_over(all_params)
        # not yet bound to buckets
        self.scheme = ReduceScatter() if self.shard_gradients else reduction_for(self.compression)
        self.reduction = self.scheme
        self.buckets = assign_buckets([all_params[i] for i in trained], trained, self.cap_bytes)
        #: Global index -> parameter, for every parameter in a bucket.
        self.bucketed = {i: p for b in self.buckets for i, p in zip(b.positions, b.params)}
        if self.compression is not None:
            self.compression.check_params(
                (f"parameter {i} (shape {tuple(all_params[i].shape)})", all_params[i])
                for i in trained)
        self._prepare_buckets()
        check_same_everywhere(self, all_params, self.group_of, self.cap_bytes, outside)
        if self.world_size > 1:  # as DDP: the module's other parameters and buffers too
            module = self.module
            _buffers.broadcast(all_params + outside + (
                list(module.buffers()) if module is not None and self.broadcast_buffers else []
            ), 0, self.process_group)
        self._compile_units()
        if self.sync is not None:
            self.trained = [all_params[i] for i in trained]
            self.partitions = partition(self.trained, self.sync.k)

    def _start(self, rebuild_buckets: bool) -> None:
        """The reducer and its group, the claims, the hooks and the records."""
        group = self.process_group
        if self.sync is None and self.buckets:
            # The communication thread issues on a group of its own, so that collectives of
            # other threads (another optimizer, SyncBatchNorm's backward) cannot interleave;
            # a group the user gives must be this optimizer's alone.
            if group is None and self.world_size > 1:
                self.comm_group = _torch.private_group()
            else:
                teardown.check_group_unshared(group)
                self.comm_group = group
            self.reduction = self.scheme.bound(self.comm_group, self.rank, self.world_size,
                                               self.buckets)
            self.reducer = self._new_reducer(record=rebuild_buckets)
        self.status.rebuild_pending = rebuild_buckets and self.reducer is not None
        all_params = [p for g in self.param_groups for p in g["params"]]
        weakref.finalize(self.surface, _freed, self.status)
        teardown.claim(all_params, self)
        _wrapped.register(self)  # a DDP built over these parameters later is refused
        if self.reducer is not None:
            teardown.close_at_exit(self.close)
            self._watch()
        #: Where this optimizer's collectives outside backward go (buffers, Join's rounds):
        #: the communication thread's group, idle between steps (``distopt.parallel.join``).
        self.forward_group = self.comm_group if self.comm_group is not None else group
        if self.module is not None:
            call = teardown.weak_call(self.before_forward)
            self.forward_hook = self.module.register_forward_pre_hook(
                _outside_graphs(lambda _m, _a: call()))
            # On the optimizer: an engine kept alive by a traceback stops forwarding too.
            weakref.finalize(self.surface, self.forward_hook.remove)
        _join.register(self)
        #: What each trained parameter was at construction (``check_params_unchanged``).
        self.param_records = [(i, p, p.dtype, p.device, p.shape, p.stride())
                              for i, p in sorted(self.bucketed.items())]

    def _prepare_buckets(self) -> None:
        """What each bucket needs of the compression: its check, its residual."""
        for bucket in self.buckets:
            if self.compression is not None:
                self.compression.check_bucket(bucket)
            if self.reduction.error_feedback:
                bucket.residual = torch.zeros_like(bucket.buffer[:bucket.numel])

    def _compile_units(self) -> None:
        """The shards and one compiled step per (bucket, param group)."""
        if self.shard is not None:
            _shard.attach(self.buckets, self.world_size, self.rank, self.shard,
                          self.optimizer_class, self.blocks)
        args, kwargs, options = self.build_args
        self.reduction.prepare(self.buckets)
        units, of_group = _plan.cut_units(self.buckets, self.group_of, self.shard, options,
                                          len(self.param_groups), self.blocks is not None)
        self.units.compile(units if self.eager is None else [], of_group, args, kwargs,
                           self.param_groups)

    def _new_reducer(self, record: bool = False) -> GradientReducer:
        gathers = self.shard is not None and self.overlap and self.eager is None
        return GradientReducer(
            self.buckets, self.reduction, self.comm_group, self.rank, self.world_size,
            self.backward_passes_per_step, self, gathers, record_arrival=record)

    def _watch(self) -> None:
        """The optimizer dropped without close(): stop the threads, retire the private
        group, and count as closed (an engine a traceback still holds does nothing more)."""
        private = self.comm_group if self.comm_group is not self.process_group else None
        self.dropped = teardown.on_drop(self.surface, _abandon, self.reducer, private,
                                        self.status)

    # ------------------------------------------------------------ the surface's

    @property
    def surface(self) -> Any:
        """The optimizer itself (RuntimeError once it has been freed)."""
        surface = self._surface()
        if surface is None:
            raise RuntimeError(
                f"Invalid use of a freed {self.name}: its engine outlived it (held by a "
                f"traceback, say), and it is closed (expected a live optimizer)")
        return surface

    @property
    def param_groups(self) -> List[Dict[str, Any]]:
        """The optimizer's param groups."""
        return self.surface.param_groups

    def bucket_layout(self) -> List[List[int]]:
        """The buckets, in reduction order, as the global indices of their parameters."""
        return [list(b.positions) for b in self.buckets]

    def gradient_bytes(self) -> int:
        """The bytes of gradient memory this rank holds now: the buckets' buffers (released
        ones hold none), the gradient shards, and each ``.grad`` of a bucketed parameter that
        lies elsewhere; each storage counted once."""
        tensors = [b.buffer for b in self.buckets]
        tensors += [b.shard.grad_part for b in self.buckets
                    if b.shard is not None and b.shard.grad_part is not None]
        tensors += [p.grad for p in self.bucketed.values() if p.grad is not None]
        storages = {}
        for t in tensors:
            storage = t.untyped_storage()
            if storage.nbytes():
                storages[storage.data_ptr()] = storage.nbytes()
        return sum(storages.values())

    def apply_changes(self) -> bool:
        """Send hyper-parameters changed in ``param_groups`` to the compiled steps."""
        return self.units.apply_changes(self.param_groups)

    # ------------------------------------------------------------ the reducer's sink

    def open_window(self) -> None:
        """Before a window's first bucket is sent (backward's thread, or ``step()``): every
        check, the hyper-parameters, where the buckets step, and Join's round."""
        self.check_untrained()  # before any bucket is sent or stepped
        self.check_params_unchanged()
        check_groups(self.param_groups, self.built)
        self.apply_changes()
        self.status.in_backward = self.status.steps_in_backward()
        # Under Join: the round that tells joined ranks to shadow this reduction.
        divisor, self.join.packet = None, False
        if _torch.join_enabled(self.surface):
            divisor, self.join.packet = _join.reduction_round(self, self.status.in_backward)
        for bucket in self.buckets:
            bucket.divisor = divisor

    def reduced(self, bucket: Bucket, unused: List[int]) -> None:
        """A bucket's average arrived (the finishing thread): stepped now, during backward,
        if this window's buckets step there."""
        bucket.unused = unused
        self.reduction.settle(bucket, unused)
        if self.status.in_backward:
            self.step_bucket(bucket)
        bucket.mark_stepped()  # what a change of .grad before step() is measured from
        if bucket is self.buckets[-1] and not self.status.in_backward:
            self.reduction.window_reduced(self.buckets)

    def start_gather(self, bucket: Bucket) -> Any:
        """Sharded (the communication thread): start the gather of a bucket stepped during
        backward, or None."""
        if not self.status.in_backward:
            return None
        return _shard.gather(bucket, self.comm_group)

    def store_gather(self, bucket: Bucket, pending: Any) -> None:
        """Sharded (the finishing thread): the gathered parameters into place."""
        _shard.store(bucket, pending)

    # ------------------------------------------------------------ step()

    def step(self, scaling: Optional[Any]) -> None:
        """``step()`` after the closure: refusals first, then one path."""
        # Also here: the reduction's own check, at its start, precedes the gradients of
        # the parameters backward reaches last.
        self.check_untrained()
        if self.status.closed:
            raise RuntimeError(
                "Invalid step: this DataParallelOptimizer is closed (by close(), its `with` "
                "block, or a newer DataParallelOptimizer over the same parameters)"
            )
        # Before anything is completed or stepped: restored, the next step() finishes this one.
        check_groups(self.param_groups, self.built)
        if self.sync is not None:
            self.check_params_unchanged()  # no reduction checked them
            self._local_step_and_average(scaling)
            self.status.stepped(scaling is not None)
            return
        if self.reducer is None:
            return
        if scaling is not None and not self.reducer.reducing:
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
        self.reducer.complete()
        try:
            self._finish_window(scaling)
        finally:
            self.reducer.reset()
        self.status.fresh = False
        if self.status.rebuild_pending:
            if self.join.packet:  # a rank has joined: it cannot follow; every rank keeps them
                self.status.rebuild_pending = False
            else:
                self.rebuild_at_first_step()

    def _finish_window(self, scaling: Optional[Any]) -> None:
        """The reduced window: refused (``_REFUSALS``), or its buckets stepped if backward
        did not step them."""
        stepped, poisoned = self.status.in_backward, self.reducer.poisoned
        if stepped and scaling is not None:  # refused below: the next step waits for it
            self.status.stepped(scaled=True)
        self.reduction.before_step(scaling)
        for refused, message in _REFUSALS:
            if refused(self, scaling, stepped, poisoned):
                raise RuntimeError(message.format(poisoned=poisoned))
        if stepped and poisoned is None and not self.reducer.broken:
            self._check_grads_kept()
        if self.apply_changes() and stepped and not self.warned_late_change:
            self.warned_late_change = True
            warnings.warn(
                "DataParallelOptimizer: param_groups changed after this step's reduction "
                "began; with overlap=True its buckets were stepped during backward with the "
                "previous values, and the new ones apply from the next step (change "
                "hyper-parameters before backward, e.g. scheduler.step() after opt.step(), "
                "or build with overlap=False)",
                stacklevel=4,
            )
        if not stepped:
            # A cast between backward and step() (the reduction checked them before).
            self.check_params_unchanged()
            if self.join.packet:  # some rank has joined: what this step reads
                _join.send_step(self, scaling)
            # After Join's packet: a joined rank agrees in its shadow of this step.
            self.agree_grad_edits(own=poisoned is None)
            self.step_all(scaling)
        self.status.stepped(scaling is not None)

    def step_all(self, scaling: Optional[Any] = None) -> None:
        """Step every bucket after backward (a step that waited for ``step()``)."""
        if self.eager is None:
            for bucket in self.buckets:
                self._take_user_grads(bucket)
                self.step_bucket(bucket, scaling)
        elif self.shard is None:
            eager_step(self.eager, scaling)
        else:
            _shard.step_own(self.buckets, lambda: eager_step(self.eager, scaling))
        if self.shard is not None:  # after a skipped step too: every rank gathers alike
            _shard.gather_all(self.buckets, self.comm_group)

    def step_bucket(self, bucket: Bucket, scaling: Optional[Any] = None) -> None:
        """The compiled steps of one bucket (sharded: this rank's pieces)."""
        with profiler_range("distopt.dp.step", bucket.index):
            unused = set(bucket.unused)
            if self.shard is not None:
                bucket.shard.load()
            for u, slots, grads in bucket.units:
                if unused:
                    grads = [None if s in unused else g for s, g in zip(slots, grads)]
                self.units.step(u, grads, scaling)

    def _take_user_grads(self, bucket: Bucket) -> None:
        """Step the ``.grad`` the user left after backward, as torch.optim would (None:
        skipped)."""
        skipped = self.reduction.take_user_grads(bucket)
        if skipped:
            bucket.unused = sorted(set(bucket.unused) | set(skipped))

    def _local_step_and_average(self, scaling: Optional[Any] = None) -> None:
        """``RoundRobin``: step on this rank's gradients (under a GradScaler, each rank's
        scaler checks its own), then average one partition."""
        if self.eager is not None:
            eager_step(self.eager, scaling)
        else:
            self.apply_changes()
            for bucket in self.buckets:
                with profiler_range("distopt.dp.step", bucket.index):
                    for u, slots, _ in bucket.units:
                        self.units.step(u, [dense_grad(bucket, s) for s in slots], scaling)
        members = self.partitions[self.round % self.sync.k]
        self.round += 1
        if not members:
            return
        params = [self.trained[m] for m in members]
        tensors = [p.data for p in params] + self._shaped_state(params)
        average_(tensors, self.process_group, self.world_size)

    def _shaped_state(self, params: List[Tensor]) -> List[Tensor]:
        """The state tensors shaped like their parameter (the step count is not one)."""
        if self.eager is not None:
            entries = [self.eager.state.get(p, {}) for p in params]
        else:
            state = self.units.torch_state(copy=False)
            index = {id(p): i for i, p in self.bucketed.items()}
            entries = [state.get(index[id(p)], {}) for p in params]
        return [v for p, entry in zip(params, entries) for k, v in entry.items()
                if k != "step" and isinstance(v, Tensor) and v.shape == p.shape
                and (v.is_floating_point() or v.is_complex())]

    # ------------------------------------------------------------ checks

    def _edited_grads(self) -> List[int]:
        """The parameters (global indices) whose ``.grad`` was replaced, set to None or
        changed in place since their bucket was reduced in this window."""
        return sorted(i for b in self.buckets if b.changed_since_step() for i in b.positions)

    def agree_grad_edits(self, own: bool = True) -> None:
        """A step that waited for ``step()``: if the loop changed ``.grad`` after the
        reduction on any rank (clipping, a scaling), every later step waits too
        (``Overlap.GRADS_EDITED``). Every rank decides alike (one all_reduce of one flag,
        only while undecided: sharded, where each bucket steps orders the gathers, and ranks
        that disagreed would issue them in another order). ``own=False``: this rank's
        gradients are not the loop's (a rank that has joined under Join, a poisoned
        window), it takes part with no edits."""
        if self.status.overlap.final():
            return
        edited = self._edited_grads() if own else []
        anywhere = bool(edited)
        if self.world_size > 1:
            flag = torch.tensor([1 if edited else 0], dtype=torch.int64,
                                device=collective_device(self.forward_group))
            dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.forward_group)
            anywhere = bool(flag.item())
        if anywhere:
            self.status.grads_edited()
            logger.info(
                "rank %d: the .grad of parameters %s changed between backward and step() "
                "on some rank (clipping, a scaling): every later step waits for step() too, "
                "and steps what .grad holds then", self.rank, edited[:10])

    def _check_grads_kept(self) -> None:
        """A ``.grad`` changed after backward stepped its bucket cannot be applied."""
        changed = self._edited_grads()
        if changed:
            # The plan is not changed here: only this rank knows (see agree_grad_edits).
            raise RuntimeError(
                f"Invalid step: the .grad of parameters {changed[:10]}"
                f"{'...' if len(changed) > 10 else ''} changed between backward and step() "
                f"(replaced, set to None, or changed in place: torch.nn.utils.clip_grad_norm_,"
                f" zero_grad(), a scaling), but the first step changed none, so with "
                f"overlap=True this step's buckets were stepped during backward with the "
                f"averaged gradients and the change is not applied (expected the same "
                f"changes from the first step on: then every step waits for step() and "
                f"steps what .grad holds; or DataParallelOptimizer(..., overlap=False))"
            )

    def check_params_unchanged(self) -> None:
        """Refuse a parameter cast, moved or re-laid out after construction (``model.double()``,
        ``.to(memory_format=...)`` when sharded), before anything is sent or stepped: its
        gradient bucket (and, sharded, its state's pieces) were cut for what it was.
        Unsharded, a new memory order is stepped as torch.optim steps it."""
        for i, p, dtype, device, shape, stride in self.param_records:
            if p.dtype == dtype and p.device == device and p.shape == shape and (
                self.shard is None or p.stride() == stride  # unsharded steps any layout
            ):
                continue
            if p.dtype != dtype or p.device != device or p.shape != shape:
                now = f"{p.dtype} on {p.device}, shape {tuple(p.shape)}"
                was = f"{dtype} on {device}, shape {tuple(shape)}"
                how = "cast, moved or replaced (model.double(), .half(), .to(...))"
            else:
                now, was = f"strides {p.stride()}", f"strides {stride}"
                how = ("laid out anew (model.to(memory_format=torch.channels_last)), and "
                       f"with shard={self.shard!r} its state's pieces follow the memory order "
                       f"it had")
            raise RuntimeError(
                f"Invalid parameter {i}: it is now {now}, but it was {was} when this "
                f"DataParallelOptimizer was built: the model was {how} after the optimizer "
                f"was built, and its gradient bucket was cut for what it was; nothing was "
                f"sent or stepped (expected the change before DataParallelOptimizer(...), or "
                f"close() and a new optimizer)"
            )

    def check_untrained(self) -> None:
        """Refuse a gradient on a parameter that was frozen at construction."""
        late = [i for i, p in self.untrained if p.requires_grad and p.grad is not None]
        if late:
            raise RuntimeError(
                f"Invalid step: parameters {late} have gradients but had requires_grad=False "
                f"when this DataParallelOptimizer was built, so they are in no bucket and "
                f"would never be averaged or stepped (expected a new DataParallelOptimizer, "
                f"after close() of this one, once they are unfrozen)"
            )

    # ------------------------------------------------------------ clipping

    def clip_grad_norm_(self, max_norm: float, norm_type: float, error_if_nonfinite: bool,
                        foreach: Optional[bool]) -> Tensor:
        """``DataParallelOptimizer.clip_grad_norm_``."""
        check_groups(self.param_groups, self.built)
        # In torch.optim's order (the param groups'), not the buckets': the norm is summed in
        # the order torch.nn.utils.clip_grad_norm_(model.parameters()) sums it, bit for bit.
        params = [self.bucketed[i] for i in sorted(self.bucketed)]
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
        if self.reducer is not None and self.reducer.reducing and self.status.in_backward:
            raise RuntimeError(
                "Invalid clip_grad_norm_: with overlap=True and no clipping in the first "
                "step, this step's buckets were stepped during backward, as soon as their "
                "gradients were averaged, so there is nothing left to clip (expected "
                "clipping from the first step on: then every step waits for step() and is "
                "clipped; or DataParallelOptimizer(..., overlap=False))"
            )
        if self.reducer is not None:
            self.reducer.complete()
        return self.reduction.clip_grad_norm_(self.buckets, params, max_norm, norm_type,
                                              error_if_nonfinite, foreach)

    # ------------------------------------------------------------ Join

    def shadow_reduction(self, divisor: Optional[int], in_backward: bool) -> None:
        """A joined rank's share of the active ranks' reduction, with zero gradients."""
        if self.reducer is None:
            return
        if self.status.closed:
            raise RuntimeError(
                "Invalid Join: this DataParallelOptimizer was closed while the other ranks "
                "still train (expected close() after the Join block)"
            )
        self.check_untrained()
        check_groups(self.param_groups, self.built)
        self.apply_changes()  # the active ranks' hyper-parameters (join._round)
        self.status.in_backward = in_backward
        self.join.packet = False
        self.status.rebuild_pending = False  # the active ranks keep theirs while one has joined
        for bucket in self.buckets:
            bucket.divisor = divisor
        try:
            self.reducer.shadow()
        finally:
            if in_backward:
                self.reducer.reset()
                self.status.generation += 1  # stepped during the shadowed backward

    def shadow_step(self, scaling: Optional[Any]) -> None:
        """A joined rank's share of the active ranks' ``step()``, on what they sent."""
        try:
            self.apply_changes()
            self.agree_grad_edits(own=False)  # as the active ranks decide, after this packet
            self.step_all(scaling)
            self.status.stepped(scaling is not None)
            self.status.fresh = False
        finally:
            self.reducer.reset()
            self.status.generation += 1

    def consolidate(self, to: Optional[int]) -> None:
        """``consolidate_state_dict(to)``: the whole state onto rank ``to`` (None: every
        rank), kept with the generation it was taken at."""
        state = _state.state_dict(self, gather=True)
        self.consolidated = (
            (self.status.generation, state) if to is None or to == self.rank else None
        )

    # ------------------------------------------------------------ buckets cut again

    def rebuild_at_first_step(self) -> None:
        """The end of the first step: cut the buckets again in the order the gradients
        arrived, as DDP does (unless the compression's state cannot follow)."""
        self.status.rebuild_pending = False
        carried = self.reduction.carried_state()
        if carried is False:  # the same on every rank: its state is the same shape
            logger.info("rank %d: buckets kept in registration order (%r holds state per "
                        "bucket)", self.rank, self.reduction)
            return
        order = _plan.arrival_order(self.reducer.take_arrivals(), self.buckets,
                                    self.world_size, self.forward_group)
        new = assign_buckets([self.bucketed[i] for i in order], order, self.cap_bytes,
                             order, self.first_cap_bytes)
        if [b.positions for b in new] == self.bucket_layout():
            return
        reduction = self.scheme.bound(self.comm_group, self.rank, self.world_size, new)
        if carried is not None:
            reduction.checked_loader(carried)()
        self.rebuild_buckets(new, reduction)
        logger.info("rank %d: buckets rebuilt in gradient arrival order: %d buckets, the "
                    "first of %d parameters", self.rank, len(new), len(new[0].params))

    def rebuild_buckets(self, new: List[Bucket], reduction: Compression) -> None:
        """Replace the buckets by ``new`` (reduced by ``reduction``), carrying the optimizer
        state, the residuals and each ``.grad`` that was a view of its bucket over unchanged.
        Between steps only (a collective, when sharded)."""
        state = self._whole_state()
        residuals = _state.residuals(self)
        views = {id(g) for b in self.buckets for g in b.grads}
        self.reducer.close()
        self.dropped.detach()
        self.buckets = new
        self.reduction = reduction
        self._prepare_buckets()
        for b in new:
            for p, view in zip(b.params, b.grads):
                if p.grad is not None and id(p.grad) in views:
                    with torch.no_grad():
                        view.copy_(p.grad)
                    p.grad = view
        _state.put_residuals(self, residuals)
        self._compile_units()
        if self.units.steps is not None:
            if self.shard is not None:
                state = _shard.own_pieces_of(self, state, list(range(max(self.bucketed) + 1)))
            self.units.load(self.param_groups, state)
        elif self.eager is not None and self.shard is not None:
            own = set(_shard.piece_index(self.buckets))
            for i, p in self.bucketed.items():
                self.eager.state.pop(p, None)
                if i in own and i in state:
                    self.eager.state[p] = {
                        k: v.to(p.device) if isinstance(v, Tensor) else v
                        for k, v in state[i].items()
                    }
        self.reducer = self._new_reducer()
        self._watch()

    def _whole_state(self) -> Dict[int, Dict[str, Any]]:
        """The optimizer state by global index, whole (sharded: gathered, a collective)."""
        if self.status.fresh:
            return {}  # no state on any rank: nothing to gather
        if self.eager is None:
            # A sharded rank may hold no pieces (no compiled steps), yet it joins the
            # gather, and may hold pieces after the rebuild.
            state = self.units.torch_state(copy=False)
            return _shard.gathered_state(self, state) if self.shard is not None else state
        if self.shard is None:
            return {}
        ids = {id(p): i for i, p in self.bucketed.items()}
        return _shard.gathered_state(
            self, {ids[id(p)]: dict(v) for p, v in self.eager.state.items() if id(p) in ids})

    # ------------------------------------------------------------ forward, close

    def before_forward(self) -> None:
        """``module``'s forward pre-hook: the buffers broadcast, as DDP does."""
        sync = self.sync_next_forward
        self.sync_next_forward = torch.is_grad_enabled() and (
            self.reducer is None or self.reducer.next_pass_reduces()
        )
        if not (sync and self.broadcast_buffers and self.world_size > 1):
            return
        buffers = list(self.module.buffers())
        if not buffers:
            return
        if self.reducer is not None and self.reducer.broken:
            # Its gathers may still be in flight on the group the broadcast would use.
            raise RuntimeError(
                "Invalid forward: the previous backward pass raised after the reduction of "
                "this step's gradients had begun on this rank, so the module's buffers "
                "cannot be broadcast yet (expected step() first: it reduces and applies "
                "the gradients that pass reached, on every rank alike)"
            )
        source = _join.buffers_round(self) if _torch.join_enabled(self.surface) else 0
        _buffers.broadcast(buffers, source, self.forward_group)

    def close(self, timeout_s: Optional[float] = None) -> bool:
        """Remove the hooks and stop the threads, waiting up to ``timeout_s`` for each;
        whether they stopped with no collective failed (only then is the private group
        destroyed)."""
        self.status.closed = True
        if self.forward_hook is not None:
            self.forward_hook.remove()
        if self.reducer is None:
            return True
        self.dropped.detach()
        stopped = self.reducer.close(timeout_s)
        if stopped:
            teardown.release_private(self)
            self.forward_group = self.process_group
        return stopped


#: Why the buffers' broadcast stays out of torch.compile's graphs (dynamo prints it where
#: ``fullgraph=True`` cannot break the graph there).
_OUTSIDE_GRAPHS = (
    "distopt: DataParallelOptimizer(..., module=model) broadcasts model's buffers before each "
    "forward, a collective that runs outside any compiled graph; with "
    "torch.compile(model, fullgraph=True) pass the compiled module instead: "
    "compiled = torch.compile(model, fullgraph=True); "
    "DataParallelOptimizer(..., module=compiled) (or compile with fullgraph=False)"
)


def _outside_graphs(hook: Any) -> Any:
    """``hook`` run eagerly where torch.compile traces the module it is registered on: a
    graph break (and, with ``fullgraph=True``, dynamo's error with ``_OUTSIDE_GRAPHS``).
    Imports torch's compiler stack (about 1 s, once per process)."""
    try:
        return torch.compiler.disable(hook, reason=_OUTSIDE_GRAPHS)
    except TypeError:  # a torch whose disable() takes no reason
        return torch.compiler.disable(hook)


def _freed(status: StepStatus) -> None:
    """The optimizer was freed: its engine, if something still holds it, is closed."""
    status.closed = True


def _abandon(reducer: GradientReducer, private_group: Any, status: StepStatus) -> None:
    """An optimizer was freed without ``close()``: stop its threads, retire its group."""
    status.closed = True
    reducer.close(0.0)
    if private_group is not None and reducer.failed is None:
        teardown.retire(private_group)

