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
import itertools
import weakref
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed.autograd as dist_autograd
import torch.distributed.rpc as rpc
from torch import Tensor

from distopt import _torch, locks
from distopt.compiled_steps import (  # noqa: F401 - in __all__ too, for this module's users
    Change,
    CompiledSteps,
    _cpu_copies,
    _global_indices,
    _torch_optim_base,
    any_gradient,
    bump_versions,
    check_step,
    cuda_device_indices,
    empty_sparse_gradient,
    gradient_rule,
    refuse_misfit,
    synchronize_devices,
)
from distopt.context import has_context

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


#: Why a released local optimizer refuses to step.
_RELEASED = "Invalid local optimizer: it was released (expected a live one)"


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


