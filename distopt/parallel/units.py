"""The compiled steps of a data-parallel optimizer, one functional optimizer per *unit*.

A unit is a (bucket, param group) for ``DataParallelOptimizer`` and a param group for
``OptimizerInBackward``; both hold one ``CompiledUnits`` (they do not inherit it). It builds
the units' ``distopt.compiled_steps.CompiledSteps``, sends the hyper-parameters changed in
``param_groups`` to every unit of the group before a step reads them, and loads and reads
the state in torch.optim's format, keyed by global parameter index.
"""
from typing import Any, Dict, List, NamedTuple, Optional

from torch import Tensor

from distopt.compiled_steps import CompiledSteps
from distopt.param_groups import as_keywords, pending_changes, snapshot
from functional import functional_optim_map

__all__ = ["CompiledUnits", "Unit"]


class Unit(NamedTuple):
    """What one unit steps: its parameters (or this rank's pieces of them), their global
    indices, and its param group's options as the user gave them."""

    params: List[Tensor]
    indices: List[int]
    options: Dict[str, Any]


class CompiledUnits:
    """One compiled functional optimizer per unit; ``of_group[j]``: param group ``j``'s units.

    Args:
        optimizer_class: the torch.optim class the compiled steps stand in for.
        hyper_keys: the keys of a param group but ``params``.
    """

    def __init__(self, optimizer_class: type, hyper_keys: List[str]) -> None:
        self.optimizer_class = optimizer_class
        self.hyper_keys = hyper_keys
        self.steps: Optional[CompiledSteps] = None
        self.of_group: List[List[int]] = []
        #: Each group's hyper-parameters as the compiled steps last received them.
        self.sent: List[Dict[str, Any]] = []
        #: Which hyper-parameters may change between steps (None: all).
        self.settable: Optional[List[str]] = None

    def compile(self, units: List[Unit], of_group: List[List[int]], args: Any,
                kwargs: Dict[str, Any], param_groups: List[Dict[str, Any]]) -> None:
        """Build the compiled steps of ``units`` (none for an empty list), replacing any."""
        cls = self.optimizer_class
        self.close()
        self.of_group = of_group
        if units:
            fargs, fkwargs = as_keywords(cls, args, kwargs)
            self.steps = CompiledSteps(
                functional_optim_map[cls], cls, [u.params for u in units],
                [u.indices for u in units], [u.options for u in units], fargs, fkwargs)
        self.reset_sent(param_groups)
        self.settable = self.steps.settable(self.hyper_keys) if self.steps else None

    def reset_sent(self, param_groups: List[Dict[str, Any]]) -> None:
        """The compiled steps now hold ``param_groups``' hyper-parameters."""
        self.sent = [{k: snapshot(g[k]) for k in self.hyper_keys} for g in param_groups]

    def apply_changes(self, param_groups: List[Dict[str, Any]]) -> bool:
        """Send hyper-parameters changed in ``param_groups`` to the compiled steps; whether
        there were any."""
        if self.steps is None:
            return False
        changes = pending_changes(param_groups, self.sent, self.settable,
                                  self.optimizer_class.__name__)
        for j, values in changes.items():
            self.steps.apply_changes(
                [(u, key, value) for u in self.of_group[j] for key, value in values.items()])
            self.sent[j].update({k: snapshot(v) for k, v in values.items()})
        return bool(changes)

    def step(self, unit: int, grads: List[Optional[Tensor]], scaling: Optional[Any]) -> None:
        """One compiled step of one unit, under a GradScaler's ``scaling`` if not None."""
        if scaling is None:
            self.steps.module.step_group(unit, grads)
        else:
            self.steps.module.step_group_scaled(unit, grads, scaling[0], scaling[1])

    def torch_state(self, copy: bool = True) -> Dict[int, Dict[str, Any]]:
        """The state in torch.optim's format by global index ({} without compiled steps)."""
        return self.steps.torch_state(copy=copy) if self.steps is not None else {}

    def check_state(self, state: Dict[int, Dict[str, Any]]) -> None:
        """``CompiledSteps.check_torch_state``: ValueError where ``state`` does not fit."""
        if self.steps is not None:
            self.steps.check_torch_state(state)

    def load(self, groups: List[Dict[str, Any]], state: Dict[int, Dict[str, Any]]) -> None:
        """Load ``state`` (global index keys) and ``groups``' hyper-parameters."""
        if self.steps is None:
            return
        group_of_unit = {u: j for j, us in enumerate(self.of_group) for u in us}
        hyper = [{k: v for k, v in groups[group_of_unit[u]].items() if k != "params"}
                 for u in range(len(self.steps.group_params))]
        self.steps.load_torch_state(hyper, state)

    def close(self) -> None:
        """Drop the compiled steps and their state."""
        if self.steps is not None:
            self.steps.close()
            self.steps = None
