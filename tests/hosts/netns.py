"""Test hosts: network namespaces on a private bridge, one process (or more) in each.

``Hosts(n)`` builds ``n`` network namespaces, each with one interface ``eth0`` joined by a
veth pair to a bridge of its own, addresses ``10.77.0.1`` .. ``10.77.0.n`` on a /24. The
bridge has no address (IPv6 is off on it and on the root-side veth ends), so the root
namespace has no route into it: traffic goes only between the namespaces this object made,
and two ``Hosts`` (in one run or in parallel runs) may use the same addresses without
meeting. Each program started on a host also gets a pid namespace of its own (``command``).

Names carry the creating process's pid and a counter (``dtn<pid>-<k>-h<i>`` for the
namespaces, ``db<pid>k<k>`` for the bridge, ``dv<pid>k<k>h<i>`` for the root-side veth
ends), so runs never collide. ``close`` kills every process left in the namespaces and
removes them and the bridge; it runs on leaving the ``with`` block, whatever ended it, and
at interpreter exit. What a killed run (SIGKILL) left behind is removed by the next
``Hosts``: objects whose pid is no longer alive.

``unavailable()`` says why namespaces cannot be made here (not root, no ``ip``), or None.
"""
import atexit
import itertools
import logging
import os
import re
import shutil
import subprocess
import time
from typing import Dict, List, Optional, Sequence

from tests import worlds

logger = logging.getLogger(__name__)

SUBNET = "10.77.0"
INTERFACE = "eth0"
_NS_PREFIX = "dtn"
_counter = itertools.count()
_NAME = re.compile(rf"^{_NS_PREFIX}(\d+)-\d+-h\d+$")
_LINK = re.compile(r"^d[bv](\d+)k\d+")
COMMAND_TIMEOUT_S = 30


def unavailable() -> Optional[str]:
    """Why this machine cannot build test hosts, or None when it can."""
    if os.geteuid() != 0:
        return "network namespaces need root (ip netns add)"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"no '{tool}' command (iproute2) on this machine"
    probe = f"{_NS_PREFIX}{os.getpid()}-probe"
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True,
                          timeout=COMMAND_TIMEOUT_S)
    if made.returncode != 0:
        return f"cannot create a network namespace: {made.stderr.strip()}"
    _ip("netns", "del", probe)
    return None


def _ip(*args: str, namespace: Optional[str] = None, check: bool = True) -> str:
    argv = ["ip", *args] if namespace is None else ["ip", "netns", "exec", namespace, "ip", *args]
    return _command(argv, check)


def _command(argv: Sequence[str], check: bool = True) -> str:
    proc = subprocess.run(list(argv), capture_output=True, text=True, timeout=COMMAND_TIMEOUT_S)
    if check and proc.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)} failed ({proc.returncode}): {proc.stderr.strip()}")
    return proc.stdout


def _no_ipv6(link: str) -> None:
    """Turn IPv6 off on a root-namespace interface (where the kernel has IPv6)."""
    knob = f"/proc/sys/net/ipv6/conf/{link}/disable_ipv6"
    if os.path.exists(knob):
        with open(knob, "w") as f:
            f.write("1")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def remove_stale() -> List[str]:
    """Remove namespaces and links left by test runs whose process is gone; their names."""
    removed = []
    for line in _command(["ip", "netns", "list"], check=False).splitlines():
        name = line.split()[0] if line.split() else ""
        match = _NAME.match(name)
        if match and not _alive(int(match.group(1))):
            _kill_processes(name)
            _ip("netns", "del", name, check=False)
            removed.append(name)
    for line in _command(["ip", "-o", "link", "show"], check=False).splitlines():
        parts = line.split(":")
        if len(parts) < 2:
            continue
        name = parts[1].strip().split("@")[0]
        match = _LINK.match(name)
        if match and not _alive(int(match.group(1))):
            _ip("link", "del", name, check=False)
            removed.append(name)
    if removed:
        logger.warning("removed test hosts left by dead runs: %s", ", ".join(removed))
    return removed


def _kill_processes(namespace: str) -> None:
    """SIGKILL every process in ``namespace`` and wait (bounded) until each has exited."""
    deadline = time.monotonic() + COMMAND_TIMEOUT_S
    while True:
        pids = [int(p) for p in _command(["ip", "netns", "pids", namespace], check=False).split()]
        if not pids:
            return
        if time.monotonic() > deadline:
            raise RuntimeError(f"processes {pids} in {namespace} outlived SIGKILL")
        for pid in pids:
            if not worlds.wait_for_exit(pid, deadline - time.monotonic(), kill=True):
                raise RuntimeError(
                    f"process {pid} in {namespace} survived SIGKILL for {COMMAND_TIMEOUT_S} s"
                )


class Hosts:
    """``n`` test hosts (network namespaces) on one private bridge.

    Args:
        n: how many hosts; host ``i`` (0-based) has address ``10.77.0.<i+1>``.

    Attributes:
        namespaces: the namespaces' names, host ``i`` is ``namespaces[i]``.
        addresses: their addresses.
        links: the root-side veth end of each host's link (what ``cut`` and ``limit`` act on).
    """

    def __init__(self, n: int) -> None:
        if not 1 <= n <= 250:
            raise ValueError(f"Invalid n: {n!r} (expected 1 to 250 hosts)")
        remove_stale()
        k = next(_counter)
        pid = os.getpid()
        self.namespaces = [f"{_NS_PREFIX}{pid}-{k}-h{i}" for i in range(n)]
        self.addresses = [f"{SUBNET}.{i + 1}" for i in range(n)]
        self.bridge = f"db{pid}k{k}"
        self.links = [f"dv{pid}k{k}h{i}" for i in range(n)]
        too_long = [name for name in [self.bridge, *self.links] if len(name) > 15]
        if too_long:
            raise RuntimeError(f"interface names over 15 characters: {too_long}")
        self._closed = False
        atexit.register(self.close)
        try:
            self._build()
        except BaseException:
            self.close()
            raise

    def _build(self) -> None:
        _ip("link", "add", self.bridge, "type", "bridge")
        _no_ipv6(self.bridge)  # no link-local address either: nothing here reaches the hosts
        _ip("link", "set", self.bridge, "up")
        for ns, link, address in zip(self.namespaces, self.links, self.addresses):
            _ip("netns", "add", ns)
            _ip("link", "add", link, "type", "veth", "peer", "name", INTERFACE, "netns", ns)
            _no_ipv6(link)
            _ip("link", "set", link, "master", self.bridge)
            _ip("link", "set", link, "up")
            _ip("addr", "add", f"{address}/24", "dev", INTERFACE, namespace=ns)
            _ip("link", "set", INTERFACE, "up", namespace=ns)
            _ip("link", "set", "lo", "up", namespace=ns)

    def __enter__(self) -> "Hosts":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def command(self, i: int, argv: Sequence[str]) -> List[str]:
        """``argv`` as run on host ``i``: in its network namespace and in a pid namespace of
        its own, as on another machine. Without the pid namespace TensorPipe would see
        processes of one machine and copy tensors from memory to memory (its CMA channel),
        past the links; ``--kill-child``: killing the started process kills the program."""
        return ["ip", "netns", "exec", self.namespaces[i],
                "unshare", "--pid", "--kill-child", *argv]

    def popen(self, i: int, argv: Sequence[str], env: Optional[Dict[str, str]] = None,
              **kwargs) -> subprocess.Popen:
        """Start ``argv`` on host ``i`` (see ``command``)."""
        return subprocess.Popen(self.command(i, argv), env=env, **kwargs)

    def pids(self, i: int) -> List[int]:
        """The processes running on host ``i``."""
        return [int(p) for p in _command(["ip", "netns", "pids", self.namespaces[i]]).split()]

    def cut(self, i: int) -> None:
        """Take host ``i``'s link down: its packets go nowhere, no connection is reset."""
        _ip("link", "set", self.links[i], "down")

    def restore(self, i: int) -> None:
        """Bring host ``i``'s link back up."""
        _ip("link", "set", self.links[i], "up")

    def limit(self, i: int, rate: str, burst: str = "64kb", latency: str = "100ms") -> None:
        """Rate-limit host ``i``'s link both ways with a token bucket (``tc ... tbf``);
        ``rate`` as tc writes it, e.g. ``"50mbit"``."""
        tbf = ["tbf", "rate", rate, "burst", burst, "latency", latency]
        _command(["tc", "qdisc", "replace", "dev", self.links[i], "root", *tbf])
        _command(self.command(i, ["tc", "qdisc", "replace", "dev", INTERFACE, "root", *tbf]))

    def unlimit(self, i: int) -> None:
        """Remove ``limit``'s token buckets."""
        _command(["tc", "qdisc", "del", "dev", self.links[i], "root"], check=False)
        _command(self.command(i, ["tc", "qdisc", "del", "dev", INTERFACE, "root"]), check=False)

    def close(self) -> None:
        """Kill what runs on the hosts, remove them and the bridge. Idempotent."""
        if self._closed:
            return
        self._closed = True
        problems = []
        for ns in self.namespaces:
            try:
                _kill_processes(ns)
            except RuntimeError as exc:
                problems.append(str(exc))
            _ip("netns", "del", ns, check=False)
        for link in [*self.links, self.bridge]:
            _ip("link", "del", link, check=False)
        left = [ns for ns in self.namespaces
                if ns in _command(["ip", "netns", "list"], check=False).split()]
        if left or problems:
            raise RuntimeError(f"test hosts not torn down: {left} {problems}")
