"""Every process a multi-process test starts comes from here.

- ``free_port()``: a loopback port to rendezvous on.
- ``World(W)``: W ranks in one gloo group on 127.0.0.1 that run scenario after
  scenario (``world.run(fn, *args)`` calls ``fn(rank, W, *args)`` on every rank and returns
  the results in rank order). Started once per test module by the ``worlds`` fixture
  (tests/conftest.py): ``worlds.run(fn, W, *args)``.
- ``run_world(fn, W, *args)``: a world of its own for one scenario, for the tests that
  break their world (a rank killed, aborted or left behind) or need a group timeout of
  their own, or pass a ``multiprocessing`` object (which only a new process inherits).
- ``spawned(...)``: processes of any other kind (RPC owners and trainers), killed and
  reaped whatever happens; ``rpc_trainer(...)``: RPC workers spawned, this process their
  trainer.
- ``Job``: scripts in fresh interpreters (here, or on test hosts), their output read as it
  comes, nothing waited for without a bound.

Every process but a ``Job``'s comes from ``CONTEXT``: a fork of a server that has torch and
distopt imported (``PRELOAD``), so a world starts in about 0.1 s, not 2. Ranks run with one
intra-op thread (several ranks on two cores must not oversubscribe them) and CUDA hidden
(torch's PowerSGD hook refuses CPU buckets where CUDA is available). Each scenario starts
with the default generator's first seed, as in a fresh process. A rank that raises makes
``run`` raise with that rank's traceback; a scenario (or a world's setup) still running at
``LIMIT_S`` fails the test, each waiting rank printing every thread's stack first (to the
test's captured stderr); a world that failed is started afresh for the next scenario. The
ranks load the native libraries the test process loaded (``_native_libraries``; where
processes are spawned, before they import anything), and a failed world's ranks are sent
SIGTERM and given ``TERM_S`` before SIGKILL: a process killed while it held torch's
extension build lock would leave the lock file behind, and every later import of
``functional``, in every later test, would wait for it for ever.
"""
import contextlib
import datetime
import faulthandler
import gc
import importlib
import io
import itertools
import multiprocessing
import os
import queue
import re
import select
import signal
import socket
import subprocess
import sys
import threading
import time
import traceback
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Tuple

#: What every test process starts with already imported (``CONTEXT``): importing them took
#: about 1.1 s of a core per process, the better part of starting a rank (0.1 s after);
#: torch._dynamo, which DataParallelOptimizer(module=...) imports, 1 s more.
PRELOAD = ["torch", "torch.distributed", "torch.distributed.rpc", "torch.distributed.autograd",
           "distopt", "distopt.parallel", "torch._dynamo"]


def _context() -> Any:
    """A fork of pytest would inherit its threads; a spawned process imports torch afresh.
    Where the OS forks, a fork server does both right: one fresh interpreter (per pytest
    process) imports ``PRELOAD``, no test code runs in it, and every test process is a fork
    of it. Its environment is the one pytest had when it started (no test changes the
    environment to pass it on). Neither it nor what it imports touches CUDA, so a test
    process can still take the GPU."""
    if "forkserver" not in multiprocessing.get_all_start_methods():
        return multiprocessing.get_context("spawn")
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(PRELOAD)
    return context


#: How every test process is started (``_context``).
CONTEXT = _context()
#: The process group's timeout in the ranks: what a collective waits for a lost peer.
TIMEOUT_S = 20.0
#: The most one scenario may run on a world before the test fails (no hang survives this).
LIMIT_S = 240.0
#: How often the test looks for a rank that died without a result.
#: The most a hung rank gets to write its stacks before the test fails.
DUMP_S = 10.0
POLL_S = 1.0
#: How long a rank may take to end once told to (then it is killed).
JOIN_S = 30.0
#: How long a rank of a failed world may take to unwind after SIGTERM (then SIGKILL).
TERM_S = 5.0


def free_port() -> int:
    """A loopback port nobody listens on right now (the OS picks it). In a network
    namespace of its own each host has its own ports: there this only avoids reuse."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


# ---------------------------------------------------------------- gloo worlds


def _encode(value: Any) -> bytes:
    # As bytes: a tensor put in a queue travels as a file descriptor that dies with us.
    import torch

    buf = io.BytesIO()
    torch.save(value, buf)
    return buf.getvalue()


def _rank(rank: int, world_size: int, port: int, timeout_s: float, libraries: List[str],
          first: Optional[tuple], tasks: Any, results: Any) -> None:
    """A rank: load ``libraries``, join the group, run ``first`` (a one-scenario world) or
    each task from ``tasks`` until None, putting (task number, rank, ok, result or
    traceback) on ``results``."""
    # CPU worlds: hide any GPU before torch first asks for one.
    os.environ["CUDA_VISIBLE_DEVICES"] = ""
    faulthandler.enable(all_threads=True)  # a rank that aborts prints where it was
    # A failed world's ranks are told to end with SIGTERM: unwind, then what is left is
    # killed (see ``_native_libraries`` for what a SIGKILL could leave behind).
    signal.signal(signal.SIGTERM, _terminated)
    import torch
    import torch.distributed as dist

    for path in libraries:
        with contextlib.suppress(Exception):  # then ``functional`` builds or loads its own
            torch.ops.load_library(path)
    torch.set_num_threads(1)
    seed = torch.initial_seed()
    try:
        dist.init_process_group(
            "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size,
            timeout=datetime.timedelta(seconds=timeout_s),
        )
    except BaseException:  # noqa: B902 - reported to the test
        results.put((None, rank, False, traceback.format_exc()))
        first, tasks = None, None
    if first is not None:
        pending: Any = [first]
    elif tasks is not None:
        pending = iter(tasks.get, None)
    else:
        pending = []
    for number, fn, args in pending:
        # Each scenario starts as in a fresh process: the default generator's first seed,
        # and nothing of the last one left waiting for the collector.
        torch.manual_seed(seed)
        try:
            if isinstance(fn, tuple):  # (module, name): imported here, after the handler
                fn = getattr(importlib.import_module(fn[0]), fn[1])
            report = (number, rank, True, _encode(fn(rank, world_size, *args)))
        except BaseException:  # noqa: B902 - reported to the test
            report = (number, rank, False, traceback.format_exc())
        gc.collect()
        results.put(report)
    # Delivered (the queue's feeder thread flushed) before the teardown, which may abort.
    results.close()
    results.join_thread()
    if dist.is_initialized():
        try:
            dist.destroy_process_group()
        except Exception:  # a peer already gone
            pass
    # Skip interpreter teardown: gloo threads of a failed group can block it.
    os._exit(0)


def _terminated(signum: int, frame: Any) -> None:
    raise SystemExit(128 + signum)


def _native_libraries() -> List[str]:
    """The native libraries this process loaded into torch (``functional``'s ops, built
    here already), for the ranks to load before they import anything.

    Without them each rank's ``import functional`` builds its ops through
    ``torch.utils.cpp_extension.load``, which in every new process runs ninja under the
    build directory's lock file (its record of what is built lives in the process): the
    ranks wait on each other, on any other process importing ``functional`` meanwhile, and,
    where a process was killed holding the lock, on its lock file for ever (a world that
    hangs at setup, as one of tests/parallel/test_powersgd.py's did). Loaded first, the ops
    are there and ``functional`` takes them as they are.
    """
    torch = sys.modules.get("torch")
    if torch is None:
        return []
    return sorted(getattr(torch.ops, "loaded_libraries", ()))


class World:
    """``world_size`` ranks in one gloo group (``timeout_s`` its timeout), started at the
    first ``run`` and again after a run that failed; ``close()`` ends them. A scenario still
    running after ``limit_s`` fails."""

    def __init__(self, world_size: int, timeout_s: float = TIMEOUT_S,
                 limit_s: float = LIMIT_S) -> None:
        self.world_size = world_size
        self.timeout_s = timeout_s
        self.limit_s = limit_s
        self.procs: List[Any] = []
        self._tasks: List[Any] = []
        self._results: Any = None
        self._numbers = itertools.count(1)

    def _start(self, first: Optional[tuple] = None) -> None:
        self._results = CONTEXT.Queue()
        self._tasks = [] if first is not None else [CONTEXT.Queue() for _ in range(self.world_size)]
        port = free_port()
        self.procs = [
            CONTEXT.Process(target=_rank, name=f"rank{r}", args=(
                r, self.world_size, port, self.timeout_s, _native_libraries(), first,
                self._tasks[r] if self._tasks else None, self._results))
            for r in range(self.world_size)
        ]
        for p in self.procs:
            p.start()

    def run(self, fn: Callable[..., Any], *args: Any) -> List[Any]:
        """``fn(rank, world_size, *args)`` on every rank (``fn`` a module-level function,
        ``args`` picklable); the results in rank order."""
        if not self.procs:
            self._start()
        number = next(self._numbers)
        for q in self._tasks:
            q.put((number, fn, args))
        return self._collect(number, ())

    def _collect(self, number: int, expect_dead: Sequence[int]) -> List[Any]:
        import torch

        out: List[Any] = [None] * self.world_size
        failures = []
        waiting = set(range(self.world_size)) - set(expect_dead)
        deadline = time.monotonic() + self.limit_s
        try:
            while waiting:
                try:
                    got, rank, ok, value = self._results.get(timeout=POLL_S)
                except queue.Empty:
                    # A rank that exited has flushed its result: one more poll would have it.
                    gone = sorted(r for r in waiting if self.procs[r].exitcode is not None)
                    if gone and self._results.empty():
                        raise AssertionError("; ".join(
                            f"rank {r} exited with code {self.procs[r].exitcode} without a "
                            f"result (its output is in the test's captured stderr)"
                            for r in gone
                        )) from None
                    if time.monotonic() > deadline:
                        # Their stacks, to the test's captured stderr: faulthandler dumps
                        # every thread on SIGABRT, then the rank dies; wait for that.
                        for r in waiting:
                            with contextlib.suppress(OSError):
                                os.kill(self.procs[r].pid, signal.SIGABRT)
                        for r in waiting:
                            self.procs[r].join(timeout=DUMP_S)
                        raise AssertionError(
                            f"ranks {sorted(waiting)} gave no result in {self.limit_s:.0f} s "
                            f"(their stacks are in the test's captured stderr)"
                        ) from None
                    continue
                if got not in (number, None):
                    continue  # a late report of a scenario that failed elsewhere
                waiting.discard(rank)
                if ok:
                    out[rank] = torch.load(io.BytesIO(value), weights_only=False)
                else:
                    failures.append(f"rank {rank}:\n{value}")
            if failures:
                raise AssertionError("\n".join(failures))
        except BaseException:
            self.close(wait=False)  # the next run starts a fresh world
            raise
        if expect_dead:
            self.close(wait=False)
        return out

    def close(self, wait: bool = True) -> None:
        """End the ranks: told to and given ``JOIN_S`` (``wait``), else sent SIGTERM and
        given ``TERM_S``; then what is left is killed."""
        for q in self._tasks:
            if wait:
                q.put(None)
        if not wait:
            for p in self.procs:
                if p.is_alive():
                    p.terminate()
        deadline = time.monotonic() + (JOIN_S if wait else TERM_S)
        for p in self.procs:
            p.join(timeout=max(0.0, deadline - time.monotonic()))
            if p.is_alive():
                p.kill()
                p.join()
        for q in self._tasks + ([self._results] if self._results is not None else []):
            q.close()
            q.cancel_join_thread()
        self.procs, self._tasks, self._results = [], [], None


def run_world(fn: Callable[..., Any], world_size: int, *args: Any,
              timeout_s: float = TIMEOUT_S, expect_dead: tuple = ()) -> List[Any]:
    """``fn(rank, world_size, *args)`` on the ranks of a world of its own; the results in
    rank order.

    Args:
        timeout_s: the process group's timeout.
        expect_dead: ranks that end without a result (killed by the scenario itself);
            their entry is None.
    """
    world = World(world_size, timeout_s)
    world._start(first=(0, (fn.__module__, fn.__qualname__), args))
    try:
        return world._collect(0, expect_dead)
    finally:
        world.close()


class Worlds:
    """A test module's worlds, one per size, each started at its first use (the ``worlds``
    fixture of tests/conftest.py)."""

    def __init__(self) -> None:
        self._by_size: Dict[int, World] = {}

    def run(self, fn: Callable[..., Any], world_size: int, *args: Any) -> List[Any]:
        """``fn(rank, world_size, *args)`` on this module's world of ``world_size`` ranks."""
        world = self._by_size.setdefault(world_size, World(world_size))
        return world.run(fn, *args)

    def close(self) -> None:
        for world in self._by_size.values():
            world.close()
        self._by_size.clear()


# ---------------------------------------------------------------- other processes


@contextlib.contextmanager
def spawned(*targets: Tuple[Callable[..., Any], tuple]) -> Iterator[List[Any]]:
    """Processes running ``target(*args)`` for each ``(target, args)``, started in that
    order; on leaving, each is given ``JOIN_S`` to end, then killed, and reaped."""
    procs = [CONTEXT.Process(target=t, args=a, daemon=True) for t, a in targets]
    try:
        for p in procs:
            p.start()
        yield procs
    finally:
        for p in procs:
            if p.pid is None:
                continue
            p.join(timeout=JOIN_S)
            if p.is_alive():
                p.kill()
                p.join()


#: How long the trainer of an RPC world waits for its workers in ``init_rpc`` (torch's own
#: bound there is its process group's, 24 days), and how many times a world that did not form
#: is started afresh on a new port (another process may have taken the free port first).
RPC_SETUP_S = 60.0
RPC_SETUP_TRIES = 2


@contextlib.contextmanager
def rpc_trainer(worker: Callable[..., Any], workers: int, options: Callable[[int], Any],
                *args: Any) -> Iterator[List[str]]:
    """``workers`` processes running ``worker(rank, world_size, port, *args)`` (each joins
    the RPC world as "worker<rank>" and serves until shutdown) and this process their
    trainer, rank 0, with ``options(port)``'s backend options and one intra-op thread while
    the world lasts; yields the workers' names, then shuts the world down. A world that has
    not formed within ``RPC_SETUP_S`` is killed and started again on another port, up to
    ``RPC_SETUP_TRIES`` times in all; then the test fails, saying so."""
    import torch
    import torch.distributed.rpc as rpc
    import torch.distributed.rpc.constants as rpc_constants

    world_size = workers + 1
    threads = torch.get_num_threads()
    for attempt in range(1, RPC_SETUP_TRIES + 1):
        port = free_port()
        targets = [(worker, (rank, world_size, port, *args)) for rank in range(1, world_size)]
        with spawned(*targets) as procs:
            torch.set_num_threads(1)
            try:
                # Only the trainer's group is bounded: the workers wait in their shutdown
                # barrier, on theirs, for as long as the tests run.
                default = rpc_constants.DEFAULT_PROCESS_GROUP_TIMEOUT
                rpc_constants.DEFAULT_PROCESS_GROUP_TIMEOUT = datetime.timedelta(
                    seconds=RPC_SETUP_S)
                try:
                    rpc.init_rpc("trainer", rank=0, world_size=world_size,
                                 rpc_backend_options=options(port))
                except BaseException as exc:
                    for p in procs:
                        p.kill()
                    if attempt == RPC_SETUP_TRIES or not isinstance(exc, RuntimeError):
                        raise RuntimeError(
                            f"the RPC world of {world_size} processes did not form (try "
                            f"{attempt} of {RPC_SETUP_TRIES}, port {port}, "
                            f"{RPC_SETUP_S:.0f} s each): {exc}") from exc
                    sys.stderr.write(f"RPC world on port {port} did not form ({exc}); "
                                     f"starting it again on another port\n")
                    continue
                finally:
                    rpc_constants.DEFAULT_PROCESS_GROUP_TIMEOUT = default
                try:
                    yield [f"worker{rank}" for rank in range(1, world_size)]
                finally:
                    rpc.shutdown()
                return
            finally:
                torch.set_num_threads(threads)


class Job:
    """Processes started together; ``out[k]`` is everything process ``k`` printed so far
    (stdout and stderr merged), read on a thread as it comes.

    A test waits, with a timeout, for a line matching a pattern (the moment to kill an owner
    or cut a link), or for every process to end."""

    def __init__(self) -> None:
        self.procs: List[subprocess.Popen] = []
        self.out: List[List[str]] = []
        self._lines: "queue.Queue[Tuple[int, Optional[str]]]" = queue.Queue()
        self._open = 0
        self._sessions: List[bool] = []

    def start(self, argv: Sequence[str], env: Dict[str, str], hosts: Any = None,
              host: int = 0, stdin: bool = False, cwd: Optional[str] = None,
              session: bool = False) -> int:
        """Start ``argv`` (on ``hosts``'s host ``host``, a ``tests.hosts.netns.Hosts``, or
        here); returns its index. ``session``: in a session of its own, so that ``kill``
        ends the processes it started as well."""
        command = list(argv) if hosts is None else hosts.command(host, argv)
        proc = subprocess.Popen(
            command, env=env, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
            stdin=subprocess.PIPE if stdin else subprocess.DEVNULL, text=True, bufsize=1,
            start_new_session=session,
        )
        k = len(self.procs)
        self.procs.append(proc)
        self.out.append([])
        self._sessions.append(session)
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

    def wait(self, timeout: float, stop_at_failure: bool = False) -> List[Optional[int]]:
        """Wait for every process to end (its output read to the end); the exit codes, None
        for each process still running after ``timeout``, or, with ``stop_at_failure``,
        once one ended with another code than 0 (each such process is killed)."""
        deadline = time.monotonic() + timeout
        stopped = False
        try:
            while self._open and not stopped:
                k, line = self._take(deadline)
                stopped = line is None and stop_at_failure and self._code(k, deadline) != 0
        except queue.Empty:
            pass
        codes = [p.poll() if stopped else self._code(k, deadline)
                 for k, p in enumerate(self.procs)]
        if None in codes:
            self.kill()
        return codes

    def _code(self, k: int, deadline: float) -> Optional[int]:
        """Process ``k``'s exit code, waiting for it until ``deadline`` (1 s at least)."""
        try:
            return self.procs[k].wait(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            return None

    def finish(self, timeout: float) -> List[int]:
        """Wait for every process to end (their output read to the end); the exit codes.
        Past ``timeout`` everything is killed and the test fails."""
        codes = self.wait(timeout)
        if None in codes:
            raise AssertionError(f"processes still running after {timeout} s:\n{self.text()}")
        return codes  # type: ignore[return-value]

    def kill(self, graceful: bool = True) -> None:
        """End every process that still runs (and, started with ``session``, every process
        of its session) and reap it: SIGINT first, so that Python unwinds (letting go of any
        lock file it holds, as torch's extension build lock: see ``_native_libraries``),
        then, after ``TERM_S``, SIGKILL; or (not ``graceful``) SIGKILL at once."""
        steps = [(signal.SIGINT, TERM_S)] if graceful else []
        for sig, grace in steps + [(signal.SIGKILL, JOIN_S)]:
            for proc, session in zip(self.procs, self._sessions):
                if session:  # its own processes too, even once it has ended
                    with contextlib.suppress(ProcessLookupError, PermissionError):
                        os.killpg(proc.pid, sig)
                elif proc.poll() is None:
                    proc.send_signal(sig)
            deadline = time.monotonic() + grace
            for proc in self.procs:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    proc.wait(timeout=max(0.0, deadline - time.monotonic()))
            if not any(self._sessions) and all(p.poll() is not None for p in self.procs):
                break
        with contextlib.suppress(queue.Empty):  # what they printed on the way out
            end = time.monotonic() + 1.0
            while self._open:
                self._take(end)

    def text(self, k: Optional[int] = None) -> str:
        """What process ``k`` (default: all, each headed by its index) printed."""
        if k is not None:
            return "".join(self.out[k])
        return "\n".join(f"--- process {i}:\n{''.join(lines)}" for i, lines in enumerate(self.out))


def _each_process(name: str) -> Iterator[Tuple[int, bytes]]:
    """(pid, the content of /proc/<pid>/<name>) for each process on this machine that is
    still there when read."""
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/{name}", "rb") as f:
                    yield int(entry), f.read()
            except OSError:  # gone meanwhile
                continue


def pids_with_env(**wanted: str) -> List[int]:
    """Processes on this machine whose environment holds every ``NAME=value`` given
    (how a test finds a worker that torchrun started)."""
    needles = [f"{name}={value}".encode() for name, value in wanted.items()]
    return [pid for pid, environ in _each_process("environ")
            if all(needle in environ.split(b"\0") for needle in needles)]


def pids_in_session(sid: int) -> List[int]:
    """The live processes (zombies left out) of session ``sid``: what a process started with
    ``start_new_session=True`` left behind, forked servers and their children included."""
    found = []
    for pid, stat in _each_process("stat"):
        fields = stat.rsplit(b")", 1)[1].split()  # after the command's name, which may hold ") "
        if fields[0] != b"Z" and int(fields[3]) == sid:
            found.append(pid)
    return found


def wait_for_exit(pid: int, timeout_s: float, kill: bool = False) -> bool:
    """Wait up to ``timeout_s`` for process ``pid``, a child or not, to end (its pidfd turns
    readable); whether it did. A pid already gone counts as ended. With ``kill``, SIGKILL it
    first, through the pidfd, so that no process that took over the pid meanwhile is hit."""
    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:
        return True
    try:
        if kill:
            signal.pidfd_send_signal(fd, signal.SIGKILL)
        return bool(select.select([fd], [], [], max(0.0, timeout_s))[0])
    except ProcessLookupError:  # ended before the signal
        return True
    finally:
        os.close(fd)
