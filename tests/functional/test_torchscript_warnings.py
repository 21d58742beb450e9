"""A user's own pytest run of a compiled optimizer shows none of torch's TorchScript
deprecation warnings: the library filters exactly those, around its own compiles
(``functional._compile.quiet_scripting``), and leaves the user's own calls warning.

The user's file runs in a fresh pytest process without this project's setup.cfg (``-c
/dev/null``), as a user's suite would. Before the filter, its first test alone reported
``1 passed, 106 warnings``: one ``torch.jit.script`` warning for each function TorchScript
compiles, and one for ``torch.jit.interface``.
"""
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

USER_TEST = '''
import warnings

import pytest
import torch

import distopt  # noqa: F401  (compiles at import: distopt.exclusive)
import functional


def test_compiled_optimizer_steps():
    filters = list(warnings.filters)
    params = [torch.randn(10, 5), torch.randn(5)]
    opt = functional.script_optimizer(functional.FunctionalAdam(params, lr=1e-3))
    opt.step([torch.randn(10, 5), torch.randn(5)])
    assert list(warnings.filters) == filters  # the library's filter is gone again


def test_own_scripting_still_warns():
    with pytest.warns(DeprecationWarning, match="torch.jit.script"):
        torch.jit.script(torch.nn.Linear(2, 2))
'''


def test_users_test_run_shows_no_torchscript_warnings(tmp_path):
    (tmp_path / "test_user.py").write_text(USER_TEST)
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [ROOT, env.get("PYTHONPATH")]))
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-c", os.devnull, "--rootdir", str(tmp_path),
         "-p", "no:cacheprovider", "-p", "no:xdist", "test_user.py"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    summary = done.stdout.strip().splitlines()[-1]
    assert "2 passed" in summary and "warning" not in summary, done.stdout
