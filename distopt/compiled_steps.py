"""The compiled steps: functional optimizers, one per param group, in one TorchScript module.

``CompiledSteps`` is what every compiled path steps: an RPC owner's
``distopt.local_optimizer.CompiledLocalOptimizer`` (from an autograd context, without the
GIL), and the data-parallel optimizers (per bucket and param group,
``distopt.parallel.units``). It keeps the state in torch.optim's format keyed by global
parameter index and takes hyper-parameter changes. Here too: the checks a step from an
autograd context makes before any group steps (``gradient_rule``, ``check_step``,
``refuse_misfit``) and the version-counter bumps after it (``bump_versions``).
"""
import inspect
import re
import threading
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed.autograd as dist_autograd
from torch import Tensor

from functional import FLAT_CLASSES, flatten_parameters, load_torch_state_dict, to_torch_state_dict
from functional import _native
from functional._common import dtype_name, layout_name
from functional._compile import script
from functional._kernels import unscale_gradients
from functional._state import (
    checked_by,
    functional_state,
    group_keys,
    hyperparameter_values,
    settable_hyperparameters,
)
from functional._validation import hyperparameter_argument

__all__ = [
    "Change",
    "CompiledSteps",
    "any_gradient",
    "bump_versions",
    "check_step",
    "cuda_device_indices",
    "empty_sparse_gradient",
    "gradient_rule",
    "lookup_gradients",
    "refuse_misfit",
    "synchronize_devices",
]

#: A piggybacked hyper-parameter change: (local group, name, new value).
Change = Tuple[int, str, Any]

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
                checked_by(view, functional_state(view, part, copy=False))
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


def _global_indices(message: str, indices: List[int]) -> str:
    """``message`` with a group's local ``state[k]`` / ``params[k]`` / ``gradients[k]``
    named by global index."""
    return re.sub(
        r"\b(state|params|gradients)\[(\d+)\]",
        lambda m: (f"{m.group(1)}[{indices[int(m.group(2))]}]"
                   if int(m.group(2)) < len(indices) else m.group(0)),
        message,
    )


def _cpu_copies(entry: Dict[str, Any]) -> Dict[str, Any]:
    """A state entry with every tensor copied to the CPU (a copy even where it is there)."""
    return {
        key: v.detach().to("cpu", copy=True) if isinstance(v, Tensor) else v
        for key, v in entry.items()
    }


