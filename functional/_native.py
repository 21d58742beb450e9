"""The native ops of flat parameter buffers (``csrc/flat_ops.cpp``), built on first import.

``torch.ops.distopt_flat.fill`` does a flat step's per-member bookkeeping (check each
gradient and that each member still views the buffer, copy the gradients into the flat
gradient buffer) and ``torch.ops.distopt_flat.lookup`` an owner's per-parameter lookups in
an autograd context's gradients, in C++ instead of the TorchScript interpreter: tens of
nanoseconds a parameter instead of about a microsecond (measured in ``benchmarks/``).

The library is compiled with ``torch.utils.cpp_extension`` (a C++ compiler and ninja; about
10 s, once: later imports, other processes included, load the cached build). Where it
cannot be built, or with ``DISTOPT_NATIVE=0`` in the environment, ``AVAILABLE`` is False and
the callers use their TorchScript code instead: the same results, slower.
"""
import logging
import os

import torch

log = logging.getLogger(__name__)

SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "csrc", "flat_ops.cpp")


def _load() -> bool:
    if os.environ.get("DISTOPT_NATIVE", "1") == "0":
        log.info("native flat ops off (DISTOPT_NATIVE=0)")
        return False
    if hasattr(torch.ops, "distopt_flat") and hasattr(torch.ops.distopt_flat, "fill"):
        return True
    try:
        from torch.utils.cpp_extension import load

        log.info("loading the native flat ops (compiled on first use, about 10 s)")
        load(
            name="distopt_flat",
            sources=[SOURCE],
            extra_cflags=["-O2"],
            is_python_module=False,
            verbose=False,
        )
        torch.ops.distopt_flat.fill  # noqa: B018 (raises if the library did not register)
    except Exception as error:  # any build or load failure: fall back, say why
        log.warning(
            "native flat ops unavailable (%s: %s); flat steps use the TorchScript path",
            type(error).__name__, error,
        )
        return False
    return True


#: Whether ``torch.ops.distopt_flat`` is registered in this process.
AVAILABLE = _load()
