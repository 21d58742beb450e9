"""Registering functional optimizer classes with TorchScript.

A ``torch.nn.Module`` that holds an optimizer instance as an attribute can only be scripted
once the instance's class is known to TorchScript. Every functional optimizer registers its
class on first construction (not at import, which would make ``import functional`` compile
all fourteen classes); the compile is serialized because TorchScript's compiler is not
thread-safe.

Every TorchScript compile of the library goes through ``script`` or ``quiet_scripting``:
torch 2.13 warns (a ``DeprecationWarning``) at every call of ``torch.jit.script``,
``script_method`` and ``interface``, and compiling one optimizer class calls
``torch.jit.script`` about a hundred times (once for each function the class calls), which
a library's users should not read in their own logs and test reports. Exactly those three
messages are filtered, around the library's own calls only: the user's calls still warn,
and so does everything else.
"""
import contextlib
import inspect
import threading
import warnings
from typing import Any, Iterator, Set

import torch

from functional._torch import class_resolution_callback

#: Held around every compile of the library: TorchScript's compiler is not thread-safe, and
#: ``warnings.catch_warnings`` restores the process's filters on exit, so two of them
#: interleaved in two threads could leave one's filter in place for good.
_lock = threading.RLock()
_compiled: Set[type] = set()

#: The start of torch's message for each call it deprecates (a ``DeprecationWarning``).
_DEPRECATED_CALLS = ("script", "script_method", "interface")


@contextlib.contextmanager
def quiet_scripting() -> Iterator[None]:
    """Run the library's own TorchScript calls without torch's deprecation warnings for
    ``torch.jit.script``, ``script_method`` and ``interface``; any other warning is shown as
    usual. A module-level ``with`` around a decorated definition covers import-time
    compiles (``torch.jit.interface`` resolves names from its caller's frame, so it cannot
    be called through a helper)."""
    with _lock, warnings.catch_warnings():
        for name in _DEPRECATED_CALLS:
            warnings.filterwarnings("ignore", message=rf"`torch\.jit\.{name}` is deprecated",
                                    category=DeprecationWarning)
        yield


def script(obj: Any) -> Any:
    """``torch.jit.script(obj)`` under ``quiet_scripting``; usable as a decorator. A class
    (not a module) resolves the names in its methods from its own module, so that any caller
    can compile it.

    Raises:
        RuntimeError: TorchScript's own error when ``obj`` does not compile.
    """
    with quiet_scripting():
        if inspect.isclass(obj) and not issubclass(obj, torch.nn.Module):
            return torch.jit.script(obj, _rcb=class_resolution_callback(obj))
        return torch.jit.script(obj)


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
        script(cls)
        _compiled.add(cls)
