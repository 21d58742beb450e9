"""state_dict / load_state_dict: torch.optim's format, gathered from and sent to the owners.

The trainer holds no optimizer state. ``gather_state_dict`` asks every owner, in parallel,
for its parameters' state (already keyed by the trainer's global parameter indices) and
adds the trainer's ``param_groups``. ``load_state_dict`` checks everything against what
the trainer learnt at construction (its ``distopt.layout.Layout``: group keys, parameter
counts, shapes), then has every owner check its part against its optimizer (keys, shapes,
dtypes, devices: ``stage``) before any owner changes (``commit``);
``distopt.checkpoint.load`` uses the same two rounds.
"""
import itertools
import logging
import uuid
from typing import Any, Dict, List

import torch
import torch.distributed.rpc as rpc
from torch import Tensor

from distopt.errors import DistributedOptimizerError, returns_failure
from distopt.fanout import fan_out
from distopt.layout import Layout
from distopt.param_groups import TrainerGroups, same, snapshot
from functional._state import IMPLEMENTATION_KEYS, check_hyperparameter, torch_group

logger = logging.getLogger(__name__)

#: State whose shape is its own rather than its parameter's (Adafactor's factored moments).
_OWN_SHAPE_KEYS = ("row_var", "col_var", "variance")


# ---------------------------------------------------------------- trainer side


def gather_state_dict(layout: Layout, param_groups: List[Dict[str, Any]]) -> Dict[str, Any]:
    """The state in torch.optim's format; one RPC per owner, all in parallel.

    Args:
        layout: the optimizer's owners and parameters.
        param_groups: the trainer's param groups.
    """
    parts = fan_out(
        "state_dict",
        {part.name: (part.info, local_state, (part.rref,)) for part in layout.owners},
    )
    merged: Dict[int, Dict[str, Any]] = {}
    for entries in parts.values():
        merged.update(entries)
    return {
        "state": {i: merged[i] for i in sorted(merged)},
        "param_groups": group_dicts(layout, param_groups),
    }


def group_dicts(layout: Layout, param_groups: List[Dict[str, Any]]) -> List[Dict[str, Any]]:
    """The trainer's param groups as a state_dict holds them: parameters as global indices."""
    return [
        {**{k: v for k, v in group.items() if k != "params"}, "params": list(indices)}
        for group, indices in zip(param_groups, layout.group_indices)
    ]


def check_groups(
    layout: Layout, trainer: TrainerGroups, groups: Any, what: str = "state_dict"
) -> Dict[Any, int]:
    """Check saved param groups against the trainer's; returns saved id -> global index.

    Args:
        layout: the optimizer's owners and parameters.
        trainer: the trainer's param groups and the values its owners hold.
        groups: the saved param groups.
        what: "state_dict" or "checkpoint", for messages.

    Raises:
        ValueError: another number of groups or of parameters in a group, keys of another
            class, or a change to a hyper-parameter the compiled optimizer fixes.
    """
    name = layout.optimizer_class.__name__
    sent = trainer.sent
    if not isinstance(groups, (list, tuple)):
        raise ValueError(
            f"Invalid {what}: param_groups is {type(groups).__name__} (expected a list)"
        )
    if len(groups) != len(trainer.param_groups):
        raise ValueError(
            f"Invalid {what}: {len(groups)} param groups (expected {len(trainer.param_groups)})"
        )
    required = set(trainer.required)
    for g, (saved, indices) in enumerate(zip(groups, layout.group_indices)):
        if not isinstance(saved, dict) or "params" not in saved:
            raise ValueError(
                f"Invalid {what}: param_groups[{g}] is not a param group (expected a dict "
                f"with 'params')"
            )
        # A state_dict of an older torch lacks the options added since: filled as
        # torch.optim's load_state_dict fills them (the owners fill theirs the same way).
        saved = torch_group(layout.optimizer_class, saved)
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
        for key in layout.hyper_keys:
            if key in saved and not same(saved[key], sent[g][key]):
                where = f"{what}: param_groups[{g}]"
                check_hyperparameter(layout.optimizer_class, key, saved[key], where)
        if layout.settable is not None:
            for key in layout.hyper_keys:
                if key in IMPLEMENTATION_KEYS:
                    continue
                if key not in layout.settable and not same(saved[key], sent[g][key]):
                    raise ValueError(
                        f"Invalid {what}: param_groups[{g}][{key!r}] is {saved[key]!r} "
                        f"(expected {sent[g][key]!r}: the compiled {name} cannot change "
                        f"{key} after construction)"
                    )
    saved_ids = list(itertools.chain.from_iterable(g["params"] for g in groups))
    id_map = dict(zip(saved_ids, itertools.chain.from_iterable(layout.group_indices)))
    if len(id_map) != len(saved_ids):
        raise ValueError(
            f"Invalid {what}: a parameter id appears twice in param_groups (expected each "
            f"parameter id once)"
        )
    return id_map


def check_values(
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
            compiled path keeps tensors only).

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
            if tensors_only and not is_step:
                raise ValueError(
                    f"Invalid {what}: state[{where}][{key!r}] is {type(value).__name__} "
                    f"(expected a Tensor)"
                )
            continue
        if (
            value.dim() > 0 and key != "step" and key not in _OWN_SHAPE_KEYS
            and value.shape != shape and value.numel() > 1
        ):
            raise ValueError(
                f"Invalid {what}: state[{where}][{key!r}] has shape {tuple(value.shape)} "
                f"(expected {tuple(shape)}, the shape of parameter {i})"
            )


def load_state_dict(layout: Layout, trainer: TrainerGroups, state_dict: Dict[str, Any]) -> None:
    """Check ``state_dict`` whole on the trainer, then send each owner its part in parallel.

    Args:
        layout: the optimizer's owners and parameters.
        trainer: the trainer's param groups and the values its owners hold; replaced by the
            loaded ones once every owner has loaded its part.
        state_dict: torch.optim's format.
    """
    if not isinstance(state_dict, dict) or not {"state", "param_groups"} <= set(state_dict):
        got = sorted(state_dict) if isinstance(state_dict, dict) else type(state_dict).__name__
        raise ValueError(
            f"Invalid state_dict: keys {got!r} (expected ['param_groups', 'state'])"
        )
    groups = state_dict["param_groups"]
    id_map = check_groups(layout, trainer, groups)
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
        check_values(
            i, entry, layout.param_shapes[i], repr(saved_id), "state_dict", layout.compiled
        )
        by_index[i] = entry
    hyper = [
        {k: v for k, v in torch_group(layout.optimizer_class, g).items() if k != "params"}
        for g in groups
    ]
    token = uuid.uuid4().hex
    stage_calls = {}
    for part in layout.owners:
        mine = {i: by_index[i] for indices in part.indices for i in indices if i in by_index}
        stage_calls[part.name] = (part.info, stage_local_state, (part.rref, mine, token))
    stage_and_commit(layout, trainer, "load_state_dict", stage_calls, token, hyper)


def stage_and_commit(
    layout: Layout,
    trainer: TrainerGroups,
    action: str,
    stage_calls: Dict[str, Any],
    token: str,
    hyper: List[Dict[str, Any]],
) -> None:
    """Load state in two rounds, so that a refusal anywhere changes nothing anywhere.

    First every owner reads and checks its part (``stage_calls``, each keeping what it
    checked under ``token``); only when all have succeeded does every owner replace its
    state and hyper-parameters with it, and the trainer adopt ``hyper``.

    Args:
        layout: the optimizer's owners and parameters.
        trainer: the trainer's param groups and the values its owners hold.
        action: the round's name, for messages.
        stage_calls: worker name -> the owner's staging call.
        token: names the staged parts.
        hyper: the loaded hyper-parameters of each param group.

    Raises:
        InvalidStateError: owners refused their part (a ValueError naming each of them).
        DistributedOptimizerError: owners failed otherwise; nothing was changed.
    """
    try:
        fan_out(action, stage_calls)
    except DistributedOptimizerError:
        _discard(layout, action, token)
        raise
    fan_out(
        action,
        {
            part.name: (
                part.info, commit_staged, (part.rref, token, [hyper[g] for g in part.groups])
            )
            for part in layout.owners
        },
    )
    adopt_groups(layout, trainer, hyper)


def _discard(layout: Layout, action: str, token: str) -> None:
    try:
        fan_out(
            action,
            {part.name: (part.info, discard_staged, (part.rref, token)) for part in layout.owners},
        )
    except DistributedOptimizerError as exc:
        logger.warning("could not discard a staged state: %s", exc)


def adopt_groups(layout: Layout, trainer: TrainerGroups, hyper: List[Dict[str, Any]]) -> None:
    """Make the trainer's groups the loaded ones (in place, so schedulers keep them); a
    compiled optimizer keeps its own kernel choices (``IMPLEMENTATION_KEYS``)."""
    for g, (group, values) in enumerate(zip(trainer.param_groups, hyper)):
        params = group["params"]
        kept = {k: group[k] for k in IMPLEMENTATION_KEYS if k in group}
        group.clear()
        group.update(values)
        if layout.compiled:
            group.update(kept)
        group["params"] = params
        trainer.sent[g] = {k: snapshot(group[k]) for k in layout.hyper_keys if k in group}


# ---------------------------------------------------------------- owner side


@returns_failure
def local_state(optimizer_rref: rpc.RRef) -> Dict[int, Dict[str, Any]]:
    """RPC target: the local optimizer's state by global index, copied under its locks."""
    local = optimizer_rref.local_value()
    with local.locked():
        return local.torch_state()


@returns_failure
def stage_local_state(
    optimizer_rref: rpc.RRef, entries: Dict[int, Dict[str, Any]], token: str
) -> None:
    """RPC target: check the local optimizer's part of a state_dict; change nothing yet."""
    local = optimizer_rref.local_value()
    local.check_torch_state(entries)
    local.staged[token] = entries


@returns_failure
def commit_staged(optimizer_rref: rpc.RRef, token: str, hyper: List[Dict[str, Any]]) -> None:
    """RPC target: replace the local state with the staged part, under the locks."""
    local = optimizer_rref.local_value()
    staged = local.staged.pop(token)
    with local.locked():
        local.load_torch_state(hyper, staged)


@returns_failure
def discard_staged(optimizer_rref: rpc.RRef, token: str) -> None:
    """RPC target: forget a staged part (another owner refused its own)."""
    optimizer_rref.local_value().staged.pop(token, None)
