r"""``DataParallelOptimizer``: a torch.optim optimizer whose gradients are averaged over ranks.

Every rank holds the whole model and runs forward and backward on its own batch; the
gradients are averaged over the process group while backward runs, in buckets, and each
bucket is stepped by compiled functional optimizers (one per bucket and param group), with
``overlap=True`` as soon as its average arrives, without the GIL: no torch.optim algorithm
couples parameters, so stepping bucket by bucket equals one step, bit for bit. Classes with
no functional twin step eagerly after the last bucket. This module holds the public
methods and holds the engine (``distopt.parallel.engine``); each other job has a module:
``arguments``, ``plan``, ``units``, ``status``, ``shard``, ``scatter``, ``state``,
``checkpoint``, ``teardown``, ``join``, ``buffers``, ``amp``.

One backward pass, as data (``distopt.parallel.engine`` holds each part):
backward → the parameter's post-accumulate-grad hook (``reducer.GradientReducer.on_grad``;
the window's first calls the engine's ``open_window``: ``param_groups`` checked, changed
hyper-parameters sent to the compiled steps, where the buckets step decided, a Join round)
→ its gradient into its ``buckets.Bucket`` (``.grad`` becomes a view of it) → the bucket
full: the communication thread issues its collective (``compression`` / ``powersgd``:
``issue``) → the finishing thread completes it (``finish``, ``Bucket.leave_unused``) → the
engine's ``reduced``: stepping during backward, the bucket's compiled steps (``units``;
sharded: this rank's pieces, then ``start_gather`` / ``store_gather``) → the pass's final
callback flushes what the pass did not reach and waits for every bucket. ``step()`` → the
engine's ``step``: its refusals, ``GradientReducer.complete`` (waits), the buckets not
stepped during backward (GradScaler, clipping, eager classes: ``step_all``; sharded: then
``shard.gather_all``), after the first step ``rebuild_at_first_step``. (``RoundRobin``
reduces nothing: each rank steps, then averages one partition.)
"""
import contextlib
import logging
from typing import Any, Dict, Iterable, Iterator, List, Optional, Union

import torch
from torch import Tensor
from torch.distributed.algorithms.join import JoinHook, Joinable

from distopt import _torch
from distopt.arguments import class_then_params
from distopt.parallel import buffers as _buffers
from distopt.parallel import checkpoint as _checkpoint
from distopt.parallel import dcp as _dcp
from distopt.parallel import join as _join
from distopt.parallel import state as _state
from distopt.parallel import wrapped as _wrapped
from distopt.parallel.amp import amp_scaling, drop_amp_scaling
from distopt.parallel.arguments import check_class, check_options, group_info, param_groups
from distopt.parallel.compression import Compression
from distopt.parallel.engine import DataParallelEngine, Options
from distopt.parallel.sync import RoundRobin, collective_device
from distopt.profiling import profiler_range
from distopt.surface import (
    become_torch_optimizer,
    load_state_dict_with_hooks,
    refuse_add_param_group,
)
from functional import functional_optim_map

logger = logging.getLogger(__name__)

__all__ = ["DataParallelOptimizer"]

#: The default ``bucket_cap_mb``, DDP's.
_DEFAULT_BUCKET_CAP_MB = 25.0


@class_then_params(
    "params", "DataParallelOptimizer(torch.optim.AdamW, model.parameters(), lr=1e-3)")
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
            scaler's inf/NaN check; nor once a step has found ``.grad``
            changed between backward and ``step()`` (``clip_grad_norm_``): every later step
            waits, and steps the changed gradients. Set False to step every bucket after
            the last one.
        shard: None (every rank holds all the optimizer state), ``"param"`` (each rank
            holds the state of whole parameters, about 1/W of it: the choice for
            Adafactor and Muon) or ``"flat"`` (1/W of each bucket's elements; elementwise
            classes): each rank steps its share and the parameters are all-gathered, bucket
            by bucket (``distopt.parallel.shard``). An eager class takes ``"param"``: it
            steps this rank's parameters after the last bucket.
        shard_gradients: with ``shard="flat"``, also shard the gradients (ZeRO-2): each
            bucket is reduce-scattered into this rank's run of elements instead of
            all-reduced, and its buffer released, so after the reducing backward pass a rank
            holds about ``1/W`` of the gradients (``gradient_bytes()``) and sends about half
            the bytes; the parameters and state equal ``shard="flat"``'s bit for bit
            (``distopt.parallel.scatter``). ``.grad`` then holds the average only for the
            parameters this rank owns whole (a view of its shard); it is None for the
            others. Clip with ``clip_grad_norm_`` (``torch.nn.utils.clip_grad_norm_`` sees
            one rank's part); a GradScaler steps as usual, but ``scaler.unscale_(opt)``
            is refused where a parameter is cut between ranks; no compression, no ``Join``.
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
        shard_gradients: bool = False,
        module: Optional[torch.nn.Module] = None,
        broadcast_buffers: bool = True,
        rebuild_buckets: bool = True,
        **kwargs: Any,
    ) -> None:
        Joinable.__init__(self)  # no Join yet: ``join_hook`` is called by Join
        eager = optimizer_class not in functional_optim_map or not _torch.jit_enabled()
        check_class(optimizer_class, eager, "DataParallelOptimizer reduces dense buckets")
        check_options(bucket_cap_mb, compression, backward_passes_per_step, sync, overlap, shard,
                      optimizer_class, eager, shard_gradients)
        group, rank, world_size = group_info(process_group)
        groups = param_groups(params)
        outside = _buffers.check_module(
            module, [p for g in groups for p in g["params"]], broadcast_buffers
        )
        # torch.optim's own checks and defaults, and (eager) the optimizer that steps.
        inner = become_torch_optimizer(self, optimizer_class, groups, args, kwargs)
        _wrapped.check_not_wrapped(
            [p for g in self.param_groups for p in g["params"] if p.requires_grad], module)
        self.process_group, self.rank, self.world_size = group, rank, world_size
        self.compression = compression
        self.sync = sync
        self.overlap = overlap
        self.shard = shard
        self.shard_gradients = shard_gradients
        self.module = module
        self.broadcast_buffers = broadcast_buffers
        self.backward_passes_per_step = backward_passes_per_step
        self.is_functional_optim = not eager
        cap_bytes = max(1, int(bucket_cap_mb * 2**20))
        # DDP's rebuilt buckets start with a small one, with the default cap only.
        first_cap_bytes = (min(cap_bytes, _torch.DDP_FIRST_BUCKET_BYTES)
                           if bucket_cap_mb == _DEFAULT_BUCKET_CAP_MB else None)
        options = Options(group, rank, world_size, compression, sync, overlap, shard,
                          shard_gradients, module,
                          broadcast_buffers, backward_passes_per_step, cap_bytes,
                          first_cap_bytes, rebuild_buckets)
        self._engine = DataParallelEngine(self, options, inner if eager else None, groups,
                                          args, kwargs, outside)
        engine = self._engine
        if not eager:  # the compiled steps hold the state: ``state`` shows it
            self.state = _state.CompiledStateView(engine)
        logger.info(
            "rank %d of %d: %d parameters in %d buckets, %s, compression=%r, sync=%r",
            rank, world_size, len(engine.bucketed), len(engine.buckets),
            "compiled" if engine.units.steps is not None else "eager", compression, sync,
        )

    def bucket_layout(self) -> List[List[int]]:
        """The buckets, in reduction order, as the global indices of their parameters (in
        each bucket's buffer order): reverse registration order at construction, the order
        the first step's gradients arrived after it (``rebuild_buckets``)."""
        return self._engine.bucket_layout()

    def step(self, closure: Optional[Any] = None) -> Optional[Any]:  # type: ignore[override]
        """Finish averaging this step's gradients and update the parameters.

        Waits for every bucket (with ``overlap=True`` most were stepped during backward).
        A parameter no rank gave a gradient since the last step keeps the ``.grad`` it had,
        as under DDP with ``find_unused_parameters=True``: None, and it is left untouched;
        a tensor (zeros after ``zero_grad(set_to_none=False)``), and it is stepped with it,
        as torch.optim steps it.

        Called by ``GradScaler.step(opt)`` (this class tells the scaler it takes the scale
        itself, as torch.optim's fused classes do), it steps as
        torch.optim steps under the scaler: the scaler's ``grad_scale`` and ``found_inf`` go
        to the fused kernels, which unscale and skip the update after an inf or NaN; other
        classes' gradients are unscaled in place and their step skipped then. The buckets
        of a step that a GradScaler takes wait for it, so none steps scaled gradients.

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
        scaling = amp_scaling(self)
        try:
            with profiler_range("distopt.DataParallelOptimizer.step"):
                loss = None
                if closure is not None:
                    with torch.enable_grad():
                        loss = closure()
                self._engine.step(scaling)
                return loss
        except BaseException:
            if scaling is not None:
                # GradScaler.step deletes them after a step that returns; after one that
                # raised, a later step() without the scaler must not find them.
                drop_amp_scaling(self)
            raise
        finally:
            self._engine.status.generation += 1  # a consolidated state_dict is out of date

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Backward passes inside accumulate gradients without reducing, as DDP's
        ``no_sync``; the first pass outside (or ``step()``) reduces the sum."""
        reducer = self._engine.reducer
        if reducer is None:
            yield
            return
        previous = reducer.no_sync
        reducer.no_sync = True
        try:
            yield
        finally:
            reducer.no_sync = previous

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

        With ``overlap=True`` the first step waits for ``step()``; clipping then (with this
        method or with ``torch.nn.utils.clip_grad_norm_``) makes every later step wait for
        ``step()`` too, so the clipped gradients are the ones stepped, as torch.optim steps
        them.

        Raises:
            RuntimeError: this step's buckets were stepped during backward (``overlap=True``,
                a compiled class, and the first step clipped nothing), so there is nothing
                left to clip.
            ValueError: ``param_groups`` no longer hold the parameters it was built with
                (``distopt.param_groups.check_groups``).
        """
        return self._engine.clip_grad_norm_(max_norm, norm_type, error_if_nonfinite, foreach)

    def state_dict(self) -> Dict[str, Any]:  # type: ignore[override]
        """The state in torch.optim's format; with error feedback also ``"residuals"``
        (global index -> this rank's residual), with ``RoundRobin`` ``"sync"``, with
        PowerSGD ``"compression"``.

        Unsharded, every rank holds the whole state: any rank may call it alone (rank 0
        saving it, as with DDP + torch.optim). Sharded, each rank holds only its part: as
        with torch's ZeroRedundancyOptimizer, call ``consolidate_state_dict(to=r)`` on every
        rank first, then ``state_dict()`` on rank ``r``, before the next step.

        Raises:
            RuntimeError: sharded, and no ``consolidate_state_dict`` sent this rank the state
                since the last step or load (at once: nothing waits for the other ranks).
        """
        engine = self._engine
        if self.shard is None:
            return _state.state_dict(engine)  # nothing to gather: no collective
        consolidated = engine.consolidated
        if consolidated is not None and consolidated[0] == engine.status.generation:
            return _state.fresh_containers(consolidated[1])
        when = ("" if consolidated is None else
                " (the state it consolidated last is out of date: a step or a load came since)")
        raise RuntimeError(
            f"Invalid state_dict on rank {self.rank}: with shard={self.shard!r} each rank "
            f"holds 1/{self.world_size} of the optimizer state, and no consolidated state "
            f"is on this rank{when}; nothing was gathered and nothing waits for the other "
            f"ranks (expected opt.consolidate_state_dict(to={self.rank}) on every rank first, "
            f"then opt.state_dict() on rank {self.rank}, as with torch's "
            f"ZeroRedundancyOptimizer; or opt.save(path) on every rank)"
        )

    def consolidate_state_dict(self, to: Optional[int] = 0) -> None:
        """Gather the whole optimizer state onto rank ``to`` of ``process_group`` (every
        rank, with ``to=None``), for its ``state_dict()``; a collective: every rank calls it,
        between steps (under ``Join`` too: a rank that has joined takes part). Unsharded,
        there is nothing to gather and nothing is sent.

        Args:
            to: the rank (in ``process_group``) whose ``state_dict()`` returns the whole
                state, or None for every rank.

        Raises:
            ValueError: ``to`` is not a rank of the group.
        """
        if to is not None and (isinstance(to, bool) or not isinstance(to, int)
                               or not 0 <= to < self.world_size):
            raise ValueError(
                f"Invalid to: {to!r} (expected a rank of the group, 0 to "
                f"{self.world_size - 1}, or None for every rank)"
            )
        if self.shard is None:
            return
        if _torch.join_enabled(self):  # ranks that have joined gather with us
            _join.consolidate_round(self._engine, to)
        self._engine.consolidate(to)

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:  # type: ignore[override]
        """Load a state_dict of this class (a local torch.optim one too); everything is
        checked before anything changes. Sharded, a collective: every rank calls it, and
        what one rank refuses every rank refuses, with the same message. Another rank's
        residuals (``"residuals_of"``) load with a warning (``distopt.parallel.state``).

        Raises:
            ValueError: another class, group count, parameter count, shape, or a state entry
                that does not fit, named.
            RuntimeError: sharded, inside a ``Join`` block (a rank that has joined cannot
                load with the others), at once, before anything is read.
        """
        if self.shard is not None and _torch.join_enabled(self):
            raise RuntimeError(
                f"Invalid load_state_dict on rank {self.rank}: with shard={self.shard!r} it is "
                f"a collective, and inside a Join block a rank that has run out of batches "
                f"cannot load with the others; nothing was read (expected load_state_dict "
                f"before the Join block)"
            )
        engine = self._engine
        engine.status.generation += 1
        load_state_dict_with_hooks(self, state_dict,
                                   lambda sd: _state.checked_loader(engine, sd)())

    def state_bytes(self) -> int:
        """The bytes of optimizer state this rank holds (its shard, when sharded): every
        state tensor, step counts included; not the gradient buckets or residuals."""
        engine = self._engine
        if engine.eager is not None:
            entries = list(engine.eager.state.values())
        else:
            entries = list(engine.units.torch_state(copy=False).values())
        return sum(v.numel() * v.element_size() for e in entries for v in e.values()
                   if isinstance(v, Tensor))

    def gradient_bytes(self) -> int:
        """The bytes of gradients this rank holds now: the gradient buckets it keeps (none
        between steps with ``shard_gradients=True``), its gradient shards, and any ``.grad``
        outside them, each storage once."""
        return self._engine.gradient_bytes()

    def bytes_per_step(self) -> float:
        """The payload bytes this rank sends per step: the reduction's model
        (``Compression.bytes_per_step``) plus, sharded, the gathers of the parameters.

        Raises:
            ValueError: the compression's bytes depend on the gradients (Threshold).
        """
        buckets = self._engine.buckets
        by_dtype: Dict[torch.dtype, List[Any]] = {}
        for b in buckets:
            by_dtype.setdefault(b.dtype, []).append((b.numel, len(b.params)))
        total = sum(self._engine.reduction.bytes_per_step(numels, dtype, self.world_size)
                    for dtype, numels in by_dtype.items())
        if self.shard is not None:
            total += sum(b.shard.gathered_bytes(self.world_size) for b in buckets)
        return total

    def save(self, path: str) -> Dict[str, Any]:
        """Write a checkpoint into the directory ``path``; every rank calls it.

        The first rank writes the optimizer state once (it is the same on every rank; with
        ``RoundRobin`` each rank writes its own), each rank its error-feedback residuals,
        then the first rank the manifest (``distopt.checkpoint.write_atomic``: temporary
        file, fsync, rename). Until the new manifest is in place the previous checkpoint is
        intact. ``path`` must be on a filesystem every rank shares.

        Returns:
            The manifest.

        Inside a ``Join`` block it may be called as the other collectives are: a rank that
        has joined takes part in the save (its state and residuals are current).

        Raises:
            RuntimeError: some rank could not write (on every rank; nothing of this save is
                left behind).
        """
        if _torch.join_enabled(self):
            _join.save_round(self._engine, path)
        return _checkpoint.save(self._engine, path)

    def load(self, path: str) -> None:
        """Load a checkpoint written by ``save``; every rank calls it.

        Every rank reads and checks its part first; only when all have accepted does any
        change (one collective decides).

        Raises:
            ValueError: the manifest is not one of this optimizer's (class, world size),
                or some rank's part does not fit (on every rank, naming the rank).
            RuntimeError: inside a ``Join`` block (a rank that has joined cannot load with
                the others), at once, before anything is read.
        """
        self._refuse_inside_join("load", f"opt.load({path!r})")
        self._engine.status.generation += 1
        _checkpoint.load(self._engine, path)

    def dcp_state_dict(self) -> Dict[str, Any]:
        """This rank's shard of the optimizer state for ``torch.distributed.checkpoint``:
        every rank calls it (one small collective) and hands the result to ``dcp.save``,
        beside the model's state if it likes (``{"model": ..., "optim":
        opt.dcp_state_dict()}``); each rank then writes its own pieces only, as views of
        the optimizer's tensors (nothing is gathered or copied here), and the first the
        replicated rest (param groups, step counts, each rank's CRC-32s). Load it with
        ``load_dcp`` on any number of ranks and in any ``shard`` mode.

        Residuals, compression state and ``RoundRobin``'s round are not in it (they are
        per rank; ``save`` keeps them). Save before the next step: the tensors handed are
        the live state.

        Raises:
            ValueError: a state value that is not a tensor, a state tensor whose entries
                do not match its piece (``elements_per_entry`` of
                ``distopt.parallel.dcp``), or state that differs between the ranks that
                hold it (``RoundRobin``), on every rank alike.
            RuntimeError: inside a ``Join`` block (DCP's collectives need every rank), at
                once.
        """
        self._refuse_inside_join("dcp_state_dict", "opt.dcp_state_dict() and dcp.save",
                                 "save through DCP")
        return _dcp.dcp_state_dict(self._engine)

    def load_dcp(self, checkpoint_id: Optional[str] = None, *, key: Optional[str] = "optim",
                 storage_reader: Any = None) -> None:
        """Load what ``dcp_state_dict()`` saved through ``dcp.save``, on any number of
        ranks and in any ``shard`` mode; every rank calls it. Each rank reads the pieces it
        holds (DCP reshards the saved ones), the saved CRC-32 of every rank's shard is
        checked against what the ranks read, and only when every rank has accepted
        everything does any state change.

        Args:
            checkpoint_id: ``dcp.load``'s: the checkpoint's directory.
            key: where ``dcp_state_dict()``'s result was put in the saved dict (None: it
                was the whole dict).
            storage_reader: ``dcp.load``'s, instead of ``checkpoint_id``.

        Raises:
            ValueError: another class, parameter sizes or param groups, or a shard whose
                CRC-32 differs (naming the rank that saved it, its files, the key and
                entries): on every rank, nothing changed.
            RuntimeError: inside a ``Join`` block, at once, before anything is read.
        """
        self._refuse_inside_join("load_dcp", "opt.load_dcp(...)")
        self._engine.status.generation += 1
        _dcp.load(self._engine, key, checkpoint_id=checkpoint_id,
                  storage_reader=storage_reader)

    def _refuse_inside_join(self, call: str, expected: str, doing: str = "load") -> None:
        """RuntimeError inside a ``Join`` block, where a rank that has joined cannot
        ``doing`` with the others."""
        if _torch.join_enabled(self):
            raise RuntimeError(
                f"Invalid {call} on rank {self.rank}: inside a Join block, where a rank that "
                f"has run out of batches cannot {doing} with the others; nothing was read or "
                f"written (expected {expected} before the Join block)"
            )

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
        self._engine.close()

    def __enter__(self) -> "DataParallelOptimizer":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

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
        return _join.join_hook(self._engine, **kwargs)

    @property
    def join_device(self) -> torch.device:
        """Where Join's own collectives put their tensors."""
        return collective_device(self.process_group)

    @property
    def join_process_group(self) -> Any:
        """The group of Join's own collectives and of the rounds that start each
        iteration: one group for every DataParallelOptimizer over ``process_group``
        (``distopt.parallel.join.group_for``), so that ``Join([opt1, opt2])`` takes several,
        and torch's Join refuses a mix with another kind of Joinable (DDP), whose rounds
        would not pair with these. Made at the first ``Join`` (``join_hook``, which every
        rank calls as it builds its Join)."""
        return _join.group_for(self.process_group)
