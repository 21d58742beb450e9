"""distopt: optimizers for parameters spread over torch.distributed.rpc workers."""
from distopt.errors import DistributedOptimizerError, InvalidStateError
from distopt.optimizer import DistributedOptimizer
from distopt import optim  # Adam8bit, AdamW8bit, AdamW4bit (and their compiled twins)
from functional._version import __version__  # one version for both packages

__all__ = [
    "DistributedOptimizer",
    "DistributedOptimizerError",
    "InvalidStateError",
]
