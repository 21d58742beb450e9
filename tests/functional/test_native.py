"""The native ops of flat buffers (functional/csrc/flat_ops.cpp) and the TorchScript path
that replaces them where they cannot be built (DISTOPT_NATIVE=0)."""
import math
import os
from typing import Any, Dict, List, Optional

import pytest
import torch

from distopt import compiled_steps
from functional import FLAT_CLASSES, _flat, _native, flatten_parameters
from functional._compile import script  # torch.jit.script without its deprecation warning

from .case import Case
from .cases import ALL_CASES

native_only = pytest.mark.skipif(
    not _native.AVAILABLE,
    reason="no native flat ops in this process (no C++ compiler or ninja, or DISTOPT_NATIVE=0)",
)


def test_the_native_ops_are_built_and_used():
    """On a machine with a C++ compiler (CI's) the ops build; every caller then uses them."""
    if os.environ.get("DISTOPT_NATIVE") == "0":
        assert not _native.AVAILABLE
        assert _flat.fill_flat_gradients is _flat._fill_script
        assert compiled_steps.lookup_gradients is compiled_steps._lookup_script
        return
    assert _native.AVAILABLE
    assert _flat.fill_flat_gradients is _flat._fill_native
    assert compiled_steps.lookup_gradients is compiled_steps._lookup_native


def _members(n: int = 3):
    buf = torch.zeros(4 * n)
    params = [torch.nn.Parameter(torch.zeros(2, 2)) for _ in range(n)]
    views = [buf[4 * k:4 * k + 4].view(2, 2) for k in range(n)]
    with torch.no_grad():
        for p, v in zip(params, views):
            p.data = v
    return params, views, [4 * k for k in range(n)]


#: The cases ``_spoil`` makes.
SPOILED = ("None", "sparse", "dtype", "shape", "replaced storage")


def _spoil(what: str, grads: List[Optional[torch.Tensor]], params: List[torch.Tensor]) -> None:
    """Make member 2 a case the fill must refuse: no gradient, a sparse one, another dtype or
    shape, or a parameter whose storage was replaced (no longer a view of the buffer)."""
    if what == "None":
        grads[2] = None
    elif what == "sparse":
        grads[2] = torch.ones(2, 2).to_sparse()
    elif what == "dtype":
        grads[2] = torch.ones(2, 2, dtype=torch.float64)
    elif what == "shape":
        grads[2] = torch.ones(4)
    else:  # "replaced storage"
        params[2].data = torch.zeros(2, 2)


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
@pytest.mark.parametrize("what", SPOILED)
def test_fill_refuses_and_writes_nothing(what: str):
    params, views, offsets = _members()
    grads: List[Optional[torch.Tensor]] = [torch.ones(2, 2) for _ in params]
    _spoil(what, grads, params)
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

    @script
    def scripted(g: Dict[torch.Tensor, torch.Tensor], p: List[torch.Tensor]) -> List[Optional[torch.Tensor]]:
        return torch.ops.distopt_flat.lookup(g, p)

    for found in (torch.ops.distopt_flat.lookup(grads, params + [twin]), scripted(grads, params + [twin])):
        assert found[0] is grads[params[0]] and found[2] is grads[params[2]]
        assert found[1] is None and found[3] is None


# ---------------------------------------------------------------- the TorchScript path
# What a process without the native ops (no compiler, or DISTOPT_NATIVE=0) runs instead:
# ``_flat._fill_script`` and ``compiled_steps._lookup_script``, compiled into the optimizers
# in place of the ops. Each is checked here against the op, eager and compiled, on every
# kind of input the flat and owner tests give it.


def _buffer(shapes, members=None) -> Any:
    """A flat buffer of parameters of ``shapes`` (its gradient buffer -1: a write shows)."""
    numels = [math.prod(s) for s in shapes]
    offsets = [sum(numels[:k]) for k in range(len(shapes))]
    param = torch.zeros(sum(numels))
    views = [param[o:o + n].view(s) for o, n, s in zip(offsets, numels, shapes)]
    params = [torch.nn.Parameter(torch.zeros(s)) for s in shapes]
    with torch.no_grad():
        for p, v in zip(params, views):
            p.data = v
    f = _flat.FlatBuffer(members or list(range(len(shapes))), params, views, offsets, param)
    f.grad.fill_(-1.0)
    return f


def _grads_for(what: str, f: Any) -> List[Optional[torch.Tensor]]:
    shapes = [tuple(v.shape) for v in f.views]
    grads: List[Optional[torch.Tensor]] = [
        torch.arange(1.0, 1.0 + math.prod(s)).view(s) * (k + 1) for k, s in enumerate(shapes)]
    if what == "any layout":
        grads = [torch.arange(4.0).view(2, 2).t(), torch.full((2, 2), 7.0),
                 torch.arange(8.0)[::2].view(2, 2)]
    elif what in SPOILED:
        _spoil(what, grads, f.params)
    elif what == "members not consecutive":  # gradients of other parameters in between
        grads = [grads[0], torch.full((9,), 5.0), grads[1], torch.full((9,), 6.0), grads[2]]
    return grads


#: What a fill meets: (shapes of the members, the gradients given, whether the fill takes
#: them). 1-D members fill by one cat, others by _chunk_cat, with a 0-dim one by
#: _foreach_copy_.
FILLS = {
    "1-D": ([(4,), (3,), (5,)], True),
    "any layout": ([(2, 2)] * 3, True),
    "2-D and 1-D": ([(2, 3), (4,), (3, 1)], True),
    "0-dim member": ([(), (3,), (2, 2)], True),
    "members not consecutive": ([(4,), (2, 2), (3,)], True),
    "None": ([(2, 2)] * 3, False),
    "sparse": ([(2, 2)] * 3, False),
    "dtype": ([(2, 2)] * 3, False),
    "shape": ([(2, 2)] * 3, False),
    "replaced storage": ([(2, 2)] * 3, False),
}


@pytest.fixture(scope="module")
def compiled_fill() -> Any:
    return script(_flat._fill_script)


@pytest.mark.parametrize("what", sorted(FILLS))
def test_the_torchscript_fill_does_what_the_native_op_does(compiled_fill, what: str):
    shapes, takes = FILLS[what]
    members = [0, 2, 4] if what == "members not consecutive" else None
    filled = {}
    for path, fill in [("script", _flat._fill_script), ("compiled", compiled_fill)] + (
            [("native", _flat._fill_native)] if _native.AVAILABLE else []):
        f = _buffer(shapes, members)
        grads = _grads_for(what, f)
        assert fill(f, grads) is takes, path
        filled[path] = f.grad.clone()
        if takes:
            expected = torch.cat([grads[i].reshape(-1) for i in f.members])
            assert torch.equal(f.grad, expected), path
        else:
            assert torch.equal(f.grad, torch.full_like(f.grad, -1.0)), f"{path} wrote to the buffer"
    for path, grad in filled.items():
        assert torch.equal(grad, filled["script"]), path


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_the_torchscript_fill_refuses_views_of_its_own_buffer_as_torch_does(compiled_fill,
                                                                          compiled: bool):
    """Gradients that are views of the buffer being filled, swapped between members (the
    native op copies them as given: ``test_views_of_the_flat_gradient_buffer_as_gradients``):
    torch's aliasing error, and nothing written."""
    f = _buffer([(4,), (4,), (4,)])
    f.grad.copy_(torch.arange(12.0))
    grads = [f.grad[8:12], f.grad[0:4], f.grad[4:8]]
    with pytest.raises((RuntimeError, torch.jit.Error), match="single memory location"):
        (compiled_fill if compiled else _flat._fill_script)(f, grads)
    assert torch.equal(f.grad, torch.arange(12.0))


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_the_torchscript_lookup_is_by_identity_as_the_native_op(compiled: bool):
    params = [torch.zeros(3, requires_grad=True) for _ in range(3)]
    grads = {params[0]: torch.ones(3), params[2]: torch.full((3,), 2.0)}
    twin = torch.zeros(3, requires_grad=True)  # equal values, another tensor
    lookup = compiled_steps._lookup_script
    if compiled:
        lookup = script(lookup)
    found = lookup(grads, params + [twin])
    assert found[0] is grads[params[0]] and found[2] is grads[params[2]]
    assert found[1] is None and found[3] is None
    if _native.AVAILABLE:
        native = compiled_steps._lookup_native(grads, params + [twin])
        assert all(g is n for g, n in zip(found, native))


FLAT_CASES = [c for c in ALL_CASES if not c.sparse and c.functional_cls.__name__ in FLAT_CLASSES]


@pytest.mark.parametrize("case", FLAT_CASES, ids=[c.id for c in FLAT_CASES])
def test_flat_steps_through_the_torchscript_fill_equal_the_native_ones(case: Case, monkeypatch):
    """An eager flat optimizer (which calls the fill by name at each step) stepped with the
    TorchScript fill, then with the op: the same parameters, bit for bit, through a step
    where a gradient is missing (the members then step one by one)."""
    # Built (so compiled, with the fill this process chose) before the fill is swapped:
    # TorchScript binds the name when it compiles.
    case.functional_cls(case.make_params(), **case.kwargs_copy())
    runs = {}
    for path in ("native", "script") if _native.AVAILABLE else ("script",):
        monkeypatch.setattr(_flat, "fill_flat_gradients", getattr(_flat, f"_fill_{path}"))
        params = case.make_params()
        opt = flatten_parameters(case.functional_cls(params, **case.kwargs_copy()))
        assert opt.groups.flats, "nothing was flattened"
        for step in range(4):
            grads = case.make_gradients(step)
            if step == 2:
                grads[1] = None
            opt.step(grads)
        runs[path] = [p.detach().clone() for p in params]
    for path, params in runs.items():
        for p, q in zip(params, runs["script"]):
            assert torch.equal(p, q), path


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


def test_each_checkout_builds_under_its_own_name(tmp_path) -> None:
    """Two checkouts on one machine get different build names (each keeps its build instead
    of rebuilding over the other's); one checkout always the same."""
    from functional import _native

    here = _native.build_name("distopt_kernels_avx2")
    assert here.startswith("distopt_kernels_avx2_") and here == _native.build_name("distopt_kernels_avx2")
    other = _native.build_name("distopt_kernels_avx2", str(tmp_path / "functional" / "csrc"))
    assert other != here
