"""How ``functional._native`` builds its libraries: under an OS lock that a killed build
cannot leave taken, one build directory per configuration, and a message on stderr before a
compile (none when the build is cached).

The builds here are of a four-line library (``probe.cpp``) in processes of their own, with
``TORCH_EXTENSIONS_DIR`` in the test's directory; ``DISTOPT_NATIVE=0`` keeps those processes
from building the real libraries at import.
"""
import fcntl
import os
import select
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import List

import pytest

from functional import _native

PROBE = """
#include <torch/library.h>
static int64_t value() { return PROBE_VALUE; }
TORCH_LIBRARY(PROBE_NS, m) { m.def("value() -> int", &value); }
"""

#: Build each configuration named on the command line (``NS=VALUE``), print what each op
#: returns (None where the build failed).
BUILD = """
import sys, torch
from functional import _native
for config in sys.argv[2:]:
    ns, value = config.split("=")
    flags = ["-O0", f"-DPROBE_NS={ns}", f"-DPROBE_VALUE={value}"]
    ok = _native._build("distopt_probe", sys.argv[1], flags, f"{ns}.value")
    print(ns, getattr(torch.ops, ns).value() if ok else None, flush=True)
"""

#: A C++ compiler that hangs in its first compile while the file ``stall`` exists (as a long
#: compile killed half way would), and is the machine's compiler otherwise.
CXX = """#!/bin/sh
case " $* " in
  *" -c "*) if [ -e "{dir}/stall" ]; then echo started > "{dir}/started"; exec cat "{dir}/hold"; fi ;;
esac
exec c++ "$@"
"""

#: Seconds a probe build may take (a few seconds idle; far more with the machine loaded).
BUILD_BOUND_S = 240


def _flags(config: str) -> List[str]:
    ns, value = config.split("=")
    return ["-O0", f"-DPROBE_NS={ns}", f"-DPROBE_VALUE={value}"]


@pytest.fixture
def probe(tmp_path: Path):
    (tmp_path / "probe.cpp").write_text(PROBE)
    cxx = tmp_path / "cxx.sh"
    cxx.write_text(CXX.format(dir=tmp_path))
    cxx.chmod(0o755)
    os.mkfifo(tmp_path / "hold")
    os.mkfifo(tmp_path / "started")
    env = dict(os.environ, DISTOPT_NATIVE="0", TORCH_EXTENSIONS_DIR=str(tmp_path / "ext"), CXX=str(cxx))
    return tmp_path, env


def _directory(tmp_path: Path, config: str) -> Path:
    """The build directory of ``config`` in the processes of ``probe`` (whose ``CXX`` differs)."""
    installation = _native._installation()[:-1] + [str(tmp_path / "cxx.sh")]
    name = _native.build_name("distopt_probe", str(tmp_path), _flags(config), [], installation)
    return Path(_native.build_directory(name, str(tmp_path / "ext")))


def _run(tmp_path: Path, env, *configs: str) -> subprocess.CompletedProcess:
    try:
        return subprocess.run([sys.executable, "-c", BUILD, str(tmp_path / "probe.cpp"), *configs],
                              env=env, capture_output=True, text=True, timeout=BUILD_BOUND_S)
    except subprocess.TimeoutExpired as error:
        pytest.fail(f"building {configs} did not finish in {BUILD_BOUND_S} s: {error.stderr}")


def _release(tmp_path: Path) -> bool:
    """Let the stalled compiler finish (its ``cat`` of the fifo ends); False if none waits."""
    try:
        os.close(os.open(tmp_path / "hold", os.O_WRONLY | os.O_NONBLOCK))
        return True
    except OSError:  # ENXIO: no reader
        return False


def _read_until(process: subprocess.Popen, text: str, bound_s: float) -> str:
    """``process``'s stderr up to the line containing ``text``; fails after ``bound_s``."""
    seen = ""
    deadline = time.monotonic() + bound_s
    while text not in seen:
        left = deadline - time.monotonic()
        assert left > 0, f"no {text!r} on stderr in {bound_s} s: {seen}"
        if select.select([process.stderr], [], [], left)[0]:
            line = process.stderr.readline()
            assert line, f"stderr closed before {text!r}: {seen}"
            seen += line
    return seen


def test_an_import_after_a_killed_build_finishes_and_configurations_keep_their_builds(probe):
    """A build killed while it compiles leaves torch's lock file, on which every later import
    used to wait forever; the next build waits for the compiler the killed one left running
    (ninja runs each in a process group of its own, so it outlives the kill), then removes
    the lock and finishes. Then two configurations built alternately each load their own
    build, saying "compiling" only when they compile."""
    tmp_path, env = probe
    (tmp_path / "stall").touch()
    command = [sys.executable, "-c", BUILD, str(tmp_path / "probe.cpp")]
    started = os.open(tmp_path / "started", os.O_RDWR | os.O_NONBLOCK)  # the compiler's signal
    killed = subprocess.Popen(command + ["probe_a=1"], env=env, stdout=subprocess.DEVNULL,
                              stderr=subprocess.PIPE, start_new_session=True)
    after = None
    try:
        assert select.select([started], [], [], BUILD_BOUND_S)[0], (
            f"the stalled build never reached its compiler in {BUILD_BOUND_S} s")
        assert os.read(started, 64) == b"started\n"
        directory = _directory(tmp_path, "probe_a=1")
        assert (directory / "lock").exists()  # torch's lock file, taken for the compile
        os.killpg(killed.pid, signal.SIGKILL)  # the build and its ninja; the compiler runs on
        killed.wait()
        assert (directory / "lock").exists()  # left behind
        (tmp_path / "stall").unlink()

        after = subprocess.Popen(command + ["probe_a=1"], env=env, stdout=subprocess.PIPE,
                                 stderr=subprocess.PIPE, text=True)
        err = _read_until(after, "waiting for processes", BUILD_BOUND_S)
        assert "left by a killed build of distopt_probe_" in err
        assert _release(tmp_path)
        out, rest = after.communicate(timeout=BUILD_BOUND_S)
    finally:
        os.close(started)
        _release(tmp_path)
        for process in (killed, after):
            if process is not None and process.poll() is None:
                process.kill()
                process.wait()
    err += rest
    assert after.returncode == 0, err
    assert out.split() == ["probe_a", "1"]
    assert f"removed {directory / 'lock'}, left by a build of {directory.name} that was killed" in err
    assert err.count("compiling") == 1, err
    built = (directory / f"{directory.name}.so").stat().st_mtime_ns

    other = _run(tmp_path, env, "probe_b=2", "probe_a=1")
    assert other.returncode == 0, other.stderr
    assert other.stdout.split() == ["probe_b", "2", "probe_a", "1"]
    assert other.stderr.count("compiling") == 1 and "probe.cpp" in other.stderr, other.stderr

    cached = _run(tmp_path, env, "probe_b=2", "probe_a=1")
    assert cached.returncode == 0, cached.stderr
    assert cached.stdout.split() == ["probe_b", "2", "probe_a", "1"]
    assert "compiling" not in cached.stderr and "distopt:" not in cached.stderr, cached.stderr
    assert (directory / f"{directory.name}.so").stat().st_mtime_ns == built


def test_each_torch_installation_python_and_flag_set_builds_under_its_own_name(tmp_path):
    """Two virtual environments (another torch), two Pythons, two compilers or two flag sets
    on one machine build in directories of their own instead of over each other's."""
    here = _native._installation()
    name = _native.build_name("distopt_flat", _native._CSRC, ["-O2"], [], here)
    assert name == _native.build_name("distopt_flat", _native._CSRC, ["-O2"], [], list(here))
    others = [
        _native.build_name("distopt_flat", _native._CSRC, ["-O2"], [], [str(tmp_path / "venv" / "torch")] + here[1:]),
        _native.build_name("distopt_flat", _native._CSRC, ["-O2"], [], here[:1] + ["2.12.0"] + here[2:]),
        _native.build_name("distopt_flat", _native._CSRC, ["-O2"], [], here[:2] + ["cpython-312"] + here[3:]),
        _native.build_name("distopt_flat", _native._CSRC, ["-O2"], [], here[:-1] + ["clang++"]),
        _native.build_name("distopt_flat", _native._CSRC, ["-O3"], [], here),
        _native.build_name("distopt_flat", _native._CSRC, ["-O2"], ["-fopenmp"], here),
    ]
    assert len({name, *others}) == 7


def test_a_build_held_by_another_process_is_waited_for_with_a_bound(tmp_path, monkeypatch, capfd, caplog):
    """While another process holds a build's lock the import waits, says for whom, and after
    ``DISTOPT_BUILD_TIMEOUT`` gives up and falls back instead of waiting forever."""
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "ext"))
    monkeypatch.setattr(_native, "BUILD_TIMEOUT", 0.3)
    monkeypatch.setattr(_native, "_QUIET_WAIT_S", 0.0)
    source = tmp_path / "probe.cpp"
    source.write_text(PROBE)
    flags = _flags("probe_held=3")
    directory = Path(_native.build_directory(_native.build_name("distopt_probe", str(tmp_path), flags, [])))
    directory.mkdir(parents=True)
    holder = os.open(directory / "distopt.lock", os.O_RDWR | os.O_CREAT)
    try:
        fcntl.flock(holder, fcntl.LOCK_EX)
        os.write(holder, b"4242")
        began = time.monotonic()
        assert not _native._build("distopt_probe", str(source), flags, "probe_held.value")
        assert time.monotonic() - began < 0.3 + 5
    finally:
        os.close(holder)
    assert "waiting for process 4242, which holds the build lock of distopt_probe_" in capfd.readouterr().err
    assert "native ops distopt_probe unavailable (BuildWaitTimeout: waited 0.3 s for process 4242" in caplog.text
    assert not (directory / "lock").exists()  # no compile was started


@pytest.mark.parametrize("text,seconds", [(None, 600.0), ("", 600.0), ("45", 45.0), ("0.5", 0.5),
                                          ("abc", 600.0), ("10s", 600.0), ("nan", 600.0),
                                          ("inf", 600.0), ("-1", 600.0), ("0", 600.0)])
def test_a_mistyped_build_timeout_is_refused_with_a_warning_not_an_error(text, seconds, caplog):
    """DISTOPT_BUILD_TIMEOUT is read at import: a bad value must neither fail the import nor
    make the wait unbounded (nan compared with a deadline never times out)."""
    assert _native._timeout(text) == seconds
    assert ("Invalid DISTOPT_BUILD_TIMEOUT" in caplog.text) == (text not in (None, "", "45", "0.5"))


def test_a_failed_build_is_not_tried_again_at_every_import(tmp_path, monkeypatch, capfd, caplog):
    """A compile error (as with no working compiler) falls back with one warning naming the
    file that keeps the compiler's output; the next import with the same sources and flags
    does not compile again, and says so in one line, until that file is deleted."""
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "ext"))
    source = tmp_path / "broken.cpp"
    source.write_text("this is not C++;\n" + PROBE)
    flags = _flags("probe_broken=5")
    assert not _native._build("distopt_probe", str(source), flags, "probe_broken.value")
    first = capfd.readouterr().err
    assert first.count("compiling") == 1
    directory = Path(_native.build_directory(_native.build_name("distopt_probe", str(tmp_path), flags, [])))
    record = directory / "distopt.failed"
    assert "this is not C++" in record.read_text()
    assert f"(the compiler's output: {record})" in caplog.text
    caplog.clear()
    assert not _native._build("distopt_probe", str(source), flags, "probe_broken.value")
    assert "compiling" not in capfd.readouterr().err
    assert "their build failed before (RuntimeError: Error building extension" in caplog.text
    assert len(caplog.records) == 1 and len(caplog.records[0].getMessage().splitlines()) == 1


def test_only_a_builds_own_processes_hold_back_the_next_build(tmp_path):
    """After a killed build, the next one waits for the compilers and ninja that the kill
    left running in the build directory, not for any process that happens to be there."""
    name = "distopt_probe_0123abcd"
    shell = subprocess.Popen(["cat"], stdin=subprocess.PIPE, cwd=tmp_path)
    compiler = subprocess.Popen(["sh", "-c", f"cat # -DTORCH_EXTENSION_NAME={name}"],
                                stdin=subprocess.PIPE, cwd=tmp_path)
    try:
        found = _native._builders(os.path.realpath(tmp_path), name)
        assert compiler.pid in found and shell.pid not in found
    finally:
        for process in (shell, compiler):
            process.stdin.close()
            process.wait()
