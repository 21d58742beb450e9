"""distopt: optimizers for parameters spread over torch.distributed.rpc workers."""
from distopt.errors import DistributedOptimizerError, InvalidStateError
from distopt.optimizer import DistributedOptimizer

__all__ = [
    "DistributedOptimizer",
    "DistributedOptimizerError",
    "InvalidStateError",
]
