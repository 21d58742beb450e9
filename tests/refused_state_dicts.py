"""The state_dicts ``load_state_dict`` refuses, one table for the three optimizers that load
torch.optim's format: the RPC ``DistributedOptimizer`` (tests/distopt/test_state_dict.py),
``DataParallelOptimizer`` with each ``shard`` and ``OptimizerInBackward``
(tests/parallel/test_state_dict.py).

A row starts from the state_dict of an optimizer of ``OPTIMIZERS[row.optimizer]`` over four
parameters in two groups of two (indices 0, 1 and 2, 3, the last of shape (3, 2)), trained
two steps. ``bad_state_dict`` first changes what a load that stopped part-way would leave
behind (every group's lr, and every state tensor, set to other values), then breaks the row's
one thing. Every optimizer must refuse it with a ValueError whose message holds
``row.pattern`` (a regular expression: it names what is wrong) and change nothing, in any
group.
"""
import copy
from typing import Any, Callable, Dict, NamedTuple

import torch

#: The optimizers of the rows: (torch.optim class, defaults, options of group 0, of group 1).
OPTIMIZERS = {
    "Adam": (torch.optim.Adam, {"lr": 0.01, "amsgrad": True}, {},
             {"lr": 0.02, "weight_decay": 0.1}),
    "Adafactor": (torch.optim.Adafactor, {"lr": 0.01}, {}, {"lr": 0.02}),
}


class Refused(NamedTuple):
    """A state_dict every optimizer refuses."""

    optimizer: str  # a key of OPTIMIZERS
    corrupt: Callable[[Dict[str, Any]], Dict[str, Any]]  # breaks a copy; returns the state_dict
    pattern: str  # what the refusal's message holds


def _another_class(sd: Dict[str, Any]) -> Dict[str, Any]:
    """torch.optim.SGD's state_dict (with momentum) over parameters of the same shapes."""
    groups = [[torch.zeros(sd["state"][i]["exp_avg"].shape, requires_grad=True)
               for i in group["params"]] for group in sd["param_groups"]]
    sgd = torch.optim.SGD([{"params": params} for params in groups], lr=0.1, momentum=0.9)
    for p in sum(groups, []):
        p.grad = torch.ones_like(p)
    sgd.step()
    return sgd.state_dict()


def _set(where: Callable[[Dict[str, Any]], Dict[str, Any]], key: Any,
         value: Callable[[Any], Any]) -> Callable[[Dict[str, Any]], Dict[str, Any]]:
    """A corruption: ``where(sd)[key]`` becomes ``value(old value, or None)``."""
    def corrupt(sd: Dict[str, Any]) -> Dict[str, Any]:
        place = where(sd)
        place[key] = value(place.get(key))
        return sd
    return corrupt


def _drop(where: Callable[[Dict[str, Any]], Dict[str, Any]],
          key: Any) -> Callable[[Dict[str, Any]], Dict[str, Any]]:
    """A corruption: ``where(sd)`` loses ``key``."""
    def corrupt(sd: Dict[str, Any]) -> Dict[str, Any]:
        del where(sd)[key]
        return sd
    return corrupt


def _group(j: int) -> Callable[[Dict[str, Any]], Dict[str, Any]]:
    return lambda sd: sd["param_groups"][j]


def _state(i: int) -> Callable[[Dict[str, Any]], Dict[str, Any]]:
    return lambda sd: sd["state"][i]


def _whole(sd: Dict[str, Any]) -> Dict[str, Any]:
    return sd


def _unknown_parameter(sd: Dict[str, Any]) -> Dict[str, Any]:
    """State for a parameter id no group names."""
    sd["state"][99] = copy.deepcopy(sd["state"][0])
    return sd


#: name -> the row. The state of parameter 3 (group 1) is what only the optimizer that holds
#: it can check (keys, dtypes, 0-dim and factored shapes).
REFUSED: Dict[str, Refused] = {
    "another-class": Refused(
        "Adam", _another_class,
        r"param_groups\[0\] lacks \['betas', 'eps'\], so it is not a Adam"),
    "later-group-lacks-lr": Refused(
        "Adam", _drop(_group(1), "lr"),
        r"param_groups\[1\] lacks \['lr'\], so it is not a Adam state_dict"),
    "group-count": Refused(
        "Adam", _set(_whole, "param_groups", lambda groups: groups[:1]),
        r"1 param groups \(expected 2\)"),
    "parameter-count": Refused(
        "Adam", _set(_group(1), "params", lambda ids: ids[:1]),
        r"param_groups\[1\] holds 1 parameters \(expected 2\)"),
    "shape": Refused(
        "Adam", _set(_state(0), "exp_avg", lambda _: torch.zeros(7, 7)),
        r"state\[\d\]\['exp_avg'\] has shape \(7, 7\) \(expected \(\d, \d\)"),
    "fixed-option": Refused(
        "Adam", _set(_group(0), "amsgrad", lambda _: False),
        r"param_groups\[0\]\['amsgrad'\] is False \(expected True: the compiled Adam"),
    "fixed-option-in-a-later-group": Refused(
        "Adam", _set(_group(1), "amsgrad", lambda _: False),
        r"param_groups\[1\]\['amsgrad'\] is False \(expected True: the compiled Adam"),
    "unknown-parameter": Refused("Adam", _unknown_parameter, r"state for parameter 99"),
    "no-state": Refused("Adam", _drop(_whole, "state"), r"keys \['param_groups'\]"),
    "option-kind": Refused(
        "Adam", _set(_group(1), "betas", lambda _: 0.9),
        r"Invalid state_dict: param_groups\[1\]: betas: 0\.9 \(expected a tuple of 2"),
    "missing-state-key": Refused(
        "Adam", _drop(_state(3), "exp_avg_sq"), r"Invalid state\[3\]: no 'exp_avg_sq'"),
    "int-buffer": Refused(
        "Adam", _set(_state(3), "exp_avg", lambda old: old.to(torch.int64)),
        r"Invalid state\[3\]\['exp_avg'\]: dtype torch.int64 \(expected torch.float32"),
    "step-as-text": Refused(
        "Adam", _set(_state(3), "step", lambda _: "3"),
        r"state\[3\]\['step'\] is str \(expected a Tensor or a number\)"),
    "vector-step": Refused(
        "Adam", _set(_state(3), "step", lambda _: torch.tensor([2.0])),
        r"Invalid state\[3\]\['step'\]: shape \[1\] \(expected \[\]"),
    "factored-shape": Refused(
        "Adafactor", _set(_state(3), "row_var", lambda _: torch.zeros(9, 1)),
        r"Invalid state\[3\]\['row_var'\]: shape \[9, 1\] \(expected \[\d, 1\]"),
}


def bad_state_dict(saved: Dict[str, Any], name: str) -> Dict[str, Any]:
    """``saved`` (left as it is) with every lr and state tensor changed, then broken as row
    ``name`` says."""
    sd = copy.deepcopy(saved)
    for group in sd["param_groups"]:
        group["lr"] = 0.5
    for entry in sd["state"].values():
        for value in entry.values():
            if isinstance(value, torch.Tensor) and value.is_floating_point():
                value.fill_(7.0)
    return REFUSED[name].corrupt(sd)
