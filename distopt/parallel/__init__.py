"""Data-parallel optimizers on torch.distributed collectives (gloo, NCCL).

``DataParallelOptimizer`` averages gradients over a process group in flat buckets while
backward runs and steps each bucket with a compiled functional optimizer as soon as its
average arrives (``shard=`` keeps 1/W of the optimizer state per rank); ``Cast``,
``TopK``, ``Threshold`` and ``PowerSGD`` compress what travels; ``RoundRobin`` synchronises
one partition of the parameters per step instead. For models
that stay wrapped in torch's DistributedDataParallel, ``compression_hook`` and
``optimizer_hook`` (``distopt.parallel.hooks``) bring the compression and the steps during
backward as DDP communication hooks.
"""
from distopt.parallel.compression import Cast, Compression, Threshold, TopK
from distopt.parallel.hooks import (
    CompressionHookState,
    OptimizerInBackward,
    compression_hook,
    optimizer_hook,
)
from distopt.parallel.optimizer import DataParallelOptimizer
from distopt.parallel.powersgd import PowerSGD
from distopt.parallel.sync import RoundRobin

# In the order a newcomer reads them (the API page follows it): the optimizer, what it
# takes (compression schemes, partial sync), the interface a scheme of your own implements,
# then the DDP hooks and their states.
__all__ = [
    "DataParallelOptimizer",
    "Cast",
    "TopK",
    "Threshold",
    "PowerSGD",
    "RoundRobin",
    "Compression",
    "optimizer_hook",
    "compression_hook",
    "OptimizerInBackward",
    "CompressionHookState",
]
