"""The native ops of flat buffers (functional/csrc/flat_ops.cpp) and the TorchScript path
that replaces them where they cannot be built (DISTOPT_NATIVE=0)."""
import os
import subprocess
import sys
from typing import Dict, List, Optional

import pytest
import torch

from distopt import local_optimizer
from functional import _flat, _native

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
native_only = pytest.mark.skipif(
    not _native.AVAILABLE,
    reason="no native flat ops in this process (no C++ compiler or ninja, or DISTOPT_NATIVE=0)",
)


def test_the_native_ops_are_built_and_used():
    """On a machine with a C++ compiler (CI's) the ops build; every caller then uses them."""
    if os.environ.get("DISTOPT_NATIVE") == "0":
        assert not _native.AVAILABLE
        assert _flat.fill_flat_gradients is _flat._fill_script
        assert local_optimizer.lookup_gradients is local_optimizer._lookup_script
        return
    assert _native.AVAILABLE
    assert _flat.fill_flat_gradients is _flat._fill_native
    assert local_optimizer.lookup_gradients is local_optimizer._lookup_native


def _members(n: int = 3):
    buf = torch.zeros(4 * n)
    params = [torch.nn.Parameter(torch.zeros(2, 2)) for _ in range(n)]
    views = [buf[4 * k:4 * k + 4].view(2, 2) for k in range(n)]
    with torch.no_grad():
        for p, v in zip(params, views):
            p.data = v
    return params, views, [4 * k for k in range(n)]


def _fill(grads, params, views, offsets, out):
    return torch.ops.distopt_flat.fill(grads, list(range(len(params))), params, views, offsets, out)


@native_only
def test_fill_copies_any_layout_in_buffer_order():
    params, views, offsets = _members()
    grads = [torch.arange(4.0).view(2, 2).t(), torch.full((2, 2), 7.0), torch.arange(8.0)[::2].view(2, 2)]
    out = torch.full((12,), -1.0)
    assert _fill(grads, params, views, offsets, out)
    assert torch.equal(out, torch.cat([g.reshape(-1) for g in grads]))


@native_only
@pytest.mark.parametrize("what", ["None", "sparse", "dtype", "shape", "replaced storage"])
def test_fill_refuses_and_writes_nothing(what: str):
    params, views, offsets = _members()
    grads: List[Optional[torch.Tensor]] = [torch.ones(2, 2) for _ in params]
    if what == "None":
        grads[2] = None
    elif what == "sparse":
        grads[2] = torch.ones(2, 2).to_sparse()
    elif what == "dtype":
        grads[2] = torch.ones(2, 2, dtype=torch.float64)
    elif what == "shape":
        grads[2] = torch.ones(4)
    else:
        params[2].data = torch.zeros(2, 2)
    out = torch.full((12,), -1.0)
    assert not _fill(grads, params, views, offsets, out)
    assert torch.equal(out, torch.full((12,), -1.0)), "a refused fill wrote to the buffer"


@native_only
def test_fill_refuses_an_index_outside_the_gradients():
    params, views, offsets = _members()
    with pytest.raises(RuntimeError, match="member index 5 for 3 gradients"):
        torch.ops.distopt_flat.fill([torch.ones(2, 2)] * 3, [0, 1, 5], params, views, offsets, torch.zeros(12))


@native_only
def test_lookup_is_by_identity_like_torchscripts_dict():
    params = [torch.zeros(3, requires_grad=True) for _ in range(3)]
    grads = {params[0]: torch.ones(3), params[2]: torch.full((3,), 2.0)}
    twin = torch.zeros(3, requires_grad=True)  # equal values, another tensor

    @torch.jit.script
    def scripted(g: Dict[torch.Tensor, torch.Tensor], p: List[torch.Tensor]) -> List[Optional[torch.Tensor]]:
        return torch.ops.distopt_flat.lookup(g, p)

    for found in (torch.ops.distopt_flat.lookup(grads, params + [twin]), scripted(grads, params + [twin])):
        assert found[0] is grads[params[0]] and found[2] is grads[params[2]]
        assert found[1] is None and found[3] is None


def test_the_torchscript_path_gives_the_same_results():
    """The flat and owner tests again in processes without the native ops."""
    env = dict(os.environ, DISTOPT_NATIVE="0")
    tests = [
        "tests/functional/test_native.py::test_the_native_ops_are_built_and_used",
        "tests/functional/test_native.py::test_views_of_the_flat_gradient_buffer_as_gradients",
        "tests/functional/test_flat.py",
        "tests/distopt/test_flat.py",
    ]
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", "-W",
         "ignore::UserWarning", *tests, "-k", "not matches_torch_and_the_per_parameter or Adam-"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=600,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert " passed" in result.stdout and "failed" not in result.stdout


@native_only
def test_fill_refuses_arguments_that_do_not_describe_a_buffer_before_writing():
    params, views, offsets = _members()
    grads = [torch.ones(2, 2) for _ in params]
    out = torch.full((12,), -1.0)
    for bad, match in [
        ([0, 4, (1 << 63) - 2], "member 2 at 9223372036854775806"),  # offset + numel overflows
        ([0, 4, 100], "member 2 at 100"),
    ]:
        with pytest.raises(RuntimeError, match=match):
            _fill(grads, params, views, bad, out)
        assert torch.equal(out, torch.full((12,), -1.0)), "a refused fill wrote to the buffer"
    with pytest.raises(RuntimeError, match="member 0 of Float in a buffer of Double"):
        _fill(grads, params, views, offsets, torch.zeros(12, dtype=torch.float64))
    with pytest.raises(RuntimeError, match="1-D contiguous buffer"):
        _fill(grads, params, views, offsets, torch.zeros(24)[::2])


@native_only
def test_fill_sends_subclasses_and_views_of_its_own_buffer_per_parameter():
    from torch.testing._internal.two_tensor import TwoTensor

    params, views, offsets = _members()
    out = torch.full((12,), -1.0)
    subclass = [torch.ones(2, 2), TwoTensor(torch.ones(2, 2), torch.ones(2, 2)), torch.ones(2, 2)]
    assert not _fill(subclass, params, views, offsets, out)
    own = [out[8:12].view(2, 2), out[0:4].view(2, 2), out[4:8].view(2, 2)]
    assert not _fill(own, params, views, offsets, out)
    assert torch.equal(out, torch.full((12,), -1.0))


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_views_of_the_flat_gradient_buffer_as_gradients(compiled: bool):
    """Gradients that are views of the optimizer's own flat gradient buffer, swapped between
    members: torch.optim's numbers natively (the members step per parameter), torch's
    aliasing error on the TorchScript path."""
    from functional import FunctionalAdam, flatten_parameters, script_optimizer

    gen = torch.Generator().manual_seed(0)
    init = [torch.randn(4, generator=gen) for _ in range(3)]
    params = [p.clone() for p in init]
    ref = [p.clone().requires_grad_() for p in init]
    opt = flatten_parameters(FunctionalAdam(params, lr=0.1))
    buf = opt.groups.flats[0].grad
    if compiled:
        opt = script_optimizer(opt)
    ref_opt = torch.optim.Adam(ref, lr=0.1)
    for step in range(3):
        buf.copy_(torch.randn(12, generator=gen))
        grads = [buf[8:12], buf[0:4], buf[4:8]]
        for p, g in zip(ref, grads):
            p.grad = g.clone()
        ref_opt.step()
        if not _native.AVAILABLE:
            with pytest.raises((RuntimeError, torch.jit.Error), match="single memory location"):
                opt.step(grads)
            return
        opt.step(grads)
        for p, r in zip(params, ref):
            torch.testing.assert_close(p, r.detach(), rtol=1e-5, atol=1e-6)
