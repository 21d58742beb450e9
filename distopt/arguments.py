"""What the trainer checks before it asks any owner to build an optimizer.

torch.optim checks its constructor's arguments when the optimizer is built. A
DistributedOptimizer builds its local optimizers on the owners, so a mistake found there
comes back once per owner, and against the class that runs there (a functional stand-in the
user never named). The class and the arguments are therefore checked on the trainer first,
against the class the user passed, with the messages its constructor would give: Python's
for the call's shape (an unknown keyword, too many positional arguments, a keyword given
twice) and ``Invalid <name>: <value> (expected <kind>)`` for a value of the wrong kind, read
from the class's annotations. Value ranges (``lr >= 0``...) stay with the owners, which
name themselves when they refuse.
"""
import functools
import inspect
import types
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch

from functional import functional_optim_map
from functional._validation import argument_hints, check_type

_P = inspect.Parameter
_POSITIONAL = (_P.POSITIONAL_ONLY, _P.POSITIONAL_OR_KEYWORD)


def check_optimizer_class(
    optimizer_class: Any, eager: bool, stand_in: Optional[type] = None
) -> None:
    """``optimizer_class`` must be an optimizer class that can step as DistributedOptimizer
    steps it.

    Args:
        optimizer_class: what the user passed.
        eager: whether its own ``step`` will run on the owners (no functional stand-in
            compiled in its place), with no closure.
        stand_in: the functional class the caller compiles in its place where that is not
            ``functional_optim_map``'s (the row-wise sparse optimizers name their own).

    Raises:
        TypeError: it is not a ``torch.optim.Optimizer`` subclass nor a class in
            ``functional.functional_optim_map``; or it runs eagerly and its ``step`` needs
            an argument (LBFGS's closure).
    """
    if isinstance(optimizer_class, torch.optim.Optimizer):
        cls = type(optimizer_class)
        raise TypeError(
            f"Invalid optimizer_class: an instance of {cls.__name__} (expected the class: "
            f"pass {_class_path(cls)}, not an instance, and its options as keyword arguments)"
        )
    if isinstance(optimizer_class, torch.nn.Module):
        raise TypeError(
            f"Invalid optimizer_class: a {type(optimizer_class).__name__} module (expected an "
            f"optimizer class, e.g. torch.optim.AdamW, first, then the parameters)"
        )
    if not inspect.isclass(optimizer_class):
        swapped = ""
        if isinstance(optimizer_class, (torch.Tensor, list, tuple, types.GeneratorType)):
            swapped = "; these look like the parameters: the class comes first, then them"
        raise TypeError(
            f"Invalid optimizer_class: {_short_repr(optimizer_class)} (expected a "
            f"torch.optim.Optimizer subclass or a class in functional.functional_optim_map"
            f"{swapped})"
        )
    if not issubclass(optimizer_class, torch.optim.Optimizer) and (
        optimizer_class not in functional_optim_map and stand_in is None
    ):
        raise TypeError(
            f"Invalid optimizer_class: {optimizer_class.__qualname__} (expected a "
            f"torch.optim.Optimizer subclass or a class in functional.functional_optim_map)"
        )
    if eager:
        _check_steps_without_closure(optimizer_class)


def class_then_params(params: str, example: str) -> Callable[[type], type]:
    """Class decorator of a constructor ``(optimizer_class, params, ...)``: a call with one
    positional argument and no ``params`` (``DataParallelOptimizer(model)``), where Python
    would say only that an argument is missing, raises a TypeError that names what goes
    where, with ``example``. Subclasses whose ``__init__`` is their own (other arguments)
    are left alone; ``inspect.signature`` of the class stays its ``__init__``'s."""

    def decorate(cls: type) -> type:
        base_init = cls.__init__

        def __new__(sub: type, *args: Any, **kwargs: Any) -> Any:
            if sub.__init__ is base_init and len(args) == 1 and params not in kwargs:
                raise TypeError(f"{sub.__name__}({_given(args[0])}): expected an optimizer "
                                f"class, then the parameters ({params}), then the class's "
                                f"options, e.g. {example}")
            return super(cls, sub).__new__(sub)  # type: ignore[misc]

        __new__.__signature__ = inspect.signature(base_init)  # type: ignore[attr-defined]
        cls.__new__ = __new__  # type: ignore[assignment]
        return cls

    return decorate


def _given(first: Any) -> str:
    if isinstance(first, torch.nn.Module):
        return f"a {type(first).__name__} module"
    if isinstance(first, torch.optim.Optimizer):
        return f"an instance of {type(first).__name__}"
    return _short_repr(first)


def _class_path(cls: type) -> str:
    """How a user names ``cls``: ``torch.optim.AdamW`` for torch.optim's classes, else its
    module and qualified name."""
    if getattr(torch.optim, cls.__name__, None) is cls:
        return f"torch.optim.{cls.__name__}"
    return f"{cls.__module__}.{cls.__qualname__}"


def _short_repr(value: Any, limit: int = 80) -> str:
    """``repr(value)`` when it is one short line, else ``a <type> object``: a message stays
    one line whatever was passed."""
    text = repr(value)
    if "\n" in text or len(text) > limit:
        return f"a {type(value).__name__} object"
    return text


def _check_steps_without_closure(optimizer_class: type) -> None:
    """Every owner calls ``optimizer.step()`` with no argument: ``step`` must allow that."""
    step = getattr(optimizer_class, "step", None)
    if step is None:
        return
    try:
        signature = inspect.signature(step)
    except (TypeError, ValueError):  # a builtin without a signature: let it try
        return
    params = list(signature.parameters.values())
    if params and params[0].kind in _POSITIONAL and not isinstance(
        inspect.getattr_static(optimizer_class, "step", None), staticmethod
    ):
        params = params[1:]  # self
    required = [
        p.name for p in params
        if p.default is _P.empty and p.kind not in (_P.VAR_POSITIONAL, _P.VAR_KEYWORD)
    ]
    if required:
        name = optimizer_class.__name__
        needs = ", ".join(repr(r) for r in required)
        raise TypeError(
            f"Invalid optimizer_class: {name} cannot step without {needs} "
            f"({name}.step{signature}), and DistributedOptimizer.step(context_id) calls "
            f"step() with no closure on every owner (expected an optimizer whose step needs "
            f"no closure: any torch.optim class but LBFGS, or one whose closure defaults to "
            f"None)"
        )


def check_arguments(
    optimizer_class: type,
    args: tuple,
    kwargs: Dict[str, Any],
    groups: Optional[List[Dict[str, Any]]] = None,
) -> None:
    """The constructor's arguments, as ``optimizer_class(params, *args, **kwargs)`` takes them.

    Args:
        optimizer_class: the class the user passed.
        args: positional arguments after the parameters.
        kwargs: keyword arguments.
        groups: param group dicts; their options named in the signature are checked too.

    Raises:
        TypeError: as Python's call would (``Adam.__init__() got an unexpected keyword
            argument 'bogus'``, ``... takes from 2 to 7 positional arguments but 9 were
            given``, ``... got multiple values for argument 'lr'``), or a value of the wrong
            kind for its annotation (``Invalid lr: 'fast' (expected a float or Tensor)``).
    """
    init = optimizer_class.__init__
    try:
        signature = inspect.signature(init)
    except (TypeError, ValueError):  # no signature to check against: the owners will tell
        return
    bound = _bind(f"{optimizer_class.__name__}.__init__()", signature, args, kwargs)
    hints = argument_hints(init)
    params = list(signature.parameters.values())
    skipped = {p.name for p in params[:2] if p.kind in _POSITIONAL}  # self, params
    for name, value in bound.arguments.items():
        kind = signature.parameters[name].kind
        if name in skipped or kind is _P.VAR_POSITIONAL:
            continue
        values = value if kind is _P.VAR_KEYWORD else {name: value}
        for key, item in values.items():
            if key in hints:
                check_type(key, item, hints[key])
    named = {p.name for p in params if p.kind not in (_P.VAR_POSITIONAL, _P.VAR_KEYWORD)}
    for g, group in enumerate(groups or []):
        for key, value in group.items():
            if key in named and key not in skipped and key in hints:
                check_type(f"params_rref[{g}][{key!r}]", value, hints[key])


@functools.lru_cache(maxsize=None)
def constructor_keywords(optimizer_class: type) -> Tuple[str, ...]:
    """The names ``optimizer_class(params, ...)`` takes after the parameters, in order (no
    ``*args`` / ``**kwargs``); none when it has no signature to read."""
    try:
        params = list(inspect.signature(optimizer_class).parameters.values())
    except (TypeError, ValueError):
        return ()
    named = [p for p in params if p.kind not in (_P.VAR_POSITIONAL, _P.VAR_KEYWORD)]
    if named and named[0].kind in _POSITIONAL:
        named = named[1:]  # the parameters
    return tuple(p.name for p in named if p.kind is not _P.POSITIONAL_ONLY)


def probe_construction(optimizer_class: type, kwargs: Dict[str, Any]) -> None:
    """Build ``optimizer_class`` with ``kwargs`` over one probe parameter (a 1 x 1 float32
    tensor: Muon takes only matrices), so that its constructor runs its own checks of these
    values: exactly torch.optim's ranges for its classes, and whatever a user's class
    refuses. About 5 µs for a torch.optim class (CPU, 2.13).

    Raises:
        What the constructor raises (torch.optim's own messages).
    """
    probe = torch.zeros(1, 1, requires_grad=True)
    optimizer_class([probe], **kwargs)


def _bind(
    where: str, signature: inspect.Signature, args: tuple, kwargs: Dict[str, Any]
) -> inspect.BoundArguments:
    """``signature`` bound to (self, params, *args, **kwargs), or Python's TypeError."""
    params = list(signature.parameters.values())
    positional = [p for p in params if p.kind in _POSITIONAL]
    given = 2 + len(args)  # self and the parameters, as Python counts them
    if given > len(positional) and not any(p.kind is _P.VAR_POSITIONAL for p in params):
        low = sum(1 for p in positional if p.default is _P.empty)
        takes = f"{low}" if low == len(positional) else f"from {low} to {len(positional)}"
        # Python's own words for a bad call, as the constructor would raise them (kept).
        raise TypeError(f"{where} takes {takes} positional arguments but {given} were given")
    by_name = {p.name: p for p in params if p.kind not in (_P.VAR_POSITIONAL, _P.VAR_KEYWORD)}
    var_keyword = any(p.kind is _P.VAR_KEYWORD for p in params)
    taken = {p.name for p in positional[:given]}
    for key in kwargs:
        if key in taken:  # Python's words, as above
            raise TypeError(f"{where} got multiple values for argument {key!r}")
        if key not in by_name and not var_keyword:  # Python's words, as above
            raise TypeError(f"{where} got an unexpected keyword argument {key!r}")
    try:
        return signature.bind(None, None, *args, **kwargs)
    except TypeError as exc:  # what is left: a missing argument, a positional-only keyword
        raise TypeError(f"{where} {exc}") from None


def check_number(name: str, value: Any, expected: str, ok: Callable[[Any], bool],
                 integer: bool = False) -> None:
    """``Invalid <name>: <value> (expected <expected>)``: TypeError unless ``value`` is a
    number (an int with ``integer``; a bool is neither), ValueError unless ``ok(value)``."""
    if isinstance(value, bool) or not isinstance(value, int if integer else (int, float)):
        raise TypeError(f"Invalid {name}: {value!r} (expected {expected})")
    if not ok(value):
        raise ValueError(f"Invalid {name}: {value!r} (expected {expected})")


def check_bool(name: str, value: Any) -> None:
    """TypeError unless ``value`` is a bool, naming ``name``."""
    if not isinstance(value, bool):
        raise TypeError(f"Invalid {name}: {value!r} (expected a bool)")
