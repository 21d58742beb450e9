"""Where a DistributedOptimizer's parameters are: what a trainer knows about its owners once
they have built their local optimizers.

A ``DistributedOptimizer`` builds one ``Placement`` at construction and passes it, with its
param groups (``distopt.param_groups.TrainerGroups``), to the modules that run its other
rounds (``distopt.state``, ``distopt.checkpoint``, ``distopt.clipping``): they take what
they need from these, never from the optimizer's own fields, and never import it.
"""
import dataclasses
from typing import List, Optional

import torch
import torch.distributed.rpc as rpc

__all__ = ["Placement", "OwnerPart"]


@dataclasses.dataclass
class OwnerPart:
    """What the trainer keeps about one owner's local optimizer.

    Attributes:
        info: the owner.
        rref: its local optimizer.
        id: the local optimizer's key on the owner, sent with every step instead of the RRef.
        groups: the global param group of each of its local groups.
        indices: for each local group, the global indices of its parameters.
        script: while the local optimizer is exclusive, the RRef that
            ``distopt.exclusive.script_step`` steps it through; None: the locked path.
    """

    info: rpc.WorkerInfo
    rref: rpc.RRef
    id: int
    groups: List[int]
    indices: List[List[int]]
    script: Optional[rpc.RRef] = None

    @property
    def name(self) -> str:
        """The owner's worker name."""
        return self.info.name


@dataclasses.dataclass(frozen=True)
class Placement:
    """Where a DistributedOptimizer's parameters live and how their owners optimize them.

    Fixed at construction. Parameters are numbered in the order given to the optimizer,
    flattened over its param groups (its global indices).

    Attributes:
        optimizer_class: the class the user asked for.
        owners: each owner's part, in the order their local optimizers were created.
        group_indices: for each param group, the global indices of its parameters.
        param_shapes: each parameter's shape, by global index.
        param_dtypes: each parameter's dtype, by global index.
        hyper_keys: the hyper-parameters the owners' optimizers keep in each group.
        settable: the keys a compiled optimizer can change between steps; None when the
            owners run ``optimizer_class`` eagerly (every key can change).
    """

    optimizer_class: type
    owners: List[OwnerPart]
    group_indices: List[List[int]]
    param_shapes: List[torch.Size]
    param_dtypes: List[torch.dtype]
    hyper_keys: List[str]
    settable: Optional[List[str]]

    @property
    def compiled(self) -> bool:
        """Whether the owners run compiled functional optimizers (they keep tensors only)."""
        return self.settable is not None
