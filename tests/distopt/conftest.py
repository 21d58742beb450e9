"""A session-wide RPC world: this pytest process is rank 0, "trainer"; workers are spawned."""
import dataclasses
import multiprocessing
import socket
from typing import Any, Iterator, List

import pytest
import torch
import torch.distributed.rpc as rpc

from tests.distopt import remote

NUM_WORKERS = 3
RPC_TIMEOUT_S = 60.0


def free_port() -> int:
    """A loopback port nobody listens on right now (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def pytest_configure(config: pytest.Config) -> None:
    # init_rpc's own barrier uses a deprecated torch.distributed call.
    config.addinivalue_line("filterwarnings", "ignore:You are using a Backend:UserWarning")


@pytest.fixture
def rpc_calls(monkeypatch) -> List[Any]:
    """Every rpc_async the trainer makes during the test: (destination, function, args)."""
    calls: List[Any] = []
    real = rpc.rpc_async

    def counting(to, func, *args, **kwargs):
        calls.append((to, func, kwargs.get("args")))
        return real(to, func, *args, **kwargs)

    monkeypatch.setattr(rpc, "rpc_async", counting)
    return calls


@dataclasses.dataclass
class World:
    """The running world: ``workers`` are the names "worker1".."workerN"."""

    workers: List[str]


@pytest.fixture(scope="package")
def world() -> Iterator[World]:
    """Start ``NUM_WORKERS`` RPC worker processes and join them as "trainer".

    Package-scoped: the world shuts down once tests/distopt is done. Kept for the whole
    session, its idle workers (waiting in ``rpc.shutdown``) used about 0.4 of this machine's
    2 cores through every later test, and the pytest process stayed an RPC agent."""
    ctx = multiprocessing.get_context("spawn")
    port = free_port()
    world_size = NUM_WORKERS + 1
    procs = [
        ctx.Process(
            target=remote.run_worker,
            args=(rank, world_size, port, RPC_TIMEOUT_S),
            name=f"worker{rank}",
            daemon=True,
        )
        for rank in range(1, world_size)
    ]
    for proc in procs:
        proc.start()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        rpc.init_rpc(
            "trainer",
            rank=0,
            world_size=world_size,
            rpc_backend_options=remote.backend_options(port, RPC_TIMEOUT_S),
        )
    except BaseException:
        for proc in procs:
            proc.kill()
        torch.set_num_threads(threads)
        raise
    try:
        yield World([f"worker{rank}" for rank in range(1, world_size)])
    finally:
        rpc.shutdown()
        for proc in procs:
            proc.join(timeout=30)
            if proc.is_alive():
                proc.kill()
                proc.join()
        torch.set_num_threads(threads)
