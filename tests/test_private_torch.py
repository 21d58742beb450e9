"""Every private torch API the source tree uses is used in one of two modules, each use with
its reason: distopt/_torch.py and, for what TorchScript must see, functional/_torch.py.

The check reads the source (``tests/code_shape.py``, ast: no import) and lists no torch
name: a private name reached from a torch module (``torch._chunk_cat``, ``torch._C.x``,
``dist._x``, ``import torch._jit_internal``, ``getattr(torch._C, "_x")``), one written in a
comment or docstring as reached from torch (``torch.profiler._ExperimentalConfig``), and
any private attribute or ``getattr`` name the project's own source never defines for its
own objects (``opt._join_config``, ``p._base``, ``self._optimizer_step_pre_hooks``): a
private name nobody here defined is someone else's. It fails naming the file, the line and
the name. The only names it lets by are torch.optim's own kernels called from TorchScript
(``torch._foreach_*``, ``torch._fused_*``), the sparse accessors TorchScript reads, the
name an optimizer declares to GradScaler, and a NamedTuple's public ``_replace``.
"""
import ast

import pytest

from tests import code_shape

PRIVATE_API_MODULES = code_shape.PRIVATE_API_MODULES


def test_private_torch_names_are_used_in_the_private_api_modules_only():
    outside = code_shape.private_torch_uses()
    assert not outside, (
        "private torch names outside " + " and ".join(PRIVATE_API_MODULES) + " (route each "
        "through one of them, with its reason): "
        + "; ".join(f"{name}: {', '.join(uses)}" for name, uses in outside.items())
    )


def test_the_private_api_modules_exist_and_give_a_reason_for_each_entry_point():
    for name in PRIVATE_API_MODULES:
        tree = ast.parse(code_shape.read(name))
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
    # Names no list holds: found because nothing in the project defines them.
    "if opt._join_config.enable:\n    pass": "1: ._join_config",
    "ignored = ddp._delay_all_reduce_params": "1: ._delay_all_reduce_params",
    "x = ddp.reducer._rebuild_buckets()": "1: ._rebuild_buckets",
    '"""Built with torch.profiler._ExperimentalConfig(profile_all_threads=True)."""':
        "1: torch.profiler._ExperimentalConfig",
    "import torch\ntorch._foreach_add_(xs, 1.0)\ntorch._fused_adam_(*args)": None,
    "import torch\ng._values()\nx = torch.__version__\ny = point._replace(x=1)": None,
}


@pytest.mark.parametrize("source", list(PLANTED), ids=range(len(PLANTED)))
def test_the_check_finds_a_planted_private_name(source):
    uses = code_shape.private_torch_names(source, code_shape.our_private_names())
    if PLANTED[source] is None:
        assert uses == [], uses
    else:
        assert any(PLANTED[source] in u for u in uses), uses


def test_a_private_name_the_project_defines_for_its_own_objects_passes():
    """``self._x`` that some class of the project sets, read anywhere, is the project's own."""
    ours = code_shape.our_private_names()
    assert "_engine" in ours and "_join_config" not in ours
    assert code_shape.private_torch_names("y = opt._engine.buckets", ours) == []


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
