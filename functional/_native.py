"""The native ops (``csrc/``), built on first import: flat-buffer bookkeeping and fused kernels.

``torch.ops.distopt_flat.fill`` does a flat step's per-member bookkeeping (check each
gradient and that each member still views the buffer, copy the gradients into the flat
gradient buffer) and ``torch.ops.distopt_flat.lookup`` an owner's per-parameter lookups in
an autograd context's gradients, in C++ instead of the TorchScript interpreter: tens of
nanoseconds a parameter instead of about a microsecond (measured in ``benchmarks/``).
``check_step`` and ``bump_versions`` serve an owner's step (``distopt.local_optimizer``):
every gradient checked, and each parameter's version counter read, before any group steps;
afterwards the counter of each stepped parameter that the kernel left as it was bumped, as
torch.optim's in-place update bumps it.

``torch.ops.distopt_kernels.*`` (``csrc/elementwise_ops.cpp``) are one fused CPU kernel per
algorithm that torch has none for (Adadelta, Adamax, RMSprop, Rprop, NAdam, RAdam, ASGD and
Adafactor's update): one pass over a parameter, its gradient and its state instead of one per
foreach op. They are built for the CPU capability of the torch kernels they reproduce
(``kernel_capability``: AVX2 on x86 with AVX2 or AVX512, else the portable build), under a
name of their own, so a build directory shared by machines of different CPUs never loads the
wrong one. Each name also carries a hash of this checkout's path (``build_name``): two
checkouts on one machine (a clone beside a worktree, a benchmark of an older commit) each keep
their own build instead of rebuilding over each other's at every import.

Each library is compiled with ``torch.utils.cpp_extension`` (a C++ compiler and ninja; about
10 s and 40 s, once: later imports, other processes included, load the cached build; a
process that finds another building it waits on the build directory's lock). Where one cannot
be built, or with ``DISTOPT_NATIVE=0`` in the environment, its flag (``AVAILABLE``,
``KERNELS``) is False and the callers use their TorchScript and foreach code instead: the same
results, slower.
"""
import hashlib
import logging
import os
from typing import List, Optional

import torch

log = logging.getLogger(__name__)

_CSRC = os.path.join(os.path.dirname(os.path.abspath(__file__)), "csrc")
SOURCE = os.path.join(_CSRC, "flat_ops.cpp")
KERNELS_SOURCE = os.path.join(_CSRC, "elementwise_ops.cpp")

#: Compiler flags of each CPU capability, as torch builds its own kernels of that capability.
_CAPABILITY_FLAGS = {
    "AVX2": ["-mavx2", "-mfma", "-mf16c", "-DCPU_CAPABILITY=AVX2", "-DCPU_CAPABILITY_AVX2"],
    "DEFAULT": ["-DCPU_CAPABILITY=DEFAULT"],
}


def build_name(name: str, root: str = _CSRC) -> str:
    """``name`` and a short hash of the checkout whose ``csrc/`` (``root``) it is built from."""
    digest = hashlib.sha1(os.path.abspath(root).encode()).hexdigest()[:8]
    return f"{name}_{digest}"


def _enabled(what: str) -> bool:
    if os.environ.get("DISTOPT_NATIVE", "1") == "0":
        log.info("native %s off (DISTOPT_NATIVE=0)", what)
        return False
    return True


def _build(name: str, source: str, flags: List[str], probe: str, ldflags: Optional[List[str]] = None) -> bool:
    """Build (or load the cached build of) library ``name`` and check that it registered
    ``probe`` (``namespace.op``); False, with a warning saying why, on any failure."""
    namespace, op = probe.split(".")
    if hasattr(torch.ops, namespace) and hasattr(getattr(torch.ops, namespace), op):
        return True
    try:
        from torch.utils.cpp_extension import load

        log.info("loading %s (compiled on first use)", name)
        load(name=build_name(name), sources=[source], extra_cflags=flags, extra_ldflags=ldflags or [],
             is_python_module=False, verbose=False)
        getattr(getattr(torch.ops, namespace), op)  # raises if the library did not register
    except Exception as error:  # any build or load failure: fall back, say why
        log.warning(
            "native ops %s unavailable (%s: %s); the TorchScript and foreach paths run instead",
            name, type(error).__name__, error,
        )
        return False
    return True


def _load_flat() -> bool:
    if not _enabled("flat ops"):
        return False
    return _build("distopt_flat", SOURCE, ["-O2"], "distopt_flat.fill")


def kernel_capability() -> str:
    """The CPU capability the fused kernels are built for: that of the torch kernels whose
    arithmetic they reproduce. On an AVX512 machine torch runs the AVX2 build of its
    elementwise kernels (add, mul, lerp, addcmul...: it registers AVX512 versions of a few
    others only), so AVX2 there too; the portable build elsewhere (``ATEN_CPU_CAPABILITY``
    lowers torch's capability, and so this)."""
    capability = torch.backends.cpu.get_cpu_capability()
    if capability in ("AVX512", "AVX2"):
        return "AVX2"
    return "DEFAULT"


def _load_kernels() -> bool:
    if not _enabled("kernels"):
        return False
    capability = kernel_capability()
    # -ffp-contract=off: the kernels fuse a multiply and an add exactly where torch's do
    # (csrc/elementwise_ops.cpp), so the compiler must fuse nothing of its own.
    flags = ["-O3", "-ffp-contract=off", "-fno-math-errno"] + _CAPABILITY_FLAGS[capability]
    ldflags: List[str] = []
    if "parallel backend: OpenMP" in torch.__config__.parallel_info():
        # at::parallel_for is an OpenMP pragma in ATen's headers: without -fopenmp a kernel
        # would run on one thread. The library then needs libgomp.so.1, the one torch loaded.
        flags.append("-fopenmp")
        ldflags.append("-fopenmp")
    return _build(f"distopt_kernels_{capability.lower()}", KERNELS_SOURCE, flags,
                  "distopt_kernels.rmsprop_", ldflags)


#: Whether ``torch.ops.distopt_flat`` is registered in this process.
AVAILABLE = _load_flat()

#: Whether ``torch.ops.distopt_kernels`` (the fused CPU kernels) is registered in this process.
KERNELS = _load_kernels()
