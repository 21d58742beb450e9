"""What the benchmarks say about the machine they ran on, the ``--device`` option they share,
and their loopback helpers (import as ``benchmarks._machine`` from the repository root)."""
import argparse
import os
import platform
import socket
import time
from typing import Callable

import torch


def cpu_model() -> str:
    """The CPU's model name (from /proc/cpuinfo where there is one)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def gpu() -> str:
    """The current CUDA device in a few words: its name, its memory, and the CUDA version
    torch was built with (only where ``torch.cuda.is_available()``)."""
    index = torch.cuda.current_device()
    memory = torch.cuda.get_device_properties(index).total_memory / 2**30
    return f"{torch.cuda.get_device_name(index)}, {memory:.0f} GiB, CUDA {torch.version.cuda}"


def machine(device: str = "cpu") -> str:
    """This machine in a few words: CPU model and core count, and with ``device="cuda"`` the
    GPU (``gpu()``)."""
    host = f"{cpu_model()}, {os.cpu_count()} cores"
    return host if device == "cpu" else f"{host}; GPU {gpu()}"


def add_device_argument(parser: argparse.ArgumentParser) -> None:
    """The ``--device {cpu,cuda}`` option (default cpu); check it with ``check_device``."""
    parser.add_argument(
        "--device", choices=("cpu", "cuda"), default="cpu",
        help="where parameters, gradients and optimizer state live (cuda: the current GPU)",
    )


def check_device(parser: argparse.ArgumentParser, device: str) -> None:
    """Exit through ``parser.error`` when ``--device cuda`` was asked for and torch has no GPU."""
    if device != "cuda" or torch.cuda.is_available():
        return
    if torch.version.cuda is None:
        why = f"torch {torch.__version__} is built without CUDA"
    else:
        why = f"torch {torch.__version__} (CUDA {torch.version.cuda}) finds no CUDA device"
    parser.error(f"Invalid --device: 'cuda' (expected cpu here: {why})")


def device_clock(device: torch.device) -> Callable[[], float]:
    """A clock in seconds for timing work on ``device``: ``time.perf_counter`` on the CPU; on
    a GPU, ``time.perf_counter`` read after ``torch.cuda.synchronize``, because kernels run
    after the call that queued them returns (so a reading before a step waits for earlier
    work, and one after it for the step's own kernels)."""
    if device.type != "cuda":
        return time.perf_counter

    def now() -> float:
        torch.cuda.synchronize(device)
        return time.perf_counter()

    return now


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def wchar() -> int:
    """Bytes this process has written so far, sockets included (every thread)."""
    with open("/proc/self/io") as f:
        for line in f:
            if line.startswith("wchar"):
                return int(line.split()[1])
    raise RuntimeError("no wchar in /proc/self/io")
