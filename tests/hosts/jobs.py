"""Processes of a test: started on test hosts (or here), their output read as it comes.

``Job`` starts processes, reads each one's merged stdout/stderr on a thread into one queue,
and lets a test wait, with a timeout, for a line matching a pattern (the moment to kill an
owner or cut a link), or for every process to end. Nothing waits without a bound.
"""
import os
import queue
import re
import subprocess
import threading
import time
from typing import Dict, List, Optional, Sequence, Tuple

from tests.hosts import netns


class Job:
    """Processes started together; ``out[k]`` is everything process ``k`` printed so far."""

    def __init__(self) -> None:
        self.procs: List[subprocess.Popen] = []
        self.out: List[List[str]] = []
        self._lines: "queue.Queue[Tuple[int, Optional[str]]]" = queue.Queue()
        self._open = 0

    def start(self, argv: Sequence[str], env: Dict[str, str], hosts: Optional[netns.Hosts] = None,
              host: int = 0, stdin: bool = False, cwd: Optional[str] = None) -> int:
        """Start ``argv`` (on ``hosts``'s host ``host``, or here); returns its index."""
        command = list(argv) if hosts is None else hosts.command(host, argv)
        proc = subprocess.Popen(
            command, env=env, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
            stdin=subprocess.PIPE if stdin else subprocess.DEVNULL, text=True, bufsize=1,
        )
        k = len(self.procs)
        self.procs.append(proc)
        self.out.append([])
        self._open += 1
        threading.Thread(target=self._read, args=(k, proc), daemon=True).start()
        return k

    def _read(self, k: int, proc: subprocess.Popen) -> None:
        for line in proc.stdout:
            self._lines.put((k, line))
        self._lines.put((k, None))

    def _take(self, deadline: float) -> Tuple[int, Optional[str]]:
        left = deadline - time.monotonic()
        if left <= 0:
            raise queue.Empty
        k, line = self._lines.get(timeout=left)
        if line is None:
            self._open -= 1
        else:
            self.out[k].append(line)
        return k, line

    def expect(self, pattern: str, timeout: float) -> Tuple[int, str]:
        """Wait for a line matching ``pattern`` (a regular expression, searched) from any
        process; returns (process, line). Fails with everything printed so far."""
        deadline = time.monotonic() + timeout
        regex = re.compile(pattern)
        try:
            while True:
                k, line = self._take(deadline)
                if line is not None and regex.search(line):
                    return k, line
                if self._open == 0:
                    raise queue.Empty
        except queue.Empty:
            raise AssertionError(
                f"no line matching {pattern!r} within {timeout} s:\n{self.text()}"
            ) from None

    def finish(self, timeout: float) -> List[int]:
        """Wait for every process to end (their output read to the end); the exit codes.
        Past ``timeout`` everything is killed and the test fails."""
        deadline = time.monotonic() + timeout
        try:
            while self._open:
                self._take(deadline)
            return [p.wait(timeout=max(1.0, deadline - time.monotonic())) for p in self.procs]
        except (queue.Empty, subprocess.TimeoutExpired):
            self.kill()
            raise AssertionError(f"processes still running after {timeout} s:\n{self.text()}")

    def kill(self) -> None:
        """SIGKILL every process that still runs and reap it."""
        for proc in self.procs:
            if proc.poll() is None:
                proc.kill()
            proc.wait(timeout=30)

    def text(self, k: Optional[int] = None) -> str:
        """What process ``k`` (default: all, each headed by its index) printed."""
        if k is not None:
            return "".join(self.out[k])
        return "\n".join(f"--- process {i}:\n{''.join(lines)}" for i, lines in enumerate(self.out))


def pids_with_env(**wanted: str) -> List[int]:
    """Processes on this machine whose environment holds every ``NAME=value`` given
    (how a test finds a worker that torchrun started)."""
    needles = [f"{name}={value}".encode() for name, value in wanted.items()]
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/environ", "rb") as f:
                env = f.read().split(b"\0")
        except OSError:
            continue
        if all(needle in env for needle in needles):
            found.append(int(entry))
    return found
