"""Local optimizers: what an owner keeps for one DistributedOptimizer, compiled or eager.

``CompiledLocalOptimizer`` holds one functional optimizer per param group inside one
TorchScript module, whose step reads the autograd context's gradients and runs without the
GIL. ``EagerLocalOptimizer`` holds any torch.optim class built with the param groups, fed
through ``.grad``. Both have one interface, ``LocalOptimizer``: unlocked steps (the RPC
targets in ``distopt.owner`` take the locks), hyper-parameter changes, the state in
torch.optim's format keyed by the trainer's global parameter indices, and ``describe`` for
the trainer.

Each takes the locks of its parameters from ``distopt.locks`` and registers as their user;
a compiled one that shares no lock with another is exclusive, which its trainer may step
with no lock at all (``distopt.exclusive``).

A step first checks every group's gradients against what the class takes (``gradient_rule``,
``check_step``) and refuses, before any group steps, one that does not fit; then it steps
the groups in order, recording how far it got, so that a failure part-way says exactly what
changed (``describe_failure``). Every parameter it stepped has its autograd version counter
bumped as torch.optim's in-place update bumps it (``bump_versions``): torch's fused kernels,
this project's native kernels and flat buffers write without bumping it, and a backward pass
that saved a parameter before another trainer's step must fail as torch's does, not run on
the new values.
"""
import abc
import contextlib
import inspect
import itertools
import re
import threading
import weakref
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed.autograd as dist_autograd
import torch.distributed.rpc as rpc
from torch import Tensor

from distopt import _torch, locks
from distopt.context import has_context
from functional import (
    FLAT_CLASSES,
    flatten_parameters,
    load_torch_state_dict,
    to_torch_state_dict,
)
from functional import _native
from functional._common import dtype_name, layout_name
from functional._compile import script
from functional._kernels import unscale_gradients
from functional._state import (
    checked_state,
    functional_state,
    group_keys,
    hyperparameter_values,
    settable_hyperparameters,
)
from functional._validation import hyperparameter_argument

__all__ = [
    "Change",
    "CompiledLocalOptimizer",
    "CompiledSteps",
    "EagerLocalOptimizer",
    "LocalOptimizer",
    "any_gradient",
    "empty_sparse_gradient",
    "bump_versions",
    "check_step",
    "cuda_device_indices",
    "gradient_rule",
    "live_by_id",
    "refuse_misfit",
    "synchronize_devices",
]

#: A piggybacked hyper-parameter change: (local group, name, new value).
Change = Tuple[int, str, Any]

#: Why a released local optimizer refuses to step.
_RELEASED = "Invalid local optimizer: it was released (expected a live one)"

# TorchScript's compiler is not thread-safe; owners create optimizers on many RPC threads.
_compile_lock = threading.Lock()


def _lookup_script(grads_by_param: Dict[Tensor, Tensor], params: List[Tensor]) -> List[Optional[Tensor]]:
    # One dict lookup per parameter (get), not two (in, then []).
    return [grads_by_param.get(p) for p in params]


def _lookup_native(grads_by_param: Dict[Tensor, Tensor], params: List[Tensor]) -> List[Optional[Tensor]]:
    return torch.ops.distopt_flat.lookup(grads_by_param, params)


#: ``[grads_by_param.get(p) for p in params]``: in one native op where it was built
#: (``functional._native``; about 0.34 us a parameter less than the interpreter's loop).
lookup_gradients = _lookup_native if _native.AVAILABLE else _lookup_script


def _check_native(
    params: List[Tensor], grads: List[Optional[Tensor]], kind: int
) -> Tuple[int, List[int]]:
    return torch.ops.distopt_flat.check_step(params, grads, kind)


def _check_script(
    params: List[Tensor], grads: List[Optional[Tensor]], kind: int
) -> Tuple[int, List[int]]:
    # TorchScript cannot read a version counter (``Tensor._version`` is Python's): 0 for
    # each parameter that steps, and ``_bump_script`` bumps every one of them.
    misfit = -1
    before: List[int] = []
    for i in range(len(params)):
        g = grads[i]
        if g is None:
            before.append(-1)
        else:
            before.append(0)
            p = params[i]
            fits = False
            if g.layout == torch.strided:
                fits = kind != 1
            elif g.layout == torch.sparse_coo:
                fits = kind != 0
            if misfit < 0 and (
                not fits or not g.is_same_size(p) or g.dtype != p.dtype or g.device != p.device
            ):
                misfit = i
    return misfit, before


def _bump_native(params: List[Tensor], before: List[int]) -> None:
    torch.ops.distopt_flat.bump_versions(params, before)


def _bump_script(params: List[Tensor], before: List[int]) -> None:
    with torch.no_grad():
        for i in range(len(params)):
            if before[i] >= 0:
                p = params[i]
                # An in-place no-op, which autograd counts as any in-place change.
                p.as_strided_(p.size(), p.stride(), p.storage_offset())


def any_gradient(grads: List[List[Optional[Tensor]]]) -> bool:
    """Whether any group's gradients hold one that is not None: what an owner's step
    replies, so that the trainer can warn when no owner found any (``distopt.optimizer``).

    It stops at the first gradient, the first look in a normal step; TorchScript inlines it
    into the compiled step (its cost: ``benchmarks/rpc_step.py``, "empty-context check").
    """
    for gs in grads:
        for g in gs:
            if g is not None:
                return True
    return False


# A build of the native library older than these ops (another process's) has ``lookup``.
_STEP_OPS = _native.AVAILABLE and hasattr(torch.ops.distopt_flat, "check_step")

#: ``check_step(params, grads, kind)``, before a step: (the position of the first gradient
#: that a class taking ``kind`` (``gradient_rule``) refuses for its layout, shape, dtype or
#: device, or -1; for each parameter the step updates, its version counter, else -1). One
#: native call for a group, where the library was built (``functional._native``).
check_step = _check_native if _STEP_OPS else _check_script

#: ``bump_versions(params, before)``, after the step: bump the version counter of each
#: parameter it updated that it left as ``check_step`` found it, as torch.optim's in-place
#: update bumps it: once, where torch's fused kernels, the native kernels or a flat buffer's
#: kernel (which writes through the buffer) did not; foreach kernels bumped it already, as
#: often as torch.optim's foreach and per-tensor steps do. Without the native library, a
#: TorchScript loop that bumps every updated parameter once more.
bump_versions = _bump_native if _STEP_OPS else _bump_script


def _torch_optim_base(optimizer_class: type) -> Optional[type]:
    """The torch.optim class whose ``step`` ``optimizer_class`` runs (itself, or a subclass
    that keeps its step), or None for any other class."""
    for base in inspect.getmro(optimizer_class):
        if base is torch.optim.Optimizer or not base.__module__.startswith("torch.optim."):
            continue
        same_step = getattr(optimizer_class, "step", None) is getattr(base, "step", None)
        return base if same_step else None
    return None


def gradient_rule(optimizer_class: type, weight_decay: Any = 0.0) -> Tuple[int, str]:
    """Which gradients a step of ``optimizer_class`` takes, checked before any group steps.

    Returns:
        (kind, reason): kind 0 takes dense gradients only, 1 sparse COO ones only, 2 either
        (a class that is not torch.optim's decides in its own step); the reason is what a
        refusal says, in torch.optim's words. SGD and Adagrad take sparse gradients only
        while the group's ``weight_decay`` is 0.
    """
    base = _torch_optim_base(optimizer_class)
    name = optimizer_class.__name__
    if base is None:
        return 2, ""
    if base is torch.optim.SparseAdam:
        return 1, f"{name} does not support dense gradients"
    if base in (torch.optim.SGD, torch.optim.Adagrad):
        if float(weight_decay) != 0.0:
            return 0, (f"{name} does not support sparse gradients with "
                       f"weight_decay={weight_decay!r}")
        return 2, ""
    return 0, f"{name} does not support sparse gradients"


def refuse_misfit(
    param: Tensor, grad: Tensor, kind: int, index: int, group: int, owner: str, reason: str
) -> None:
    """Raise the refusal of ``grad`` (found by ``check_step``) for ``param``, parameter
    ``index`` of param group ``group`` on ``owner``, before any group stepped there: a
    RuntimeError for its kind (``reason``, from ``gradient_rule``), else ValueError."""
    where = f"Invalid gradient of parameter {index} (param group {group}) on {owner}"
    nothing = f"nothing was stepped on {owner}"
    if grad.layout == torch.sparse_coo and kind == 0:
        raise RuntimeError(f"{where}: sparse (expected dense: {reason}); {nothing}")
    if grad.layout == torch.strided and kind == 1:
        raise RuntimeError(f"{where}: dense (expected sparse: {reason}); {nothing}")
    if grad.layout != torch.strided and grad.layout != torch.sparse_coo:
        raise ValueError(
            f"{where}: layout {layout_name(grad.layout)} (expected torch.strided or "
            f"torch.sparse_coo); {nothing}"
        )
    if not grad.is_same_size(param):
        raise ValueError(
            f"{where}: shape {list(grad.shape)} (expected {list(param.shape)}, the "
            f"parameter's); {nothing}"
        )
    if grad.dtype != param.dtype:
        raise ValueError(
            f"{where}: dtype {dtype_name(grad.dtype)} (expected {dtype_name(param.dtype)}, "
            f"the parameter's); {nothing}"
        )
    raise ValueError(
        f"{where}: device {grad.device} (expected {param.device}, the parameter's); {nothing}"
    )


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


def cuda_device_indices(tensors: Sequence[Tensor]) -> List[int]:
    """The indices of the CUDA devices ``tensors`` live on, sorted (none on the CPU)."""
    return sorted({t.device.index or 0 for t in tensors if t.is_cuda})


def synchronize_devices(devices: Sequence[int]) -> None:
    """``torch.cuda.synchronize`` each CUDA device index of ``devices``."""
    for index in devices:
        torch.cuda.synchronize(index)


class LocalOptimizer(abc.ABC):
    """What an owner keeps for one DistributedOptimizer: its groups, their step and locks.

    Attributes:
        group_params: the local parameters of each local group.
        params: all of them, flattened in group order.
        global_indices: for each local group, the trainer's indices of its parameters (the
            order the DistributedOptimizer was given them, flattened over its groups).
        optimizer_class: the class the user asked for (its state_dict format is used).
        trainer: (worker name, key) of the DistributedOptimizer that created this one, for
            ``distopt.exclusive.switch_to_locked``; None when no trainer can be switched.
        group_numbers: the trainer's number of each local group (its param group index).
        owner: this worker's name, for messages.
        locks: the parameters' distinct locks, in acquisition order.
        exclusive: whether its trainer may step it without the locks (``script_step``).
        to_revoke: the exclusive optimizers to switch to the locked path before this one
            steps (``distopt.owner`` empties it).
        staged: checkpoint parts read and checked by ``distopt.state`` and
            ``distopt.checkpoint``, awaiting a commit, by token.
        id: the key steps send instead of the RRef: an int pickles cheaply, and an RRef
            sent back to its owner costs the RRef protocol's extra messages at every step.
        step_context: ``step_context(autograd_ctx_id)``: one step with the context's
            gradients, unlocked; parameters without one are skipped. Returns whether the
            context held a gradient of any of them.
    """

    #: Whether the step is a compiled TorchScript module (which may then be exclusive).
    compiled = False
    step_context: Callable[[int], bool]

    def __init__(
        self,
        group_params: List[List[Tensor]],
        global_indices: List[List[int]],
        optimizer_class: type,
        trainer: Optional[Tuple[str, int]],
        group_numbers: Optional[List[int]] = None,
    ) -> None:
        self.group_params = group_params
        self.params = [p for ps in group_params for p in ps]
        self.global_indices = global_indices
        self.optimizer_class = optimizer_class
        self.trainer = trainer
        self.group_numbers = (
            list(group_numbers) if group_numbers is not None else list(range(len(group_params)))
        )
        self.owner = _this_worker()
        #: The CUDA devices of the parameters (``synchronize``).
        self.cuda_devices = cuda_device_indices(self.params)
        with locks.registry_lock:
            self._param_locks = locks.param_locks_for(self.params)
            sharers = {lo for pl in self._param_locks for lo in pl.users}
            for pl in self._param_locks:
                pl.users.add(self)
            self.exclusive = self._may_be_exclusive() and not sharers
            self.to_revoke: List[LocalOptimizer] = [lo for lo in sharers if lo.exclusive]
        self.locks = [pl.lock for pl in self._param_locks]
        self.staged: Dict[str, Any] = {}
        self.id = next(_ids)
        live_by_id[self.id] = self

    def _may_be_exclusive(self) -> bool:
        # A CUDA owner steps on the locked path, which synchronizes its devices; the
        # TorchScript step cannot (a CPU build of torch has no cuda::synchronize to compile).
        return self.compiled and self.trainer is not None and not self.cuda_devices

    def synchronize(self) -> None:
        """Wait for all work queued on the parameters' CUDA devices (none on a CPU owner).

        TensorPipe runs each request on CUDA streams of its own, and a reply only waits for
        the tensors it carries: the backward pass that made the gradients, or this
        optimizer's update, may still be running on another request's streams (torch's
        DistributedOptimizer has the same gap: pytorch/pytorch#57960). Called before a step
        or a clip reads the gradients, and after a step, so that once the trainer has the
        reply, every later request reads the updated parameters.
        """
        synchronize_devices(self.cuda_devices)

    def locked(self) -> "contextlib.AbstractContextManager[None]":
        """Hold every lock of this optimizer's parameters."""
        return locks.holding(self.locks)

    @abc.abstractmethod
    def step_with_empty(self, autograd_ctx_id: int, empty: List[List[int]]) -> bool:
        """``step_context``, where the parameters at positions ``empty[j]`` of local group
        ``j`` that the context gives no gradient (or that have no context here) step with
        ``empty_sparse_gradient``; unlocked. Returns whether any parameter stepped."""

    @abc.abstractmethod
    def describe_failure(self, message: str, autograd_ctx_id: int) -> Tuple[str, str]:
        """What the latest step in ``autograd_ctx_id``, which failed with ``message``
        (``Type: message``), applied here; the caller holds the locks, or this is an
        exclusive optimizer whose trainer waits for the answer.

        Returns:
            (the message, saying what changed where if the step failed part-way, and
            ``"none"``, ``"part"`` or ``"maybe"``: see
            ``distopt.errors.DistributedOptimizerError``).
        """

    def _groups_text(self, groups: Sequence[int]) -> str:
        """``param group 0 (parameters [0, 2])`` for local groups ``groups``."""
        numbers = ", ".join(str(self.group_numbers[j]) for j in groups)
        label = "param group" if len(groups) == 1 else "param groups"
        indices = sorted(i for j in groups for i in self.global_indices[j])
        return f"{label} {numbers} (parameters {indices})"

    @abc.abstractmethod
    def apply_changes(self, changes: Sequence[Change]) -> None:
        """Apply hyper-parameter changes; the caller holds the locks."""

    @abc.abstractmethod
    def hyperparameters(self) -> List[Dict[str, Any]]:
        """Each local group's hyper-parameters as torch.optim's param_groups hold them."""

    @abc.abstractmethod
    def torch_state(self, copy: bool = True) -> Dict[int, Dict[str, Any]]:
        """The state in torch.optim's format, keyed by global index.

        The caller holds the locks. With ``copy`` the tensors are CPU copies (whatever
        device the state lives on), one consistent snapshot that later steps leave alone and
        that RPC can send without a TensorPipe device map; without, they are the optimizer's
        own, on their devices, to be written out before the locks are released (no second
        copy of the state in memory).
        """

    @abc.abstractmethod
    def load_torch_state(
        self, hyperparameters: List[Dict[str, Any]], state: Dict[int, Dict[str, Any]]
    ) -> None:
        """Replace the state and hyper-parameters; the caller holds the locks.

        Args:
            hyperparameters: each local group's hyper-parameters, torch.optim's keys.
            state: global index -> that parameter's state in torch.optim's format, for this
                owner's parameters (any other entry is ignored).
        """

    @abc.abstractmethod
    def check_torch_state(self, state: Dict[int, Dict[str, Any]]) -> None:
        """Check ``state`` (global index -> torch.optim entry) as loading it would; change
        nothing.

        Raises:
            ValueError: naming the parameter, the key and both values.
        """

    @abc.abstractmethod
    def settable(self, keys: List[str]) -> Optional[List[str]]:
        """Which of the hyper-parameters ``keys`` can change between steps; None: all."""

    @abc.abstractmethod
    def defaults(self) -> Optional[Dict[str, Any]]:
        """The optimizer's own ``defaults`` (eager), or None (compiled)."""

    def describe(self) -> Dict[str, Any]:
        """What the trainer keeps about this optimizer: shapes, dtypes, hyper-parameters.

        ``settable`` lists the keys a compiled optimizer can change between steps (None:
        eager, every key); ``defaults`` is the eager optimizer's (None when compiled).
        """
        hyper = self.hyperparameters()
        return {
            "shapes": [[tuple(p.shape) for p in ps] for ps in self.group_params],
            "dtypes": [[p.dtype for p in ps] for ps in self.group_params],
            "hyper": hyper,
            "settable": self.settable(list(hyper[0])),
            "defaults": self.defaults(),
        }

    def end_exclusive(self, refusal: str) -> None:
        """Refuse unlocked steps from now on, with ``refusal`` as the error's message."""
        self.exclusive = False

    def regain_exclusive(self) -> None:
        """Become exclusive again if no other live optimizer uses any of its locks (its
        sharers were released); only a compiled one with a trainer can."""
        if not self._may_be_exclusive():
            return
        with locks.registry_lock:
            # Whoever registered meanwhile saw this one as not exclusive and is a user now.
            self.exclusive = all(lo is self for pl in self._param_locks for lo in pl.users)

    def close(self) -> None:
        """Drop the optimizer and its state now, before the RRef protocol frees this object."""
        live_by_id.pop(self.id, None)
        with locks.registry_lock:
            for pl in self._param_locks:
                pl.users.discard(self)
            self._param_locks = []
        self.end_exclusive(_RELEASED)
        self.step_context = _closed_step
        self.group_params = []
        self.params = []
        self.global_indices = []
        self.locks = []
        self.staged = {}


class _FunctionalGroups(torch.nn.Module):
    """Functional optimizers, one per param group, stepped from an autograd context id.

    Scripted, this is the whole compiled step: ``distopt.exclusive.script_step`` calls it
    with no Python on the owner. A step from an autograd context checks every group's
    gradients first (``kinds``), steps the groups in order and bumps the version counters of
    the parameters it stepped; it records how far it got for ``describe_failure``.

    Args:
        functional_cls: the functional optimizer class.
        group_params: the local parameters of each group, in the order the optimizer sees them.
        group_kwargs: the constructor's keyword arguments for each group.
        args: positional arguments for ``functional_cls``, after the parameters.
        flat: put each group's small parameters into flat buffers (elementwise classes).

    Attributes:
        owner, group_numbers, indices: for messages: this worker's name, the trainer's
            number of each group and its parameters' global indices (set by the owner).
        kinds, kind_reasons: each group's ``gradient_rule``.
        attempt, checked, stepped: the latest step's context id, whether its gradients
            passed the check, and how many groups it stepped.
    """

    owner: str
    group_numbers: List[int]
    indices: List[List[int]]
    kinds: List[int]
    kind_reasons: List[str]
    attempt: int
    checked: bool
    stepped: int

    def __init__(
        self,
        functional_cls: type,
        group_params: List[List[Tensor]],
        group_kwargs: List[Dict[str, Any]],
        args: tuple = (),
        flat: bool = False,
    ) -> None:
        super().__init__()
        self.params = group_params
        self.optims = [
            functional_cls(ps, *args, **kw) for ps, kw in zip(group_params, group_kwargs)
        ]
        if flat:
            for optim in self.optims:
                if type(optim).__name__ in FLAT_CLASSES:
                    flatten_parameters(optim)
        #: Why ``step_exclusive`` refuses to step ("" while it may): set once the optimizer
        #: stops being exclusive or is released, for a trainer that missed the switch.
        self.refusal = ""
        self.owner = "this worker"
        self.group_numbers = list(range(len(group_params)))
        self.indices = [list(range(len(ps))) for ps in group_params]
        self.kinds = [2 for _ in group_params]
        self.kind_reasons = ["" for _ in group_params]
        self.attempt = -1
        self.checked = False
        self.stepped = 0

    def forward(self, autograd_ctx_id: int) -> bool:
        return self.step_context(autograd_ctx_id)

    @torch.jit.export
    def step_exclusive(self, autograd_ctx_id: int) -> bool:
        """``step_context`` without the locks, for an optimizer that nobody shares."""
        if self.refusal != "":
            raise RuntimeError(self.refusal)
        return self.step_context(autograd_ctx_id)

    @torch.jit.export
    def step_exclusive_with_empty(self, autograd_ctx_id: int, empty: List[List[int]]) -> bool:
        """``step_with_empty`` without the locks, in a context this worker holds."""
        if self.refusal != "":
            raise RuntimeError(self.refusal)
        return self._step_gradients(
            autograd_ctx_id, dist_autograd.get_gradients(autograd_ctx_id), empty
        )

    @torch.jit.export
    def step_context(self, autograd_ctx_id: int) -> bool:
        """Step every group with the gradients the context holds; others are skipped.
        Returns whether the context held a gradient of any parameter here."""
        grads_by_param = dist_autograd.get_gradients(autograd_ctx_id)
        return self._step_checked(autograd_ctx_id, self._gradients(grads_by_param))

    @torch.jit.export
    def step_with_empty(
        self, autograd_ctx_id: int, in_context: bool, empty: List[List[int]]
    ) -> bool:
        """``step_context``, where the parameters at positions ``empty[j]`` of group ``j``
        that the context gives no gradient step with a sparse gradient holding no rows.

        ``in_context`` is False when this worker holds no such context: then every
        parameter but those in ``empty`` is skipped.
        """
        grads_by_param = torch.jit.annotate(Dict[Tensor, Tensor], {})
        if in_context:
            grads_by_param = dist_autograd.get_gradients(autograd_ctx_id)
        return self._step_gradients(autograd_ctx_id, grads_by_param, empty)

    def _step_gradients(
        self, autograd_ctx_id: int, grads_by_param: Dict[Tensor, Tensor], empty: List[List[int]]
    ) -> bool:
        grads = self._gradients(grads_by_param)
        for j in range(len(self.optims)):
            for k in empty[j]:
                if grads[j][k] is None:
                    grads[j][k] = empty_sparse_gradient(self.params[j][k])
        return self._step_checked(autograd_ctx_id, grads)

    def _gradients(self, grads_by_param: Dict[Tensor, Tensor]) -> List[List[Optional[Tensor]]]:
        """Each group's gradients in the context (None where it holds none)."""
        grads = torch.jit.annotate(List[List[Optional[Tensor]]], [])
        for j in range(len(self.optims)):
            grads.append(lookup_gradients(grads_by_param, self.params[j]))
        return grads

    def _step_checked(self, autograd_ctx_id: int, grads: List[List[Optional[Tensor]]]) -> bool:
        """Refuse, before any group steps, a gradient its group cannot take; then step the
        groups in order, bumping the version counters of the parameters each stepped.
        Returns whether any parameter had a gradient (the trainer warns when none had, on
        any owner: ``distopt.optimizer``)."""
        self.attempt = autograd_ctx_id
        self.checked = False
        self.stepped = 0
        found = any_gradient(grads)
        befores = torch.jit.annotate(List[List[int]], [])
        for j in range(len(self.optims)):
            k, before = check_step(self.params[j], grads[j], self.kinds[j])
            if k >= 0:
                g = grads[j][k]
                if g is not None:
                    refuse_misfit(
                        self.params[j][k], g, self.kinds[j], self.indices[j][k],
                        self.group_numbers[j], self.owner, self.kind_reasons[j],
                    )
            befores.append(before)
        self.checked = True
        for j in range(len(self.optims)):
            self.optims[j].step(grads[j])
            bump_versions(self.params[j], befores[j])
            self.stepped = j + 1
        return found

    @torch.jit.export
    def step_group(self, group: int, gradients: List[Optional[Tensor]]) -> None:
        """Step one group with ``gradients`` (its parameters' order; None skips one)."""
        self.optims[group].step(gradients)

    @torch.jit.export
    def step_group_scaled(
        self,
        group: int,
        gradients: List[Optional[Tensor]],
        grad_scale: Optional[Tensor],
        found_inf: Optional[Tensor],
    ) -> None:
        """``step_group`` under a ``GradScaler``, with the ``grad_scale`` (None once
        ``scaler.unscale_`` ran) and ``found_inf`` it hands an optimizer whose
        ``_step_supports_amp_scaling`` is set: as torch.optim steps with them. A class with a
        fused kernel (``step_scaled``) gives them to it, as torch.optim's ``fused=True``
        classes do; every other class's gradients are divided in place and its step skipped
        after an inf or NaN, as ``GradScaler.unscale_`` and ``step`` treat torch.optim's
        other classes (``unscale_gradients``)."""
        optim = self.optims[group]
        if hasattr(optim, "step_scaled"):
            optim.step_scaled(gradients, grad_scale, found_inf)
        elif not unscale_gradients(gradients, grad_scale, found_inf):
            optim.step(gradients)

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


class CompiledSteps:
    """Functional optimizers, one per param group, in one scripted module, with their
    state in torch.optim's format keyed by global index: what the data-parallel optimizers
    step (per bucket and group; no owner, no locks, no registry), and what an RPC owner's
    ``CompiledLocalOptimizer`` steps.

    Args:
        functional_cls: the functional stand-in for ``optimizer_class``.
        optimizer_class: the class the user asked for.
        group_params: the parameters of each group.
        global_indices: for each group, its parameters' global indices.
        group_options: each group's options as the user gave them (those
            ``functional_cls`` does not take are left out).
        args: positional arguments for ``functional_cls``, after the parameters.
        kwargs: keyword arguments shared by every group; a group's own options win.
        flat: put each group's small parameters into flat buffers, for the elementwise
            classes (``functional.flatten_parameters``).

    Attributes:
        module: the scripted module (it holds its own copies of the functional optimizers).
    """

    def __init__(
        self,
        functional_cls: type,
        optimizer_class: type,
        group_params: List[List[Tensor]],
        global_indices: List[List[int]],
        group_options: List[Dict[str, Any]],
        args: tuple,
        kwargs: Dict[str, Any],
        flat: bool = False,
    ) -> None:
        accepted = set(inspect.signature(functional_cls).parameters)
        group_kwargs = [
            {**kwargs, **{k: v for k, v in options.items() if k in accepted and k != "params"}}
            for options in group_options
        ]
        with _compile_lock:  # construction may compile the functional class too
            module = _FunctionalGroups(
                functional_cls, group_params, group_kwargs, tuple(args), flat
            )
            self.module: Any = script(module)
        self.group_params = group_params
        self.global_indices = global_indices
        self.optimizer_class = optimizer_class

    def apply_changes(self, changes: Sequence[Change]) -> None:
        """Apply hyper-parameter changes, (group, name, value) each."""
        for group, name, value in changes:
            self.module.set_hyperparameter(group, name, hyperparameter_values(name, value))

    def hyperparameters(self) -> List[Dict[str, Any]]:
        """Each group's hyper-parameters as torch.optim's param_groups hold them."""
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
        """The state in torch.optim's format, keyed by global index (with ``copy``, CPU
        copies; without, the optimizers' own tensors)."""
        out: Dict[int, Dict[str, Any]] = {}
        for j, indices in enumerate(self.global_indices):
            sd = to_torch_state_dict(self.module.optims[j], self.optimizer_class, clone=False)
            for k, entry in sd["state"].items():
                out[indices[k]] = _cpu_copies(entry) if copy else entry
        return out

    def load_torch_state(
        self, hyperparameters: List[Dict[str, Any]], state: Dict[int, Dict[str, Any]]
    ) -> None:
        """Replace the state and hyper-parameters (``state`` keyed by global index; other
        entries are ignored)."""
        for j, indices in enumerate(self.global_indices):
            part = {
                "state": {k: state[i] for k, i in enumerate(indices) if i in state},
                "param_groups": [{**hyperparameters[j], "params": list(range(len(indices)))}],
            }
            load_torch_state_dict(_GroupView(self.module, j), self.optimizer_class, part)

    def check_torch_state(self, state: Dict[int, Dict[str, Any]]) -> None:
        """Each group's part goes through its functional optimizer's ``check_state`` (every
        key, shape, dtype and device); messages name parameters by global index."""
        for j, indices in enumerate(self.global_indices):
            view = _GroupView(self.module, j)
            part = {k: state[i] for k, i in enumerate(indices) if i in state}
            try:
                checked_state(view, functional_state(view, part, copy=False))
            except ValueError as exc:
                raise ValueError(_global_indices(str(exc), indices)) from None

    def settable(self, keys: List[str]) -> Optional[List[str]]:
        """Which of the hyper-parameters ``keys`` can change between steps; None: all."""
        return settable_hyperparameters(_GroupView(self.module, 0), keys)

    def set_hyperparameter(self, group: int, name: str, value: Any) -> None:
        """Change a hyper-parameter of one group: ``value`` as the functional classes'
        ``set_hyperparameter`` takes it (a float, or a list of floats)."""
        self.module.set_hyperparameter(group, name, hyperparameter_argument(name, value))

    def close(self) -> None:
        """Drop the module and its state."""
        self.module = None


class CompiledLocalOptimizer(CompiledSteps, LocalOptimizer):
    """Functional optimizers, one per local param group, in one scripted module.

    Args:
        functional_cls: the functional stand-in for ``optimizer_class``.
        optimizer_class: the class the user asked for.
        group_params: the local parameters of each local group.
        global_indices: for each local group, the trainer's indices of its parameters.
        group_options: each group's options as the user gave them (those
            ``functional_cls`` does not take are left out).
        args: positional arguments for ``functional_cls``, after the parameters.
        kwargs: keyword arguments shared by every group; a group's own options win.
        trainer: (worker name, key) of the creating DistributedOptimizer; None keeps the
            optimizer on the locked path.
        flat: put each group's small parameters into flat buffers, for the elementwise
            classes (``functional.flatten_parameters``).
        group_numbers: the trainer's number of each local group; None: 0, 1, ...

    Attributes:
        module: the scripted module (it holds its own copies of the functional optimizers).
    """

    compiled = True

    def __init__(self, *steps: Any, trainer: Optional[Tuple[str, int]] = None,
                 flat: bool = False, group_numbers: Optional[List[int]] = None) -> None:
        """``steps``: ``CompiledSteps``'s arguments up to ``kwargs``."""
        CompiledSteps.__init__(self, *steps, flat=flat)
        # The scripted method itself: no Python frame between the step RPC and TorchScript.
        self.step_context = self.module.step_context
        LocalOptimizer.__init__(self, self.group_params, self.global_indices,
                                self.optimizer_class, trainer, group_numbers)
        self.module.owner = self.owner
        self.module.group_numbers = self.group_numbers
        self.module.indices = self.global_indices
        self._set_gradient_rules()

    def _set_gradient_rules(self) -> None:
        """Each group's ``gradient_rule`` on the module, for its weight decay now (SGD and
        Adagrad take sparse gradients without it only)."""
        rules = []
        for j in range(len(self.group_params)):
            weight_decay = 0.0
            if _torch_optim_base(self.optimizer_class) in (torch.optim.SGD, torch.optim.Adagrad):
                weight_decay = getattr(self.module.optims[j], "weight_decay", 0.0)
            rules.append(gradient_rule(self.optimizer_class, weight_decay))
        self.module.kinds = [kind for kind, _ in rules]
        self.module.kind_reasons = [reason for _, reason in rules]

    def apply_changes(self, changes: Sequence[Change]) -> None:
        CompiledSteps.apply_changes(self, changes)
        if any(name == "weight_decay" for _, name, _ in changes):
            self._set_gradient_rules()

    def set_hyperparameter(self, group: int, name: str, value: Any) -> None:
        CompiledSteps.set_hyperparameter(self, group, name, value)
        if name == "weight_decay":
            self._set_gradient_rules()

    def load_torch_state(
        self, hyperparameters: List[Dict[str, Any]], state: Dict[int, Dict[str, Any]]
    ) -> None:
        CompiledSteps.load_torch_state(self, hyperparameters, state)
        self._set_gradient_rules()

    def step_with_empty(self, autograd_ctx_id: int, empty: List[List[int]]) -> bool:
        return self.module.step_with_empty(autograd_ctx_id, has_context(autograd_ctx_id), empty)

    def describe_failure(self, message: str, autograd_ctx_id: int) -> Tuple[str, str]:
        """The scripted step's record: refused before any group stepped (the refusal says
        so), or the groups stepped before the one that raised, which is unchanged if its
        functional class's own checks refused (they run before any change) and partly
        stepped if a kernel failed."""
        module, n = self.module, len(self.group_params)
        if module is None or module.attempt != autograd_ctx_id or not module.checked:
            return message, "none"
        j = module.stepped
        if j >= n:
            return f"{message} (raised after every param group on {self.owner} stepped)", "part"
        said = []
        if j > 0:
            said.append(f"{self._groups_text(range(j))} stepped")
        said.append(f"{self._groups_text([j])} raised this, unchanged if its own checks "
                    f"refused the step, else partly stepped")
        if j + 1 < n:
            said.append(f"{self._groups_text(range(j + 1, n))} not stepped")
        message = _global_indices(message, self.global_indices[j])
        return f"{message} (part-way through the step on {self.owner}: {'; '.join(said)})", "part"

    def defaults(self) -> Optional[Dict[str, Any]]:
        return None

    def end_exclusive(self, refusal: str) -> None:
        super().end_exclusive(refusal)
        # The trainer's RRef to the scripted module may outlive this object.
        if self.module is not None:
            self.module.refusal = refusal

    def close(self) -> None:
        LocalOptimizer.close(self)
        self.module = None


class EagerLocalOptimizer(LocalOptimizer):
    """A torch.optim optimizer over the local param groups, stepped through ``.grad``.

    Args:
        optim_cls: the torch.optim class.
        group_params: the local parameters of each local group.
        global_indices: for each local group, the trainer's indices of its parameters.
        group_options: each group's options as the user gave them.
        args: positional arguments for ``optim_cls``, after the param groups.
        kwargs: keyword arguments for ``optim_cls``.
        trainer: (worker name, key) of the creating DistributedOptimizer, or None.
        group_numbers: the trainer's number of each local group; None: 0, 1, ...

    Attributes:
        optim: the torch.optim optimizer.
    """

    def __init__(
        self,
        optim_cls: type,
        group_params: List[List[Tensor]],
        global_indices: List[List[int]],
        group_options: List[Dict[str, Any]],
        args: tuple,
        kwargs: Dict[str, Any],
        trainer: Optional[Tuple[str, int]] = None,
        group_numbers: Optional[List[int]] = None,
    ) -> None:
        groups = [{"params": ps, **options} for ps, options in zip(group_params, group_options)]
        self.optim: Any = optim_cls(groups, *args, **kwargs)
        super().__init__(group_params, global_indices, optim_cls, trainer, group_numbers)
        # The latest step's record for ``describe_failure``: its context id, whether its
        # gradients passed the check, and the version counters before it.
        self._attempt = -1
        self._checked = False
        self._before: List[int] = []
        self._stepping: List[int] = []

    def step_context(
        self,
        autograd_ctx_id: int,
        empty: Optional[List[List[int]]] = None,
        in_context: bool = True,
    ) -> bool:
        """Step with the context's gradients; ``empty`` and ``in_context`` as in
        ``step_with_empty``. Gradients are checked first, and parameters the class stepped
        without bumping their version counters (a fused torch.optim step) get one bump.
        Returns whether any parameter had a gradient."""
        grads_by_param = dist_autograd.get_gradients(autograd_ctx_id) if in_context else {}
        grads = [[grads_by_param.get(p) for p in params] for params in self.group_params]
        for j, positions in enumerate(empty or []):
            for k in positions:
                if grads[j][k] is None:
                    grads[j][k] = empty_sparse_gradient(self.group_params[j][k])
        self._attempt, self._checked = autograd_ctx_id, False
        for j, (params, gs) in enumerate(zip(self.group_params, grads)):
            kind, reason = gradient_rule(
                self.optimizer_class, self.optim.param_groups[j].get("weight_decay", 0.0)
            )
            k = check_step(params, gs, kind)[0]
            if k >= 0:
                refuse_misfit(params[k], gs[k], kind, self.global_indices[j][k],
                              self.group_numbers[j], self.owner, reason)
        self._checked = True
        flat = [g for gs in grads for g in gs]
        self._stepping = [k for k, g in enumerate(flat) if g is not None]
        self._before = [_torch.version(p) for p in self.params]
        try:
            for p, g in zip(self.params, flat):
                p.grad = g
            self.optim.step()
        finally:
            for p in self.params:
                p.grad = None
        for k in self._stepping:
            if _torch.version(self.params[k]) == self._before[k]:
                torch.autograd.graph.increment_version(self.params[k])
        return bool(self._stepping)

    def describe_failure(self, message: str, autograd_ctx_id: int) -> Tuple[str, str]:
        """Which parameters the failed step changed in place, by their version counters (a
        torch.optim step is one call: its progress through the groups is not seen)."""
        if self._attempt != autograd_ctx_id or not self._checked:
            return message, "none"
        flat = [i for indices in self.global_indices for i in indices]
        changed = [
            flat[k] for k in self._stepping if _torch.version(self.params[k]) != self._before[k]
        ]
        if not changed:
            # An optimizer that writes through ``.data`` moves no version counter: the step
            # raised inside the class's step(), which may have changed parameters unseen.
            return (f"{message} (part-way through the step on {self.owner}: the optimizer "
                    f"raised inside its step(); no parameter's autograd version counter "
                    f"moved, but changes made through .data move none)", "maybe")
        unchanged = [flat[k] for k in self._stepping if flat[k] not in changed]
        said = f"parameters {sorted(changed)} changed in place"
        if unchanged:
            said += f", parameters {sorted(unchanged)} did not"
        return (f"{message} (part-way through the step on {self.owner}: {said}, by their "
                f"autograd version counters)", "part")

    def step_with_empty(self, autograd_ctx_id: int, empty: List[List[int]]) -> bool:
        return self.step_context(autograd_ctx_id, empty, has_context(autograd_ctx_id))

    def apply_changes(self, changes: Sequence[Change]) -> None:
        for group, name, value in changes:
            self.optim.param_groups[group][name] = value

    def hyperparameters(self) -> List[Dict[str, Any]]:
        return [{k: v for k, v in g.items() if k != "params"} for g in self.optim.param_groups]

    def torch_state(self, copy: bool = True) -> Dict[int, Dict[str, Any]]:
        out: Dict[int, Dict[str, Any]] = {}
        flat = [i for indices in self.global_indices for i in indices]
        for k, entry in self.optim.state_dict()["state"].items():
            out[flat[k]] = _cpu_copies(entry) if copy else dict(entry)
        return out

    def load_torch_state(
        self, hyperparameters: List[Dict[str, Any]], state: Dict[int, Dict[str, Any]]
    ) -> None:
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

    def check_torch_state(self, state: Dict[int, Dict[str, Any]]) -> None:
        """An eager optimizer has no template: an entry must have the keys, shapes and
        dtypes of the parameter's current state, or of its group's, where there is one (a
        fresh eager optimizer takes what torch.optim's load_state_dict takes)."""
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

    def settable(self, keys: List[str]) -> Optional[List[str]]:
        return None

    def defaults(self) -> Optional[Dict[str, Any]]:
        return dict(self.optim.defaults)

    def close(self) -> None:
        super().close()
        self.optim = None


def _global_indices(message: str, indices: List[int]) -> str:
    """``message`` with a group's local ``state[k]`` / ``params[k]`` / ``gradients[k]``
    named by global index."""
    return re.sub(
        r"\b(state|params|gradients)\[(\d+)\]",
        lambda m: (f"{m.group(1)}[{indices[int(m.group(2))]}]"
                   if int(m.group(2)) < len(indices) else m.group(0)),
        message,
    )


def _this_worker() -> str:
    """This worker's name, for messages ("this worker" outside an RPC world: a local
    optimizer built directly, as the data-parallel steps' and tests' are)."""
    try:
        return rpc.get_worker_info().name
    except RuntimeError:  # RPC has not been initialized
        return "this worker"


def _closed_step(autograd_ctx_id: int, *more: Any) -> None:
    raise RuntimeError(_RELEASED)


#: The live local optimizers on this worker by ``id`` (neither released nor freed). Weak:
#: the trainer's RRef (through its OwnerRRef here) keeps a local optimizer alive.
live_by_id: "weakref.WeakValueDictionary[int, LocalOptimizer]" = weakref.WeakValueDictionary()
_ids = itertools.count(1)


def _cpu_copies(entry: Dict[str, Any]) -> Dict[str, Any]:
    """A state entry with every tensor copied to the CPU (a copy even where it is there)."""
    return {
        key: v.detach().to("cpu", copy=True) if isinstance(v, Tensor) else v
        for key, v in entry.items()
    }
