"""What the benchmarks say about the machine they ran on, and the loopback helpers they
share (import as ``benchmarks._machine`` from the repository root)."""
import os
import platform
import socket


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


def machine() -> str:
    """This machine in a few words: CPU model and core count."""
    return f"{cpu_model()}, {os.cpu_count()} cores"


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
