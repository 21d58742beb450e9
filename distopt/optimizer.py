"""The trainer's side: DistributedOptimizer groups parameters by owner and fans steps out.

It holds what it learnt at construction in a ``distopt.placement.Placement`` and hands that, with
its param groups, to the modules that run its other rounds (``distopt.state``,
``distopt.checkpoint``, ``distopt.clipping``), which never import this one.
"""
import inspect
import logging
import threading
import warnings
from collections import defaultdict
from typing import Any, Dict, Iterable, List, Optional, Set, Tuple, Union

import torch
import torch.distributed.rpc as rpc
from torch import Tensor

from distopt import _torch, checkpoint, clipping, exclusive, owner, state
from distopt.arguments import check_arguments, check_optimizer_class, class_then_params
from distopt.context import live_context
from distopt.errors import DistributedOptimizerError, compose_error
from distopt.fanout import Call, fan_out
from distopt.placement import OwnerPart, Placement
from distopt.param_groups import (
    TrainerGroups,
    as_keywords,
    built_groups,
    check_groups,
    holds_tensor,
    normalize_param_groups,
    pending_changes,
    signature_defaults,
    snapshot,
)
from distopt.profiling import profiler_range
from distopt.surface import load_state_dict_with_hooks, refuse_add_param_group, state_dict_with_hooks
from functional import functional_optim_map

logger = logging.getLogger(__name__)


@class_then_params(
    "params_rref", "DistributedOptimizer(torch.optim.SGD, [rpc.RRef(p) for p in model.parameters()], lr=0.05)")
class DistributedOptimizer(torch.optim.Optimizer):
    r"""An optimizer over parameters held by several RPC workers, each updating its own.

    A drop-in for :class:`torch.distributed.optim.DistributedOptimizer`: same arguments,
    same ``step(context_id)``, same ``is_functional_optim``; and, like a torch.optim
    optimizer, param groups, ``param_groups``, ``state_dict`` / ``load_state_dict``, and
    :mod:`torch.optim.lr_scheduler` support. Each owner gets one local optimizer over its
    parameters of every group. When ``optimizer_class`` has a functional stand-in in
    ``functional.functional_optim_map`` the local optimizer is compiled with TorchScript and
    steps without the GIL, reading the gradients straight from the autograd context;
    otherwise ``optimizer_class`` itself runs eagerly, fed through ``.grad``.

    ``param_groups`` is a list of dicts as in torch.optim (``params`` holds the RRefs).
    Changing a hyper-parameter there (``lr``, ``momentum``, ``betas``, ``weight_decay``...)
    takes effect on every owner at the next ``step``, sent with that step's RPC; nothing is
    recompiled. A compiled optimizer can change only the keys its functional class accepts
    in ``set_hyperparameter``; changing another raises ValueError at the next step. The
    groups themselves are fixed at construction: a group's ``params`` replaced or changed in
    place (a parameter appended, removed, replaced, reordered), a group added or removed, a
    key deleted, or a constructor keyword the group was built without added, raises
    ValueError naming the group and the change at the next ``step``, ``state_dict``,
    ``load_state_dict``, ``save``, ``load`` or clipping call, before any owner is contacted
    (``distopt.param_groups.check_groups``).

    Every step of every local optimizer holds the locks of the parameters it updates, so any
    number of trainers, each with its own DistributedOptimizer over the same parameters,
    lose no update, while optimizers over disjoint parameters step in parallel. As with
    torch's version, nothing orders one trainer's forward, backward and step against
    another's, and a step bumps the autograd version counter of every parameter it updates,
    as torch.optim's does: a backward pass whose forward saved a parameter on its owner
    before another trainer stepped it raises autograd's "modified by an inplace operation"
    error instead of running on the new values. A compiled local optimizer that shares no
    parameter with another on its owner needs no lock there: it steps through a TorchScript
    RPC, without the owner's GIL, until another optimizer over its parameters is created
    (see :mod:`distopt.exclusive`).
    One DistributedOptimizer runs one owner-facing operation (step, state_dict, save,
    clipping, ...) at a time; calls from several threads wait for each other.

    Parameters are numbered in the order given, flattened over the groups, as torch.optim
    numbers them in its ``state_dict``.

    Args:
        optimizer_class: a :class:`torch.optim.Optimizer` subclass whose ``step`` needs no
            closure (every torch.optim class but LBFGS), or any class registered in
            ``functional.functional_optim_map``.
        params_rref: RRefs to the parameters to optimize, local or remote; or param group
            dicts, ``{"params": [rref, ...], "lr": ...}``, as torch.optim takes them.
        *args: positional arguments for the optimizer, given after the parameters.
        **kwargs: keyword arguments for the optimizer: the defaults of every group.
            ``flat=False`` (taken here, not passed on) keeps every parameter on its own on
            the owners; by default a compiled optimizer puts each owner's small parameters
            of the elementwise algorithms into flat buffers (``functional.flatten_parameters``:
            they become views of one buffer, and a step is one kernel call over it).

    Raises:
        TypeError: before any RPC: ``optimizer_class`` is not an optimizer class, or runs
            eagerly and its ``step`` needs a closure (LBFGS); an item of ``params_rref`` is
            not an RRef; the arguments do not fit ``optimizer_class``'s constructor (named
            as Python names them, e.g. ``Adam.__init__() got an unexpected keyword argument
            'bogus'``), or one is of the wrong kind for its annotation (``Invalid lr:
            'fast' (expected a float or Tensor)``).
        ValueError: ``params_rref`` is empty, or a group has no parameters.
        DistributedOptimizerError: some owners failed to create their optimizer (for
            instance they rejected a value, ``lr=-1``); those created elsewhere are released.

    Example::

        >>> opt = DistributedOptimizer(
        ...     torch.optim.Adam, [{"params": enc_rrefs}, {"params": dec_rrefs, "lr": 1e-4}],
        ...     lr=1e-3)
        >>> sched = torch.optim.lr_scheduler.StepLR(opt, step_size=10)
        >>> with dist_autograd.context() as context_id:
        ...     loss = rpc.rpc_sync("worker1", forward, args=(enc_rrefs, x))
        ...     dist_autograd.backward(context_id, [loss])
        ...     opt.clip_grad_norm_(context_id, max_norm=1.0)
        ...     opt.step(context_id)
        >>> sched.step()
        >>> opt.save("/shared/ckpt")
    """

    def __init__(
        self,
        optimizer_class: type,
        params_rref: Iterable[Union[rpc.RRef, Dict[str, Any]]],
        *args: Any,
        **kwargs: Any,
    ) -> None:
        is_class = inspect.isclass(optimizer_class)
        stand_in = self._functional_stand_in(optimizer_class) if is_class else None
        functional_cls = stand_in
        if functional_cls is None and is_class:
            functional_cls = functional_optim_map.get(optimizer_class)
        # Mirror torch: with TorchScript disabled, torch.optim classes run eagerly.
        jit_enabled = _torch.jit_enabled()
        is_functional_optim = functional_cls is not None and (
            jit_enabled or not issubclass(optimizer_class, torch.optim.Optimizer)
        )
        check_optimizer_class(optimizer_class, eager=not is_functional_optim, stand_in=stand_in)
        flat = kwargs.pop("flat", True)
        if not isinstance(flat, bool):
            raise TypeError(f"Invalid flat: {flat!r} (expected True or False)")
        user_groups = normalize_param_groups(params_rref)
        check_arguments(optimizer_class, args, kwargs, user_groups)
        self._init_optimizer_fields()
        self.optimizer_class = optimizer_class
        #: Held around every owner-facing operation: one in flight at a time.
        self._lock = threading.Lock()
        #: Owners that switched this optimizer to the locked path (``_switch_to_locked``).
        self._locked_owners: Set[str] = set()
        #: Whether a step already warned that its context held no gradient (once each).
        self._warned_no_gradients = False
        self._owners: List[OwnerPart] = []
        # Registered before any owner hears of it: an owner may switch it mid-construction.
        self._key = exclusive.register(self._switch_to_locked)
        me = rpc.get_worker_info()
        self._worker_id: int = me.id
        trainer = (me.name, self._key)

        self.is_functional_optim = is_functional_optim

        # Global numbering: the order given, flattened over the groups.
        by_owner: Dict[str, Tuple[rpc.WorkerInfo, Dict[int, Tuple[list, list]]]] = {}
        group_indices: List[List[int]] = []
        n = 0
        for g, group in enumerate(user_groups):
            group_indices.append(list(range(n, n + len(group["params"]))))
            for rref in group["params"]:
                info = rref.owner()
                parts = by_owner.setdefault(info.name, (info, {}))[1]
                rrefs, indices = parts.setdefault(g, ([], []))
                rrefs.append(rref)
                indices.append(n)
                n += 1

        def specs(parts: Dict[int, Tuple[list, list]]) -> List[owner.GroupSpec]:
            return [
                (rrefs, indices, {k: v for k, v in user_groups[g].items() if k != "params"})
                for g, (rrefs, indices) in parts.items()
            ]

        if self.is_functional_optim:
            call_args, call_kwargs = as_keywords(optimizer_class, args, kwargs)
            calls = {
                name: (info, owner.new_compiled_local_optimizer,
                       (functional_cls, optimizer_class, specs(parts), call_args, call_kwargs,
                        trainer, flat, list(parts)))
                for name, (info, parts) in by_owner.items()
            }
        else:
            logger.info("%s runs eagerly on its owners (no functional stand-in)", optimizer_class)
            calls = {
                name: (info, owner.new_eager_local_optimizer,
                       (optimizer_class, specs(parts), args, kwargs, trainer, list(parts)))
                for name, (info, parts) in by_owner.items()
            }
        results = fan_out(
            "construction", calls, partial=lambda done: _release([r[0] for r in done.values()])
        )

        owners: List[OwnerPart] = []
        described: Dict[int, Dict[str, Any]] = {}
        shapes: Dict[int, Tuple[int, ...]] = {}
        dtypes: Dict[int, torch.dtype] = {}
        settable: Optional[List[str]] = None
        eager_defaults: Optional[Dict[str, Any]] = None
        for name, (rref, info) in results.items():
            parts = by_owner[name][1]
            part = OwnerPart(
                by_owner[name][0], rref, info["id"], list(parts),
                [indices for _, indices in parts.values()], info["script"],
            )
            owners.append(part)
            for j, g in enumerate(part.groups):
                described.setdefault(g, info["hyper"][j])
                for i, shape, dtype in zip(part.indices[j], info["shapes"][j], info["dtypes"][j]):
                    shapes[i] = torch.Size(shape)
                    dtypes[i] = dtype
            settable = info["settable"] if settable is None else settable
            eager_defaults = info["defaults"] if eager_defaults is None else eager_defaults
        with self._lock:  # an owner may have switched a part while the others were built
            for part in owners:
                if part.name in self._locked_owners:
                    part.script = None
            self._owners = owners
        self.remote_optimizers: List[rpc.RRef] = [part.rref for part in self._owners]
        self._placement = Placement(
            optimizer_class=optimizer_class,
            owners=self._owners,
            group_indices=group_indices,
            param_shapes=[shapes[i] for i in range(n)],
            param_dtypes=[dtypes[i] for i in range(n)],
            hyper_keys=list(described[0]),
            settable=settable,
        )

        given = as_keywords(optimizer_class, args, kwargs)[1]
        for g, group in enumerate(user_groups):
            extra = {k: v for k, v in group.items() if k != "params" and k not in described[g]}
            # A Tensor the user gave (lr, betas, ...) stays the very object, as torch.optim
            # keeps it: a change made to it in place reaches the owners at the next step.
            mine = {
                k: v for k, v in {**given, **group}.items()
                if k in described[g] and holds_tensor(v)
            }
            self.param_groups.append(
                {"params": group["params"], **described[g], **mine, **extra}
            )
        if eager_defaults is not None:
            self.defaults = eager_defaults
        else:
            self.defaults = signature_defaults(
                optimizer_class, args, kwargs, self._placement.hyper_keys
            ) or {k: v for k, v in described[0].items() if k not in user_groups[0]}
        #: For each group, the hyper-parameter values the owners have.
        self._sent: List[Dict[str, Any]] = [
            {k: snapshot(group[k]) for k in self._placement.hyper_keys}
            for group in self.param_groups
        ]
        #: What ``param_groups`` must keep: the owners' optimizers are built from it once.
        self._built = built_groups(
            type(self).__name__, self.param_groups, self._placement.hyper_keys, optimizer_class
        )

    def _functional_stand_in(self, optimizer_class: type) -> Optional[type]:
        """The functional class to compile for ``optimizer_class`` where it is not the one
        ``functional_optim_map`` names: None here. The row-wise sparse optimizers name
        their own (classes with no torch.optim counterpart, kept out of the map of
        torch.optim's stand-ins)."""
        return None

    def _init_optimizer_fields(self) -> None:
        """What torch.optim.Optimizer's constructor sets, without its checks on tensors.

        The parameters are RRefs, so Optimizer.__init__ cannot take them; schedulers and
        the step hooks need only these fields.
        """
        self.defaults: Dict[str, Any] = {}
        #: Always empty: the state lives on the owners (see ``state_dict``).
        self.state: Dict[Any, Any] = defaultdict(dict)
        self.param_groups: List[Dict[str, Any]] = []
        _torch.init_optimizer_internals(self)

    def step(self, context_id: int) -> None:  # type: ignore[override]
        """Step every owner's local optimizer with the gradients of ``context_id``.

        Blocks until every owner has replied. Owners that received no gradient in this
        context leave their parameters as they are (but see ``distopt.sparse``: a sharded
        table steps on every owner when it got a gradient). When no owner found a gradient
        of any parameter (``loss.backward()`` instead of ``dist_autograd.backward``, or a
        step before the backward pass), nothing changes and a ``UserWarning`` naming the
        context says so, once per optimizer. Hyper-parameters changed in ``param_groups``
        since the last step travel with this step's RPCs.

        Args:
            context_id: the id of the live distributed autograd context whose backward pass
                computed the gradients.

        Raises:
            TypeError: ``context_id`` is not an integer.
            ValueError: no such context is alive on this worker, a hyper-parameter that
                cannot change was changed, or ``param_groups`` were edited in a way the
                owners cannot follow (all checked before any owner is contacted).
            DistributedOptimizerError: some owners failed, or could not be reached. An
                owner refuses a gradient its class cannot take (a sparse one under a dense
                class, one of another shape or dtype than its parameter, ...) before any of
                its groups steps; a failure part-way through an owner's step says which
                groups (or, for an eager class, which parameters) it changed. ``applied``
                and the error's last line say what each owner applied.
        """
        with self._lock, profiler_range("distopt.DistributedOptimizer.step"):
            check_groups(self.param_groups, self._built)
            context_id, context = live_context(context_id)
            self._before_step(context_id)
            changes = pending_changes(
                self.param_groups, self._sent, self._placement.settable, self.optimizer_class.__name__
            )
            empty_params = self._empty_gradient_params(context_id)
            reached: Optional[Set[int]] = None
            calls: Dict[str, Call] = {}
            for part in self._owners:
                local_changes = [
                    (j, key, value)
                    for j, g in enumerate(part.groups)
                    for key, value in changes.get(g, {}).items()
                ]
                empty = _local_positions(part, empty_params) if empty_params else None
                if part.script is not None and not local_changes:
                    if reached is None:
                        reached = set(_torch.known_worker_ids(context))
                        reached.add(self._worker_id)
                    # Only an owner this context reached surely holds it; another may hold
                    # it through a nested RPC, or not at all, which the locked path handles.
                    if part.info.id in reached:
                        if empty is None:
                            target, args = exclusive.script_step, (part.script, context_id)
                        else:
                            target = exclusive.script_step_with_empty
                            args = (part.script, context_id, empty)
                        calls[part.name] = (part.info, target, args)
                        continue
                if empty is not None:
                    args = (part.id, context_id, local_changes or None, empty)
                elif local_changes:
                    args = (part.id, context_id, local_changes)
                else:
                    args = (part.id, context_id)
                calls[part.name] = (part.info, owner.step_local_optimizer, args)
            try:
                found = fan_out("step", calls)
            except DistributedOptimizerError as exc:
                described = _described_step_error(exc, calls, self._owners, context_id)
                raise described from exc.__cause__
            for g, values in changes.items():
                self._sent[g].update({k: snapshot(v) for k, v in values.items()})
            # Each owner replied whether the context held a gradient of its parameters.
            if not self._warned_no_gradients and not any(found.values()):
                self._warn_no_gradients(context_id)

    def _warn_no_gradients(self, context_id: int) -> None:
        """Warn, once for this optimizer, that a step's context held no gradient of any of
        its parameters: torch's DistributedOptimizer returns silently there."""
        self._warned_no_gradients = True
        warnings.warn(
            f"{type(self).__name__}.step({context_id}): the distributed autograd context "
            f"{context_id} holds no gradient of any of this optimizer's parameters, so none "
            f"changed. Likely cause: the loss was back-propagated with loss.backward() "
            f"instead of dist_autograd.backward(context_id, [loss]), or step() ran before "
            f"the backward pass (warned once per optimizer)",
            UserWarning, stacklevel=4,  # here, step(), torch.optim's step wrapper, the caller
        )

    def _before_step(self, context_id: int) -> None:
        """What a subclass must do on the owners before each step, under the step's lock
        (the live ``context_id`` is checked already). Nothing here."""

    def _empty_gradient_params(self, context_id: int) -> Set[int]:
        """The global indices of the parameters that this step must update even where the
        context holds no gradient for them, with a sparse gradient holding no rows
        (``distopt.local_optimizer.empty_sparse_gradient``); told to their owners with the
        step's RPC.

        Nothing here: a parameter without a gradient is skipped, as torch.optim skips a
        ``None`` ``.grad``. The sharded-table optimizers name every shard of a table that
        got a gradient, so that the table steps as one parameter (``distopt.sparse``).
        """
        return set()

    def _switch_to_locked(self, owner_name: str) -> None:
        """Step the local optimizer on ``owner_name`` through its locks from now on.

        Registered with ``distopt.exclusive.register``, called by its ``switch_to_locked`` on
        an RPC thread; returns once no operation of this optimizer is in flight.
        """
        with self._lock:
            self._locked_owners.add(owner_name)
            for part in self._owners:
                if part.name == owner_name:
                    part.script = None

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Does nothing: gradients live in each autograd context, never in ``.grad``.

        It exists so that code written for torch.optim runs unchanged; a new
        ``dist_autograd.context()`` starts with no gradients.

        Args:
            set_to_none: accepted for compatibility.
        """

    def add_param_group(self, param_group: Dict[str, Any]) -> None:
        """Not supported: the owners' optimizers are fixed at construction.

        Raises:
            NotImplementedError: always; build a new DistributedOptimizer instead.
        """
        refuse_add_param_group("a DistributedOptimizer's owners' optimizers",
                               "at construction")

    def state_dict(self) -> Dict[str, Any]:  # type: ignore[override]
        """The state in torch.optim's format, gathered from every owner in parallel, with
        torch's state-dict hooks (``register_state_dict_pre_hook`` /
        ``register_state_dict_post_hook``) run around it as torch.optim runs them.

        Returns:
            ``{"state": {index: {key: value}}, "param_groups": [{..., "params": [index, ...]}]}``
            with parameters numbered as given to the constructor; loadable by a local
            torch.optim optimizer of the same class over the same parameters.

        Raises:
            DistributedOptimizerError: some owners failed or could not be reached.
        """
        with self._lock:
            check_groups(self.param_groups, self._built)
            return state_dict_with_hooks(
                self, lambda: state.gather_state_dict(self._placement, self.param_groups)
            )

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:  # type: ignore[override]
        """Load a state_dict from a DistributedOptimizer or a local torch.optim optimizer,
        with torch's load hooks (``register_load_state_dict_pre_hook`` /
        ``register_load_state_dict_post_hook``) run
        around it.

        Everything is checked on the trainer before any owner changes; then each owner gets
        its part, in parallel.

        Args:
            state_dict: torch.optim's format, for the same class over the same parameters in
                the same order (and groups).

        Raises:
            ValueError: the state_dict is for another class, another number of groups or
                parameters, other shapes, or changes a hyper-parameter the compiled
                optimizer fixes at construction; it names what differs.
            DistributedOptimizerError: some owners failed or could not be reached.
        """
        with self._lock:
            check_groups(self.param_groups, self._built)
            load_state_dict_with_hooks(
                self, state_dict,
                lambda sd: state.load_state_dict(self._placement, self._trainer_groups(), sd),
            )

    def save(self, path: str) -> Dict[str, Any]:
        """Write a sharded checkpoint into the directory ``path``; see :mod:`distopt.checkpoint`.

        Returns:
            The manifest written.
        """
        with self._lock:
            check_groups(self.param_groups, self._built)
            return checkpoint.save(self._placement, self.param_groups, path)

    def load(self, path: str) -> None:
        """Restore a checkpoint written by ``save``; see :mod:`distopt.checkpoint`."""
        with self._lock:
            check_groups(self.param_groups, self._built)
            checkpoint.load(self._placement, self._trainer_groups(), path)

    def clip_grad_norm_(
        self,
        context_id: int,
        max_norm: float,
        norm_type: float = 2.0,
        error_if_nonfinite: bool = False,
        foreach: Optional[bool] = None,
    ) -> Tensor:
        """Clip the context's gradients of this optimizer's parameters by their global norm.

        As :func:`torch.nn.utils.clip_grad_norm_`; see :func:`distopt.clipping.clip_grad_norm_`.
        """
        with self._lock:
            check_groups(self.param_groups, self._built)
            return clipping.clip_grad_norm_(
                self._owners, context_id, max_norm, norm_type, error_if_nonfinite, foreach
            )

    def clip_grad_value_(
        self, context_id: int, clip_value: float, foreach: Optional[bool] = None
    ) -> None:
        """Clamp the context's gradients to ``[-clip_value, clip_value]``, in place.

        As :func:`torch.nn.utils.clip_grad_value_`; see :func:`distopt.clipping.clip_grad_value_`.
        """
        with self._lock:
            check_groups(self.param_groups, self._built)
            clipping.clip_grad_value_(self._owners, context_id, clip_value, foreach)

    @property
    def owners(self) -> List[OwnerPart]:
        """The owners' parts, in the order their local optimizers were created."""
        return list(self._owners)

    def _trainer_groups(self) -> TrainerGroups:
        """The param groups and the values the owners hold, for a round that loads state."""
        placement = self._placement
        # A saved group must hold every key the owners' optimizers keep: for an eager one,
        # every key of its defaults.
        required = placement.hyper_keys if placement.compiled else list(self.defaults)
        return TrainerGroups(self.param_groups, self._sent, required)


def _described_step_error(
    exc: DistributedOptimizerError,
    calls: Dict[str, Call],
    parts: List[OwnerPart],
    context_id: int,
) -> DistributedOptimizerError:
    """``exc``, a failed step, with each failed exclusive step (a TorchScript RPC, which
    cannot say what it applied) described by its owner (``owner.describe_step_failure``, one
    parallel round); an owner that cannot be asked stays undescribed."""
    by_name = {part.name: part for part in parts}
    scripted = (exclusive.script_step, exclusive.script_step_with_empty)
    asks = {
        name: (calls[name][0], owner.describe_step_failure,
               (by_name[name].id, context_id, message))
        for name, message in exc.failures.items()
        if name in calls and calls[name][1] in scripted and name not in exc.applied
    }
    if not asks:
        return exc
    described: Dict[str, Any] = {}  # those that answered, if some could not
    try:
        described = fan_out("step failure description", asks, partial=described.update)
    except DistributedOptimizerError as failed:
        logger.warning("could not ask every owner what its failed step applied: %s", failed)
    failures, applied = dict(exc.failures), dict(exc.applied)
    for name, (message, what) in described.items():
        failures[name], applied[name] = message, what
    return compose_error("step", failures, exc.succeeded, applied)


def _local_positions(part: OwnerPart, wanted: Set[int]) -> Optional[List[List[int]]]:
    """For each of ``part``'s local groups, the positions of its parameters in ``wanted``
    (global indices); None when it has none."""
    positions = [[k for k, i in enumerate(indices) if i in wanted] for indices in part.indices]
    return positions if any(positions) else None


def _release(optimizer_rrefs: List[rpc.RRef]) -> None:
    """Ask each owner to free a local optimizer now; failures are logged, not raised."""
    try:
        fan_out("release", {
            f"{rref.owner_name()}#{i}": (rref.owner(), owner.release_local_optimizer, (rref,))
            for i, rref in enumerate(optimizer_rrefs)
        })
    except DistributedOptimizerError as exc:
        for name, message in exc.failures.items():
            logger.warning("could not release local optimizer %s: %s", name, message)
