"""functional/ is the math only: torch and typing, never torch.distributed or numpy.

Besides torch and typing it may use a few standard-library modules that every Python has
(math in TorchScript-compiled code, threading for the compile lock, copy and inspect for the
state_dict conversion, functools and numbers for the constructors' argument checks, logging,
os, sys, hashlib, time and fcntl for building the native ops under an OS lock, warnings and contextlib to compile without torch's
deprecation warnings, enum for the named constants TorchScript folds); anything else, and any of torch.distributed, fails this
test.
"""
import ast
import pathlib

import functional

ALLOWED_ROOTS = {
    "torch", "typing", "functional", "math", "threading", "copy", "inspect", "functools", "numbers",
    "logging", "os", "sys", "hashlib", "time", "fcntl", "warnings", "contextlib", "enum",
}


def _imports(path: pathlib.Path):
    tree = ast.parse(path.read_text(), filename=str(path))
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name
        elif isinstance(node, ast.ImportFrom) and node.level == 0:
            yield node.module


def test_functional_imports_only_torch_typing_and_stdlib() -> None:
    root = pathlib.Path(functional.__file__).parent
    for path in sorted(root.glob("*.py")):
        for name in _imports(path):
            assert name.split(".")[0] in ALLOWED_ROOTS, f"{path.name} imports {name}"
            assert not name.startswith("torch.distributed"), f"{path.name} imports {name}"


def test_both_packages_carry_the_distribution_s_version() -> None:
    import configparser
    import re

    import distopt
    from functional import _version

    # One source: setup.cfg reads functional/_version.py; both packages import it.
    cfg = configparser.ConfigParser()
    cfg.read(pathlib.Path(functional.__file__).parent.parent / "setup.cfg")
    assert cfg["metadata"]["version"] == "attr: functional._version.__version__"
    assert distopt.__version__ == functional.__version__ == _version.__version__
    assert re.fullmatch(r"\d+\.\d+\.\d+\S*", functional.__version__), functional.__version__
    # Not part of the documented API (docs/_ext/public_api.py documents __all__).
    assert "__version__" not in distopt.__all__ and "__version__" not in functional.__all__
