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
wrong one.

Each library is compiled with ``torch.utils.cpp_extension`` (a C++ compiler and ninja) the
first time it is imported with a given checkout, torch installation, Python, compiler and
flags (``build_name``: each combination builds in a directory of its own, so two virtual
environments never rebuild over each other's build); later imports, other processes
included, load the cached build. Before it compiles, the import says so on stderr, with
what it builds and how long that took here. Builds of one library are serialised by an
``fcntl.flock`` (``_BuildLock``), which the kernel releases when its holder dies, so a
build killed half way cannot leave a lock behind that makes every later import wait
(torch 2.13's own lock is a file, which a killed build leaves: it is removed, under ours,
once the killed build's compilers have finished); the wait for another process's build is
bounded by ``DISTOPT_BUILD_TIMEOUT`` seconds. Where a library cannot be built or loaded, or
with ``DISTOPT_NATIVE=0`` in the environment, its flag (``AVAILABLE``, ``KERNELS``) is False
and the callers use their TorchScript and foreach code instead: the same results, slower.
"""
import hashlib
import logging
import os
import sys
import time
from typing import List, Optional, Sequence

import torch

try:
    import fcntl
except ImportError:  # not a POSIX system: torch's own lock file alone serialises builds
    fcntl = None  # type: ignore[assignment]

log = logging.getLogger(__name__)

_CSRC = os.path.join(os.path.dirname(os.path.abspath(__file__)), "csrc")
SOURCE = os.path.join(_CSRC, "flat_ops.cpp")
KERNELS_SOURCE = os.path.join(_CSRC, "elementwise_ops.cpp")

#: Compiler flags of each CPU capability, as torch builds its own kernels of that capability.
_CAPABILITY_FLAGS = {
    "AVX2": ["-mavx2", "-mfma", "-mf16c", "-DCPU_CAPABILITY=AVX2", "-DCPU_CAPABILITY_AVX2"],
    "DEFAULT": ["-DCPU_CAPABILITY=DEFAULT"],
}

#: How long an import waits for another process's build of the same library before it gives
#: up and runs the TorchScript paths (seconds; ``DISTOPT_BUILD_TIMEOUT``). A build took up to
#: 40 s here under load; the bound is there so that no import can wait forever.
def _timeout(text: Optional[str], default: float = 600.0) -> float:
    """``DISTOPT_BUILD_TIMEOUT``'s value: a positive number of seconds, else ``default``
    with a warning (an import must not fail, nor wait forever, on a mistyped setting)."""
    if text is None or text.strip() == "":
        return default
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not 0 < value < float("inf"):
        log.warning("Invalid DISTOPT_BUILD_TIMEOUT: %r (expected a positive number of seconds); "
                    "waiting at most %g s", text, default)
        return default
    return value


BUILD_TIMEOUT = _timeout(os.environ.get("DISTOPT_BUILD_TIMEOUT"))

#: How long an import waits for another process's lock before it says so (seconds).
_QUIET_WAIT_S = 2.0

#: The lock file torch's ``cpp_extension.load`` creates in a build directory while it builds
#: (torch 2.13's ``FileBaton``: a file, not an OS lock, so a killed build leaves it and every
#: later ``load`` of that directory waits on it forever).
_TORCH_LOCK = "lock"
#: Ours beside it: an ``fcntl.flock``, which the kernel releases when its holder dies.
_OUR_LOCK = "distopt.lock"
#: What the last build here was built from (``_fingerprint``): its absence, or another
#: fingerprint, means the next ``load`` compiles, and the import says so first.
_STAMP = "distopt.stamp"
#: What the last build here was built from, and its error, where it failed: the next
#: import with the same fingerprint does not try again until this file is deleted.
_FAILED = "distopt.failed"


def _installation() -> List[str]:
    """What a build depends on besides its sources and flags: the torch installation (its
    headers and libraries, by path and version), the Python ABI and the compiler."""
    return [os.path.realpath(os.path.dirname(torch.__file__)), torch.__version__,
            sys.implementation.cache_tag or "", getattr(sys, "abiflags", ""),
            os.environ.get("CXX", "c++")]


def build_name(name: str, root: str = _CSRC, flags: Sequence[str] = (), ldflags: Sequence[str] = (),
               installation: Optional[Sequence[str]] = None) -> str:
    """``name`` and a short hash of what its build depends on: the checkout whose ``csrc/``
    (``root``) it is built from, the torch installation, Python and compiler
    (``installation``, this process's by default) and the flags. Each combination has a build
    directory of its own, so two checkouts, two virtual environments or two torch versions
    on one machine never rebuild over each other's build."""
    parts = [os.path.abspath(root), *(installation if installation is not None else _installation()),
             " ".join(flags), " ".join(ldflags)]
    digest = hashlib.sha1("\0".join(parts).encode()).hexdigest()[:8]
    return f"{name}_{digest}"


def build_directory(name: str, root: Optional[str] = None) -> str:
    """Where library ``name`` (a ``build_name``) is built: under ``root``, by default
    ``TORCH_EXTENSIONS_DIR`` or torch's extensions root, in the folder torch's own ``load``
    would use."""
    from torch.utils.cpp_extension import get_default_build_root

    root = root or os.environ.get("TORCH_EXTENSIONS_DIR") or get_default_build_root()
    if torch.version.hip is not None:
        accelerator = "rocm" + torch.version.hip.replace(".", "")
    elif torch.version.cuda is not None:
        accelerator = "cu" + torch.version.cuda.replace(".", "")
    else:
        accelerator = "cpu"
    python = f"py{sys.version_info.major}{sys.version_info.minor}{getattr(sys, 'abiflags', '')}"
    return os.path.join(root, f"{python}_{accelerator}", name)


def _enabled(what: str) -> bool:
    if os.environ.get("DISTOPT_NATIVE", "1") == "0":
        log.info("native %s off (DISTOPT_NATIVE=0)", what)
        return False
    return True


def _say(message: str) -> None:
    print(f"distopt: {message}", file=sys.stderr, flush=True)


class BuildWaitTimeout(RuntimeError):
    """Another process held a build's lock for longer than ``BUILD_TIMEOUT``."""


def _builders(directory: str, name: str) -> List[int]:
    """The ninja and compilers of a build of ``name`` whose Python process was killed alone:
    they run on, in the build directory, and must finish before another build starts there.
    Processes whose working directory is ``directory`` and whose command line is ninja's or
    names the library (the compile and link commands do); a shell someone opened there is
    not one. Linux only; elsewhere none are seen."""
    found = []
    try:
        entries = os.listdir("/proc")
    except OSError:
        return found
    for entry in entries:
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            if os.path.realpath(os.readlink(f"/proc/{entry}/cwd")) != directory:
                continue
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                argv = f.read().decode(errors="replace").split("\0")
        except OSError:  # gone, or not ours to read
            continue
        if os.path.basename(argv[0]) == "ninja" or any(name in arg for arg in argv):
            found.append(int(entry))
    return found


class _BuildLock:
    """An exclusive ``fcntl.flock`` on ``directory``'s lock file, waited for at most
    ``timeout`` seconds (``BuildWaitTimeout`` then), saying once on stderr whom it waits for.
    The kernel releases it when the holder exits or is killed, so a killed build never leaves
    it taken. While holding it, ``clear_stale`` removes what a killed build left."""

    def __init__(self, directory: str, name: str, timeout: float):
        self.directory, self.name, self.timeout = directory, name, timeout
        self.fd = -1

    def __enter__(self) -> "_BuildLock":
        os.makedirs(self.directory, exist_ok=True)
        self.deadline = time.monotonic() + self.timeout
        if fcntl is None:
            return self
        path = os.path.join(self.directory, _OUR_LOCK)
        self.fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        said = False
        # A cached load holds the lock for a fraction of a second: say nothing for that.
        quiet_until = time.monotonic() + _QUIET_WAIT_S
        while True:
            try:
                fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() >= self.deadline:
                    holder = self._holder()
                    os.close(self.fd)
                    raise BuildWaitTimeout(
                        f"waited {self.timeout:g} s for {holder} building {self.name} in "
                        f"{self.directory} (DISTOPT_BUILD_TIMEOUT)") from None
                if not said and time.monotonic() >= quiet_until:
                    _say(f"waiting for {self._holder()}, which holds the build lock of "
                         f"{self.name} in {self.directory} to build or load it (at most "
                         f"{self.timeout:g} s, DISTOPT_BUILD_TIMEOUT)")
                    said = True
                time.sleep(0.05)
        os.ftruncate(self.fd, 0)
        os.lseek(self.fd, 0, os.SEEK_SET)
        os.write(self.fd, str(os.getpid()).encode())
        return self

    def _holder(self) -> str:
        try:
            os.lseek(self.fd, 0, os.SEEK_SET)
            pid = os.read(self.fd, 32).decode().strip()
        except OSError:
            pid = ""
        return f"process {pid}" if pid else "another process"

    def clear_stale(self) -> None:
        """Remove torch's lock file if a killed build left it (no build can hold it while we
        hold ours), after the ninja and compilers that build left running, if any, finish."""
        stale = os.path.join(self.directory, _TORCH_LOCK)
        if fcntl is None or not os.path.exists(stale):
            return
        said = False
        while True:
            pids = _builders(os.path.realpath(self.directory), self.name)
            if not pids:
                break
            if time.monotonic() >= self.deadline:
                raise BuildWaitTimeout(
                    f"processes {pids} left by a killed build of {self.name} still run in "
                    f"{self.directory} after {self.timeout:g} s (DISTOPT_BUILD_TIMEOUT)")
            if not said:
                _say(f"waiting for processes {pids} left by a killed build of {self.name} in "
                     f"{self.directory} to finish (at most {self.timeout:g} s)")
                said = True
            time.sleep(0.2)
        os.remove(stale)
        _say(f"removed {stale}, left by a build of {self.name} that was killed")

    def __exit__(self, *exc) -> None:
        if self.fd >= 0:
            os.close(self.fd)  # releases the flock


def _fingerprint(sources: Sequence[str], flags: Sequence[str], ldflags: Sequence[str]) -> str:
    digest = hashlib.sha1()
    for source in sources:
        with open(source, "rb") as f:
            digest.update(f.read())
    digest.update("\0".join([*flags, "|", *ldflags, *_installation()]).encode())
    return digest.hexdigest()


def _is_built(directory: str, name: str, fingerprint: str) -> bool:
    try:
        with open(os.path.join(directory, _STAMP)) as f:
            stamp = f.read().strip()
    except OSError:
        return False
    return stamp == fingerprint and os.path.exists(os.path.join(directory, f"{name}.so"))


def _failed_before(directory: str, fingerprint: str) -> Optional[str]:
    """The first line of the error of the last build here, if it failed with these sources,
    flags and installation (``_FAILED``); None otherwise."""
    try:
        with open(os.path.join(directory, _FAILED)) as f:
            stamp, _, reason = f.read().partition("\n")
    except OSError:
        return None
    return reason.strip().splitlines()[0] if stamp == fingerprint and reason.strip() else None


def _build(name: str, source: str, flags: List[str], probe: str, ldflags: Optional[List[str]] = None,
           what: str = "native ops", took: str = "") -> bool:
    """Build (or load the cached build of) library ``name`` and check that it registered
    ``probe`` (``namespace.op``); False, with one warning saying why, on any failure.

    Builds of one library are serialised by an OS lock (``_BuildLock``), waited for at most
    ``BUILD_TIMEOUT`` seconds. Before compiling, stderr says what is built, that it happens
    once, and how long it took here (``took``); a cached build loads silently. A build that
    failed is not tried again with the same sources, flags and installation until its
    record (``distopt.failed``, which keeps the compiler's output) is deleted."""
    namespace, op = probe.split(".")
    if hasattr(torch.ops, namespace) and hasattr(getattr(torch.ops, namespace), op):
        return True
    ldflags = ldflags or []
    compiling = False
    try:
        from torch.utils.cpp_extension import load

        unique = build_name(name, os.path.dirname(os.path.abspath(source)), flags, ldflags)
        directory = build_directory(unique)
        fingerprint = _fingerprint([source], flags, ldflags)
        with _BuildLock(directory, unique, BUILD_TIMEOUT) as lock:
            lock.clear_stale()
            fresh = not _is_built(directory, unique, fingerprint)
            if fresh:
                failed = _failed_before(directory, fingerprint)
                if failed is not None:
                    log.warning(
                        "native ops %s unavailable: their build failed before (%s; the "
                        "compiler's output is in %s, delete it to build again); the "
                        "TorchScript and foreach paths run instead",
                        name, failed, os.path.join(directory, _FAILED))
                    return False
                _say(f"compiling {what} ({os.path.basename(source)}) into {directory}: once per "
                     f"checkout, torch installation and Python{took}; later imports load the build")
                started = time.monotonic()
                compiling = True
            try:
                load(name=unique, sources=[source], extra_cflags=flags, extra_ldflags=ldflags,
                     build_directory=directory, is_python_module=False, verbose=False)
                getattr(getattr(torch.ops, namespace), op)  # raises if it did not register
            except Exception as error:
                if compiling:
                    with open(os.path.join(directory, _FAILED), "w") as f:
                        f.write(f"{fingerprint}\n{type(error).__name__}: {error}\n")
                raise
            if fresh:
                with open(os.path.join(directory, _STAMP), "w") as f:
                    f.write(fingerprint)
                _say(f"built {unique} in {time.monotonic() - started:.1f} s")
    except Exception as error:  # any build or load failure: fall back, say why
        text = str(error).strip().splitlines()
        reason = text[0] if text else ""
        more = (f" (the compiler's output: {os.path.join(directory, _FAILED)})"
                if compiling else "")
        log.warning(
            "native ops %s unavailable (%s: %s)%s; the TorchScript and foreach paths run instead",
            name, type(error).__name__, reason, more,
        )
        return False
    return True


#: How long each build took on the project's machine, for the first import's message
#: (2-core AMD EPYC VM, g++ 12, torch 2.13; docs/guide/functional.md#the-native-build).
_TOOK_FLAT = " (9 s on 2 idle cores here, 17 s beside the test suite)"
_TOOK_KERNELS = " (18 s on 2 idle cores here, 41 s beside the test suite)"


def _load_flat() -> bool:
    if not _enabled("flat ops"):
        return False
    return _build("distopt_flat", SOURCE, ["-O2"], "distopt_flat.fill",
                  what="the flat-buffer ops", took=_TOOK_FLAT)


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
                  "distopt_kernels.rmsprop_", ldflags, what="the fused CPU kernels", took=_TOOK_KERNELS)


#: Whether ``torch.ops.distopt_flat`` is registered in this process.
AVAILABLE = _load_flat()

#: Whether ``torch.ops.distopt_kernels`` (the fused CPU kernels) is registered in this process.
KERNELS = _load_kernels()
