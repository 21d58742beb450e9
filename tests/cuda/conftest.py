"""CUDA tests: ``python -m pytest -m cuda`` on a machine with a GPU.

Elsewhere every test here is skipped with the reason "no CUDA device". Setting
``DISTOPT_TEST_DEVICE=cpu`` runs them on the CPU instead (the tests that only mean something
on a GPU, CUDA graphs and the synchronisation check, still skip): a way to check the tests'
own logic on a machine without one, not a substitute for the GPU run.
"""
import os

import pytest
import torch

#: The device the tests put parameters on.
DEVICE = torch.device(os.environ.get("DISTOPT_TEST_DEVICE", "cuda"))

#: Every test module here carries ``pytestmark = CUDA``.
CUDA = [
    pytest.mark.cuda,
    pytest.mark.skipif(
        DEVICE.type == "cuda" and not torch.cuda.is_available(), reason="no CUDA device"
    ),
]

#: For the tests that only mean something on a GPU.
gpu_only = pytest.mark.skipif(
    DEVICE.type != "cuda",
    reason="no CUDA device: DISTOPT_TEST_DEVICE=cpu runs the CUDA tests on the CPU, and this "
    "one (a CUDA graph, CUDA synchronisation) means something only on a GPU",
)
