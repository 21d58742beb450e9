"""The fused CPU kernels (functional/csrc/elementwise_ops.cpp) against torch.optim itself.

Every combination of the options that change a kernel's arithmetic (weight decay, decoupled
or not, maximize, momentum, centered, averaging, factored or not), in float32, float64,
float16 and bfloat16, per parameter, in odd memory layouts and on flat buffers, and the
foreach path that runs without them (``DISTOPT_NATIVE=0``).

The reference is the torch.optim kernel whose arithmetic the fused kernel reproduces: its
foreach path for Adadelta, Adamax, RMSprop, Rprop, NAdam and RAdam, its per-tensor loop for
ASGD and Adafactor. Every dtype must match it bit for bit (the kernels round where torch
stores, and take torch's own square root: MKL's for float32 / float64 where torch has MKL,
which is not always correctly rounded), except Adafactor, whose norms are reductions in
another order: within a few units in the last place.
"""
import itertools
import math
import os
import subprocess
import sys
from typing import Any, Dict, List, Optional, Tuple

import pytest
import torch

from functional import _native, flatten_parameters, functional_optim_map, script_optimizer
from functional._kernels import INEXACT_KERNELS

from .layouts import gradient_in, in_own_layout, outside_intact, place

O = torch.optim
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
kernels_only = pytest.mark.skipif(
    not _native.KERNELS,
    reason="no fused kernels in this process (no C++ compiler or ninja, or DISTOPT_NATIVE=0)",
)
pytestmark = kernels_only

#: One tensor with a vector body and a scalar tail, one of a whole vector pair, one
#: 0-dim, one 3-D (Adafactor factors it over its last two dimensions).
SHAPES: Tuple[Tuple[int, ...], ...] = ((37,), (4, 16), (), (2, 3, 5))
STEPS = 8  # RAdam's rectified step starts at step 6 with its default betas
DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16)


def _grid(**choices: Any) -> List[Dict[str, Any]]:
    """Every combination of ``choices`` (name -> values)."""
    names = list(choices)
    return [dict(zip(names, values)) for values in itertools.product(*choices.values())]


def _decays() -> List[Dict[str, Any]]:
    """No weight decay, L2 decay and decoupled decay."""
    return [{"weight_decay": 0.0}, {"weight_decay": 0.1},
            {"weight_decay": 0.1, "decoupled_weight_decay": True}]


ROWS: List[Tuple[type, Dict[str, Any]]] = (
    [(O.Adadelta, dict(lr=0.5, rho=0.8, eps=1e-2, **k)) for k in _grid(weight_decay=[0.0, 0.1], maximize=[False, True])]
    + [(O.Adamax, dict(lr=0.01, betas=(0.8, 0.99), **k)) for k in _grid(weight_decay=[0.0, 0.1], maximize=[False, True])]
    + [(O.RMSprop, dict(lr=0.01, eps=1e-3, **k)) for k in _grid(
        momentum=[0.0, 0.9], centered=[False, True], weight_decay=[0.0, 0.1], maximize=[False, True])]
    + [(O.Rprop, dict(lr=0.01, **k)) for k in _grid(
        etas=[(0.5, 1.2), (0.3, 1.5)], step_sizes=[(1e-6, 50.0), (1e-3, 0.02)], maximize=[False, True])]
    # eps=1e-3: float16 has no 1e-8 (0 / 0 would make NaN, in torch.optim too)
    + [(O.NAdam, dict(lr=0.01, eps=1e-3, momentum_decay=0.1, **d, maximize=m))
       for d in _decays() for m in (False, True)]
    + [(O.RAdam, dict(lr=0.01, eps=1e-3, **d, maximize=m)) for d in _decays() for m in (False, True)]
    + [(O.RAdam, {"lr": 0.01, "eps": 1e-3, "betas": (0.9, 0.5)})]  # never rectified
    + [(O.ASGD, dict(lr=0.05, lambd=0.1, alpha=1.5, **k)) for k in _grid(
        t0=[1e6, 2.0], weight_decay=[0.0, 0.1], maximize=[False, True])]
    + [(O.Adafactor, dict(lr=0.1, **k)) for k in _grid(weight_decay=[0.0, 0.1], maximize=[False, True])]
    + [(O.Adafactor, {"lr": 0.1, "eps": (1e-4, 1e-2), "d": 1.5, "beta2_decay": -0.5})]
)
#: The torch.optim kernel each class's fused kernel reproduces.
REFERENCE = {"ASGD": {"foreach": False}, "Adafactor": {"foreach": False}}
#: Classes whose kernel takes a square root (torch's: MKL's where torch has MKL).
SQRT = {"Adadelta", "RMSprop", "NAdam", "RAdam"}
#: Adafactor, in every dtype (its norms and means are reductions in another order): up to 4
#: measured.
ADAFACTOR_ULPS = 8.0


def allowed_ulps(name: str, dtype: torch.dtype) -> float:
    """How far the fused kernel of class ``name`` may be from its torch.optim reference."""
    return ADAFACTOR_ULPS if name == "Adafactor" else 0.0


def _row_id(row: Tuple[type, Dict[str, Any]]) -> str:
    cls, kwargs = row
    return cls.__name__ + "(" + ",".join(f"{k}={v}" for k, v in kwargs.items()) + ")"


def _ulp(x: torch.Tensor, dtype: torch.dtype) -> float:
    """One unit in the last place of ``dtype`` at the magnitude of ``x``'s largest element."""
    big = max(x.double().abs().nan_to_num(0.0).max().item(), torch.finfo(dtype).tiny)
    return 2.0 ** math.floor(math.log2(big)) * torch.finfo(dtype).eps


def ulps_apart(ours: torch.Tensor, theirs: torch.Tensor) -> float:
    """max |ours - theirs| in units in the last place at ``theirs``' largest magnitude."""
    if ours.numel() == 0:
        return 0.0
    both_nan = torch.isnan(ours) & torch.isnan(theirs)
    diff = (ours.double() - theirs.double()).abs().masked_fill(both_nan, 0.0)
    return diff.max().item() / _ulp(theirs, theirs.dtype)


def _data(shapes, dtype: torch.dtype, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    init = [torch.randn(s, generator=gen).to(dtype) for s in shapes]
    grads = [[torch.randn(s, generator=gen).to(dtype) for s in shapes] for _ in range(STEPS)]
    return init, grads


def _ours(cls: type, params: List[torch.Tensor], **kwargs: Any) -> Any:
    """The functional optimizer on its kernel: the classes of ``INEXACT_KERNELS`` take it
    only with ``foreach=False`` (their default is the foreach path)."""
    if cls.__name__ in INEXACT_KERNELS and "foreach" not in kwargs:
        kwargs = {**kwargs, "foreach": False}
    return functional_optim_map[cls](params, **kwargs)


def _reference(cls: type, kwargs: Dict[str, Any], params: List[torch.Tensor]) -> torch.optim.Optimizer:
    return cls(params, **kwargs, **REFERENCE.get(cls.__name__, {"foreach": True}))


def _assert_matches(name: str, dtype: torch.dtype, ours: List[torch.Tensor],
                    theirs: List[torch.Tensor], what: str, ulps: Optional[float] = None) -> None:
    """Bit for bit, or within ``ulps`` (default: ``allowed_ulps``)."""
    if ulps is None:
        ulps = allowed_ulps(name, dtype)
    for i, (a, b) in enumerate(zip(ours, theirs)):
        b = b.detach()
        assert a.dtype == b.dtype and a.shape == b.shape, f"{what}[{i}]"
        if ulps == 0.0:
            assert torch.equal(a, b), f"{what}[{i}]: {ulps_apart(a, b):.1f} ulps from torch.optim"
        else:
            assert ulps_apart(a, b) <= ulps, f"{what}[{i}]: {ulps_apart(a, b):.1f} ulps from torch.optim"


def _state_tensors(state: Dict[str, Any]) -> List[str]:
    """The keys of a torch.optim state entry that hold tensors shaped like a parameter."""
    return [k for k, v in state.items() if isinstance(v, torch.Tensor) and v.dim() > 0]


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).replace("torch.", ""))
@pytest.mark.parametrize("row", ROWS, ids=[_row_id(r) for r in ROWS])
def test_kernel_matches_torch_optim(row, dtype: torch.dtype) -> None:
    """Parameters and state after ``STEPS`` steps, on the kernel (checked to be chosen)."""
    cls, kwargs = row
    init, grads = _data(SHAPES, dtype)
    ref = [p.clone().requires_grad_() for p in init]
    ref_opt = _reference(cls, kwargs, ref)
    params = [p.clone() for p in init]
    opt = _ours(cls, params, **kwargs)
    assert opt.native, "the fused kernel was not chosen"
    for step in grads:
        for p, g in zip(ref, step):
            p.grad = g.clone()
        ref_opt.step()
        opt.step([g.clone() for g in step])
    assert all(not torch.equal(p, p0) for p, p0 in zip(params, init)), "a parameter did not move"
    _assert_matches(cls.__name__, dtype, params, ref, "params")
    for i, p in enumerate(ref):
        theirs = ref_opt.state[p]
        for key in _state_tensors(theirs):
            _assert_matches(cls.__name__, dtype, [opt.state[i][key]], [theirs[key]],
                            f"state[{i}][{key!r}]")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["float32", "float64"])
@pytest.mark.parametrize("row", [r for r in ROWS if r[0].__name__ in SQRT and r[1].get("maximize")],
                         ids=lambda r: _row_id(r))
def test_square_roots_are_torchs_across_blocks_and_threads(row, dtype: torch.dtype) -> None:
    """The kernels that take a square root take torch.sqrt's (MKL's where torch has MKL: about
    1 in 6 float32 roots differ from the correctly rounded one) on blocks of 32 KiB (8,192 float32, 4,096 float64) per
    thread range: sizes below, at and above a block, and one split over threads. Bit for bit
    with torch.optim."""
    cls, kwargs = row
    torch.manual_seed(0)
    shapes = [(4095,), (4096,), (8192,), (8193,), (3, 70001)]
    init = [torch.rand(s, dtype=dtype) for s in shapes]
    ref = [p.clone().requires_grad_() for p in init]
    ref_opt = _reference(cls, kwargs, ref)
    params = [p.clone() for p in init]
    opt = _ours(cls, params, **kwargs)
    assert opt.native
    for _ in range(STEPS):
        grads = [torch.randn(s, dtype=dtype) for s in shapes]
        for p, g in zip(ref, grads):
            p.grad = g.clone()
        ref_opt.step()
        opt.step(grads)
    _assert_matches(cls.__name__, dtype, params, ref, "params", ulps=0.0)
    for i, p in enumerate(ref):
        for key in _state_tensors(ref_opt.state[p]):
            _assert_matches(cls.__name__, dtype, [opt.state[i][key]], [ref_opt.state[p][key]],
                            f"state[{i}][{key!r}]", ulps=0.0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["float32", "float64"])
@pytest.mark.parametrize("cls,kwargs", [
    (O.RMSprop, {"lr": 0.01, "centered": True, "momentum": 0.5}), (O.Adadelta, {"lr": 1.0}),
    (O.NAdam, {"lr": 0.01}), (O.RAdam, {"lr": 0.01})], ids=lambda v: getattr(v, "__name__", ""))
def test_square_roots_of_hostile_values_are_torchs(cls, kwargs, dtype: torch.dtype) -> None:
    """NaN and infinite gradients, subnormal parameters and gradients, gradients from 1e-30 to
    1e30 (centered RMSprop's variance estimate goes negative): the same NaNs, infinities and
    bits as torch.optim."""
    torch.manual_seed(1)
    n, tiny = 5000, torch.finfo(dtype).tiny
    init = torch.randn(n, dtype=dtype)
    init[:10] = tiny / 8
    ref = init.clone().requires_grad_()
    ref_opt = _reference(cls, kwargs, [ref])
    mine = init.clone()
    opt = _ours(cls, [mine], **kwargs)
    assert opt.native
    for step in range(8):
        g = torch.randn(n, dtype=dtype) * 10.0 ** torch.randint(-30, 30, (n,)).to(dtype)
        g[7 * step:7 * step + 3] = float("nan")
        g[100 + step], g[200 + step] = float("inf"), -float("inf")
        g[300:310] = tiny / 4
        ref.grad = g.clone()
        ref_opt.step()
        opt.step([g.clone()])
    pairs = [(mine, ref.detach())] + [(opt.state[0][k], v) for k, v in ref_opt.state[ref].items()
                                      if v.dim() > 0]
    for ours, theirs in pairs:
        assert torch.equal(ours.isnan(), theirs.isnan())
        assert torch.equal(ours.nan_to_num(0.5), theirs.nan_to_num(0.5))


#: One row per class (options on), for the layout, flat and compiled tests.
PER_CLASS = [
    (O.Adadelta, {"lr": 0.5, "eps": 1e-2, "weight_decay": 0.1, "maximize": True}),
    (O.Adamax, {"lr": 0.01, "weight_decay": 0.1}),
    (O.RMSprop, {"lr": 0.01, "momentum": 0.9, "centered": True, "weight_decay": 0.1}),
    (O.Rprop, {"lr": 0.01, "maximize": True}),
    (O.NAdam, {"lr": 0.01, "eps": 1e-3, "weight_decay": 0.1, "decoupled_weight_decay": True}),
    (O.RAdam, {"lr": 0.01, "eps": 1e-3, "weight_decay": 0.1, "maximize": True}),
    (O.ASGD, {"lr": 0.05, "lambd": 0.1, "t0": 2.0, "weight_decay": 0.1}),
    (O.Adafactor, {"lr": 0.1, "weight_decay": 0.1}),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
@pytest.mark.parametrize("shape", [(9,), (3, 3)], ids=["variance", "factored"])
@pytest.mark.parametrize("case", ["parameter", "update"])
def test_adafactor_norms_overflow_as_torchs(case: str, shape, dtype: torch.dtype) -> None:
    """Adafactor's kernel adds its squares in double; torch adds them in float, where a sum
    of squares above 3.4e38 is inf although the norm itself would fit. The kernel's norms
    overflow where torch's do: the parameter's (its scale becomes inf: torch.optim's -inf
    parameters), and the update's (its scale becomes 0: the parameter does not move)."""
    if case == "parameter":  # 9 x (1e20)^2 = 9e40
        init, grads, kwargs = torch.full(shape, 1e20), [torch.ones(shape)], {"lr": 0.1}
    else:  # a variance of 0 clamped at eps1^2 = 1e-38: the update's squares are about 1e38
        init, grads = torch.ones(shape), [torch.zeros(shape), torch.ones(shape)]
        kwargs = {"lr": 0.1, "eps": (1e-19, 1e-3), "beta2_decay": -1000.0}
    init = init.to(dtype)
    ref = init.clone().requires_grad_()
    ref_opt = torch.optim.Adafactor([ref], foreach=False, **kwargs)
    params = [init.clone()]
    opt = _ours(torch.optim.Adafactor, params, **kwargs)
    assert opt.native
    for g in grads:
        ref.grad = g.to(dtype)
        ref_opt.step()
        opt.step([g.to(dtype)])
    expected = {"parameter": float("-inf"), "update": 1.0}[case]
    assert ref.detach().eq(expected).all(), "torch.optim's own result moved: the case no longer overflows"
    assert torch.equal(params[0], ref.detach())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
@pytest.mark.parametrize("row", PER_CLASS, ids=[_row_id(r) for r in PER_CLASS])
def test_any_memory_layout(row, dtype: torch.dtype) -> None:
    """Transposed, sliced (gaps between elements), as_strided and channels_last parameters
    with gradients in their own, contiguous, permuted or expanded (stride 0) layout: stepped
    where they lie or through contiguous copies, never written outside. The reference steps
    the same values laid out as its parameters (its for-loop takes any layout); reduced
    dtypes within one unit (the kernel rounds a copy's tail where torch rounds its
    strided loop's)."""
    cls, kwargs = row
    layouts = ["transpose", "slice", "as_strided", "channels_last", "contiguous"]
    shapes = [(6, 5), (9,), (3, 4, 2), (2, 3, 4, 4), (33,)]
    gen = torch.Generator().manual_seed(0)
    values = [torch.randn(s, generator=gen).to(dtype) for s in shapes]
    mine = [place(v, layout)[0] for v, layout in zip(values, layouts)]
    ref = [place(v, layout)[0].requires_grad_() for v, layout in zip(values, layouts)]
    ref_opt = _reference(cls, kwargs, ref)
    opt = _ours(cls, mine, **kwargs)
    assert opt.native
    grad_layouts = ["own", "contiguous", "permuted", "expanded"]
    for step in range(4):
        ours, theirs = [], []
        for i, p in enumerate(mine):
            g = gradient_in(torch.randn(shapes[i], generator=gen).to(dtype), p,
                            grad_layouts[(i + step) % 4])
            ours.append(g)
            theirs.append(in_own_layout(g, p))
        for p, g in zip(ref, theirs):
            p.grad = g
        ref_opt.step()
        opt.step(ours)
    ulps = max(1.0, allowed_ulps(cls.__name__, dtype)) if dtype == torch.bfloat16 else None
    _assert_matches(cls.__name__, dtype, mine, ref, "params", ulps)
    assert all(outside_intact(p) for p in mine), "a step wrote outside a parameter"
    for i, p in enumerate(ref):
        for key in _state_tensors(ref_opt.state[p]):
            assert opt.state[i][key].stride() == ref_opt.state[p][key].stride(), (i, key)


FLAT_ROWS = [r for r in PER_CLASS if r[0] is not O.Adafactor]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["float32", "float16"])
@pytest.mark.parametrize("row", FLAT_ROWS, ids=[_row_id(r) for r in FLAT_ROWS])
def test_flat_buffers(row, dtype: torch.dtype) -> None:
    """One kernel call over a flat buffer equals torch.optim per parameter (float16: within
    one unit, elements moving between a vector body and a scalar tail)."""
    cls, kwargs = row
    init, grads = _data(SHAPES, dtype)
    ref = [p.clone().requires_grad_() for p in init]
    ref_opt = _reference(cls, kwargs, ref)
    params = [p.clone() for p in init]
    opt = flatten_parameters(_ours(cls, params, **kwargs))
    flat = opt.groups.flats[0]
    assert opt.native and flat.members == list(range(len(SHAPES)))
    for step in grads:
        for p, g in zip(ref, step):
            p.grad = g.clone()
        ref_opt.step()
        opt.step([g.clone() for g in step])
        assert torch.equal(flat.grad, torch.cat([g.reshape(-1) for g in step])), "not stepped flat"
    _assert_matches(cls.__name__, dtype, params, ref, "params", 1.0 if dtype == torch.float16 else None)


@pytest.mark.parametrize("row", PER_CLASS, ids=[_row_id(r) for r in PER_CLASS])
def test_compiled_step_runs_the_kernel(row) -> None:
    """The TorchScript step calls the op (without the GIL) and equals the eager kernel bit
    for bit; ``foreach=True`` takes the foreach path instead, within the same allowance."""
    cls, kwargs = row
    init, grads = _data(SHAPES, torch.float32)
    eager = [p.clone() for p in init]
    compiled = [p.clone() for p in init]
    foreach = [p.clone() for p in init]
    eager_opt = _ours(cls, eager, **kwargs)
    compiled_opt = script_optimizer(_ours(cls, compiled, **kwargs))
    foreach_opt = functional_optim_map[cls](foreach, **kwargs, foreach=True)
    assert not foreach_opt.native
    op = f"distopt_kernels::{cls.__name__.lower()}_"
    for k, step in enumerate(grads):
        eager_opt.step([g.clone() for g in step])
        foreach_opt.step([g.clone() for g in step])
        if k == 0:
            with torch.profiler.profile() as prof:
                compiled_opt.step([g.clone() for g in step])
            names = {e.name for e in prof.events()}
            assert op in names and not any(n.startswith("aten::_foreach") for n in names), names
        else:
            compiled_opt.step([g.clone() for g in step])
    for a, b in zip(compiled, eager):
        assert torch.equal(a, b)
    _assert_matches(cls.__name__, torch.float32, eager, foreach, "kernel against foreach",
                    max(1.0, allowed_ulps(cls.__name__, torch.float32)))


def test_kernels_are_chosen_like_torchs_fused_ones() -> None:
    """Default: the kernel (for INEXACT_KERNELS' classes only with foreach=False);
    foreach=True, capturable=True, or a GPU parameter: foreach."""
    p = [torch.zeros(3)]
    for cls in (O.Adadelta, O.Adamax, O.RMSprop, O.Rprop, O.NAdam, O.RAdam, O.ASGD, O.Adafactor):
        f = functional_optim_map[cls]
        assert f(p).native == (cls.__name__ not in INEXACT_KERNELS) and f(p, foreach=False).native
        assert not f(p, foreach=True).native
        if cls is not O.Adafactor:
            assert not f(p, capturable=True).native


def test_the_kernels_refuse_operands_that_do_not_match() -> None:
    """Wrong lengths, shapes or state dtypes raise before anything is written."""
    p = torch.zeros(4)
    with pytest.raises(RuntimeError, match="1 params but 2 grads"):
        torch.ops.distopt_kernels.adamax_([p], [p, p], [torch.zeros(())], [p], [p], 0.1, 0.9, 0.99, 1e-8, 0.0, False)
    with pytest.raises(RuntimeError, match=r"exp_infs\[0\] of shape \[3\]"):
        torch.ops.distopt_kernels.adamax_([p], [p], [torch.zeros(())], [p], [torch.zeros(3)], 0.1, 0.9, 0.99, 1e-8, 0.0, False)
    with pytest.raises(RuntimeError, match=r"steps\[0\] must be a one-element floating-point CPU tensor"):
        torch.ops.distopt_kernels.adamax_([p], [p], [torch.zeros(2)], [p], [p], 0.1, 0.9, 0.99, 1e-8, 0.0, False)
    assert torch.equal(p, torch.zeros(4))


#: What ``_steps_without_kernels`` runs: every class with options on, float32 and bfloat16.
FALLBACK_DTYPES = (torch.float32, torch.bfloat16)


def _run_classes() -> Dict[str, torch.Tensor]:
    """Each ``PER_CLASS`` row's parameters after ``STEPS`` compiled steps, concatenated."""
    out: Dict[str, torch.Tensor] = {}
    for cls, kwargs in PER_CLASS:
        for dtype in FALLBACK_DTYPES:
            init, grads = _data(SHAPES, dtype)
            params = [p.clone() for p in init]
            opt = script_optimizer(_ours(cls, params, **kwargs))
            for step in grads:
                opt.step([g.clone() for g in step])
            out[f"{cls.__name__}-{dtype}"] = torch.cat([p.reshape(-1) for p in params])
    return out


def _steps_without_kernels(path: str) -> None:
    """Run in a process with DISTOPT_NATIVE=0 by ``test_without_the_kernels_...``."""
    assert not _native.KERNELS
    for cls, kwargs in PER_CLASS:
        assert not functional_optim_map[cls]([torch.zeros(2)], **kwargs).native
    torch.save(_run_classes(), path)


@kernels_only
def test_without_the_kernels_the_foreach_path_gives_the_same_results(tmp_path) -> None:
    """DISTOPT_NATIVE=0 (as without a compiler): nothing built, the TorchScript steps compile
    without the ops and run the foreach path; float32 within the sqrt allowance, bfloat16 bit
    for bit except where torch.optim's own kernels round differently (ASGD: the foreach path
    follows torch's foreach ASGD, the kernel its default per-tensor loop; Adafactor)."""
    path = str(tmp_path / "foreach.pt")
    code = ("from tests.functional.test_native_kernels import _steps_without_kernels; "
            f"_steps_without_kernels({path!r})")
    env = dict(os.environ, DISTOPT_NATIVE="0")
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env,
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    theirs = torch.load(path)
    ours = _run_classes()
    assert set(ours) == set(theirs)
    for key, a in ours.items():
        name, dtype = key.split("-")
        b = theirs[key]
        if dtype == "torch.bfloat16" and name not in ("ASGD", "Adafactor"):
            assert torch.equal(a, b), f"{key}: {ulps_apart(a, b):.1f} ulps"
        else:
            allowed = 9.0 if dtype == "torch.bfloat16" else max(1.0, allowed_ulps(name, torch.float32))
            assert ulps_apart(a, b) <= allowed, f"{key}: {ulps_apart(a, b):.1f} ulps"
