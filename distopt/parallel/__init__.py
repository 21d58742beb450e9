"""Data-parallel optimizers on torch.distributed collectives (gloo, NCCL).

``DataParallelOptimizer`` averages gradients over a process group in flat buckets while
backward runs and steps each bucket with a compiled functional optimizer as soon as its
average arrives; ``Cast``, ``TopK`` and ``Threshold`` compress what travels;
``RoundRobin`` synchronises one partition of the parameters per step instead.
"""
from distopt.parallel.compression import Cast, Compression, Threshold, TopK
from distopt.parallel.optimizer import DataParallelOptimizer
from distopt.parallel.sync import RoundRobin

__all__ = [
    "Cast",
    "Compression",
    "DataParallelOptimizer",
    "RoundRobin",
    "Threshold",
    "TopK",
]
