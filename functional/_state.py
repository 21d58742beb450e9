"""Lossless conversion between a functional optimizer's state and torch.optim's state_dict.

torch.optim's format is ``{"state": {index: {key: Tensor}}, "param_groups": [{..., "params":
[index, ...]}]}``. A functional optimizer is one param group over its parameters, numbered in
the order it was given them, and keeps its state under torch.optim's keys, so the conversion
is a copy plus the hyper-parameters.
"""
import copy
import inspect
import numbers
from typing import Any, Dict, List, Optional

import torch
from torch import Tensor

from functional._scripted import ScriptedOptimizer
from functional._validation import argument_hints, check_type
from functional.blockwise_adam import QUANTISED_KEYS, is_quantised_entry
from functional.rowwise import ROW_STATE_KEYS

_NOT_GROUP_KEYS = ("self", "params")
#: Group keys that choose kernels, not the numbers: a state_dict's values are not adopted
#: (a torch.optim state_dict saved with foreach=False loads into a fused optimizer).
IMPLEMENTATION_KEYS = ("foreach", "fused", "capturable", "differentiable")
#: torch.optim classes whose ``step`` state is a Python int rather than a 0-dim tensor.
_INT_STEP_CLASSES = ("SparseAdam",)


def _instance(optim: Any) -> Any:
    """The functional optimizer object (a Python copy sharing tensors, for a scripted one;
    the object itself from ``script_optimizer`` under ``PYTORCH_JIT=0``)."""
    if isinstance(optim, (torch.jit.ScriptModule, ScriptedOptimizer)):
        return optim.optim
    return optim


def group_keys(torch_cls: type) -> List[str]:
    """The hyper-parameter names torch.optim keeps in each param group for ``torch_cls``."""
    sig = inspect.signature(torch_cls.__init__)
    return [n for n in sig.parameters if n not in _NOT_GROUP_KEYS]


def torch_group(torch_cls: type, group: Dict[str, Any]) -> Dict[str, Any]:
    """A copy of a state_dict's param ``group`` with the keys ``torch_cls.load_state_dict``
    adds: a state_dict saved by an older torch lacks the options added since (``maximize``,
    ``foreach``, ``decoupled_weight_decay``, ...), and torch.optim loads it with their
    defaults. The class's own ``__setstate__`` (which unpickling runs, and ``load_state_dict``
    ends with) fills them in, run on a bare instance, so no copy of its defaults can drift
    from torch's. A class whose ``__setstate__`` cannot run so fills nothing.
    """
    filled = dict(group)
    holder = torch_cls.__new__(torch_cls)
    try:
        holder.__setstate__({"defaults": {}, "state": {}, "param_groups": [filled]})
    except Exception:  # a registered class of the user's, with its own __setstate__
        return dict(group)
    return filled


def missing_group_keys(torch_cls: type, group: Dict[str, Any]) -> List[str]:
    """The keys of a ``torch_cls`` param group that a saved ``group`` lacks, once the keys an
    older torch did not save are filled as ``torch_cls.load_state_dict`` fills them
    (``torch_group``); sorted, ``"params"`` included where it is missing."""
    expected = set(group_keys(torch_cls)) | {"params"}
    return sorted(expected - set(torch_group(torch_cls, group)))


def held_value(obj: Any, key: str) -> Any:
    """The hyper-parameter ``key`` that the functional optimizer ``obj`` steps with now, as a
    torch.optim param group holds it: a Tensor lr or Tensor betas given to the constructor
    (perhaps changed in place since) as copies, else a copy of the attribute."""
    if key == "lr" and getattr(obj, "lr_tensor", None) is not None:
        return obj.lr_tensor.clone()
    if key == "betas" and getattr(obj, "betas_tensor", None) is not None:
        return tuple(t.clone() for t in obj.betas_tensor)
    return copy.deepcopy(getattr(obj, key))


def to_torch_state_dict(optim: Any, torch_cls: type, clone: bool = True) -> Dict[str, Any]:
    """The state of ``optim`` as ``torch_cls().state_dict()`` would give it.

    Args:
        optim: a functional optimizer, or a module from ``script_optimizer``.
        torch_cls: the torch.optim class whose format to produce.
        clone: copy the state tensors (the default), so that later steps do not change
            them; False returns the optimizer's own tensors, as torch.optim's state_dict
            does (for writing them out at once without a second copy in memory).

    Returns:
        A new dict.
    """
    obj = _instance(optim)
    group: Dict[str, Any] = {}
    for key in group_keys(torch_cls):
        group[key] = held_value(obj, key)
    group["params"] = list(range(len(obj.params)))
    state = {
        int(i): {k: _to_torch_value(torch_cls, k, v, clone) for k, v in entry.items()}
        for i, entry in sorted(obj.state.items())
    }
    return {"state": state, "param_groups": [group]}


def own_shape(key: str, value: Tensor, entry: Dict[str, Any], param_shape: Any) -> bool:
    """Whether state tensor ``entry[key]`` may have a shape other than its parameter's, its
    class's own ``check_state`` checking it: Adafactor's factored moments, a row-wise class's
    one value per row, a blockwise-quantised parameter's codes and scales. The one rule of
    both checkers of saved state (this module's and ``distopt.saved_state``)."""
    if key in ("row_var", "col_var", "variance"):
        return True
    if key in ROW_STATE_KEYS and tuple(value.shape) == tuple(param_shape[:1]):
        return True
    return key in QUANTISED_KEYS and is_quantised_entry(entry)


def check_torch_state_dict(optim: Any, torch_cls: type, state_dict: Dict[str, Any]) -> None:
    """Raise ValueError naming the first difference between ``state_dict`` and ``optim``."""
    obj = _instance(optim)
    if not isinstance(state_dict, dict) or set(state_dict) != {"state", "param_groups"}:
        got = sorted(state_dict) if isinstance(state_dict, dict) else type(state_dict).__name__
        raise ValueError(f"Invalid state_dict: keys {got!r} (expected ['param_groups', 'state'])")
    groups = state_dict["param_groups"]
    if len(groups) != 1:
        raise ValueError(f"Invalid state_dict: {len(groups)} param groups (expected 1)")
    group = torch_group(torch_cls, groups[0])
    missing = missing_group_keys(torch_cls, groups[0])
    if missing:
        raise ValueError(
            f"Invalid state_dict: param group lacks {missing!r}, so it is not a "
            f"{torch_cls.__name__} state_dict"
        )
    n = len(obj.params)
    if list(group["params"]) != list(range(n)):
        raise ValueError(
            f"Invalid state_dict: param group holds {len(group['params'])} parameters "
            f"(expected {n}, numbered 0..{n - 1})"
        )
    for i, entry in state_dict["state"].items():
        if not 0 <= int(i) < n:
            raise ValueError(f"Invalid state_dict: state for parameter {i!r} (expected 0..{n - 1})")
        p = obj.params[int(i)]
        for key, value in entry.items():
            value = _from_torch_value(key, value)
            if not isinstance(value, Tensor):
                raise ValueError(
                    f"Invalid state_dict: state[{i}][{key!r}] is {type(value).__name__} "
                    f"(expected a Tensor)"
                )
            if (value.dim() > 0 and key != "step" and value.shape != p.shape
                    and value.numel() > 1 and not own_shape(key, value, entry, p.shape)):
                raise ValueError(
                    f"Invalid state_dict: state[{i}][{key!r}] has shape {tuple(value.shape)} "
                    f"(expected {tuple(p.shape)}, the shape of parameter {i})"
                )


def load_torch_state_dict(optim: Any, torch_cls: type, state_dict: Dict[str, Any]) -> None:
    """Load a torch.optim-format state_dict into ``optim`` (eager or scripted).

    Everything is checked before anything changes: the hyper-parameters' kinds against
    ``torch_cls``'s constructor, the state by the optimizer's own ``check_state`` (keys,
    shapes, dtypes, devices). Hyper-parameters that can change between steps (lr, betas, ...)
    are taken from the state_dict; ``IMPLEMENTATION_KEYS`` (foreach, fused, ...) keep this
    optimizer's values; the others must already agree.

    Raises:
        ValueError: the state_dict is for another class, another parameter count or shapes,
            would change a hyper-parameter fixed at construction, or holds a state entry that
            lacks a key or has a tensor of another shape, dtype or device.
    """
    check_torch_state_dict(optim, torch_cls, state_dict)
    obj = _instance(optim)
    group = torch_group(torch_cls, state_dict["param_groups"][0])
    changes: Dict[str, List[float]] = {}
    settable: Optional[List[str]] = None
    for key in group_keys(torch_cls):
        if key in IMPLEMENTATION_KEYS:
            continue
        new, old = group[key], held_value(obj, key)
        if key == "lr" and isinstance(new, Tensor):
            new = float(new.item())
        if _same(new, old):
            continue
        if settable is None:
            settable = settable_hyperparameters(optim, group_keys(torch_cls))
        if key not in settable:
            raise ValueError(
                f"Invalid state_dict: {key}={new!r} differs from this optimizer's {old!r} "
                f"and cannot change after construction"
            )
        check_hyperparameter(torch_cls, key, new, "state_dict")
        changes[key] = hyperparameter_values(key, new)
    state = checked_by(optim, functional_state(obj, state_dict["state"]))
    for key, value in changes.items():
        optim.set_hyperparameter(key, value)
    optim.set_state(state)


def functional_state(
    obj: Any, torch_state: Dict[Any, Dict[str, Any]], copy: bool = True
) -> Dict[int, Dict[str, Tensor]]:
    """torch.optim state entries as a functional optimizer keeps them: ``step`` as a float32
    tensor, other floating-point tensors cast to their parameter's dtype (not a blockwise
    optimizer's) and device where the parameter is real (torch.optim's load_state_dict
    casts the same way; a complex parameter's real scalars, such as NAdam's
    ``mu_product``, stay real); copies, unless ``copy`` is False (to check a state without
    a second one in memory)."""
    state: Dict[int, Dict[str, Tensor]] = {}
    # Blockwise-quantised state keeps its dtypes (float32 scales and small parameters'
    # float32 moments beside a bfloat16 parameter), as the class's own load_state_dict does.
    cast = not bool(getattr(obj, "blockwise", False))
    for i, entry in torch_state.items():
        p = obj.params[int(i)]
        entry = {k: _from_torch_value(k, v) for k, v in entry.items()}
        for k, v in entry.items():
            if v.is_meta:
                raise ValueError(
                    f"Invalid state[{i}][{k!r}]: a tensor on the meta device, which holds no "
                    f"values (expected one on {p.device} or the CPU)"
                )
        if copy:
            entry = {k: v.detach().clone() for k, v in entry.items()}
        state[int(i)] = {
            k: (v.detach().to(torch.float32) if k == "step" else
                v.detach().to(device=p.device, dtype=p.dtype)
                if cast and v.is_floating_point() and p.is_floating_point() else
                v.detach().to(device=p.device) if p.is_complex() and v.is_complex() else
                v.detach())
            for k, v in entry.items()
        }
    return state


def checked_by(
    optim: Any, state: Dict[int, Dict[str, Tensor]]
) -> Dict[int, Dict[str, Tensor]]:
    """``optim.check_state(state)`` (nothing changes), with a compiled optimizer's error
    raised as the ValueError it is; a registered class without ``check_state`` is not checked.

    Raises:
        ValueError: naming the parameter, the key and both values.
    """
    check = getattr(optim, "check_state", None)
    if check is None:
        return state
    try:
        return check(state)
    except torch.jit.Error as exc:
        raise ValueError(script_error_message(exc)) from None


def script_error_message(exc: BaseException) -> str:
    """The ``message`` of TorchScript's ``builtins.Type: message``, the last line of its error."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    last = lines[-1] if lines else str(exc)
    if last.startswith("builtins."):
        last = last.split(": ", 1)[-1]
    return last


def check_hyperparameter(torch_cls: type, key: str, value: Any, what: str) -> None:
    """A hyper-parameter a state_dict brings must be of the kind ``torch_cls``'s constructor
    takes (a pair for betas, a number for lr, ...), checked before anything changes.

    Raises:
        ValueError: ``Invalid <what>: <key> <value> (expected ...)``.
    """
    hint = argument_hints(torch_cls).get(key)
    if hint is None:
        return
    try:
        check_type(key, value, hint)
    except TypeError as exc:
        message = str(exc)
        if message.startswith("Invalid "):
            message = message[len("Invalid "):]
        raise ValueError(f"Invalid {what}: {message}") from None


def _to_torch_value(torch_cls: type, key: str, value: Tensor, clone: bool = True) -> Any:
    """One state entry in torch.optim's form (SparseAdam's ``step`` is an int)."""
    if key == "step" and torch_cls.__name__ in _INT_STEP_CLASSES:
        return int(value.item())
    return value.clone() if clone else value


def _from_torch_value(key: str, value: Any) -> Any:
    """A state entry as a functional optimizer keeps it: a Python number step becomes a tensor."""
    if key == "step" and isinstance(value, (int, float)) and not isinstance(value, bool):
        return torch.tensor(float(value), dtype=torch.float32)
    return value


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, (tuple, list)) and isinstance(b, (tuple, list)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return a == b


def hyperparameter_values(name: str, value: Any) -> List[float]:
    """A hyper-parameter as the list of floats ``set_hyperparameter`` takes.

    A Tensor (lr) gives its elements, a pair (betas) its two numbers (each a number or a
    1-element Tensor); Adafactor's ``eps=(None, eps2)`` gives the number alone, which its
    setter reads as ``(None, eps2)``.

    Raises:
        TypeError: for booleans, None, strings and other values no functional optimizer can
            change between steps.
    """
    if isinstance(value, Tensor):
        return [float(x) for x in value.detach().reshape(-1).tolist()]
    if isinstance(value, (tuple, list)):
        return [_number(name, x) for x in value if x is not None]
    return [_number(name, value)]


def _number(name: str, value: Any) -> float:
    """One number of a hyper-parameter: a Python or numpy number, or a 1-element Tensor (Adam's
    Tensor betas), as torch.optim computes with them."""
    if isinstance(value, Tensor) and value.numel() == 1 and not value.dtype == torch.bool:
        return float(value.item())
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"Invalid {name}: {value!r} (expected a number)")
    return float(value)


def settable_hyperparameters(optim: Any, keys: List[str]) -> List[str]:
    """The ``keys`` that ``optim`` can change between steps.

    Each key is set to the value it already has: accepted means settable, and nothing
    changes either way.
    """
    obj = _instance(optim)
    settable = []
    for key in keys:
        try:
            optim.set_hyperparameter(key, hyperparameter_values(key, held_value(obj, key)))
        except Exception:  # TorchScript raises its own error types for unknown names
            continue
        settable.append(key)
    return settable
