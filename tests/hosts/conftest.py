"""Fixtures for tests across test hosts (network namespaces, see ``netns``).

``hosts(n)`` builds ``n`` hosts for the test and tears them down after it, whatever happens;
where namespaces cannot be made (not root, no iproute2) the test is skipped with the reason.
``host_env(hosts, rank, world_size)`` is the environment of a process of an RPC world across
them: rank 0 on host 0 is the rendezvous, TensorPipe and gloo talk over ``eth0`` only.
"""
import os
import signal
import sys
import threading
from typing import Callable, Dict, Iterator, List

import pytest

from tests.hosts import netns

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PYTHON = sys.executable
RNN = os.path.join(ROOT, "examples", "model_parallel_rnn.py")
#: The RNN example's settings in these tests: 60 steps, a checkpoint every 20, 40 characters
#: sampled at the end (after the last checkpoint: the losses and the state are the same
#: without; tests/examples checks the sample is printed).
RNN_ARGS = ["--steps", "60", "--log-every", "5", "--hidden", "32", "--sample", "40",
            "--save-every", "20"]
EXAMPLE_TIMEOUT_S = 300
_WHY_NOT = netns.unavailable()


@pytest.fixture
def host_tools() -> None:
    """Skips the test, saying why, on a machine where network namespaces cannot be made
    (not root, no iproute2): the reason is the machine's, like "no CUDA device"."""
    if _WHY_NOT is not None:
        pytest.skip(f"no test hosts on this machine: {_WHY_NOT}")


@pytest.fixture
def hosts(host_tools) -> Iterator[Callable[[int], netns.Hosts]]:
    """A factory of test hosts; everything it built is removed when the test ends."""
    built: List[netns.Hosts] = []
    # SIGTERM (a CI time limit, ``timeout``) would end pytest without any teardown and leave
    # the hosts and their processes running: make it an interrupt, as SIGINT is.
    previous = None
    if threading.current_thread() is threading.main_thread():
        previous = signal.getsignal(signal.SIGTERM)
        if previous == signal.SIG_DFL:
            signal.signal(signal.SIGTERM, _interrupt)

    def make(n: int) -> netns.Hosts:
        built.append(netns.Hosts(n))
        return built[-1]

    try:
        yield make
    finally:
        errors = []
        for h in built:
            try:
                h.close()
            except RuntimeError as exc:
                errors.append(exc)
        if previous == signal.SIG_DFL:
            signal.signal(signal.SIGTERM, previous)
        if errors:
            raise errors[0]


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def host_env(h: netns.Hosts, rank: int, world_size: int, port: int) -> Dict[str, str]:
    """The environment of rank ``rank`` of a world across ``h`` (rank 0 on host 0)."""
    env = dict(os.environ)
    env.update(
        RANK=str(rank), WORLD_SIZE=str(world_size), MASTER_ADDR=h.addresses[0],
        MASTER_PORT=str(port), TP_SOCKET_IFNAME=netns.INTERFACE,
        GLOO_SOCKET_IFNAME=netns.INTERFACE, OMP_NUM_THREADS="1",
        PYTHONPATH=os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")])),
    )
    return env


def local_env() -> Dict[str, str]:
    """The environment of a one-machine run, whatever launched pytest."""
    env = dict(os.environ, PYTHONPATH=ROOT)
    for name in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(name, None)
    return env
