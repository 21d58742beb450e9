"""The examples across test hosts train exactly as on one machine.

- model_parallel_rnn.py with trainer, ps0 and ps1 on three hosts logs, step by step, the same
  losses (exact floats) as the same command on one machine, and ends with the same weights
  and optimizer state bit for bit, with ps1's link limited to 50 Mbit/s (``tc ... tbf``).
- parameter_server.py with the server and three trainers on four hosts loses no update: the
  server's tally (SGD, lr 1, gradient -1 per step) ends exactly at trainers x steps.
"""
import os
import re
from typing import List

from tests import worlds
from tests.hosts import checkpoints
from tests.hosts.conftest import PYTHON, RNN, RNN_ARGS, ROOT, host_env

PS = os.path.join(ROOT, "examples", "parameter_server.py")
TIMEOUT_S = 240


def run_across(h, argv: List[str], world: int) -> worlds.Job:
    """``argv`` as rank r of a ``world``-process world on host r, talking over eth0."""
    port = worlds.free_port()
    job = worlds.Job()
    for rank in range(world):
        job.start([PYTHON, *argv, "--interface", "eth0"], env=host_env(h, rank, world, port),
                  hosts=h, host=rank, cwd=ROOT)
    return job


def test_rnn_across_three_hosts_equals_one_machine(hosts, rnn_one_machine, tmp_path):
    """ps1's link limited to 50 Mbit/s; the other links at full rate."""
    h = hosts(3)
    h.limit(2, "50mbit")
    job = run_across(h, [RNN, *RNN_ARGS, "--loss-log", str(tmp_path / "losses"),
                         "--checkpoint", str(tmp_path / "ckpt")], world=3)
    assert job.finish(TIMEOUT_S) == [0, 0, 0], job.text()
    assert "compiled: True" in job.text(0)
    want_losses, want_state = rnn_one_machine
    got_losses = checkpoints.loss_log(str(tmp_path / "losses"))
    assert len(want_losses) == 60
    assert got_losses == want_losses
    checkpoints.assert_identical(
        checkpoints.contents(checkpoints.latest_folder(str(tmp_path / "ckpt"))), want_state
    )


def test_parameter_server_with_three_trainer_hosts_loses_no_update(hosts):
    steps, trainers = 60, 3
    h = hosts(1 + trainers)
    job = run_across(h, [PS, "--trainers", str(trainers), "--steps", str(steps),
                         "--log-every", str(steps)], world=1 + trainers)
    assert job.finish(TIMEOUT_S) == [0] * (1 + trainers), job.text()
    out = job.text(0)
    for i in range(1, trainers + 1):
        assert re.search(rf"^trainer{i} +{steps} ", out, re.MULTILINE), out
    assert f"updates applied: {steps * trainers} of {steps * trainers} sent" in out, out
    before, after = map(float, re.search(r"before ([\d.]+) -> after ([\d.]+)", out).groups())
    assert after < before / 4, out
