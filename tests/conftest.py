"""Fixtures shared across test folders."""
import pytest

from tests.hosts import checkpoints, jobs
from tests.hosts.conftest import EXAMPLE_TIMEOUT_S, PYTHON, RNN, RNN_ARGS, ROOT, local_env


@pytest.fixture(scope="session")
def rnn_one_machine(tmp_path_factory):
    """The RNN example run once on this machine, uninterrupted, with ``RNN_ARGS``:
    (every step's loss, the final checkpoint's contents)."""
    where = tmp_path_factory.mktemp("rnn_one_machine")
    job = jobs.Job()
    job.start([PYTHON, RNN, *RNN_ARGS, "--loss-log", str(where / "losses"),
               "--checkpoint", str(where / "ckpt")], env=local_env(), cwd=ROOT)
    assert job.finish(EXAMPLE_TIMEOUT_S) == [0], job.text()
    return (checkpoints.loss_log(str(where / "losses")),
            checkpoints.contents(checkpoints.latest_folder(str(where / "ckpt"))))
