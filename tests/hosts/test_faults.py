"""Faults across test hosts; every wait is bounded, nothing may hang.

- An owner's process is killed while it is inside a step (the error comes at once: its
  connections close), or the link to its host is cut and the owner then finishes its step
  (``ip link set ... down``: no reset reaches anyone, only the RPC timeout can tell): the
  trainer's ``step`` raises ``DistributedOptimizerError`` naming that owner, and only it,
  within the RPC timeout (plus a margin), says that the other owner applied the step, and the
  trainer then shuts down without waiting for the lost owner (under a second) and exits 0.
- The trainer is killed (SIGKILL) in the middle of a save, while owner1 holds its new shard
  in its temporary file: a fresh world on the same hosts loads the previous
  checkpoint, every shard checked, and gets exactly the state it held; the next save removes
  what the interrupted one left.
"""
import json
import os
import re
import signal

import pytest

from tests import worlds
from tests.hosts.conftest import PYTHON, ROOT, host_env

SHARD = re.compile(r"shard-([0-9a-f]{16})-")
RPC_TIMEOUT_S = 4.0
START_TIMEOUT_S = 180


def start_world(h, scenario: str, directory: str) -> worlds.Job:
    port = worlds.free_port()
    job = worlds.Job()
    for rank in range(3):
        env = host_env(h, rank, 3, port)
        env["FAULT_RPC_TIMEOUT"] = str(RPC_TIMEOUT_S)
        job.start([PYTHON, "-m", "tests.hosts.fault_node", scenario, directory], env=env,
                  hosts=h, host=rank, stdin=rank > 0, cwd=ROOT)
    return job


def report(job: worlds.Job, timeout: float) -> dict:
    _, line = job.expect(r"^REPORT ", timeout)
    return json.loads(line[len("REPORT "):])


@pytest.mark.parametrize("fault", ["owner-killed", "link-cut"])
def test_owner_lost_mid_step_is_named_and_the_trainer_exits(hosts, tmp_path, fault):
    h = hosts(3)
    job = start_world(h, "step", str(tmp_path))
    try:
        k, _ = job.expect(r"^OWNER-IN-STEP", START_TIMEOUT_S)
        assert k == 2, job.text()
        if fault == "owner-killed":
            job.procs[2].kill()
        else:
            h.cut(2)
            # owner2 finishes its step now: had the link not been cut, the step would succeed
            job.procs[2].stdin.write("go\n")
            job.procs[2].stdin.flush()
        got = report(job, RPC_TIMEOUT_S + 60)
        assert job.procs[0].wait(timeout=30) == 0, job.text(0)
        # owner1 waits for the lost owner2 in its graceful shutdown for ever; every process
        # is past its imports (no build lock to let go of), so no SIGINT grace is needed
        job.kill(graceful=False)
    finally:
        job.kill()
    print(f"{fault}: error after {got['seconds']:.3f} s, shutdown "
          f"{got['shutdown_seconds'] * 1000:.1f} ms")
    assert got["failures"] == ["owner2"], got
    assert got["succeeded"] == ["owner1"], got
    assert re.search(r"\bowner2: ", got["error"]), got["error"]
    assert "applied on ['owner1']" in got["error"], got["error"]
    if fault == "owner-killed":
        # its connections closed with it: no need to wait for the timeout (had it not been
        # killed, owner2 would still block in its step and only the timeout would end it)
        assert got["seconds"] < RPC_TIMEOUT_S - 1, got
    else:
        # nothing told the trainer: the RPC timeout ended the wait
        assert RPC_TIMEOUT_S - 0.5 <= got["seconds"] < RPC_TIMEOUT_S + 5, got
    assert got["shutdown_seconds"] < 1.0, got


def test_trainer_killed_mid_save_leaves_the_previous_checkpoint(hosts, tmp_path):
    h = hosts(3)
    directory = str(tmp_path / "ckpt")
    job = start_world(h, "save", directory)
    try:
        k, _ = job.expect(r"^OWNER-SHARD-WRITTEN", START_TIMEOUT_S)
        assert k == 1, job.text()
        job.procs[0].send_signal(signal.SIGKILL)
        assert job.procs[0].wait(timeout=30) == -signal.SIGKILL
        job.kill(graceful=False)  # the owners wait for the dead trainer; past their imports
    finally:
        job.kill()
    leftovers = sorted(os.listdir(directory))
    job = start_world(h, "load", directory)
    try:
        got = report(job, START_TIMEOUT_S)
        assert job.finish(60) == [0, 0, 0], job.text()
    finally:
        job.kill()
    assert got["before"] == leftovers
    # The interrupted save left files of its own generation (owner1's temporary file, and
    # owner2's shard or temporary file) beside the complete checkpoint.
    assert len(generations(leftovers)) == 2, leftovers
    assert got["equal"] is True, got
    assert len(generations(got["after"])) == 1, got["after"]
    assert not [n for n in got["after"] if n.startswith(".")], got["after"]


def generations(names):
    return {m.group(1) for m in map(SHARD.search, names) if m}
