"""Owner-side probes for the sparse tests, in a module the RPC workers can import by name."""
from typing import Optional, Tuple

import torch
import torch.distributed.autograd as dist_autograd
import torch.distributed.rpc as rpc
from torch import Tensor

from distopt.sparse import _owner


def context_gradient(
    shard_rref: rpc.RRef, context_id: int
) -> Optional[Tuple[bool, Tensor, Tensor]]:
    """(is sparse, indices, values) of the shard's gradient in the context, or None."""
    grad = dist_autograd.get_gradients(context_id).get(shard_rref.local_value())
    if grad is None:
        return None
    if not grad.is_sparse:
        return False, torch.empty(0), grad.clone()
    return True, grad._indices().clone(), grad._values().clone()


def tracked_records() -> int:
    """How many lookup records this owner keeps for averaging."""
    return _owner.tracked_records()
