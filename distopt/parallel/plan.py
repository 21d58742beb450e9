"""The step plan: where each bucket of a DataParallelOptimizer steps.

Buckets and compiled steps are cut once (``_plan_units``) and again after the first step,
in the order the gradients arrived (``_rebuild_at_first_step``). Each window decides before
its first bucket is sent (``_before_reduction``) whether its buckets step during backward
(``_next_plan``) or in ``step()`` (``_step_all``); sharded, on this rank's pieces only.
"""
import logging
import weakref
from typing import Any, Callable, Dict, List, Optional

import torch
import torch.distributed as dist
from torch import Tensor

from distopt.parallel import buffers as _buffers
from distopt.parallel import join as _join
from distopt.parallel import shard as _shard
from distopt.parallel.buckets import Bucket, assign_buckets
from distopt.parallel.compression import Compression
from distopt.parallel.reducer import GradientReducer
from distopt.parallel.state import DataParallelState
from distopt.parallel.sync import average_, collective_device
from distopt.param_groups import check_groups
from distopt.profiling import profiler_range
from functional._kernels import unscale_gradients

logger = logging.getLogger(__name__)

__all__ = ["StepPlan", "amp_scaling", "drop_amp_scaling", "weak_call"]


class StepPlan(DataParallelState):
    """``DataParallelOptimizer``'s buckets, compiled steps and where each bucket steps."""

    def _prepare_buckets(self) -> None:
        """What each bucket needs of the compression: its check, its residual."""
        for bucket in self._buckets:
            if self.compression is not None:
                self.compression.check_bucket(bucket)
            if self._codec.error_feedback:
                bucket.residual = torch.zeros_like(bucket.buffer[:bucket.numel])

    def _plan_units(self) -> None:
        """The shards and one compiled step per (bucket, param group)."""
        shard, group_of = self.shard, self._group_of
        if shard is not None:
            _shard.attach(self._buckets, self.world_size, self.rank, shard, self.optimizer_class)
        args, kwargs, options = self._ctor
        self._units_of_group: List[List[int]] = [[] for _ in self.param_groups]
        units: List[Any] = []
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
                self._units_of_group[j].append(len(units))
                units.append(([t for _, t, _ in ms], [bucket.positions[k] for k, _, _ in ms],
                              options[j]))
                bucket.units.append((len(units) - 1, [k for k, _, _ in ms], [g for _, _, g in ms]))
        self._compile(units if self._eager is None else [], args, kwargs)

    def _new_reducer(self, record: bool = False) -> GradientReducer:
        gathers = self.shard is not None and self.overlap and self._eager is None
        return GradientReducer(
            self._buckets, self._codec, self._comm_group, self.rank, self.world_size,
            self.backward_passes_per_step,
            weak_call(self._before_reduction), weak_call(self._on_reduced),
            weak_call(self._gather_stepped) if gathers else None,
            _shard.store if gathers else None,
            record_arrival=record,
        )

    def _arrival_order(self) -> List[int]:
        """The first step's arrival order (global indices) on the group's first rank, then
        the parameters whose gradient did not arrive; every rank takes it (one broadcast)."""
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
        ``where`` where it cannot be."""
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
        """The end of the first step: cut the buckets again in the order the gradients
        arrived, as DDP does (unless the compression's state cannot follow)."""
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
        state, the residuals and each ``.grad`` that was a view of its bucket over unchanged.
        Between steps only (a collective, when sharded)."""
        state: Dict[int, Dict[str, Any]] = {}
        if self._fresh:
            pass  # no state on any rank: nothing to gather
        elif self._eager is None:
            # Compiled. A sharded rank may hold no pieces (no compiled steps), yet it joins
            # the gather, and may hold pieces after the rebuild.
            state = self._local.torch_state(copy=False) if self._local is not None else {}
            if self.shard is not None:
                state = _shard.gathered_state(self, state)
        elif self._eager is not None and self.shard is not None:
            ids = {id(p): i for i, p in self._bucketed.items()}
            state = _shard.gathered_state(
                self, {ids[id(p)]: dict(v) for p, v in self._eager.state.items() if id(p) in ids}
            )
        residuals = self._residuals()
        views = {id(g) for b in self._buckets for g in b.grads}
        self._reducer.close()
        self._dropped.detach()
        self._buckets = new
        self._codec = codec
        self._prepare_buckets()
        for b in new:
            for p, view in zip(b.params, b.grads):
                if p.grad is not None and id(p.grad) in views:
                    with torch.no_grad():
                        view.copy_(p.grad)
                    p.grad = view
        self._put_residuals(residuals)
        self._plan_units()
        if self._local is not None:
            if self.shard is not None:
                state = _shard.own_pieces_of(self, state, list(range(max(self._bucketed) + 1)))
            self._load_units(self.param_groups, state)
        elif self._eager is not None and self.shard is not None:
            own = set(_shard.piece_index(self._buckets))
            for i, p in self._bucketed.items():
                self._eager.state.pop(p, None)
                if i in own and i in state:
                    self._eager.state[p] = {
                        k: v.to(p.device) if isinstance(v, Tensor) else v
                        for k, v in state[i].items()
                    }
        self._reducer = self._new_reducer()
        self._watch()

    def _next_plan(self) -> bool:
        """Whether the next window's buckets step as they arrive, during backward.

        A GradScaler's ``scale(loss)`` cannot be seen from here, and a bucket stepped before
        the scaler's inf/NaN check would apply scaled gradients. So they do only with
        ``overlap=True``, a compiled class, and after a ``step()`` that came without a
        GradScaler (``GradScaler.step`` hands this optimizer ``grad_scale`` and
        ``found_inf``): the first step, and every step a scaler takes, wait for ``step()``,
        while the reductions still overlap backward. Nor once a step that waited has found
        ``.grad`` changed after its reduction on some rank (``torch.nn.utils.clip_grad_norm_``
        between backward and ``step()``, ``_agree_grad_edits``): the loop edits gradients,
        so every later step waits for ``step()`` and steps what ``.grad`` then holds, as
        torch.optim does.
        """
        return (self.overlap and self._eager is None and self._last_step_unscaled
                and not self._grads_edited)

    def _steps_in_backward(self) -> bool:
        """Whether this window's buckets step (or will step) during backward."""
        if self._reducer is not None and self._reducer.reducing:
            return self._in_backward
        return self._next_plan()

    def _edited_grads(self) -> List[int]:
        """The parameters (global indices) whose ``.grad`` was replaced, set to None or
        changed in place since their bucket was reduced in this window."""
        return sorted(i for b in self._buckets if b.changed_since_step() for i in b.positions)

    def _agree_grad_edits(self, own: bool = True) -> None:
        """A step that waited for ``step()``: if the loop changed ``.grad`` after the
        reduction on any rank (clipping, a scaling), every later step waits too
        (``_next_plan``). Every rank decides alike (one all_reduce of one flag, only while
        undecided: sharded, where each bucket steps orders the gathers, and ranks that
        disagreed would issue them in another order). ``own=False``: this rank's gradients
        are not the loop's (a rank that has joined under Join, a poisoned window), it takes
        part with no edits."""
        if self._grads_edited or not self.overlap or self._eager is not None:
            return
        edited = self._edited_grads() if own else []
        anywhere = bool(edited)
        if self.world_size > 1:
            flag = torch.tensor([1 if edited else 0], dtype=torch.int64,
                                device=collective_device(self._forward_group))
            dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self._forward_group)
            anywhere = bool(flag.item())
        if anywhere:
            self._grads_edited = True
            logger.info(
                "rank %d: the .grad of parameters %s changed between backward and step() "
                "on some rank (clipping, a scaling): every later step waits for step() too, "
                "and steps what .grad holds then", self.rank, edited[:10])

    def _check_grads_kept(self) -> None:
        """A ``.grad`` changed after backward stepped its bucket cannot be applied."""
        changed = self._edited_grads()
        if changed:
            # The plan is not changed here: only this rank knows (see _agree_grad_edits).
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

    def _record_params(self) -> None:
        """Remember each trained parameter's dtype, device, shape and strides."""
        self._param_records = [(i, p, p.dtype, p.device, p.shape, p.stride())
                               for i, p in sorted(self._bucketed.items())]

    def _check_params_unchanged(self) -> None:
        """Refuse a parameter cast, moved or re-laid out after construction (``model.double()``,
        ``.to(memory_format=...)`` when sharded), before anything is sent or stepped: its
        gradient bucket (and, sharded, its state's pieces) were cut for what it was.
        Unsharded, a new memory order is stepped as torch.optim steps it."""
        for i, p, dtype, device, shape, stride in self._param_records:
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
        self._check_untrained()  # before any bucket is sent or stepped
        self._check_params_unchanged()
        check_groups(self.param_groups, self._built)
        self._apply_changes()
        self._in_backward = self._next_plan()  # before the window's first bucket is sent
        # Under Join: the round that tells joined ranks to shadow this reduction.
        divisor, self._join_packet = None, False
        if self._join_config.enable:
            divisor, self._join_packet = _join.reduction_round(self, self._in_backward)
        for bucket in self._buckets:
            bucket.divisor = divisor

    def _on_reduced(self, bucket: Bucket, unused: List[int]) -> None:
        bucket.unused = unused
        if self._in_backward:
            self._step_bucket(bucket)
        bucket.mark_stepped()  # what a change of .grad before step() is measured from

    def _gather_stepped(self, bucket: Bucket) -> Any:
        """Start the gather of a bucket stepped during backward (sharded), else None."""
        if not self._in_backward:
            return None
        return _shard.gather(bucket, self._comm_group)

    def _step_bucket(self, bucket: Bucket, scaling: Optional[Any] = None) -> None:
        with profiler_range("distopt.dp.step", bucket.index):
            unused = set(bucket.unused)
            if self.shard is not None:
                bucket.shard.load()
            for u, slots, grads in bucket.units:
                if unused:
                    grads = [None if s in unused else g for s, g in zip(slots, grads)]
                self._step_unit(u, grads, scaling)

    def _step_unit(self, unit: int, grads: List[Optional[Tensor]], scaling: Optional[Any]) -> None:
        """One compiled step of one (bucket, param group), under ``scaling`` if not None."""
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
            _shard.step_own(self._buckets, lambda: self._eager_step(scaling))
        if self.shard is not None:  # after a skipped step too: every rank gathers alike
            _shard.gather_all(self._buckets, self._comm_group)

    def _eager_step(self, scaling: Optional[Any] = None) -> None:
        """The eager optimizer's step; under a GradScaler as the scaler would step it."""
        inner = self._eager
        if scaling is None:
            inner.step()
        elif getattr(inner, "_step_supports_amp_scaling", False):
            inner.grad_scale, inner.found_inf = scaling
            try:
                inner.step()
            finally:
                drop_amp_scaling(inner)
        elif not unscale_gradients(
            [p.grad for g in inner.param_groups for p in g["params"]], scaling[0], scaling[1]
        ):
            inner.step()

    def _take_user_grads(self, bucket: Bucket) -> None:
        """Step the ``.grad`` the user left after backward, as torch.optim would (None:
        skipped)."""
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
            state = self._local.torch_state(copy=False)
            index = {id(p): i for i, p in self._bucketed.items()}
            entries = [state.get(index[id(p)], {}) for p in params]
        return [v for p, entry in zip(params, entries) for k, v in entry.items()
                if k != "step" and isinstance(v, Tensor) and v.shape == p.shape
                and (v.is_floating_point() or v.is_complex())]


def amp_scaling(opt: Any) -> Optional[Any]:
    """``(grad_scale, found_inf)`` that ``GradScaler.step`` set on ``opt`` for this step
    (``grad_scale`` None once ``scaler.unscale_(opt)`` ran), or None without a scaler."""
    if not hasattr(opt, "found_inf"):
        return None
    found_inf = opt.found_inf
    if not isinstance(found_inf, Tensor):  # 0: the scaler found no gradient to check
        found_inf = torch.tensor(float(found_inf))
    return getattr(opt, "grad_scale", None), found_inf


def drop_amp_scaling(opt: Any) -> None:
    """Remove what ``GradScaler.step`` set on ``opt``."""
    for name in ("grad_scale", "found_inf"):
        if name in vars(opt):
            delattr(opt, name)


def weak_call(method: Any) -> Callable[..., Any]:
    """``method`` without a strong reference to its object (a no-op once it is gone)."""
    ref = weakref.WeakMethod(method)

    def call(*args: Any) -> Any:
        bound = ref()
        return None if bound is None else bound(*args)

    return call


def _dense_grad(bucket: Bucket, slot: int) -> Optional[Tensor]:
    grad = bucket.params[slot].grad
    if grad is not None and grad.layout != torch.strided:
        raise ValueError(
            f"Invalid gradient of parameter {bucket.positions[slot]}: {grad.layout} "
            f"(expected a dense gradient)"
        )
    return grad
