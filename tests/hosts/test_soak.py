"""Soak: five trainers and two owners, each process on its own test host, thousands of steps.

Every trainer runs ``STEPS`` steps concurrently with the others (``soak_node`` describes a
step). Asserted:

- no lost update: each owner's shared parameter, stepped by every trainer's own SGD
  DistributedOptimizer (lr 1, gradient ones), holds ``1 - TRAINERS * STEPS`` exactly;
- each trainer's Adam parameters on both owners equal, bit for bit, a local
  ``torch.optim.Adam(fused=True)`` replay of the same gradients (flat buffers for odd
  trainers, ``flat=False`` for even ones);
- both of an owner's step paths ran: the shared parameters' optimizers under their locks,
  each trainer's own Adam exclusive (TorchScript RPC);
- no owner's RSS (VmRSS after ``gc.collect()``) grows by more than ``RSS_GROWTH_BOUND``
  between the end of the first 1,000 steps (200 of each trainer) and the end of the last
  (3,000 in all); every sample is printed (``-s``) and named in the failure.

Every wait is bounded: a process that exits with an error fails the test at once, with its
output; one still running at ``DEADLINE_S`` fails it too. Processes are killed and the hosts
removed whatever happens.
"""
import json
import time
from typing import List

import pytest
import torch

from tests import worlds
from tests.hosts import soak_node
from tests.hosts.conftest import PYTHON, ROOT, host_env

TRAINERS = 5
#: Per trainer: 3,000 steps in all.
STEPS = 600
#: Per trainer: the owners' RSS is sampled after every 1,000 steps of the five together.
SAMPLE_EVERY = 200
WORLD_SIZE = len(soak_node.OWNERS) + TRAINERS
DEADLINE_S = 300.0
#: Measured (5 runs, 2 cores): owners grew 0.47 to 0.73 MB from the first sample to the
#: last, by less each 1,000 steps (about +0.3, +0.15, +0.1, +0.06 MB). Longer runs flatten
#: out: 1.2 MB in all over 15,000 steps; over 10,000, glibc's in-use heap (mallinfo2) grew
#: 0.6 MB, by 0.2 MB in the first 1,000 steps and ~0 in the last, while the owners' Python
#: object count (gc.get_objects) stayed the same: caches filling, not a per-step leak.
#: 2 MB is ~3x the worst run and catches a leak of 512 bytes a step (a lost 64 x 64
#: gradient a step would add 64 MB).
RSS_GROWTH_BOUND = 2 * 2**20


def _report(text: str) -> dict:
    """A trainer's report: the last line of its output that is a JSON object."""
    return json.loads([line for line in text.splitlines() if line.startswith("{")][-1])


def test_soak_five_trainers_two_owners(hosts, tmp_path):
    """Five trainer processes x 600 steps over two owners, each on its own host: no lost
    update, Adam bit-identical to torch.optim, owners' RSS flat after the first 1,000."""
    h = hosts(WORLD_SIZE)
    port = worlds.free_port()
    names = soak_node.OWNERS + [f"trainer{k}" for k in range(1, TRAINERS + 1)]
    job = worlds.Job()
    start = time.monotonic()
    try:
        for rank, name in enumerate(names):
            job.start([PYTHON, "-m", "tests.hosts.soak_node", str(tmp_path), str(STEPS),
                       str(SAMPLE_EVERY)], env=host_env(h, rank, WORLD_SIZE, port), hosts=h,
                      host=rank, cwd=ROOT)
        # every process exits 0: the first that does not, or one still running at the
        # deadline, fails the test with what it printed
        codes = job.wait(DEADLINE_S, stop_at_failure=True)
    finally:
        job.kill()
    failed = [k for k, code in enumerate(codes) if code not in (0, None)]
    if failed:
        k = failed[0]
        pytest.fail(f"{names[k]} exited with {codes[k]}; its output:\n{job.text(k)[-4000:]}")
    running = [names[k] for k, code in enumerate(codes) if code is None]
    if running:
        pytest.fail(f"still running after {DEADLINE_S} s: {running}\n" + "\n".join(
            f"--- {names[k]}:\n{job.text(k)[-4000:]}" for k, code in enumerate(codes)
            if code is None))
    seconds = time.monotonic() - start

    reports: List[dict] = [_report(job.text(k)) for k in range(len(soak_node.OWNERS), len(names))]
    for report in reports:
        print(f"soak: {json.dumps(report)}")
    print(f"soak: {TRAINERS} trainers x {STEPS} steps in {seconds:.1f} s (processes included)")
    assert all(r["compiled"] == [True, True] for r in reports), reports
    # Both owner paths ran: the shared parameters' optimizers under their locks, each
    # trainer's own Adam exclusive (TorchScript RPC, no lock, no GIL on the owner).
    assert all(r["exclusive"] == {"sgd": [False, False], "adam": [True, True]}
               for r in reports), reports

    first = torch.load(tmp_path / "trainer1.pt")
    expected = torch.full(soak_node.SHARED_SHAPE, 1.0 - TRAINERS * STEPS)
    for owner, shared in zip(soak_node.OWNERS, first["shared"]):
        lost = int((shared - expected).ne(0).sum())
        assert torch.equal(shared, expected), (
            f"{owner}: {lost} of {shared.numel()} elements lost updates "
            f"(max {float((shared - expected).max())} steps)")

    for k in range(1, TRAINERS + 1):
        results = torch.load(tmp_path / f"trainer{k}.pt")
        for i, (got, want) in enumerate(zip(results["adam"], results["replay"])):
            assert torch.equal(got, want), (
                f"trainer{k} Adam parameter {i} {tuple(got.shape)}: max |distopt - torch.optim| "
                f"{float((got - want).abs().max())} after {STEPS} steps")

    samples = first["rss"]
    assert len(samples) == STEPS // SAMPLE_EVERY
    rss = "; ".join(
        f"{owner} " + ", ".join(f"{sample[j] / 2**20:.2f}" for sample in samples) + " MB"
        for j, owner in enumerate(soak_node.OWNERS))
    print(f"soak: owners' RSS after every {TRAINERS * SAMPLE_EVERY} steps: {rss}")
    for j, owner in enumerate(soak_node.OWNERS):
        growth = samples[-1][j] - samples[0][j]
        assert growth <= RSS_GROWTH_BOUND, (
            f"{owner}'s RSS grew by {growth / 2**20:.2f} MB from the first "
            f"{TRAINERS * SAMPLE_EVERY} steps to the last (bound "
            f"{RSS_GROWTH_BOUND / 2**20:.1f} MB): {rss}")
