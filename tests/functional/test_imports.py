"""functional/ is the math only: torch and typing, never torch.distributed or numpy.

Besides torch and typing it may use a few standard-library modules that every Python has
(math in TorchScript-compiled code, threading for the compile lock, copy and inspect for the
state_dict conversion, functools and numbers for the constructors' argument checks, logging,
os and hashlib for building the native ops); anything else, and any of torch.distributed, fails this
test.
"""
import ast
import pathlib

import functional

ALLOWED_ROOTS = {
    "torch", "typing", "functional", "math", "threading", "copy", "inspect", "functools", "numbers",
    "logging", "os", "hashlib",
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
