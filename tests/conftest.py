"""Fixtures shared across test folders."""
from pathlib import Path
from typing import Iterator, Tuple

import pytest

from tests import worlds as _worlds
from tests.hosts import checkpoints
from tests.hosts.conftest import EXAMPLE_TIMEOUT_S, PYTHON, RNN, RNN_ARGS, ROOT, local_env


@pytest.fixture(scope="module")
def worlds() -> Iterator[_worlds.Worlds]:
    """This module's gloo worlds: ``worlds.run(fn, W, *args)`` runs ``fn(rank, W, *args)``
    on every rank of a world of W ranks, started at its first use and kept until the
    module's tests are done (``tests.worlds``)."""
    pool = _worlds.Worlds()
    try:
        yield pool
    finally:
        pool.close()


@pytest.fixture(scope="session")
def rnn_one_machine_run(tmp_path_factory) -> Tuple[str, Path]:
    """The RNN example run once on this machine, uninterrupted, with ``RNN_ARGS`` (one run
    for tests/examples and the test hosts' references): (what it printed, the folder of its
    loss log ``losses`` and checkpoints ``ckpt``)."""
    where = tmp_path_factory.mktemp("rnn_one_machine")
    job = _worlds.Job()
    job.start([PYTHON, RNN, *RNN_ARGS, "--loss-log", str(where / "losses"),
               "--checkpoint", str(where / "ckpt")], env=local_env(), cwd=ROOT)
    assert job.finish(EXAMPLE_TIMEOUT_S) == [0], job.text()
    return job.text(0), where


@pytest.fixture(scope="session")
def rnn_one_machine(rnn_one_machine_run):
    """``rnn_one_machine_run``'s (every step's loss, the final checkpoint's contents)."""
    where = rnn_one_machine_run[1]
    return (checkpoints.loss_log(str(where / "losses")),
            checkpoints.contents(checkpoints.latest_folder(str(where / "ckpt"))))
