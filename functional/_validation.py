"""Argument checks run when a functional optimizer is constructed (always in Python).

Constructors are compiled by TorchScript but only ever executed eagerly, so they call these
checks under ``if not torch.jit.is_scripting():``, which the compiler skips: the checks stay
plain Python and keep ``!r`` formatting, which TorchScript f-strings lack.
"""
import functools
import inspect
import numbers
import typing
from typing import Any, Dict, Iterable, List, Optional, Sequence, Tuple, Union

import torch
from torch import Tensor


#: What torch.optim says of a tensor given twice, quoted in our refusal: it only warns, then
#: steps the tensor once per occurrence, with results that differ between its for-loop,
#: foreach and fused kernels (measured on 2.13), so there is no torch.optim result to match.
TORCH_DUPLICATE_WARNING = (
    "optimizer contains a parameter group with duplicate parameters; in future, this will "
    "cause an error"
)


def check_params(params: Iterable[Tensor]) -> List[Tensor]:
    """``params`` as a list: any iterable of distinct tensors (a list, a tuple, a generator
    such as ``model.parameters()``), not empty, as torch.optim takes them.

    Returns:
        ``params`` itself when it is a list, else a new list of its items.

    Raises:
        TypeError: a module, a single Tensor or a non-iterable, or an item is not a Tensor.
        ValueError: there is none, or one tensor is given twice (named by both indices).
    """
    params = iterable_argument("params", params, "Tensors")
    if len(params) == 0:
        raise ValueError("Invalid params: [] (expected at least one Tensor)")
    for i, p in enumerate(params):
        if not isinstance(p, Tensor):
            raise TypeError(f"Invalid params[{i}]: {type(p).__name__} (expected a Tensor)")
    pair = duplicate_pair(params)
    if pair is not None:
        raise ValueError(
            f"Invalid params: params[{pair[0]}] and params[{pair[1]}] are the same tensor "
            f"(expected each tensor once; torch.optim warns \"{TORCH_DUPLICATE_WARNING}\" and "
            f"steps it once per occurrence, with results its kernels do not agree on)"
        )
    return params


def iterable_argument(
    name: str, value: Any, of: str, fix: str = "model.parameters()"
) -> List[Any]:
    """``value``, an iterable of ``of`` (torch.optim's ``params``), as a list: itself when it
    is one. ``fix`` is what the messages say to pass instead of a module.

    Raises:
        TypeError: a ``torch.nn.Module`` (its parameters were meant), a single Tensor, or
            something that is not iterable; each in one line that names the fix.
    """
    check_not_module(name, value, of, fix)
    if isinstance(value, Tensor):
        raise TypeError(
            f"Invalid {name}: a Tensor (expected an iterable of {of}, e.g. {fix}; put one "
            f"Tensor in a list)"
        )
    if isinstance(value, list):
        return value
    try:
        return list(value)
    except TypeError:
        raise TypeError(
            f"Invalid {name}: {type(value).__name__} (expected an iterable of {of}, e.g. {fix})"
        ) from None


def check_not_module(name: str, value: Any, of: str, fix: str) -> None:
    """Refuse a ``torch.nn.Module`` given for an iterable of ``of`` (a model for its
    parameters), in one line that says to pass ``fix``.

    Raises:
        TypeError: ``value`` is a module.
    """
    if isinstance(value, torch.nn.Module):
        raise TypeError(
            f"Invalid {name}: a {type(value).__name__} module (expected an iterable of {of}: "
            f"pass {fix})"
        )


def hyperparameter_argument(name: str, value: Any) -> List[float]:
    """``set_hyperparameter(name, value)``'s ``value`` as the list of floats every class
    takes (compiled, it takes nothing else): a number alone stands for a list of that one
    (``set_hyperparameter("lr", 1e-4)``), a list or tuple gives its numbers
    (``[0.9, 0.999]`` for betas); a number may be an int, a numpy number or a one-element
    Tensor. Called under ``if not torch.jit.is_scripting():``, as the constructors' checks.

    Raises:
        TypeError: anything else, naming the hyper-parameter, the value and the forms taken.
    """
    items = list(value) if isinstance(value, (list, tuple)) else [value]
    if all(_is_number(v) for v in items):
        return [float(v) for v in items]
    raise TypeError(
        f"Invalid set_hyperparameter({name!r}, value): {value!r} (expected a float, or a "
        f"list of floats: 1e-4 or [1e-4], or [0.9, 0.999] for a pair such as betas)"
    )


def _is_number(value: Any) -> bool:
    """A real number that is not a bool: Python's, numpy's, or a one-element Tensor."""
    if isinstance(value, Tensor):
        return value.numel() == 1 and not value.is_complex() and value.dtype != torch.bool
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def duplicate_pair(items: Sequence[Any]) -> Optional[Tuple[int, int]]:
    """The indices of the first item that is the very object of an earlier one, and of that
    earlier one (``(first, again)``); None when every item is distinct."""
    seen: Dict[int, int] = {}
    for i, item in enumerate(items):
        first = seen.setdefault(id(item), i)
        if first != i:
            return first, i
    return None


def check_lr(lr: Union[float, Tensor]) -> None:
    """``lr`` must be >= 0; a Tensor lr must hold one element."""
    if isinstance(lr, Tensor):
        if lr.numel() != 1:
            raise ValueError(f"Invalid lr: Tensor of shape {tuple(lr.shape)} (expected 1 element)")
        value = float(lr.item())
    else:
        value = float(lr)
    if not value >= 0.0:
        raise ValueError(f"Invalid lr: {lr!r} (expected >= 0)")


def check_at_least(name: str, value: float, low: float) -> None:
    """``value`` must be >= ``low``."""
    if not value >= low:
        raise ValueError(f"Invalid {name}: {value!r} (expected >= {low!r})")


def check_in_range(name: str, value: float, low: float, high: float, high_open: bool) -> None:
    """``low <= value < high`` (or ``<= high`` when ``high_open`` is False)."""
    ok = low <= value < high if high_open else low <= value <= high
    if not ok:
        bracket = ")" if high_open else "]"
        raise ValueError(f"Invalid {name}: {value!r} (expected in [{low!r}, {high!r}{bracket})")


def check_betas(betas: Tuple[float, float]) -> None:
    """Each beta in [0, 1)."""
    for i in range(2):
        if not 0.0 <= betas[i] < 1.0:
            raise ValueError(f"Invalid betas[{i}]: {betas[i]!r} (expected in [0, 1))")


def check_flags(foreach: Optional[bool], fused: Optional[bool]) -> None:
    """``foreach`` and ``fused`` cannot both be True (torch.optim's rule and error type)."""
    if foreach and fused:
        raise RuntimeError("Invalid fused: True with foreach=True (expected at most one of them)")


def check_nesterov(nesterov: bool, momentum: float, dampening: float) -> None:
    """Nesterov momentum needs momentum > 0 and zero dampening."""
    if nesterov and (momentum <= 0.0 or dampening != 0.0):
        raise ValueError(
            f"Invalid nesterov: True with momentum={momentum!r}, dampening={dampening!r} "
            f"(expected momentum > 0 and dampening == 0)"
        )


def check_etas(etas: Tuple[float, float]) -> None:
    """Rprop's ``(etaminus, etaplus)``: ``0 < etaminus < 1 < etaplus``."""
    if not 0.0 < etas[0] < 1.0 < etas[1]:
        raise ValueError(f"Invalid etas: {tuple(etas)!r} (expected 0 < etas[0] < 1 < etas[1])")


def check_fused(params: List[Tensor], fused: Optional[bool], differentiable: bool) -> None:
    """``fused=True`` needs floating-point parameters and excludes ``differentiable``
    (torch.optim's rules and error type)."""
    if not fused:
        return
    check_fused_differentiable(fused, differentiable)
    for i, p in enumerate(params):
        if not torch.is_floating_point(p):
            kind = "complex " if p.is_complex() else ""
            raise RuntimeError(
                f"Invalid fused: True with params[{i}] of {kind}dtype {p.dtype} (expected "
                f"floating-point parameters: torch.optim's fused kernels take no "
                f"{kind or 'integer '}parameters; leave fused unset)"
            )


def check_no_tensor_lr_with_foreach(
    lr: Union[float, Tensor], foreach: Optional[bool], capturable: bool
) -> None:
    """A Tensor lr cannot go with ``foreach=True`` and ``capturable=False`` (torch.optim.Adam)."""
    if isinstance(lr, Tensor) and foreach and not capturable:
        raise ValueError(
            "Invalid lr: Tensor with foreach=True, capturable=False (expected a float lr, "
            "or foreach=False, or capturable=True)"
        )


def check_betas_kind(betas: Tuple[float, float], foreach: Optional[bool], capturable: bool) -> None:
    """Adam's betas: both floats or both 1-element Tensors, and no Tensors with foreach=True."""
    both_floats = isinstance(betas[0], float) and isinstance(betas[1], float)
    both_tensors = isinstance(betas[0], Tensor) and isinstance(betas[1], Tensor)
    if not (both_floats or both_tensors):
        raise ValueError(f"Invalid betas: {betas!r} (expected both floats or both Tensors)")
    for i in range(2):
        beta = betas[i]
        if isinstance(beta, Tensor):
            if foreach and not capturable:
                raise ValueError(
                    f"Invalid betas[{i}]: Tensor with foreach=True, capturable=False "
                    f"(expected a float)"
                )
            if beta.numel() != 1:
                raise ValueError(
                    f"Invalid betas[{i}]: Tensor of shape {tuple(beta.shape)} (expected 1 element)"
                )


def check_fused_differentiable(fused: Optional[bool], differentiable: bool) -> None:
    """A fused kernel cannot record autograd history (torch.optim's rule)."""
    if fused and differentiable:
        raise RuntimeError("Invalid fused: True with differentiable=True (expected one of them)")


def check_at_most(name: str, value: float, high: float) -> None:
    """``value`` must be <= ``high``."""
    if not value <= high:
        raise ValueError(f"Invalid {name}: {value!r} (expected <= {high!r})")


def check_greater(name: str, value: float, low: float) -> None:
    """``value`` must be > ``low`` (strictly)."""
    if not value > low:
        raise ValueError(f"Invalid {name}: {value!r} (expected > {low!r})")


def check_choice(name: str, value: Optional[str], choices: List[Optional[str]]) -> None:
    """``value`` must be one of ``choices``."""
    if value not in choices:
        raise ValueError(f"Invalid {name}: {value!r} (expected one of {choices!r})")


def check_matrix_params(params: List[Tensor]) -> None:
    """Every parameter must be 2-D (Muon orthogonalizes matrices)."""
    for i, p in enumerate(params):
        if p.dim() != 2:
            raise ValueError(
                f"Invalid params[{i}]: shape {tuple(p.shape)} (expected a 2-D parameter)"
            )


def check_dense_real_params(params: List[Tensor], algorithm: str) -> None:
    """Every parameter must be a dense (strided), real tensor: ``algorithm`` (torch.optim's
    class name) is one torch.optim refuses complex parameters for."""
    for i, p in enumerate(params):
        if p.is_sparse:
            raise ValueError(f"Invalid params[{i}]: a sparse tensor (expected a dense Tensor)")
        if p.is_complex():
            raise ValueError(
                f"Invalid params[{i}]: complex dtype {p.dtype} (expected a real dtype: "
                f"{algorithm} does not support complex parameters, as torch.optim.{algorithm})"
            )


def check_optional_eps_pair(eps: Tuple[Optional[float], float]) -> None:
    """Adafactor's ``eps``: epsilon1 None or >= 0, epsilon2 >= 0."""
    if len(eps) != 2 or (eps[0] is not None and not eps[0] >= 0.0) or not eps[1] >= 0.0:
        raise ValueError(f"Invalid eps: {eps!r} (expected (None or >= 0, >= 0))")


def check_below(name: str, value: float, high: float) -> None:
    """``value`` must be < ``high`` (strictly)."""
    if not value < high:
        raise ValueError(f"Invalid {name}: {value!r} (expected < {high!r})")


def check_length(name: str, value: Sequence[float], length: int) -> None:
    """``value`` must hold exactly ``length`` values."""
    if len(value) != length:
        raise ValueError(f"Invalid {name}: {value!r} (expected {length} values)")


# ---------------------------------------------------------------- argument types
#
# One check for every constructor: each argument against its annotation, leniently, as
# torch.optim's arithmetic takes it (an int, a numpy scalar or a Tensor where a float is
# annotated, an int or None where a bool is, a list where a tuple is); value ranges are the
# other checks' job. A string where a flag is annotated is refused although torch.optim
# would read it for its truth: "False" is true, and TorchScript cannot hold it in a bool.
# Annotations this check does not understand (Any, Iterable, a class of the user's) accept
# everything.


def argument_hints(function: Any) -> Dict[str, Any]:
    """The annotations of ``function``'s arguments (of ``__init__`` for a class).

    Annotations that cannot be resolved (forward references to unknown names, ``X | Y``
    before Python 3.10) are left out: they accept every value.
    """
    if inspect.isclass(function):
        function = function.__init__
    try:
        return _resolved_hints(function)
    except TypeError:  # not hashable: resolved again each time
        return _hints(function)


@functools.lru_cache(maxsize=None)
def _resolved_hints(function: Any) -> Dict[str, Any]:
    return _hints(function)


def _hints(function: Any) -> Dict[str, Any]:
    try:
        hints = typing.get_type_hints(function)
    except Exception:  # NameError, TypeError: an annotation that does not evaluate here
        raw = getattr(function, "__annotations__", None) or {}
        hints = {k: v for k, v in raw.items() if not isinstance(v, str)}
    hints.pop("return", None)
    return hints


def check_types(function: Any, arguments: Dict[str, Any]) -> None:
    """Each of ``arguments`` must be of the kind its annotation in ``function`` names.

    ``self`` and ``params`` are skipped (``check_params`` checks the parameters). Call it
    with ``locals()`` first thing in a constructor.

    Args:
        function: a class (its ``__init__`` is read) or a function.
        arguments: argument name -> value.

    Raises:
        TypeError: ``Invalid <name>: <value> (expected <kind>)``, e.g. ``Invalid lr: 'fast'
            (expected a float or Tensor)``.
    """
    hints = argument_hints(function)
    for name, value in arguments.items():
        if name in ("self", "params") or name not in hints:
            continue
        check_type(name, value, hints[name])


def check_type(name: str, value: Any, hint: Any) -> None:
    """``value`` must be of the kind ``hint`` names; a tuple is checked element by element.

    Raises:
        TypeError: ``Invalid <name>: <value> (expected <kind>)``; ``<name>[i]`` for an element.
    """
    if _accepts(hint, value):
        return
    args = typing.get_args(hint)
    if (
        typing.get_origin(hint) is tuple
        and _is_sequence(value)
        and (len(args) == 2 and args[1] is Ellipsis or len(value) == len(args))
    ):
        elements = [args[0]] * len(value) if args[-1:] == (Ellipsis,) else list(args)
        for i, (element, item) in enumerate(zip(elements, value)):
            check_type(f"{name}[{i}]", item, element)
    raise TypeError(f"Invalid {name}: {_show(value)} (expected {_article(_kind(hint))})")


def _is_union(hint: Any) -> bool:
    # ``X | Y`` (types.UnionType, Python >= 3.10) and ``Union[X, Y]`` / ``Optional[X]``.
    return typing.get_origin(hint) is Union or type(hint).__name__ == "UnionType"


def _is_sequence(value: Any) -> bool:
    if isinstance(value, (tuple, list)):
        return True
    return (isinstance(value, Tensor) or _numpy_array(value)) and value.ndim == 1


def _numpy_array(value: Any) -> bool:
    """A numpy array or scalar, known without importing numpy (functional does not)."""
    return type(value).__module__ == "numpy" and hasattr(value, "dtype") and hasattr(value, "ndim")


def _numpy_scalar(value: Any, kinds: str) -> bool:
    """A numpy scalar or 0-dim array whose dtype kind is one of ``kinds`` ("f" float, "i"
    signed, "u" unsigned, "b" bool), as torch.optim computes with one."""
    return _numpy_array(value) and value.ndim == 0 and value.dtype.kind in kinds


def _understood(hint: Any) -> bool:
    """Whether ``_accepts`` knows ``hint``; any other annotation accepts every value."""
    if hint in (float, int, bool, str, Tensor, type(None)):
        return True
    if _is_union(hint):
        return all(_understood(h) for h in typing.get_args(hint))
    if typing.get_origin(hint) is tuple:
        args = [a for a in typing.get_args(hint) if a is not Ellipsis]
        return bool(args) and all(_understood(h) for h in args)
    return False


def _accepts(hint: Any, value: Any) -> bool:
    if not _understood(hint):
        return True
    if _is_union(hint):
        return any(_accepts(h, value) for h in typing.get_args(hint))
    if hint is float:  # what torch.optim's arithmetic and comparisons take for a float
        return isinstance(value, (numbers.Real, Tensor)) or _numpy_scalar(value, "fiub")
    if hint is int:
        return isinstance(value, numbers.Integral) or _numpy_scalar(value, "iub")
    if hint is bool:  # torch.optim reads a flag for its truth: an int or None will do
        return (
            value is None or isinstance(value, numbers.Integral) or _numpy_scalar(value, "iub")
            or isinstance(value, Tensor) and value.numel() == 1 and not value.is_floating_point()
        )
    if hint is str:
        return isinstance(value, str)
    if hint is Tensor:
        return isinstance(value, Tensor)
    if hint is type(None):
        return value is None
    args = typing.get_args(hint)  # a tuple
    if not _is_sequence(value):
        return False
    if args[-1:] == (Ellipsis,):
        return all(_accepts(args[0], item) for item in value)
    return len(value) == len(args) and all(_accepts(h, item) for h, item in zip(args, value))


def _kind(hint: Any) -> str:
    """``hint`` in words: ``float``, ``bool or None``, ``tuple of 2 floats``..."""
    if _is_union(hint):
        return " or ".join(_kind(h) for h in typing.get_args(hint))
    if hint is type(None):
        return "None"
    if typing.get_origin(hint) is tuple:
        args = typing.get_args(hint)
        if args[-1:] == (Ellipsis,):
            return f"tuple of {_kind(args[0])}"
        kinds = [_kind(h) for h in args]
        if len(set(kinds)) > 1:
            return f"tuple ({', '.join(kinds)})"
        if " " in kinds[0]:
            return f"tuple of {len(kinds)} ({kinds[0]})"
        return f"tuple of {len(kinds)} {kinds[0]}s"
    return getattr(hint, "__name__", str(hint))


def _article(kind: str) -> str:
    if kind == "None":
        return kind
    return ("an " if kind[0] in "aeiou" else "a ") + kind


def _show(value: Any) -> str:
    """The value for a message: its repr, or a Tensor's kind and shape."""
    if isinstance(value, Tensor):
        return f"Tensor of dtype {value.dtype} and shape {tuple(value.shape)}"
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."
