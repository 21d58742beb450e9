"""What a class's per-parameter state is made of, and where ``_kernels.gather`` puts it.

A ``StateSpec`` names a class's state keys (torch.optim's), the value each starts at and
where it lives (``Place``). An operand set, one of the lists a step's update runs on, holds
the parameters, their gradients, then one list per state key in the spec's order:
``Operand`` names the first three positions, and each algorithm module names its own state
keys' positions in an Enum of its own (``AdamOperand.EXP_AVG``, ...).

TorchScript reads no module-level int, but it folds an Enum member's ``.value`` into a
constant at compile time: the names cost nothing at a step.
"""
import enum
from typing import List, NamedTuple

import torch
from torch import Tensor


class Place(enum.Enum):
    """Where ``_kernels.new_state`` makes a state entry."""

    #: A tensor laid out as the parameter (``exp_avg``, ``sum``, ...).
    PARAM_LAYOUT = 0
    #: A 0-dim float32 tensor on the CPU (``step``, where torch.optim keeps it there).
    CPU_SCALAR = 1
    #: A 0-dim float32 tensor on the parameter's device (``step`` of a fused or capturable
    #: class; ASGD's ``eta`` and ``mu``).
    DEVICE_SCALAR = 2
    #: One value per row of a 2-D parameter, of its dtype and device (the row-wise
    #: optimizers' ``momentum1`` / ``momentum2``).
    ROW = 3


class StateSpec(NamedTuple):
    """A class's fresh state: ``keys[k]`` holds ``fills[k]``, made where ``places[k]`` says.

    Attributes:
        keys: the state keys, in torch.optim's order (the order of the operand sets).
        fills: each key's starting value.
        places: each key's ``Place``.
    """

    keys: List[str]
    fills: List[float]
    places: List[Place]


class Operand(enum.Enum):
    """Positions in every operand set ``[params, grads, state[keys[0]], ...]``.

    Each algorithm module names its state's positions in an Enum of its own
    (``AdamOperand``, ...): one member per state key, named after it, in the spec's order
    from ``STATE`` on (``tests/functional/test_operands.py`` checks it).
    """

    PARAMS = 0
    GRADS = 1
    #: The first state key's list; key ``k`` of the spec is at ``STATE + k``.
    STATE = 2


def scalar_places(keys: List[str], scalar_keys: List[str], on_device: bool) -> List[Place]:
    """Where each of ``keys`` lives: ``scalar_keys`` (``step``, ``mu_product``, ...) as 0-dim
    tensors on the parameter's device when ``on_device``, else on the CPU; the others laid
    out as the parameter.

    torch.optim keeps ``step`` on the CPU, where the foreach paths read it without a device
    synchronisation, and on the parameter's device when ``fused`` or ``capturable`` (the
    kernel, or a CUDA graph, reads it there): ``on_device``. State therefore moves between
    the two unchanged.
    """
    places: List[Place] = []
    for key in keys:
        if key in scalar_keys:
            places.append(Place.DEVICE_SCALAR if on_device else Place.CPU_SCALAR)
        else:
            places.append(Place.PARAM_LAYOUT)
    return places


def scalar_device(p: Tensor, place: Place) -> torch.device:
    """The device of a 0-dim state entry of ``p`` made at ``place`` (a scalar ``Place``)."""
    if place == Place.DEVICE_SCALAR:
        return p.device
    return torch.device("cpu")


def state_spec(
    keys: List[str], fills: List[float], scalar_keys: List[str], on_device: bool
) -> StateSpec:
    """The ``StateSpec`` of ``keys`` starting at ``fills``, placed by ``scalar_places``."""
    return StateSpec(keys, fills, scalar_places(keys, scalar_keys, on_device))
