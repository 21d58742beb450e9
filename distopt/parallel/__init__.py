"""Data-parallel optimizers on torch.distributed collectives (gloo, NCCL).

``DataParallelOptimizer`` averages gradients over a process group in flat buckets while
backward runs and steps each bucket with a compiled functional optimizer as soon as its
average arrives; ``Cast``, ``TopK``, ``Threshold`` and ``PowerSGD`` compress what
travels; ``RoundRobin`` synchronises one partition of the parameters per step instead.
"""
from distopt.parallel.compression import Cast, Compression, Threshold, TopK
from distopt.parallel.optimizer import DataParallelOptimizer
from distopt.parallel.powersgd import PowerSGD
from distopt.parallel.sync import RoundRobin

__all__ = [
    "Cast",
    "Compression",
    "DataParallelOptimizer",
    "PowerSGD",
    "RoundRobin",
    "Threshold",
    "TopK",
]
