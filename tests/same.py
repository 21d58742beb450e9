"""Exact equality of nested values (state dicts, checkpoints), shared by the test folders."""
from typing import Any

import torch


def assert_identical(got: Any, want: Any, where: str = "") -> None:
    """Equal structure, equal tensors bit for bit (dtype, shape, values); the first
    difference is named by its path in ``where``."""
    if isinstance(want, torch.Tensor):
        assert isinstance(got, torch.Tensor), where
        assert got.dtype == want.dtype and got.shape == want.shape, where
        assert torch.equal(got, want), f"{where}: tensors differ"
    elif isinstance(want, dict):
        assert isinstance(got, dict) and got.keys() == want.keys(), (where, got, want)
        for key in want:
            assert_identical(got[key], want[key], f"{where}/{key}")
    elif isinstance(want, (list, tuple)):
        assert isinstance(got, (list, tuple)) and len(got) == len(want), where
        for i, (g, w) in enumerate(zip(got, want)):
            assert_identical(g, w, f"{where}[{i}]")
    else:
        assert got == want, f"{where}: {got!r} != {want!r}"


def identical(got: Any, want: Any) -> bool:
    """``assert_identical`` as a truth value (for code that reports rather than asserts)."""
    try:
        assert_identical(got, want)
    except AssertionError:
        return False
    return True
