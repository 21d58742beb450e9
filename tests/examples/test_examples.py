"""Each example runs end to end, as a user would start it, with tiny settings."""
import contextlib
import importlib.util
import io
import os
import re
import select
import signal
import subprocess
import sys
import time
from typing import Any, List

import pytest
import torch
from torch import nn

from distopt.arguments import check_optimizer_class
from functional import functional_optim_map, script_optimizer
from tests import worlds

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TIMEOUT_S = 120


def run_example(script: str, args: List[str]) -> str:
    """Run ``examples/<script>`` in a fresh interpreter; returns its output, fails on exit code."""
    env = dict(os.environ)
    for name in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(name, None)  # a local run, whatever launched pytest
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [ROOT, env.get("PYTHONPATH")]))
    proc = subprocess.run(
        [sys.executable, os.path.join(ROOT, "examples", script), *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
    )
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"{script} exited with {proc.returncode}:\n{output}"
    return output


def test_model_parallel_rnn_loss_falls(rnn_one_machine_run) -> None:
    """The session's one run of the example (tests/conftest.py: 60 steps, hidden 32, a
    checkpoint every 20, 40 characters sampled), which the test hosts compare against."""
    out = rnn_one_machine_run[0]
    match = re.search(r"loss: first ([\d.]+) -> final ([\d.]+)", out)
    assert match, out
    first, final = float(match.group(1)), float(match.group(2))
    assert final < first, out
    assert "compiled: True" in out
    assert re.search(r"^sample: ['\"].+['\"]$", out, re.MULTILINE), out  # its repr


def _refused(script: str, args: List[str]) -> str:
    """``examples/<script>``'s command line ``args`` refused (exit 2, as argparse does, before
    any process starts); what it printed."""
    err = io.StringIO()
    with pytest.raises(SystemExit) as info, contextlib.redirect_stderr(err):
        _load_example(script).parse_args(args)
    assert info.value.code == 2, err.getvalue()
    return err.getvalue()


@pytest.mark.parametrize("optimizer", ["Adam", "NAdam"])  # NAdam: not compiled by torch's version
def test_parameter_server(optimizer: str) -> None:
    out = run_example(
        "parameter_server.py", ["--steps", "30", "--log-every", "10", "--optimizer", optimizer]
    )
    for trainer in ("trainer1", "trainer2"):
        assert re.search(rf"^{trainer} +30 ", out, re.MULTILINE), out
    match = re.search(r"held-out loss: before ([\d.]+) -> after ([\d.]+)", out)
    assert match and float(match.group(2)) < float(match.group(1)), out
    assert "samples/s" in out


def test_custom_optimizer_is_compiled_and_equals_eager() -> None:
    out = run_example("custom_optimizer.py", ["--steps", "20"])
    assert "is_functional_optim = True" in out, out
    assert "results equal: yes" in out, out


def test_bad_optimizer_name_is_rejected() -> None:
    proc = subprocess.run(
        [sys.executable, os.path.join(ROOT, "examples", "parameter_server.py"),
         "--optimizer", "LBFGS"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
    )
    assert proc.returncode == 2
    assert "Invalid optimizer: 'LBFGS'" in proc.stderr


# ---------------------------------------------------------------- --optimizer says what is true


def _load_example(script: str) -> Any:
    """``examples/<script>`` imported as a module (its ``main`` is not run)."""
    examples = os.path.join(ROOT, "examples")
    if examples not in sys.path:
        sys.path.insert(0, examples)  # for the examples' own ``import _launch``
    path = os.path.join(examples, script)
    spec = importlib.util.spec_from_file_location(f"example_{script[:-3]}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _parameters(script: str, module: Any) -> List[torch.Tensor]:
    """Parameters of the example's model, shaped as the example makes them."""
    if script == "parameter_server.py":
        return [p.detach().clone() for p in module.mlp(16, 64, 0).parameters()]
    parts = [nn.Embedding(30, 32), nn.LSTM(32, 64, 1, batch_first=True), nn.Linear(64, 30)]
    return [p.detach().clone() for part in parts for p in part.parameters()]


TORCH_OPTIMIZERS = {
    name for name, obj in vars(torch.optim).items()
    if isinstance(obj, type) and issubclass(obj, torch.optim.Optimizer)
    and obj is not torch.optim.Optimizer
}


@pytest.mark.parametrize("script", ["parameter_server.py", "model_parallel_rnn.py"])
def test_optimizer_option_lists_what_trains_and_refuses_the_rest(script: str) -> None:
    module = _load_example(script)
    params = _parameters(script, module)
    module = module._launch  # the list both dense examples share
    assert set(module.OPTIMIZERS) | set(module.REFUSED) == TORCH_OPTIMIZERS
    assert not set(module.OPTIMIZERS) & set(module.REFUSED)
    for name in module.OPTIMIZERS:
        cls = module.optimizer_class(name)
        # What each owner runs: the compiled stand-in, over the model's parameters.
        check_optimizer_class(cls, eager=cls not in functional_optim_map)
        ps = [p.clone() for p in params]
        optim = script_optimizer(functional_optim_map[cls](ps, lr=0.1))
        optim.step([torch.ones_like(p) for p in ps])
        assert all(not torch.equal(p, q) for p, q in zip(ps, params)), name
    for name, why in module.REFUSED.items():
        with pytest.raises(ValueError) as info:
            module.optimizer_class(name)
        assert str(info.value) == (
            f"Invalid optimizer: {name!r} (expected one of {', '.join(module.OPTIMIZERS)}; "
            f"{name}: {why})"
        )
    # ... and each refused one indeed cannot train this model.
    with pytest.raises(TypeError, match="cannot step without 'closure'"):
        check_optimizer_class(torch.optim.LBFGS, eager=True)
    with pytest.raises(ValueError, match=r"expected a 2-D parameter"):
        functional_optim_map[torch.optim.Muon](params)
    with pytest.raises(torch.jit.Error, match="SparseAdam does not support dense gradients"):
        optim = script_optimizer(functional_optim_map[torch.optim.SparseAdam](params))
        optim.step([torch.ones_like(p) for p in params])
    assert set(module.REFUSED) == {"LBFGS", "Muon", "SparseAdam"}


def _launch_module():
    spec = importlib.util.spec_from_file_location(
        "_launch_for_test", os.path.join(ROOT, "examples", "_launch.py")
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_examples_talk_over_one_interface(monkeypatch) -> None:
    """torch RPC runs any connecting peer's pickled calls: the examples pin TensorPipe and
    gloo to one interface, loopback for a one-machine run, and refuse an unknown one."""
    launch = _launch_module()
    for name in ("TP_SOCKET_IFNAME", "GLOO_SOCKET_IFNAME"):
        monkeypatch.delenv(name, raising=False)
    launch.pin_interface(None, local=False)  # several machines, no --interface: as given
    assert "TP_SOCKET_IFNAME" not in os.environ
    launch.pin_interface(None, local=True)
    assert os.environ["TP_SOCKET_IFNAME"] == os.environ["GLOO_SOCKET_IFNAME"] == "lo"
    with pytest.raises(ValueError, match=r"Invalid --interface: 'nosuch' \(expected one of "):
        launch.pin_interface("nosuch", local=True)
    proc = subprocess.run(
        [sys.executable, os.path.join(ROOT, "examples", "parameter_server.py"),
         "--interface", "nosuch"], cwd=ROOT, capture_output=True, text=True, timeout=TIMEOUT_S,
    )
    assert proc.returncode != 0 and "Invalid --interface: 'nosuch'" in proc.stderr


def test_examples_refuse_torchrun_restarts_onto_a_shared_store() -> None:
    """torchrun with --max-restarts and its rendezvous store shared with the workers would
    hang the restarted world in init_rpc (pytorch#135712): refused, saying what to set."""
    launch = _launch_module()
    shared = {"TORCHELASTIC_MAX_RESTARTS": "2", "TORCHELASTIC_USE_AGENT_STORE": "True"}
    with pytest.raises(RuntimeError, match=r"--max-restarts 2: .*TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1"):
        launch.check_restartable(shared)
    launch.check_restartable({**shared, "TORCHELASTIC_USE_AGENT_STORE": "False"})
    launch.check_restartable({**shared, "TORCHELASTIC_MAX_RESTARTS": "0"})
    launch.check_restartable({})  # not under torchrun


def test_ranks_stop_when_the_example_is_killed() -> None:
    """A one-machine example's ranks fork from a fork server, which outlives the example's
    process: they must still stop when that process is killed (SIGKILL: no handler runs),
    as torch.multiprocessing.spawn's ranks do, not train on to the end."""
    proc = subprocess.Popen(
        [sys.executable, os.path.join(ROOT, "examples", "data_parallel.py"),
         "--steps", "1000000", "--log-every", "20"],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
        start_new_session=True,
    )
    try:
        deadline = time.monotonic() + TIMEOUT_S
        line = ""
        while not line.startswith("step"):  # a step logged: every rank is up
            ready, _, _ = select.select([proc.stdout], [], [], max(0.0, deadline - time.monotonic()))
            assert ready, "no step logged"
            line = proc.stdout.readline()
            assert line, "the example ended before its first step was logged"
        others = [pid for pid in worlds.pids_in_session(proc.pid) if pid != proc.pid]
        assert len(others) >= 3, others  # the fork server and 2 ranks, at least
        proc.kill()
        proc.wait()
        deadline = time.monotonic() + 30.0
        running = [pid for pid in others
                   if not worlds.wait_for_exit(pid, deadline - time.monotonic())]
        assert running == [], "processes of the example still run"
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        proc.stdout.close()
