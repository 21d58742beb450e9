"""The test hosts themselves: isolated, rate-limited for real, and always torn down."""
import json
import os
import subprocess

import pytest

from tests import worlds
from tests.hosts import netns
from tests.hosts.conftest import PYTHON, ROOT
from tests.hosts.test_faults import report, start_world


def _netns_names():
    return subprocess.run(["ip", "netns", "list"], capture_output=True, text=True,
                          check=True).stdout.split()


def _links():
    out = subprocess.run(["ip", "-o", "link", "show"], capture_output=True, text=True,
                         check=True).stdout
    return {line.split(":")[1].strip().split("@")[0] for line in out.splitlines()}


def test_rpc_across_a_limited_link_takes_at_least_its_bytes_over_its_rate(hosts, tmp_path):
    """50 Mbit/s on owner2's link (token bucket of 64 kB): 2 MiB of tensor to owner2 cannot
    arrive sooner than (2 MiB - 64 kB) / 50 Mbit/s = 0.33 s; had TensorPipe copied it from
    process memory past the link (as it does for processes of one machine), it would."""
    h = hosts(3)
    h.limit(2, "50mbit", burst="64kb")
    job = start_world(h, "transfer", str(tmp_path))
    try:
        got = report(job, 180)
        assert job.finish(60) == [0, 0, 0], job.text()
    finally:
        job.kill()
    floor = (got["bytes"] - 64 * 1024) * 8 / 50e6
    assert got["seconds"]["owner2"] >= floor, got
    assert got["seconds"]["owner1"] < floor, got  # the other link is not limited


def test_hosts_are_private_and_removed_whatever_happens(host_tools):
    """The bridge has no address (the root namespace has no route in); leaving the block by
    an exception kills what runs on the hosts and removes namespaces, links and bridge."""
    with pytest.raises(RuntimeError, match="boom"):
        with netns.Hosts(2) as h:
            names, links = list(h.namespaces), [*h.links, h.bridge]
            assert set(names) <= set(_netns_names())
            assert set(links) <= _links()
            addresses = subprocess.run(["ip", "-o", "addr", "show", "dev", h.bridge],
                                       capture_output=True, text=True, check=True).stdout
            assert "inet" not in addresses, addresses
            # Its first line is written from inside the namespace (``ip netns exec`` enters
            # it before it runs unshare, the process started here): from then on the host has a
            # process to kill.
            sleeper = h.popen(1, ["sh", "-c", "echo in; exec sleep 600"],
                              stdout=subprocess.PIPE, text=True)
            assert sleeper.stdout.readline() == "in\n"
            assert sleeper.pid in h.pids(1)
            raise RuntimeError("boom")
    assert sleeper.wait(timeout=30) != 0
    sleeper.stdout.close()
    assert not set(names) & set(_netns_names())
    assert not set(links) & _links()


def test_hosts_left_by_a_killed_run_are_removed_by_the_next(host_tools, tmp_path):
    """A run killed with SIGKILL cannot tear down; the next ``Hosts`` removes what it left."""
    code = ("import json, sys; from tests.hosts import netns; h = netns.Hosts(2); "
            "print(json.dumps([h.namespaces, [*h.links, h.bridge]]), flush=True); "
            "sys.stdin.readline()")
    job = worlds.Job()
    job.start([PYTHON, "-c", code], env=dict(os.environ), cwd=ROOT, stdin=True)
    try:
        names, links = json.loads(job.expect(r"^\[", timeout=60)[1])
    finally:
        job.kill(graceful=False)
    assert set(names) <= set(_netns_names())
    removed = netns.remove_stale()
    assert set(names) | {links[-1]} <= set(removed)  # the veth ends go with the namespaces
    assert not set(names) & set(_netns_names())
    assert not set(links) & _links()
