"""How far the fused CPU kernels (functional/csrc/elementwise_ops.cpp) are from torch.optim and
from the foreach path they replace, in units in the last place.

For every algorithm with a fused kernel and every combination of the options that change its
arithmetic (weight decay, decoupled or not, maximize, momentum, centered, averaging), steps a
few parameters (one of 4,133 elements, a 64 x 129 matrix, a 0-dim one) ``--steps`` times in
each dtype with the default step (the kernel), ``foreach=True`` (the foreach path) and the
torch.optim kernel the fused one reproduces (torch's foreach path; its per-tensor loop for
ASGD and Adafactor), and prints the largest difference over the combinations:

- "ulps": max |a - b| over a tensor, in units in the last place of the dtype at that
  tensor's largest magnitude (0 means bit for bit);
- "differ": the share of elements that are not bit for bit equal.

Run: ``python benchmarks/kernel_ulps.py [--steps N] [--markdown]``; the table goes to stdout.
"""
import argparse
import itertools
import math
import os
import sys
from typing import Any, Dict, List, Tuple

_HERE = os.path.dirname(os.path.abspath(__file__))
_ROOT = os.path.dirname(_HERE)
sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != _HERE]
if _ROOT not in [os.path.abspath(p or os.curdir) for p in sys.path]:
    sys.path.insert(0, _ROOT)

import torch  # noqa: E402

from benchmarks._machine import machine  # noqa: E402
from functional import _native, functional_optim_map  # noqa: E402

O = torch.optim
SHAPES = ((4133,), (64, 129), ())
DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16)


def _grid(**choices: Any) -> List[Dict[str, Any]]:
    names = list(choices)
    return [dict(zip(names, values)) for values in itertools.product(*choices.values())]


_DECAYS = [{"weight_decay": 0.0}, {"weight_decay": 0.1},
           {"weight_decay": 0.1, "decoupled_weight_decay": True}]
#: algorithm -> every combination of its arithmetic-changing options (eps large enough for
#: float16, whose smallest normal number is 6e-5).
TABLE: Dict[type, List[Dict[str, Any]]] = {
    O.Adadelta: [dict(lr=0.5, eps=1e-2, **k) for k in _grid(weight_decay=[0.0, 0.1], maximize=[False, True])],
    O.Adamax: [dict(lr=0.01, **k) for k in _grid(weight_decay=[0.0, 0.1], maximize=[False, True])],
    O.RMSprop: [dict(lr=0.01, eps=1e-3, **k) for k in _grid(
        momentum=[0.0, 0.9], centered=[False, True], weight_decay=[0.0, 0.1], maximize=[False, True])],
    O.Rprop: [dict(lr=0.01, **k) for k in _grid(step_sizes=[(1e-6, 50.0), (1e-3, 0.02)], maximize=[False, True])],
    O.NAdam: [dict(lr=0.01, eps=1e-3, **d, maximize=m) for d in _DECAYS for m in (False, True)],
    O.RAdam: [dict(lr=0.01, eps=1e-3, **d, maximize=m) for d in _DECAYS for m in (False, True)],
    O.ASGD: [dict(lr=0.05, lambd=0.1, **k) for k in _grid(
        t0=[1e6, 2.0], weight_decay=[0.0, 0.1], maximize=[False, True])],
    O.Adafactor: [dict(lr=0.1, **k) for k in _grid(weight_decay=[0.0, 0.1], maximize=[False, True])],
}
#: The torch.optim kernel each fused kernel reproduces (foreach unless named here).
REFERENCE = {O.ASGD: {"foreach": False}, O.Adafactor: {"foreach": False}}


def ulps(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a - b| in units in the last place at b's largest magnitude (NaN where both are)."""
    if a.numel() == 0:
        return 0.0
    diff = (a.double() - b.double()).abs().masked_fill(torch.isnan(a) & torch.isnan(b), 0.0)
    big = max(b.double().abs().nan_to_num(0.0).max().item(), torch.finfo(b.dtype).tiny)
    return diff.max().item() / (2.0 ** math.floor(math.log2(big)) * torch.finfo(b.dtype).eps)


def _differ(a: torch.Tensor, b: torch.Tensor) -> Tuple[int, int]:
    same = (a == b) | (torch.isnan(a) & torch.isnan(b))
    return int((~same).sum()), a.numel()


def measure(cls: type, kwargs: Dict[str, Any], dtype: torch.dtype, steps: int):
    """(ulps, differing, elements) of the kernel against torch.optim and against the foreach
    path, over the parameters and the parameter-shaped state."""
    gen = torch.Generator().manual_seed(0)
    init = [torch.randn(s, generator=gen).to(dtype) for s in SHAPES]
    ref = [p.clone().requires_grad_() for p in init]
    ref_opt = cls(ref, **kwargs, **REFERENCE.get(cls, {"foreach": True}))
    ours = [p.clone() for p in init]
    opt = functional_optim_map[cls](ours, **kwargs, foreach=False)
    foreach = [p.clone() for p in init]
    foreach_opt = functional_optim_map[cls](foreach, **kwargs, foreach=True)
    if not opt.native:
        raise SystemExit("the fused kernels are not built here (DISTOPT_NATIVE=0 or no compiler)")
    for _ in range(steps):
        grads = [torch.randn(s, generator=gen).to(dtype) for s in SHAPES]
        for p, g in zip(ref, grads):
            p.grad = g.clone()
        ref_opt.step()
        opt.step([g.clone() for g in grads])
        foreach_opt.step([g.clone() for g in grads])
    pairs_torch, pairs_foreach = [], []
    for i, (a, r, f) in enumerate(zip(ours, ref, foreach)):
        pairs_torch.append((a, r.detach()))
        pairs_foreach.append((a, f))
        for key, value in ref_opt.state[r].items():
            if isinstance(value, torch.Tensor) and value.dim() > 0:
                pairs_torch.append((opt.state[i][key], value))
                pairs_foreach.append((opt.state[i][key], foreach_opt.state[i][key]))
    out = []
    for pairs in (pairs_torch, pairs_foreach):
        worst = max(ulps(a, b) for a, b in pairs)
        counts = [_differ(a, b) for a, b in pairs]
        out.append((worst, sum(c[0] for c in counts), sum(c[1] for c in counts)))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--markdown", action="store_true")
    args = parser.parse_args()
    print(f"machine: {machine('cpu')}; torch {torch.__version__}; kernels built for "
          f"{_native.kernel_capability()}; {args.steps} steps, every option combination")
    if args.markdown:
        print()
    names = [str(d).replace("torch.", "") for d in DTYPES]
    print("| algorithm | against | " + " | ".join(names) + " |")
    print("|---|---|" + "---:|" * len(DTYPES))
    for cls, rows in TABLE.items():
        results = {dtype: [measure(cls, kw, dtype, args.steps) for kw in rows] for dtype in DTYPES}
        for k, against in enumerate(("torch.optim", "foreach path")):
            cells = []
            for dtype in DTYPES:
                worst = max(r[k][0] for r in results[dtype])
                differ = sum(r[k][1] for r in results[dtype])
                total = sum(r[k][2] for r in results[dtype])
                cells.append(f"{worst:.3g} ulps, {100.0 * differ / total:.2g}% differ")
            print(f"| {cls.__name__} | {against} | " + " | ".join(cells) + " |", flush=True)


if __name__ == "__main__":
    main()
