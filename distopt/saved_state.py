"""One checker of saved optimizer state, for every optimizer of this project.

``DistributedOptimizer`` (``distopt.state``, ``distopt.checkpoint``), ``DataParallelOptimizer``
and ``OptimizerInBackward`` (``distopt.parallel.state``) load torch.optim's format. Each
describes what it holds in a ``SavedStateSpec`` and has ``check_state_dict`` check a whole
state_dict against it before anything changes: the dict's form, the number of groups and of
parameters in each, every group's keys (those of another class are refused), the kind of
each hyper-parameter and the options its compiled steps cannot change, every state entry's
parameter id and the shape of its tensors. What only the optimizer holding a parameter can
check (state keys, dtypes, devices) it checks after this, still before anything changes.
"""
import itertools
from typing import Any, Collection, Dict, List, NamedTuple, Optional, Sequence

import torch
from torch import Tensor

from distopt.param_groups import same
from functional._state import IMPLEMENTATION_KEYS, check_hyperparameter, torch_group
from functional._state import own_shape

__all__ = ["CheckedState", "SavedStateSpec", "check_saved_entry", "check_saved_groups",
           "check_state_dict"]

#: State whose shape is its own rather than its parameter's (Adafactor's factored moments).


class SavedStateSpec(NamedTuple):
    """What an optimizer holds, for ``check_state_dict``.

    Attributes:
        optimizer_class: the torch.optim class (or the class the user named).
        group_indices: each param group's parameters, as global indices.
        param_shapes: each parameter's shape, by global index.
        hyper_keys: the hyper-parameters each group keeps.
        settable: the keys compiled steps can change between steps; None: every key
            (an eager class).
        sent: each group's values as the optimizer's steps hold them.
        required: the keys a saved group must hold to be one of this class's.
        tensors_only: every state value but a numeric ``step`` must be a tensor (compiled).
    """

    optimizer_class: type
    group_indices: List[List[int]]
    param_shapes: Sequence[torch.Size]
    hyper_keys: List[str]
    settable: Optional[List[str]]
    sent: List[Dict[str, Any]]
    required: Collection[str]
    tensors_only: bool


class CheckedState(NamedTuple):
    """A state_dict that passed ``check_state_dict``."""

    id_map: Dict[Any, int]  #: saved parameter id -> global index
    by_index: Dict[int, Dict[str, Any]]  #: the saved state by global index
    hyper: List[Dict[str, Any]]  #: each saved group's hyper-parameters (torch's keys filled)


def check_state_dict(spec: SavedStateSpec, state_dict: Any) -> CheckedState:
    """Check a whole state_dict in torch.optim's format against ``spec``.

    Raises:
        ValueError: naming what does not fit: not a dict with ``state`` and
            ``param_groups``, another group or parameter count, a group of another class,
            a hyper-parameter of the wrong kind or one the compiled steps fix, state for a
            parameter no group names, a state tensor of another shape.
    """
    if not isinstance(state_dict, dict) or not {"state", "param_groups"} <= set(state_dict):
        got = sorted(state_dict) if isinstance(state_dict, dict) else type(state_dict).__name__
        raise ValueError(
            f"Invalid state_dict: keys {got!r} (expected ['param_groups', 'state'])"
        )
    groups = state_dict["param_groups"]
    id_map = check_saved_groups(spec, groups)
    saved_state = state_dict["state"]
    if not isinstance(saved_state, dict):
        raise ValueError(
            f"Invalid state_dict: state is {type(saved_state).__name__} (expected a dict)"
        )
    by_index: Dict[int, Dict[str, Any]] = {}
    for saved_id, entry in saved_state.items():
        if saved_id not in id_map:
            raise ValueError(
                f"Invalid state_dict: state for parameter {saved_id!r} (expected one of the "
                f"ids in param_groups)"
            )
        i = id_map[saved_id]
        check_saved_entry(i, entry, spec.param_shapes[i], repr(saved_id), "state_dict",
                          spec.tensors_only)
        by_index[i] = entry
    hyper = [{k: v for k, v in torch_group(spec.optimizer_class, g).items() if k != "params"}
             for g in groups]
    return CheckedState(id_map, by_index, hyper)


def check_saved_groups(spec: SavedStateSpec, groups: Any, what: str = "state_dict"
                       ) -> Dict[Any, int]:
    """Check saved param groups against ``spec``; returns saved id -> global index.

    Args:
        spec: what the optimizer holds.
        groups: the saved param groups.
        what: "state_dict" or "checkpoint", for messages.

    Raises:
        ValueError: another number of groups or of parameters in a group, keys of another
            class, or a change to a hyper-parameter the compiled optimizer fixes.
    """
    name = spec.optimizer_class.__name__
    sent = spec.sent
    if not isinstance(groups, (list, tuple)):
        raise ValueError(
            f"Invalid {what}: param_groups is {type(groups).__name__} (expected a list)"
        )
    if len(groups) != len(spec.group_indices):
        raise ValueError(
            f"Invalid {what}: {len(groups)} param groups (expected {len(spec.group_indices)})"
        )
    required = set(spec.required)
    for g, (saved, indices) in enumerate(zip(groups, spec.group_indices)):
        if not isinstance(saved, dict) or "params" not in saved:
            raise ValueError(
                f"Invalid {what}: param_groups[{g}] is not a param group (expected a dict "
                f"with 'params')"
            )
        # A state_dict of an older torch lacks the options added since: filled as
        # torch.optim's load_state_dict fills them (the owners fill theirs the same way).
        saved = torch_group(spec.optimizer_class, saved)
        missing = sorted(required - set(saved))
        if missing:
            raise ValueError(
                f"Invalid {what}: param_groups[{g}] lacks {missing!r}, so it is not a "
                f"{name} state_dict (expected every key of a {name} param group)"
            )
        if len(saved["params"]) != len(indices):
            raise ValueError(
                f"Invalid {what}: param_groups[{g}] holds {len(saved['params'])} parameters "
                f"(expected {len(indices)})"
            )
        for key in spec.hyper_keys:
            if key in saved and not same(saved[key], sent[g][key]):
                where = f"{what}: param_groups[{g}]"
                check_hyperparameter(spec.optimizer_class, key, saved[key], where)
        if spec.settable is not None:
            for key in spec.hyper_keys:
                if key in IMPLEMENTATION_KEYS:
                    continue
                if key not in spec.settable and not same(saved[key], sent[g][key]):
                    raise ValueError(
                        f"Invalid {what}: param_groups[{g}][{key!r}] is {saved[key]!r} "
                        f"(expected {sent[g][key]!r}: the compiled {name} cannot change "
                        f"{key} after construction)"
                    )
    saved_ids = list(itertools.chain.from_iterable(g["params"] for g in groups))
    id_map = dict(zip(saved_ids, itertools.chain.from_iterable(spec.group_indices)))
    if len(id_map) != len(saved_ids):
        raise ValueError(
            f"Invalid {what}: a parameter id appears twice in param_groups (expected each "
            f"parameter id once)"
        )
    return id_map


def check_saved_entry(
    i: int, entry: Any, shape: torch.Size, where: str, what: str, tensors_only: bool
) -> None:
    """Check one parameter's saved state against the shape of parameter ``i``.

    Args:
        i: the parameter's global index.
        entry: its saved state, ``{key: value}``.
        shape: the parameter's shape.
        where: the entry's key in the saved state, for messages.
        what: "state_dict" or "checkpoint", for messages.
        tensors_only: whether every value but a numeric ``step`` must be a tensor (the
            compiled path keeps tensors only); a ``step`` is a tensor or a number always.

    Raises:
        ValueError: naming the entry, when it is not a dict, holds a non-tensor where only
            tensors are kept, or a tensor of another shape.
    """
    if not isinstance(entry, dict):
        raise ValueError(
            f"Invalid {what}: state[{where}] is {type(entry).__name__} (expected a dict)"
        )
    for key, value in entry.items():
        if not isinstance(value, Tensor):
            is_step = key == "step" and isinstance(value, (int, float)) and not isinstance(
                value, bool)
            if (tensors_only or key == "step") and not is_step:
                # An eager class keeps other values too (LBFGS's counts and lists), but a
                # step count is a number wherever it is not a tensor.
                raise ValueError(
                    f"Invalid {what}: state[{where}][{key!r}] is {type(value).__name__} "
                    f"(expected a Tensor{' or a number' if key == 'step' else ''})"
                )
            continue
        if (
            value.dim() > 0 and key != "step" and value.shape != shape and value.numel() > 1
            and not own_shape(key, value, entry, shape)
        ):
            raise ValueError(
                f"Invalid {what}: state[{where}][{key!r}] has shape {tuple(value.shape)} "
                f"(expected {tuple(shape)}, the shape of parameter {i})"
            )
