"""Distributed autograd contexts: whether one is alive here, and which one a thread is in.

The one place distopt asks, on the trainer (a step's ``context_id`` is checked before any
owner is contacted) and on the owners (an owner that took no part in a backward pass holds
no context for it). A leaf: it imports nothing else from distopt but ``distopt._torch``.
"""
import operator
from typing import Any, Optional, Tuple

from distopt import _torch

__all__ = ["check_context_id", "current_context_id", "has_context", "live_context"]


def has_context(context_id: int) -> bool:
    """Whether this worker holds the live distributed autograd context ``context_id``."""
    try:
        _torch.retrieve_context(context_id)
    except RuntimeError:
        return False
    return True


def live_context(context_id: Any) -> Tuple[int, Any]:
    """(``context_id`` as an int, the live context it names on this worker).

    Raises:
        TypeError: ``context_id`` is not an integer.
        ValueError: no such live context on this worker.
    """
    try:
        context_id = operator.index(context_id)
    except TypeError:
        raise TypeError(
            f"Invalid context_id: {context_id!r} (expected an int, the id of a "
            f"dist_autograd.context())"
        ) from None
    try:
        return context_id, _torch.retrieve_context(context_id)
    except RuntimeError as exc:
        raise ValueError(
            f"Invalid context_id: {context_id!r} (expected the id of a live "
            f"dist_autograd.context() on this worker)"
        ) from exc


def check_context_id(context_id: Any) -> int:
    """``context_id`` as an int, if it names a live context on this worker; raises as
    ``live_context``."""
    return live_context(context_id)[0]


def current_context_id() -> Optional[int]:
    """The id of the distributed autograd context this thread is in; None outside any."""
    try:
        return _torch.current_context_id()
    except RuntimeError:
        return None
