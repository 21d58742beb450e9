"""Operand sets are read by name: each algorithm module names the positions of its state
in an Enum (``AdamOperand.EXP_AVG``, ...), and those names must be the class's state keys,
in the order ``gather`` puts them, from ``Operand.STATE`` on."""
import enum
import re
from pathlib import Path
from typing import Any, Dict, List, Type

import pytest
import torch

import functional
from functional._spec import Operand
from functional.adadelta import AdadeltaOperand
from functional.adagrad import AdagradOperand
from functional.adam import AdamOperand
from functional.adamax import AdamaxOperand
from functional.asgd import ASGDOperand
from functional.muon import MuonOperand
from functional.nadam import NAdamOperand
from functional.radam import RAdamOperand
from functional.rmsprop import RMSpropOperand
from functional.rprop import RpropOperand
from functional.sgd import SGDOperand
from functional.sparse_adam import SparseAdamOperand

#: (class, options that give it every state key, its operand Enum). RMSprop's ``grad_avg``
#: is read as the last set (its place depends on momentum), so its Enum names a prefix.
CLASSES = [
    (functional.FunctionalAdam, {"amsgrad": True}, AdamOperand),
    (functional.FunctionalAdadelta, {}, AdadeltaOperand),
    (functional.FunctionalAdagrad, {}, AdagradOperand),
    (functional.FunctionalAdamax, {}, AdamaxOperand),
    (functional.FunctionalASGD, {}, ASGDOperand),
    (functional.FunctionalMuon, {}, MuonOperand),
    (functional.FunctionalNAdam, {}, NAdamOperand),
    (functional.FunctionalRAdam, {}, RAdamOperand),
    (functional.FunctionalRMSprop, {"momentum": 0.9, "centered": True}, RMSpropOperand),
    (functional.FunctionalRprop, {}, RpropOperand),
    (functional.FunctionalSGD, {"momentum": 0.9}, SGDOperand),
    (functional.FunctionalSparseAdam, {}, SparseAdamOperand),
]


def _state_keys(cls: type, kwargs: Dict[str, Any]) -> List[str]:
    """The keys of one parameter's state after a step, in the order they were made."""
    params = [torch.randn(3, 4)]
    opt = cls(params, **kwargs)
    grad = torch.randn(3, 4)
    opt.step([grad.to_sparse() if cls is functional.FunctionalSparseAdam else grad])
    return list(opt.state[0])


@pytest.mark.parametrize("cls,kwargs,names", CLASSES, ids=[c[0].__name__ for c in CLASSES])
def test_operand_names_are_the_state_keys_in_order(
    cls: type, kwargs: Dict[str, Any], names: Type[enum.Enum]
) -> None:
    members = list(names)
    keys = _state_keys(cls, kwargs)
    assert [m.name.lower() for m in members] == keys[:len(members)]
    first = Operand.STATE.value
    assert [m.value for m in members] == list(range(first, first + len(members)))


def test_no_module_reads_an_operand_by_a_literal_index() -> None:
    package = Path(functional.__file__).parent
    literal = re.compile(r"\b(ops|first|later|mat|vec)\[\d")
    found = [
        f"{path.name}:{n}: {line.strip()}"
        for path in sorted(package.glob("*.py"))
        for n, line in enumerate(path.read_text().splitlines(), 1)
        if literal.search(line)
    ]
    assert found == []
