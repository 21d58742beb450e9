"""Every private torch API the source tree calls is called in one of two modules, each call
with its reason: distopt/_torch.py and, for what TorchScript must see, functional/_torch.py.

The check reads the source (ast), so it needs no import: a private name reached from torch
(``torch._chunk_cat``, ``torch._C._storage_Use_Count``, ``dist._x``, ``import
torch._jit_internal``, ``getattr(torch._C, "_x")``), or one of torch's private fields of an
optimizer, tensor or autograd object (``opt._optimizer_state_dict_pre_hooks``,
``p._base``), anywhere else fails it, naming the file, the line and the name.
"""
import ast
import os
import re
from typing import Dict, List

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGES = ("distopt", "functional")
#: The modules allowed to call private torch APIs.
PRIVATE_API_MODULES = ("distopt/_torch.py", "functional/_torch.py")

#: Private names reached from ``torch`` that any module may call: the kernels torch.optim
#: itself runs (``_foreach_*``, ``_fused_*``), called from TorchScript functions, where a
#: Python wrapper cannot be called (distopt/_torch.py's docstring says so too).
ALLOWED_KERNELS = re.compile(r"_(foreach|fused)_\w+")

#: torch's private fields of its objects, by name (reached from any object): Optimizer's
#: hook dicts and step patching, Tensor and Storage internals, the autograd engine and
#: contexts, process groups' backends.
PRIVATE_FIELDS = re.compile(
    r"_optimizer_\w+_hooks|_patch_step_function|_warned_capturable_if_run_uncaptured"
    r"|_base|_version|_cdata|_execution_engine|_engine_run_backward"
    r"|_context_id|_known_worker_ids|_get_backend|_storage_Use_Count"
)
# Not listed: ``Tensor._values()`` / ``_indices()``, a sparse COO gradient's uncoalesced
# values and indices, read in TorchScript by the sparse kernels as torch.optim's own sparse
# code reads them (``values()`` refuses an uncoalesced tensor); and
# ``_step_supports_amp_scaling``, the class attribute GradScaler reads: a name an optimizer
# declares to take part in torch's protocol, not a call.


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def _chain(node: ast.AST) -> List[str]:
    """``a.b.c`` as ["a", "b", "c"]; [] where the chain does not start at a name."""
    parts: List[str] = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if not isinstance(node, ast.Name):
        return []
    return [node.id] + parts[::-1]


def private_uses(source: str) -> List[str]:
    """``"line: name"`` for each private torch API ``source`` uses."""
    tree = ast.parse(source)
    torch_names: Dict[str, str] = {}  # local name -> what it is in torch
    found: List[str] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == "torch":
                    if any(_private(p) for p in alias.name.split(".")):
                        found.append(f"{node.lineno}: import {alias.name}")
                    local = alias.asname or alias.name.split(".")[0]
                    torch_names[local] = alias.name if alias.asname else "torch"
        elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "torch":
            for alias in node.names:
                where = f"{node.module}.{alias.name}"
                if any(_private(p) for p in where.split(".")):
                    found.append(f"{node.lineno}: from {node.module} import {alias.name}")
                torch_names[alias.asname or alias.name] = where
    inner = {id(n.value) for n in ast.walk(tree) if isinstance(n, ast.Attribute)}
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute):
            if PRIVATE_FIELDS.fullmatch(node.attr):
                found.append(f"{node.lineno}: .{node.attr}")
            parts = _chain(node)
            if id(node) in inner or not parts or parts[0] not in torch_names:
                continue  # a chain is checked once, whole, at its outermost attribute
            private = [p for p in parts[1:] if _private(p)]
            kernel = torch_names[parts[0]] == "torch" and len(parts) == 2 and (
                ALLOWED_KERNELS.fullmatch(parts[1]) is not None)
            if private and not kernel:
                found.append(f"{node.lineno}: {'.'.join(parts)}")
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and (
            node.func.id in ("getattr", "hasattr", "setattr")
        ) and len(node.args) >= 2 and isinstance(node.args[1], ast.Constant):
            name = node.args[1].value
            target = _chain(node.args[0])
            if isinstance(name, str) and _private(name) and (
                PRIVATE_FIELDS.fullmatch(name) or (target and target[0] in torch_names)
            ):
                found.append(f"{node.lineno}: {node.func.id}(..., {name!r})")
    return sorted(set(found), key=lambda s: int(s.split(":")[0]))


def _sources() -> List[str]:
    out = []
    for package in PACKAGES:
        for folder, _, files in os.walk(os.path.join(ROOT, package)):
            out += [os.path.relpath(os.path.join(folder, f), ROOT)
                    for f in files if f.endswith(".py")]
    return sorted(out)


def test_private_torch_apis_are_called_in_the_private_api_modules_only():
    outside = {}
    for name in _sources():
        if name in PRIVATE_API_MODULES:
            continue
        with open(os.path.join(ROOT, name)) as f:
            uses = private_uses(f.read())
        if uses:
            outside[name] = uses
    assert not outside, (
        "private torch APIs outside " + " and ".join(PRIVATE_API_MODULES) + " (route each "
        "through one of them, with its reason): "
        + "; ".join(f"{name}: {', '.join(uses)}" for name, uses in outside.items())
    )


def test_the_private_api_modules_exist_and_give_a_reason_for_each_entry_point():
    for name in PRIVATE_API_MODULES:
        with open(os.path.join(ROOT, name)) as f:
            tree = ast.parse(f.read())
        for node in tree.body:
            if isinstance(node, ast.FunctionDef) and not node.name.startswith("_"):
                doc = ast.get_docstring(node) or ""
                assert "Needed" in doc, f"{name}: {node.name} does not say why it is needed"


PLANTED = {
    # source: what the check must report (None: nothing)
    "import torch\ntorch._chunk_cat(xs, 0, 1)": "2: torch._chunk_cat",
    "import torch\nuse = getattr(torch._C, '_storage_Use_Count', None)": "2: torch._C",
    "import torch._jit_internal as j": "1: import torch._jit_internal",
    "from torch._C._distributed_rpc import PyRRef": "from torch._C._distributed_rpc import",
    "import torch.distributed.autograd as da\nda._retrieve_context(1)":
        "2: da._retrieve_context",
    "import torch\nlayouts = [torch.strided, torch._mkldnn]": "2: torch._mkldnn",
    "for h in self._optimizer_state_dict_pre_hooks.values():\n    h(self)":
        "1: ._optimizer_state_dict_pre_hooks",
    "ok = p._base is None": "1: ._base",
    "import torch\ntorch._foreach_add_(xs, 1.0)\ntorch._fused_adam_(*args)": None,
    "import torch\ng._values()\nself._state = {}\nx = torch.__version__": None,
}


@pytest.mark.parametrize("source", list(PLANTED), ids=range(len(PLANTED)))
def test_the_check_finds_a_planted_private_call(source):
    uses = private_uses(source)
    if PLANTED[source] is None:
        assert uses == [], uses
    else:
        assert any(PLANTED[source] in u for u in uses), uses


# ---------------------------------------------------------------- the entry points, on torch


@pytest.mark.parametrize("kind", ["state_dict_pre", "state_dict_post", "load_state_dict_pre",
                                  "load_state_dict_post"])
def test_optimizer_hooks_are_those_torch_registered_in_order(kind):
    import torch

    from distopt import _torch

    opt = torch.optim.SGD([torch.zeros(2, requires_grad=True)], lr=0.1)
    first, second = (lambda *a: None), (lambda *a: None)
    register = getattr(opt, f"register_{kind}_hook")
    register(first)
    handle = register(second)
    assert _torch.optimizer_hooks(opt, kind) == [first, second]
    handle.remove()
    assert _torch.optimizer_hooks(opt, kind) == [first]
    with pytest.raises(ValueError, match="Invalid kind: 'step_pre'"):
        _torch.optimizer_hooks(opt, "step_pre")


def test_the_functional_entry_points_answer_as_torch_does():
    import torch

    from functional import _torch

    grads = [torch.randn(2, 3), torch.randn(4)]
    out = torch.empty(1, 10)
    _torch.chunk_cat(grads, 0, 1, out)
    assert torch.equal(out[0], torch.cat([g.flatten() for g in grads]))
    found = torch.zeros(())
    _torch.unscale_and_check_(grads, found, torch.tensor(0.5))
    assert found.item() == 0.0
    _torch.unscale_and_check_([torch.tensor([float("inf")])], found, torch.tensor(1.0))
    assert found.item() == 1.0
    assert _torch.mkldnn_layout() == torch._mkldnn
    p = torch.zeros(3)
    assert not _torch.is_view(p) and _torch.is_view(p[1:])
    alone = _torch.storage_use_count(p.untyped_storage())
    view = p[1:]
    assert alone is None or _torch.storage_use_count(p.untyped_storage()) == alone + 1, view
    assert callable(_torch.class_resolution_callback(torch.nn.Linear))
