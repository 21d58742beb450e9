"""Fixtures shared across test folders, and how the suite spreads over processes.

With pytest-xdist installed (the ``test`` extra installs it) and no ``-n`` given, the suite
runs on ``workers()`` processes; ``-n 0`` (or ``-p no:xdist``) runs it in this one. Each test
module stays on one worker, so its worlds and module fixtures start once; tests/distopt (one
RPC world for the package) and everything that builds test hosts or reads the RNN example's
one run (tests/hosts, one ``Hosts`` subnet) each stay on one worker too.
"""
import os
from pathlib import Path
from typing import Iterator, List, Tuple

import pytest

from tests import worlds as _worlds
from tests.hosts import checkpoints
from tests.hosts.conftest import EXAMPLE_TIMEOUT_S, PYTHON, RNN, RNN_ARGS, ROOT, local_env

#: The most worker processes the suite takes: one per core keeps the cores busy while a test
#: waits on its processes (one pytest process kept 1.5 of 2 cores busy, on average).
MAX_WORKERS = 4


@pytest.hookimpl(tryfirst=True)
def pytest_cmdline_main(config: pytest.Config) -> None:
    """Run on ``workers()`` xdist workers unless the command line says how many."""
    if (config.pluginmanager.hasplugin("xdist") and not hasattr(config, "workerinput")
            and config.getoption("numprocesses", None) is None
            and not config.getoption("collectonly") and not config.getoption("usepdb")):
        config.option.numprocesses = workers()
        if config.option.dist == "no":
            config.option.dist = "loadgroup"


@pytest.hookimpl(optionalhook=True)  # xdist's hook: without xdist, never called
def pytest_configure_node(node) -> None:
    """(xdist, in this process) Tell each worker how the tests are distributed."""
    node.workerinput["distopt_dist"] = node.config.option.dist


def workers() -> int:
    """One worker per core this process may use, at most ``MAX_WORKERS``."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return max(1, min(MAX_WORKERS, cores or 1))


@pytest.hookimpl(tryfirst=True)  # before xdist's own, which reads the marks
def pytest_collection_modifyitems(config: pytest.Config, items: List[pytest.Item]) -> None:
    """Each test's xdist group (see the module docstring)."""
    if not config.pluginmanager.hasplugin("xdist"):
        return
    if getattr(config, "workerinput", {}).get("distopt_dist") == "loadgroup":
        # A worker parses the command line afresh, where no --dist was given: xdist reads the
        # groups only where it sees loadgroup there.
        config.option.loadgroup = True
    for item in items:
        path = item.nodeid.split("::")[0]
        if path.startswith("tests/hosts/") or any(
                name.startswith("rnn_one_machine") for name in getattr(item, "fixturenames", ())):
            group = "tests/hosts"
        elif path.startswith("tests/distopt/"):
            group = "tests/distopt"
        else:
            group = path
        item.add_marker(pytest.mark.xdist_group(group))


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
