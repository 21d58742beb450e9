"""Registering functional optimizer classes with TorchScript.

A ``torch.nn.Module`` that holds an optimizer instance as an attribute can only be scripted
once the instance's class is known to TorchScript. Every functional optimizer registers its
class on first construction (not at import, which would make ``import functional`` compile
all fourteen classes); the compile is serialized because TorchScript's compiler is not
thread-safe.
"""
import threading
from typing import Set

import torch

from functional._torch import class_resolution_callback

_lock = threading.Lock()
_compiled: Set[type] = set()


def ensure_scripted(cls: type) -> None:
    """Compile ``cls`` as a TorchScript class once; later calls return at once.

    Raises:
        RuntimeError: TorchScript's own error when the class does not compile.
    """
    if cls in _compiled:
        return
    with _lock:
        if cls in _compiled:
            return
        # torch.jit.script(cls) resolves names from the caller's frame; resolve them from the
        # class's own module instead, so that any caller can trigger the compile.
        rcb = class_resolution_callback(cls)
        torch.jit.script(cls, _rcb=rcb)
        _compiled.add(cls)
