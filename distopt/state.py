"""state_dict / load_state_dict: torch.optim's format, gathered from and sent to the owners.

The trainer holds no optimizer state. ``gather_state_dict`` asks every owner, in parallel,
for its parameters' state (already keyed by the trainer's global parameter indices) and
adds the trainer's ``param_groups``. ``load_state_dict`` checks everything against what
the trainer learnt at construction (its ``distopt.placement.Placement``: group keys, parameter
counts, shapes), then has every owner check its part against its optimizer (keys, shapes,
dtypes, devices: ``stage``) before any owner changes (``commit``);
``distopt.checkpoint.load`` uses the same two rounds.
"""
import logging
import uuid
from typing import Any, Dict, List

import torch.distributed.rpc as rpc

from distopt.errors import DistributedOptimizerError, returns_failure
from distopt.fanout import fan_out
from distopt.placement import Placement
from distopt.param_groups import TrainerGroups, snapshot
from distopt.saved_state import SavedStateSpec, check_state_dict
from functional._state import IMPLEMENTATION_KEYS

logger = logging.getLogger(__name__)

# ---------------------------------------------------------------- trainer side


def gather_state_dict(placement: Placement, param_groups: List[Dict[str, Any]]) -> Dict[str, Any]:
    """The state in torch.optim's format; one RPC per owner, all in parallel.

    Args:
        placement: the optimizer's owners and parameters.
        param_groups: the trainer's param groups.
    """
    parts = fan_out(
        "state_dict",
        {part.name: (part.info, local_state, (part.rref,)) for part in placement.owners},
    )
    merged: Dict[int, Dict[str, Any]] = {}
    for entries in parts.values():
        merged.update(entries)
    return {
        "state": {i: merged[i] for i in sorted(merged)},
        "param_groups": group_dicts(placement, param_groups),
    }


def group_dicts(placement: Placement, param_groups: List[Dict[str, Any]]) -> List[Dict[str, Any]]:
    """The trainer's param groups as a state_dict holds them: parameters as global indices."""
    return [
        {**{k: v for k, v in group.items() if k != "params"}, "params": list(indices)}
        for group, indices in zip(param_groups, placement.group_indices)
    ]


def spec_of(placement: Placement, trainer: TrainerGroups) -> SavedStateSpec:
    """What a saved state must fit to load into a DistributedOptimizer."""
    return SavedStateSpec(placement.optimizer_class, placement.group_indices, placement.param_shapes,
                          placement.hyper_keys, placement.settable, trainer.sent, trainer.required,
                          placement.compiled)


def load_state_dict(placement: Placement, trainer: TrainerGroups, state_dict: Dict[str, Any]) -> None:
    """Check ``state_dict`` whole on the trainer, then send each owner its part in parallel.

    Args:
        placement: the optimizer's owners and parameters.
        trainer: the trainer's param groups and the values its owners hold; replaced by the
            loaded ones once every owner has loaded its part.
        state_dict: torch.optim's format.
    """
    checked = check_state_dict(spec_of(placement, trainer), state_dict)
    by_index, hyper = checked.by_index, checked.hyper
    token = uuid.uuid4().hex
    stage_calls = {}
    for part in placement.owners:
        mine = {i: by_index[i] for indices in part.indices for i in indices if i in by_index}
        stage_calls[part.name] = (part.info, stage_local_state, (part.rref, mine, token))
    stage_and_commit(placement, trainer, "load_state_dict", stage_calls, token, hyper)


def stage_and_commit(
    placement: Placement,
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
        placement: the optimizer's owners and parameters.
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
        _discard(placement, action, token)
        raise
    fan_out(
        action,
        {
            part.name: (
                part.info, commit_staged, (part.rref, token, [hyper[g] for g in part.groups])
            )
            for part in placement.owners
        },
    )
    adopt_groups(placement, trainer, hyper)


def _discard(placement: Placement, action: str, token: str) -> None:
    try:
        fan_out(
            action,
            {part.name: (part.info, discard_staged, (part.rref, token)) for part in placement.owners},
        )
    except DistributedOptimizerError as exc:
        logger.warning("could not discard a staged state: %s", exc)


def adopt_groups(placement: Placement, trainer: TrainerGroups, hyper: List[Dict[str, Any]]) -> None:
    """Make the trainer's groups the loaded ones (in place, so schedulers keep them); a
    compiled optimizer keeps its own kernel choices (``IMPLEMENTATION_KEYS``)."""
    for g, (group, values) in enumerate(zip(trainer.param_groups, hyper)):
        params = group["params"]
        kept = {k: group[k] for k in IMPLEMENTATION_KEYS if k in group}
        group.clear()
        group.update(values)
        if placement.compiled:
            group.update(kept)
        group["params"] = params
        trainer.sent[g] = {k: snapshot(group[k]) for k in placement.hyper_keys if k in group}


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
