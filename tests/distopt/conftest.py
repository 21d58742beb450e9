"""A package-wide RPC world: this pytest process is rank 0, "trainer"; workers are spawned
(``tests.worlds.rpc_trainer``)."""
import dataclasses
from typing import Any, Iterator, List

import pytest
import torch.distributed.rpc as rpc

from tests import worlds
from tests.distopt import remote

NUM_WORKERS = 3
RPC_TIMEOUT_S = 60.0


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
    with worlds.rpc_trainer(remote.run_worker, NUM_WORKERS,
                            lambda port: remote.backend_options(port, RPC_TIMEOUT_S),
                            RPC_TIMEOUT_S) as names:
        yield World(names)
