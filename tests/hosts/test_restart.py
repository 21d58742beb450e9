"""torchrun --max-restarts brings the RNN example back after an owner dies, exactly.

The example runs under torchrun with ``--checkpoint DIR --auto-resume --save-every 20``; once
the trainer has logged step 25, the process of ``ps1`` (rank 2) is killed (SIGKILL). The
trainer's next RPC fails, torchrun stops the group and starts it again, and the restarted
trainer resumes from the last complete checkpoint (step 20). The run must then end with
exactly what an uninterrupted run (one machine, no torchrun) that saved at the same steps
ends with: every step's loss (the steps done twice, both times), the final weights and
optimizer state bit for bit. On one host (``--standalone``) and across three test hosts
(c10d rendezvous, one torchrun per host). The one-host run's finished checkpoint is then
refused where it cannot be continued: a fresh run into its DIR, a resume with another
``--lr`` or ``--steps``, a ``latest`` that names nothing valid.

The parameter server, one trainer, under torchrun across two test hosts: the server (the
owner of every parameter) is killed after the trainer logged step 25; the restarted run resumes
after step 20 and ends with the weights, the tally (exactly 60 updates) and the trainer's
optimizer state and data generator of an uninterrupted run, bit for bit; its checkpoint is
then refused with another ``--trainers`` or without ``--auto-resume``.
"""
import os
from typing import List

from tests import worlds
from tests.hosts import checkpoints
from tests.hosts.conftest import (
    EXAMPLE_TIMEOUT_S, PYTHON, RNN, RNN_ARGS, ROOT, local_env,
)
from tests.examples.test_examples import _refused
from tests.hosts.test_examples_across_hosts import PS

KILL_AFTER = r"^step +25 "
TIMEOUT_S = 300


def torchrun_env(marker: str) -> dict:
    env = local_env()
    # Every attempt gets a fresh rendezvous store (see examples/_launch.check_restartable).
    env.update(TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1", DISTOPT_TEST_JOB=marker)
    return env


def example_args(tmp_path, interface: str) -> List[str]:
    return [RNN, *RNN_ARGS, "--checkpoint", str(tmp_path / "ckpt"), "--auto-resume",
            "--loss-log", str(tmp_path / "losses"), "--interface", interface]


def kill_owner_and_check(job: worlds.Job, marker: str, tmp_path, rnn_one_machine) -> None:
    job.expect(KILL_AFTER, TIMEOUT_S)
    victims = worlds.pids_with_env(DISTOPT_TEST_JOB=marker, RANK="2",
                                 TORCHELASTIC_RESTART_COUNT="0")
    assert len(victims) == 1, (victims, job.text())
    os.kill(victims[0], 9)
    codes = job.finish(TIMEOUT_S)
    out = job.text()
    assert codes == [0] * len(codes), out
    assert "resumed from" in out and "after step 20" in out, out
    # The attempt before the kill got past step 25, so steps 21..25 at least ran twice.
    logged = checkpoints.loss_log(str(tmp_path / "losses"))
    want_losses, want_state = rnn_one_machine
    assert sorted(logged) == list(range(1, 61)), sorted(logged)
    redone = [step for step, values in logged.items() if len(values) > 1]
    assert set(range(21, 26)) <= set(redone), redone
    for step, values in logged.items():
        assert values == want_losses[step] * len(values), (step, values, want_losses[step])
    checkpoints.assert_identical(
        checkpoints.contents(checkpoints.latest_folder(str(tmp_path / "ckpt"))), want_state
    )
    assert sorted(os.listdir(tmp_path / "ckpt")) == ["latest", "step-00000060"]


def assert_refused_where_it_cannot_be_continued(ckpt) -> None:
    """Refused before any work, naming the option or file: a fresh run into a DIR holding
    the checkpoint (its first save would replace it), a resume with other options, and a
    ``latest`` that names no step-N folder."""
    common = [*RNN_ARGS, "--checkpoint", str(ckpt)]
    for extra, message in (
        ([], "already holds a checkpoint (after step 60)"),
        (["--auto-resume", "--lr", "0.05"], "Invalid --lr: 0.05 (the checkpoint in"),
        (["--resume", "--steps", "80"], "Invalid --steps: 80 (the checkpoint in"),
    ):
        refused = _refused("model_parallel_rnn.py", common + extra)
        assert message in refused, refused
    for latest, message in (("../elsewhere", "expected the name of a step-N folder"),
                            ("step-00000099", "names 'step-00000099', which is missing")):
        (ckpt / "latest").write_text(latest)
        refused = _refused("model_parallel_rnn.py", common + ["--resume"])
        assert message in refused, refused


def test_torchrun_on_one_host_resumes_exactly(rnn_one_machine, tmp_path):
    marker = f"one-host-{os.getpid()}"
    job = worlds.Job()
    job.start(["torchrun", "--standalone", "--nproc-per-node", "3", "--max-restarts", "2",
               "--monitor-interval", "0.1", *example_args(tmp_path, "lo")],
              env=torchrun_env(marker), cwd=ROOT)
    try:
        kill_owner_and_check(job, marker, tmp_path, rnn_one_machine)
    finally:
        job.kill()
    assert_refused_where_it_cannot_be_continued(tmp_path / "ckpt")


def torchrun_across(h, marker: str, argv: List[str]) -> worlds.Job:
    """One torchrun per host of ``h`` (c10d rendezvous on host 0), each running ``argv``."""
    endpoint = f"{h.addresses[0]}:{worlds.free_port()}"
    job = worlds.Job()
    n = len(h.namespaces)
    for i in range(n):
        # Namespaces share the machine's hostname, so torchrun cannot tell which host serves
        # the rendezvous: is_host says it; --local-addr is each host's own address.
        job.start(["torchrun", "--nnodes", str(n), "--nproc-per-node", "1",
                   "--rdzv-backend", "c10d", "--rdzv-endpoint", endpoint,
                   "--rdzv-id", marker, "--rdzv-conf", f"is_host={int(i == 0)}",
                   "--local-addr", h.addresses[i], "--max-restarts", "2",
                   "--monitor-interval", "0.1", *argv],
                  env=torchrun_env(marker), hosts=h, host=i, cwd=ROOT)
    return job


def test_torchrun_across_three_hosts_resumes_exactly(hosts, rnn_one_machine, tmp_path):
    marker = f"three-hosts-{os.getpid()}"
    job = torchrun_across(hosts(3), marker, example_args(tmp_path, "eth0"))
    try:
        kill_owner_and_check(job, marker, tmp_path, rnn_one_machine)
    finally:
        job.kill()


PS_ARGS = ["--trainers", "1", "--steps", "60", "--log-every", "5", "--save-every", "20"]


def test_parameter_server_under_torchrun_across_two_hosts_resumes_exactly(hosts, tmp_path):
    straight = tmp_path / "straight"
    job = worlds.Job()
    job.start([PYTHON, PS, *PS_ARGS, "--checkpoint", str(straight)], env=local_env(), cwd=ROOT)
    assert job.finish(EXAMPLE_TIMEOUT_S) == [0], job.text()
    assert "updates applied: 60 of 60 sent" in job.text()
    marker = f"ps-{os.getpid()}"
    job = torchrun_across(hosts(2), marker, [PS, *PS_ARGS, "--checkpoint", str(tmp_path / "ckpt"),
                                             "--auto-resume", "--interface", "eth0"])
    try:
        job.expect(r"^trainer1 step +25 ", TIMEOUT_S)
        victims = worlds.pids_with_env(DISTOPT_TEST_JOB=marker, RANK="0",
                                     TORCHELASTIC_RESTART_COUNT="0")
        assert len(victims) == 1, (victims, job.text())
        os.kill(victims[0], 9)
        assert job.finish(TIMEOUT_S) == [0, 0], job.text()
    finally:
        job.kill()
    out = job.text()
    assert "ps: resumed from" in out and "after step 20" in out, out
    assert "updates applied: 60 of 60 sent" in out, out
    checkpoints.assert_identical(
        checkpoints.server_contents(checkpoints.latest_folder(str(tmp_path / "ckpt")), 1),
        checkpoints.server_contents(checkpoints.latest_folder(str(straight)), 1),
    )
    # The same checkpoint is refused, before any work, with another --trainers and without
    # --auto-resume.
    common = [*PS_ARGS, "--checkpoint", str(straight)]
    refused = _refused("parameter_server.py", common + ["--auto-resume", "--trainers", "2"])
    assert "Invalid --trainers: 2 (the checkpoint in" in refused, refused
    refused = _refused("parameter_server.py", common)
    assert "already holds a checkpoint (after step 60)" in refused, refused
