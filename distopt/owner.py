"""The owner's side: local optimizers over the parameters a worker owns, and their locks.

A local optimizer is either compiled (one functional optimizer per param group, inside one
TorchScript module whose step reads the autograd context's gradients and runs without the
GIL) or eager (any torch.optim class built with the param groups, fed through ``.grad``).
Both are stepped by ``step_local_optimizer``, the function every locked step RPC calls: take
the parameters' locks, apply any hyper-parameter changes the trainer piggybacked, make one
call, release.

Locks belong to parameters. The first optimizer to touch a parameter gives it, and every
other new parameter in that optimizer, one fresh lock with the next sequence number; later
optimizers reuse the locks already there. An optimizer takes its distinct locks in sequence
order, so trainers over the same parameters serialize, optimizers over disjoint parameters
run in parallel, and overlapping sets cannot deadlock.

Each lock knows the live local optimizers that use it. A compiled optimizer that shares no
lock with another is exclusive: its trainer steps it with ``distopt.exclusive.script_step``,
no Python and no lock here. Creating an optimizer over a lock that an exclusive one uses
first switches that one to the locked path (see ``distopt.exclusive``).
"""
import contextlib
import inspect
import itertools
import logging
import re
import threading
import weakref
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Tuple, Union

import torch
import torch.distributed.autograd as dist_autograd
import torch.distributed.rpc as rpc
from torch import Tensor
from distopt import exclusive
from distopt._torch import WeakIdKeyDictionary
from distopt.context import has_context
from distopt.errors import DistributedOptimizerError, RemoteFailure, returns_failure
from distopt.fanout import fan_out
from functional import load_torch_state_dict, to_torch_state_dict
from functional._state import (
    checked_state,
    functional_state,
    group_keys,
    hyperparameter_values,
    settable_hyperparameters,
)

#: What the trainer sends for one local param group: (parameter RRefs, their global
#: indices, the group's options as the user gave them, without "params").
GroupSpec = Tuple[List[rpc.RRef], List[int], Dict[str, Any]]
#: A piggybacked hyper-parameter change: (local group, name, new value).
Change = Tuple[int, str, Any]

logger = logging.getLogger(__name__)

# TorchScript's compiler is not thread-safe; owners create optimizers on many RPC threads.
_compile_lock = threading.Lock()


class _ParamLock:
    """A lock shared by a batch of parameters, ordered by when the batch was first seen.

    ``users`` are the live local optimizers that take it (changed under ``_registry_lock``).
    """

    __slots__ = ("sequence", "lock", "users", "__weakref__")

    def __init__(self, sequence: int) -> None:
        self.sequence = sequence
        self.lock = threading.Lock()
        self.users: "weakref.WeakSet[LocalOptimizer]" = weakref.WeakSet()


_registry_lock = threading.Lock()
# Keyed by tensor identity: a plain WeakKeyDictionary compares tensors with ``==``.
_param_locks: WeakIdKeyDictionary = WeakIdKeyDictionary()
_sequence = itertools.count()


def _param_locks_for(params: List[Tensor]) -> List[_ParamLock]:
    """The distinct locks of ``params``, in acquisition order; new params get one new lock.

    The caller holds ``_registry_lock``.
    """
    new = [p for p in params if p not in _param_locks]
    if new:
        shared = _ParamLock(next(_sequence))
        for p in new:
            _param_locks[p] = shared
    distinct = {id(pl): pl for pl in (_param_locks[p] for p in params)}
    return sorted(distinct.values(), key=lambda pl: pl.sequence)


@contextlib.contextmanager
def holding(locks: Sequence[threading.Lock]) -> Iterator[None]:
    """Take ``locks`` in the order given; release them in reverse, whatever happens."""
    taken = 0
    try:
        for lock in locks:
            lock.acquire()
            taken += 1
        yield
    finally:
        for lock in reversed(locks[:taken]):
            lock.release()


def lock_of(param: Tensor) -> Optional[threading.Lock]:
    """The lock guarding ``param``, or None if no optimizer has touched it."""
    with _registry_lock:
        entry = _param_locks.get(param)
    return None if entry is None else entry.lock


def empty_sparse_gradient(param: Tensor) -> Tensor:
    """A sparse COO gradient of ``param`` holding no rows.

    It is what ``embedding(..., sparse=True)`` gives a table for an empty lookup, and what
    torch.optim steps with when a table's gradient holds rows of other shards only: the
    step counts (SparseAdam's and Adagrad's ``step`` advance, SGD's momentum buffer decays
    and moves the rows it holds), yet no row is added.
    """
    indices = torch.empty([1, 0], dtype=torch.int64, device=param.device)
    values = param.new_empty([0] + list(param.shape[1:]))
    return torch.sparse_coo_tensor(indices, values, param.shape)


class _CompiledLocalOptimizer(torch.nn.Module):
    """Functional optimizers, one per param group, stepped from an autograd context id.

    Args:
        functional_cls: the functional optimizer class.
        group_params: the local parameters of each group, in the order the optimizer sees them.
        group_kwargs: the constructor's keyword arguments for each group.
        args: positional arguments for ``functional_cls``, after the parameters.
    """

    def __init__(
        self,
        functional_cls: type,
        group_params: List[List[Tensor]],
        group_kwargs: List[Dict[str, Any]],
        args: tuple = (),
    ) -> None:
        super().__init__()
        self.params = group_params
        self.optims = [
            functional_cls(ps, *args, **kw) for ps, kw in zip(group_params, group_kwargs)
        ]
        #: Why ``step_exclusive`` refuses to step ("" while it may): set once the optimizer
        #: stops being exclusive or is released, for a trainer that missed the switch.
        self.refusal = ""

    def forward(self, autograd_ctx_id: int) -> None:
        self.step_context(autograd_ctx_id)

    @torch.jit.export
    def step_exclusive(self, autograd_ctx_id: int) -> None:
        """``step_context`` without the locks, for an optimizer that nobody shares."""
        if self.refusal != "":
            raise RuntimeError(self.refusal)
        self.step_context(autograd_ctx_id)

    @torch.jit.export
    def step_exclusive_with_empty(self, autograd_ctx_id: int, empty: List[List[int]]) -> None:
        """``step_with_empty`` without the locks, in a context this worker holds."""
        if self.refusal != "":
            raise RuntimeError(self.refusal)
        self._step_gradients(dist_autograd.get_gradients(autograd_ctx_id), empty)

    @torch.jit.export
    def step_context(self, autograd_ctx_id: int) -> None:
        """Step every group with the gradients the context holds; others are skipped."""
        grads_by_param = dist_autograd.get_gradients(autograd_ctx_id)
        for j in range(len(self.optims)):
            # One dict lookup per parameter (get), not two (in, then []).
            grads: List[Optional[Tensor]] = [grads_by_param.get(p) for p in self.params[j]]
            self.optims[j].step(grads)

    @torch.jit.export
    def step_with_empty(
        self, autograd_ctx_id: int, in_context: bool, empty: List[List[int]]
    ) -> None:
        """``step_context``, where the parameters at positions ``empty[j]`` of group ``j``
        that the context gives no gradient step with a sparse gradient holding no rows.

        ``in_context`` is False when this worker holds no such context: then every
        parameter but those in ``empty`` is skipped.
        """
        grads_by_param = torch.jit.annotate(Dict[Tensor, Tensor], {})
        if in_context:
            grads_by_param = dist_autograd.get_gradients(autograd_ctx_id)
        self._step_gradients(grads_by_param, empty)

    def _step_gradients(
        self, grads_by_param: Dict[Tensor, Tensor], empty: List[List[int]]
    ) -> None:
        for j in range(len(self.optims)):
            params = self.params[j]
            grads: List[Optional[Tensor]] = [grads_by_param.get(p) for p in params]
            for k in empty[j]:
                if grads[k] is None:
                    grads[k] = empty_sparse_gradient(params[k])
            self.optims[j].step(grads)

    @torch.jit.export
    def set_hyperparameter(self, group: int, name: str, value: List[float]) -> None:
        """Change a hyper-parameter (lr, betas, ...) of one group for the following steps."""
        self.optims[group].set_hyperparameter(name, value)

    @torch.jit.export
    def check_state(
        self, group: int, state: Dict[int, Dict[str, Tensor]]
    ) -> Dict[int, Dict[str, Tensor]]:
        """One group's state checked as ``set_state`` would check it, changing nothing."""
        optim = self.optims[group]
        if hasattr(optim, "check_state"):
            return optim.check_state(state)
        return state

    @torch.jit.export
    def set_state(self, group: int, state: Dict[int, Dict[str, Tensor]]) -> None:
        """Replace one group's whole state."""
        self.optims[group].set_state(state)


class _GroupView:
    """One group of a compiled module, shaped as ``functional.load_torch_state_dict`` wants.

    Attributes are read from a Python copy of the group's functional optimizer (TorchScript
    hands class-typed attributes back as copies); changes go through the module's methods.
    """

    def __init__(self, module: Any, group: int) -> None:
        self._module = module
        self._group = group
        self._copy = module.optims[group]

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_"):
            raise AttributeError(name)
        return getattr(self._copy, name)

    def set_hyperparameter(self, name: str, value: List[float]) -> None:
        self._module.set_hyperparameter(self._group, name, value)

    def check_state(self, state: Dict[int, Dict[str, Tensor]]) -> Dict[int, Dict[str, Tensor]]:
        return self._module.check_state(self._group, state)

    def set_state(self, state: Dict[int, Dict[str, Tensor]]) -> None:
        self._module.set_state(self._group, state)


class _EagerStep:
    """A torch.optim optimizer stepped from an autograd context through ``.grad``."""

    def __init__(
        self,
        optim_cls: type,
        group_params: List[List[Tensor]],
        group_options: List[Dict[str, Any]],
        args: tuple,
        kwargs: Dict[str, Any],
    ) -> None:
        self.group_params = group_params
        self.params = [p for ps in group_params for p in ps]
        groups = [{"params": ps, **options} for ps, options in zip(group_params, group_options)]
        self.optim = optim_cls(groups, *args, **kwargs)

    def __call__(
        self,
        autograd_ctx_id: int,
        empty: Optional[List[List[int]]] = None,
        in_context: bool = True,
    ) -> None:
        """Step with the context's gradients; ``empty`` and ``in_context`` as in
        ``_CompiledLocalOptimizer.step_with_empty``."""
        grads_by_param = dist_autograd.get_gradients(autograd_ctx_id) if in_context else {}
        try:
            for p in self.params:
                p.grad = grads_by_param.get(p)
            for params, positions in zip(self.group_params, empty or []):
                for k in positions:
                    if params[k].grad is None:
                        params[k].grad = empty_sparse_gradient(params[k])
            self.optim.step()
        finally:
            for p in self.params:
                p.grad = None


class LocalOptimizer:
    """What an owner keeps for one DistributedOptimizer: its groups, their step and locks.

    Attributes:
        group_params: the local parameters of each local group.
        params: all of them, flattened in group order.
        global_indices: for each local group, the trainer's indices of its parameters (the
            order the DistributedOptimizer was given them, flattened over its groups).
        locks: the parameters' distinct locks, in acquisition order.
        module: the compiled module (functional path) or None (eager path).
        optim: the torch.optim optimizer (eager path) or None (functional path).
        optimizer_class: the class the user asked for (its state_dict format is used).
        step_context: ``step_context(autograd_ctx_id)``, unlocked.
        trainer: (worker name, key) of the DistributedOptimizer that created this one, for
            ``distopt.exclusive.switch_to_locked``; None when no trainer can be switched.
        exclusive: whether its trainer may step it without the locks (``script_step``).
    """

    def __init__(
        self,
        group_params: List[List[Tensor]],
        global_indices: List[List[int]],
        step_context: Callable[[int], None],
        optim: Any,
        module: Optional[torch.nn.Module] = None,
        optimizer_class: Optional[type] = None,
        trainer: Optional[Tuple[str, int]] = None,
    ) -> None:
        self.group_params = group_params
        self.params = [p for ps in group_params for p in ps]
        self.global_indices = global_indices
        self.trainer = trainer
        with _registry_lock:
            self._param_locks = _param_locks_for(self.params)
            sharers = {lo for pl in self._param_locks for lo in pl.users}
            for pl in self._param_locks:
                pl.users.add(self)
            self.exclusive = module is not None and trainer is not None and not sharers
            #: The exclusive optimizers to switch to the locked path before this one steps.
            self.to_revoke = [lo for lo in sharers if lo.exclusive]
        self.locks = [pl.lock for pl in self._param_locks]
        self.step_context = step_context
        self.optim = optim
        self.module = module
        self.optimizer_class = optimizer_class
        #: Checkpoint parts read and checked by ``distopt.checkpoint``, awaiting a commit.
        self.staged: Dict[str, Any] = {}
        #: The key steps use instead of the RRef: an int pickles cheaply, and an RRef sent
        #: back to its owner costs the RRef protocol's extra messages at every step.
        self.id = next(_ids)
        _live_local_optimizers.add(self)
        _by_id[self.id] = self

    def step_with_empty(self, autograd_ctx_id: int, empty: List[List[int]]) -> None:
        """``step_context``, where the parameters at positions ``empty[j]`` of local group
        ``j`` that the context gives no gradient (or that have no context here) step with
        ``empty_sparse_gradient``; unlocked."""
        in_context = has_context(autograd_ctx_id)
        if self.module is not None:
            self.module.step_with_empty(autograd_ctx_id, in_context, empty)
        else:
            self.step_context(autograd_ctx_id, empty, in_context)

    def locked(self) -> "contextlib.AbstractContextManager[None]":
        """Hold every lock of this optimizer's parameters."""
        return holding(self.locks)

    def apply_changes(self, changes: Sequence[Change]) -> None:
        """Apply hyper-parameter changes; the caller holds the locks."""
        for group, name, value in changes:
            if self.module is not None:
                self.module.set_hyperparameter(group, name, hyperparameter_values(name, value))
            else:
                self.optim.param_groups[group][name] = value

    def hyperparameters(self) -> List[Dict[str, Any]]:
        """Each local group's hyper-parameters as torch.optim's param_groups hold them."""
        if self.module is None:
            return [{k: v for k, v in g.items() if k != "params"} for g in self.optim.param_groups]
        out = []
        for j in range(len(self.group_params)):
            obj = self.module.optims[j]
            group = {}
            for key in group_keys(self.optimizer_class):
                if key == "lr" and getattr(obj, "lr_tensor", None) is not None:
                    group[key] = obj.lr_tensor.clone()
                else:
                    group[key] = getattr(obj, key)
            out.append(group)
        return out

    def torch_state(self, copy: bool = True) -> Dict[int, Dict[str, Any]]:
        """The state in torch.optim's format, keyed by global index.

        The caller holds the locks. With ``copy`` the tensors are copies, one consistent
        snapshot that later steps leave alone; without, they are the optimizer's own, to be
        written out before the locks are released (no second copy of the state in memory).
        """
        out: Dict[int, Dict[str, Any]] = {}
        if self.module is None:
            flat = [i for indices in self.global_indices for i in indices]
            for k, entry in self.optim.state_dict()["state"].items():
                out[flat[k]] = {
                    key: v.clone() if copy and isinstance(v, Tensor) else v
                    for key, v in entry.items()
                }
            return out
        for j, indices in enumerate(self.global_indices):
            sd = to_torch_state_dict(self.module.optims[j], self.optimizer_class, clone=copy)
            for k, entry in sd["state"].items():
                out[indices[k]] = entry
        return out

    def load_torch_state(
        self, hyperparameters: List[Dict[str, Any]], state: Dict[int, Dict[str, Any]]
    ) -> None:
        """Replace the state and hyper-parameters; the caller holds the locks.

        Args:
            hyperparameters: each local group's hyper-parameters, torch.optim's keys.
            state: global index -> that parameter's state in torch.optim's format, for this
                owner's parameters (any other entry is ignored).
        """
        if self.module is None:
            flat = [i for indices in self.global_indices for i in indices]
            position = {i: k for k, i in enumerate(flat)}
            groups, start = [], 0
            for j, indices in enumerate(self.global_indices):
                groups.append(
                    {**hyperparameters[j], "params": list(range(start, start + len(indices)))}
                )
                start += len(indices)
            local_state = {position[i]: entry for i, entry in state.items() if i in position}
            self.optim.load_state_dict({"state": local_state, "param_groups": groups})
            return
        for j, indices in enumerate(self.global_indices):
            part = {
                "state": {k: state[i] for k, i in enumerate(indices) if i in state},
                "param_groups": [{**hyperparameters[j], "params": list(range(len(indices)))}],
            }
            load_torch_state_dict(_GroupView(self.module, j), self.optimizer_class, part)

    def check_torch_state(self, state: Dict[int, Dict[str, Any]]) -> None:
        """Check ``state`` (global index -> torch.optim entry) as loading it would; change nothing.

        A compiled group's part goes through its functional optimizer's ``check_state``
        (every key, shape, dtype and device); messages name parameters by global index. An
        eager optimizer has no template: an entry must have the keys, shapes and dtypes of
        the parameter's current state, or of its group's, where there is one (a fresh eager
        optimizer takes what torch.optim's load_state_dict takes).

        Raises:
            ValueError: naming the parameter, the key and both values.
        """
        if self.module is None:
            self._check_eager_state(state)
            return
        for j, indices in enumerate(self.global_indices):
            view = _GroupView(self.module, j)
            part = {k: state[i] for k, i in enumerate(indices) if i in state}
            try:
                checked_state(view, functional_state(view, part, copy=False))
            except ValueError as exc:
                raise ValueError(_global_indices(str(exc), indices)) from None

    def _check_eager_state(self, state: Dict[int, Dict[str, Any]]) -> None:
        current = self.torch_state(copy=False)
        for indices in self.global_indices:
            group_entry = next((current[i] for i in indices if i in current), None)
            for i in indices:
                entry = state.get(i)
                model = current.get(i, group_entry)
                if not entry or model is None:
                    continue
                missing = sorted(set(model) - set(entry))
                if missing:
                    raise ValueError(
                        f"Invalid state[{i}]: no {missing[0]!r} (expected keys {sorted(model)}, "
                        f"got {sorted(entry)})"
                    )
                for key, value in entry.items():
                    want = model.get(key)
                    if not (isinstance(value, Tensor) and isinstance(want, Tensor)):
                        continue
                    if i in current and value.shape != want.shape:
                        raise ValueError(
                            f"Invalid state[{i}][{key!r}]: shape {list(value.shape)} (expected "
                            f"{list(want.shape)})"
                        )
                    if value.is_floating_point() != want.is_floating_point():
                        raise ValueError(
                            f"Invalid state[{i}][{key!r}]: dtype {value.dtype} (expected "
                            f"{want.dtype})"
                        )

    def describe(self) -> Dict[str, Any]:
        """What the trainer keeps about this optimizer: shapes, dtypes, hyper-parameters.

        ``settable`` lists the keys a compiled optimizer can change between steps (None:
        eager, every key); ``defaults`` is the eager optimizer's (None when compiled).
        """
        hyper = self.hyperparameters()
        compiled = self.module is not None
        return {
            "shapes": [[tuple(p.shape) for p in ps] for ps in self.group_params],
            "dtypes": [[p.dtype for p in ps] for ps in self.group_params],
            "hyper": hyper,
            "settable": (
                settable_hyperparameters(_GroupView(self.module, 0), list(hyper[0]))
                if compiled else None
            ),
            "defaults": None if compiled else dict(self.optim.defaults),
        }

    def end_exclusive(self, refusal: str) -> None:
        """Refuse unlocked steps from now on, with ``refusal`` as the error's message."""
        self.exclusive = False
        module = self.module
        if module is not None:
            module.refusal = refusal

    def close(self) -> None:
        """Drop the optimizer and its state now, before the RRef protocol frees this object."""
        _live_local_optimizers.discard(self)
        _by_id.pop(self.id, None)
        with _registry_lock:
            for pl in self._param_locks:
                pl.users.discard(self)
            self._param_locks = []
        # The trainer's RRef to the scripted module may outlive this object.
        self.end_exclusive("Invalid local optimizer: it was released (expected a live one)")
        self.step_context = _closed_step
        self.group_params = []
        self.params = []
        self.global_indices = []
        self.locks = []
        self.optim = None
        self.module = None
        self.staged = {}


def _global_indices(message: str, indices: List[int]) -> str:
    """``message`` with a group's local ``state[k]`` / ``params[k]`` named by global index."""
    return re.sub(
        r"\b(state|params)\[(\d+)\]",
        lambda m: f"{m.group(1)}[{indices[int(m.group(2))]}]",
        message,
    )


def _closed_step(autograd_ctx_id: int, *more: Any) -> None:
    raise RuntimeError("Invalid local optimizer: it was released (expected a live one)")


_live_local_optimizers: "weakref.WeakSet[LocalOptimizer]" = weakref.WeakSet()
# Weak: the trainer's RRef (through its OwnerRRef here) keeps a local optimizer alive.
_by_id: "weakref.WeakValueDictionary[int, LocalOptimizer]" = weakref.WeakValueDictionary()
_ids = itertools.count(1)


def live_local_optimizers() -> List[LocalOptimizer]:
    """The local optimizers on this worker that are neither released nor freed."""
    return list(_live_local_optimizers)


def _local_groups(specs: List[GroupSpec]) -> Tuple[List[List[Tensor]], List[List[int]]]:
    group_params = [[rref.local_value() for rref in rrefs] for rrefs, _, _ in specs]
    seen: Dict[int, int] = {}
    for (_, indices, _), params in zip(specs, group_params):
        for i, p in zip(indices, params):
            if id(p) in seen and seen[id(p)] != i:
                raise ValueError(
                    f"Invalid params: parameters {seen[id(p)]} and {i} are the same tensor "
                    f"(expected each parameter in one param group only)"
                )
            seen[id(p)] = i
    return group_params, [list(indices) for _, indices, _ in specs]


@returns_failure
def new_compiled_local_optimizer(
    functional_cls: type,
    optimizer_class: type,
    specs: List[GroupSpec],
    args: tuple,
    kwargs: Dict[str, Any],
    trainer: Optional[Tuple[str, int]] = None,
) -> Tuple[rpc.RRef, Dict[str, Any]]:
    """RPC target: compile functional optimizers, one per group, over the local parameters.

    Args:
        functional_cls: the functional stand-in for ``optimizer_class``.
        optimizer_class: the class the user asked for.
        specs: the local part of each param group that has parameters here.
        args: positional arguments for the optimizer, after the parameters.
        kwargs: keyword arguments shared by every group; a group's own options win.
        trainer: (worker name, key) of the creating DistributedOptimizer; None keeps the
            new optimizer on the locked path.

    Returns:
        (an RRef to the new ``LocalOptimizer``, its ``describe()``), or a ``RemoteFailure``.
        The description's ``script`` is an RRef for ``distopt.exclusive.script_step`` when
        the optimizer is exclusive, else None.
    """
    group_params, global_indices = _local_groups(specs)
    accepted = set(inspect.signature(functional_cls).parameters)
    group_kwargs = [
        {**kwargs, **{k: v for k, v in options.items() if k in accepted and k != "params"}}
        for _, _, options in specs
    ]
    with _compile_lock:  # construction may compile the functional class too
        module = _CompiledLocalOptimizer(functional_cls, group_params, group_kwargs, tuple(args))
        scripted = torch.jit.script(module)
    # The scripted module holds its own copies of the optimizers; keep only the module.
    local = LocalOptimizer(
        group_params, global_indices, scripted.step_context, None, scripted, optimizer_class,
        trainer,
    )
    _revoke_exclusive(local)
    script = rpc.RRef(scripted, exclusive.ExclusiveStep) if local.exclusive else None
    return rpc.RRef(local), {**local.describe(), "id": local.id, "script": script}


@returns_failure
def new_eager_local_optimizer(
    optim_cls: type,
    specs: List[GroupSpec],
    args: tuple,
    kwargs: Dict[str, Any],
    trainer: Optional[Tuple[str, int]] = None,
) -> Tuple[rpc.RRef, Dict[str, Any]]:
    """RPC target: construct a torch.optim optimizer over the local param groups.

    An eager optimizer is never exclusive, but it ends the exclusivity of those it shares
    locks with, as a compiled one does.

    Returns:
        (an RRef to the new ``LocalOptimizer``, its ``describe()``), or a ``RemoteFailure``.
    """
    group_params, global_indices = _local_groups(specs)
    eager = _EagerStep(
        optim_cls, group_params, [options for _, _, options in specs], tuple(args), kwargs
    )
    local = LocalOptimizer(
        group_params, global_indices, eager, eager.optim, None, optim_cls, trainer
    )
    _revoke_exclusive(local)
    return rpc.RRef(local), {**local.describe(), "id": local.id, "script": None}


def _revoke_exclusive(local: LocalOptimizer) -> None:
    """Switch the exclusive optimizers ``local`` shares locks with to the locked path.

    Called by the constructor handlers before ``local`` is handed to its trainer, so it
    cannot step before the switch. For each, a nested RPC to its trainer
    (``distopt.exclusive.switch_to_locked``) returns once that trainer has no operation of
    it in flight and sends every later step through ``step_local_optimizer``. A trainer
    that cannot be reached is logged; the optimizer's unlocked steps are refused from then
    on either way. One whose trainer has collected it is released now, and if that leaves
    ``local`` alone on its locks, ``local`` becomes exclusive (a trainer replacing its
    optimizer keeps the fast path). When a sharer is released later, the survivors stay on
    the locked path: simpler than handing exclusivity back, and always safe.
    """
    doomed, local.to_revoke = local.to_revoke, []
    if not doomed:
        return
    me = rpc.get_worker_info().name
    # Whether each one's trainer still has it: all replies, or those that came on a failure.
    alive: Dict[str, bool] = {}
    try:
        alive = fan_out(
            "switch_to_locked",
            {
                str(other.id): (other.trainer[0], exclusive.switch_to_locked,
                                (other.trainer[1], me))
                for other in doomed
            },
            partial=alive.update,
        )
    except DistributedOptimizerError as exc:  # a dead trainer can no longer step its optimizer
        for other in doomed:
            if str(other.id) in exc.failures:
                logger.warning(
                    "could not switch local optimizer %d of trainer %s to the locked path: %s",
                    other.id, other.trainer[0], exc.failures[str(other.id)],
                )
    gone = []
    for other in doomed:
        other.end_exclusive(
            f"Invalid step: local optimizer {other.id} on {me} now shares parameters "
            f"(expected its trainer to step it through the locks)"
        )
        if not alive.get(str(other.id), True):
            gone.append(other)
    for other in gone:
        other.close()
    if gone and local.module is not None and local.trainer is not None:
        with _registry_lock:
            # Whoever registered meanwhile saw ``local`` as not exclusive and is a user now.
            local.exclusive = all(
                lo is local for pl in local._param_locks for lo in pl.users
            )


def step_local_optimizer(
    optimizer: Union[int, rpc.RRef],
    autograd_ctx_id: int,
    changes: Optional[List[Change]] = None,
    empty: Optional[List[List[int]]] = None,
) -> Optional[RemoteFailure]:
    """RPC target of every locked step: lock, apply piggybacked changes, one call, unlock.

    An owner that took no part in the backward pass has no such context: it only applies
    the changes, and steps the parameters in ``empty``.

    Args:
        optimizer: the local optimizer's ``id`` (what the trainer sends), or its RRef.
        autograd_ctx_id: the context holding the gradients.
        changes: hyper-parameter changes made on the trainer since the last step, or None.
        empty: for each local group, the positions of the parameters that step even when
            the context holds no gradient for them, with one holding no rows (a sharded
            table whose gradient fell on other owners; see ``empty_sparse_gradient``).

    Returns:
        None, or a ``RemoteFailure``.
    """
    try:
        if isinstance(optimizer, int):
            local = _by_id.get(optimizer)
            if local is None:
                raise RuntimeError(
                    f"Invalid local optimizer: id {optimizer!r} was released (expected a live one)"
                )
        else:
            local = optimizer.local_value()
        with holding(local.locks):
            if changes:
                try:
                    local.apply_changes(changes)
                except Exception as exc:  # reported even when this owner has no gradients
                    return RemoteFailure.from_exception(exc)
            if empty:
                local.step_with_empty(autograd_ctx_id, empty)
            else:
                local.step_context(autograd_ctx_id)
        return None
    except Exception as exc:
        # Asked only after a failure (one C++ call): an owner outside the context skips.
        if not empty and not has_context(autograd_ctx_id):
            return None
        return RemoteFailure.from_exception(exc)


def release_local_optimizer(optimizer_rref: rpc.RRef) -> None:
    """RPC target: free a local optimizer now (its creator is giving up on it)."""
    optimizer_rref.local_value().close()


def set_local_hyperparameter(
    optimizer_rref: rpc.RRef, name: str, value: List[float], group: Optional[int] = None
) -> None:
    """RPC target: change a hyper-parameter of a compiled local optimizer, under its locks.

    An exclusive optimizer's steps take no lock: call this between its trainer's steps.

    Args:
        optimizer_rref: the local optimizer.
        name: the hyper-parameter.
        value: its new value, as a list of floats.
        group: the local group to change; None changes every group.
    """
    local = optimizer_rref.local_value()
    if local.module is None:
        raise TypeError(
            f"Invalid local optimizer: {type(local.optim).__name__} is eager "
            f"(expected a compiled functional optimizer)"
        )
    groups = range(len(local.group_params)) if group is None else [group]
    with holding(local.locks):
        for j in groups:
            local.module.set_hyperparameter(j, name, value)
