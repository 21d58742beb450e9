"""Param groups on the trainer: reading the constructor's argument, and what changed since.

The trainer keeps ``param_groups`` as torch.optim does (dicts holding ``params`` and every
hyper-parameter). At each step it compares them with what it last sent to the owners and
piggybacks the differences on that step's RPC, so a scheduler's change costs no extra round.
"""
import dataclasses
import inspect
from typing import Any, Collection, Dict, Iterable, List, Optional, Sequence, Tuple

import torch
from torch import Tensor

from distopt._torch import PyRRef


@dataclasses.dataclass
class TrainerGroups:
    """A trainer's param groups and the hyper-parameter values its owners hold.

    What the rounds that read or replace hyper-parameters (``distopt.state``,
    ``distopt.checkpoint``) take from a DistributedOptimizer.

    Attributes:
        param_groups: the optimizer's ``param_groups`` list itself: loading a state changes
            its dicts in place, so that schedulers keep them.
        sent: for each group, the values the owners have (loading replaces its items).
        required: the keys a saved param group must hold to be one of this optimizer's.
    """

    param_groups: List[Dict[str, Any]]
    sent: List[Dict[str, Any]]
    required: Collection[str]


def normalize_param_groups(params_rref: Iterable[Any]) -> List[Dict[str, Any]]:
    """The constructor's parameters as a list of groups, each ``{"params": [RRef, ...], ...}``.

    Args:
        params_rref: RRefs, or dicts with a ``"params"`` key holding RRefs (one RRef alone is
            accepted too) and any per-group hyper-parameters, as torch.optim takes them.

    Returns:
        New dicts with new ``params`` lists; the other values are the caller's.

    Raises:
        TypeError: ``params_rref`` is not iterable, mixes RRefs and dicts, or an item is
            neither; a group's ``params`` holds something that is not an RRef.
        ValueError: there are no parameters, or a group has none or lacks ``"params"``.
    """
    try:
        items = list(params_rref)
    except TypeError:
        raise TypeError(
            f"Invalid params_rref: {type(params_rref).__name__} (expected a list of RRefs or "
            f"of param group dicts)"
        ) from None
    if not items:
        raise ValueError("Invalid params_rref: [] (expected at least one RRef)")
    if not isinstance(items[0], dict):
        _check_rrefs(items, "params_rref")
        return [{"params": items}]
    groups = []
    for g, group in enumerate(items):
        where = f"params_rref[{g}]"
        if not isinstance(group, dict):
            raise TypeError(
                f"Invalid {where}: {type(group).__name__} (expected a param group dict, like "
                f"params_rref[0])"
            )
        if "params" not in group:
            raise ValueError(f"Invalid {where}: keys {sorted(group)!r} (expected a 'params' key)")
        rrefs = group["params"]
        rrefs = [rrefs] if isinstance(rrefs, PyRRef) else list(rrefs)
        if not rrefs:
            raise ValueError(f"Invalid {where}['params']: [] (expected at least one RRef)")
        _check_rrefs(rrefs, f"{where}['params']")
        groups.append({**group, "params": rrefs})
    return groups


def _check_rrefs(rrefs: Sequence[Any], where: str) -> None:
    for i, rref in enumerate(rrefs):
        if not isinstance(rref, PyRRef):  # rpc.remote returns the base, not rpc.RRef
            raise TypeError(
                f"Invalid {where}[{i}]: {type(rref).__name__} (expected an RRef to a parameter)"
            )


def as_keywords(
    optimizer_class: type, args: tuple, kwargs: Dict[str, Any]
) -> Tuple[tuple, Dict[str, Any]]:
    """``args`` moved into ``kwargs`` by name, so that a group's own options can override them.

    When the signature cannot take them by name (``*args``, or a binding error, which the
    owners will then report), both are returned as given.
    """
    try:
        sig = inspect.signature(optimizer_class)
        bound = sig.bind_partial(None, *args, **kwargs)
    except (TypeError, ValueError):
        return args, kwargs
    params = list(sig.parameters.values())
    if not args or any(p.kind is inspect.Parameter.VAR_POSITIONAL for p in params):
        return args, kwargs
    out: Dict[str, Any] = {}
    for name, value in list(bound.arguments.items())[1:]:
        if sig.parameters[name].kind is inspect.Parameter.VAR_KEYWORD:
            out.update(value)
        else:
            out[name] = value
    return (), out


def signature_defaults(
    optimizer_class: type, args: tuple, kwargs: Dict[str, Any], keys: Sequence[str]
) -> Optional[Dict[str, Any]]:
    """The hyper-parameters a group without options of its own gets, from the signature."""
    try:
        bound = inspect.signature(optimizer_class).bind_partial(None, *args, **kwargs)
        bound.apply_defaults()
    except (TypeError, ValueError):
        return None
    values = dict(list(bound.arguments.items())[1:])
    if not all(k in values for k in keys):
        return None
    return {k: values[k] for k in keys}


_PLAIN = (float, int, bool, str)


def snapshot(value: Any) -> Any:
    """A copy of a hyper-parameter value that later in-place changes cannot reach."""
    if isinstance(value, Tensor):
        return value.detach().clone()
    if isinstance(value, (tuple, list)):
        return tuple(snapshot(v) for v in value)
    return value


def same(a: Any, b: Any) -> bool:
    """Whether two hyper-parameter values are equal (tensors by value, lists as tuples)."""
    if isinstance(a, Tensor) or isinstance(b, Tensor):
        a_t = a if isinstance(a, Tensor) else torch.tensor(a)
        b_t = b if isinstance(b, Tensor) else torch.tensor(b)
        try:
            return a_t.shape == b_t.shape and bool(torch.equal(a_t.to(b_t.dtype), b_t))
        except (TypeError, RuntimeError):
            return False
    if isinstance(a, (tuple, list)) and isinstance(b, (tuple, list)):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    if isinstance(a, (tuple, list)) or isinstance(b, (tuple, list)):
        return False
    try:
        return bool(a == b)
    except Exception:  # some objects refuse to compare
        return a is b


def pending_changes(
    param_groups: List[Dict[str, Any]],
    sent: List[Dict[str, Any]],
    settable: Optional[Sequence[str]],
    class_name: str,
) -> Dict[int, Dict[str, Any]]:
    """The hyper-parameters changed on the trainer since they were last sent.

    Args:
        param_groups: the trainer's groups, as the user and schedulers left them.
        sent: for each group, the values the owners have.
        settable: the keys the owners can change between steps (None: all of them).
        class_name: the optimizer's name, for messages.

    Returns:
        group index -> {key: new value}, only for groups with changes.

    Raises:
        ValueError: a key was removed, or one that cannot change between steps was changed.
    """
    changes: Dict[int, Dict[str, Any]] = {}
    for g, (group, known) in enumerate(zip(param_groups, sent)):
        for key, old in known.items():
            if key not in group:
                raise ValueError(
                    f"Invalid param_groups[{g}]: lacks {key!r} (expected every key the "
                    f"optimizer was built with)"
                )
            new = group[key]
            # The hot path: most values are the very objects or plain numbers last sent.
            if new is old or (type(new) in _PLAIN and type(new) is type(old) and new == old):
                continue
            if same(new, old):
                continue
            if settable is not None and key not in settable:
                raise ValueError(
                    f"Invalid param_groups[{g}][{key!r}]: {new!r} (expected {old!r}: the "
                    f"compiled {class_name} cannot change {key} after construction; it can "
                    f"change {sorted(settable)!r})"
                )
            changes.setdefault(g, {})[key] = new
    return changes
