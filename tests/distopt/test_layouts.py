"""DistributedOptimizer steps owners' parameters of any memory layout exactly, with gradients
from a real dist_autograd backward.

Owners hold contiguous, transposed, sliced (gaps), as_strided (gaps) and channels_last
parameters; the loss's backward kernels make gradients transposed, contiguous or expanded
(stride 0). What reaches the context (torch 2.13): a dense parameter's gradient laid out as
the parameter, a parameter with gaps a contiguous one, so the fused kernels' flat walk from
each pointer would pair the wrong elements and write into the gaps. Mismatches of every other
kind are covered, with gradients given directly, by tests/functional/test_layouts.py. The
reference is torch.optim's for-loop implementation on local copies in the same layouts.
"""
from typing import Any, Dict, List, Tuple

import pytest
import torch
import torch.distributed.autograd as dist_autograd
import torch.distributed.rpc as rpc

from distopt import DistributedOptimizer
from functional import functional_optim_map
from tests.distopt import remote
from tests.distopt.test_parity import parity_args
from tests.functional.layouts import outside_intact, place

# (shape, parameter layout, loss term kind, owner)
PARAMS: Tuple[Tuple[Tuple[int, ...], str, str, str], ...] = (
    ((5, 3), "contiguous", "mul_t", "worker1"),     # contiguous parameter, transposed gradient
    ((4, 2), "transpose", "matmul_t", "worker1"),   # transposed parameter, contiguous gradient
    ((6, 3), "slice", "sum", "worker2"),            # sliced parameter, from an expanded gradient
    ((3, 4), "as_strided", "mul", "worker2"),       # gaps
    ((2, 3, 2, 2), "channels_last", "sum", "worker1"),  # channels_last
    ((4, 3), "transpose", "mul", "worker2"),        # gradient laid out as its parameter
)
STEPS = 3

DENSE = [c for c in functional_optim_map if c is not torch.optim.SparseAdam]
# The default (fused) path of the four classes that have one, and every class's richest case.
ROWS: List[Tuple[type, Dict[str, Any]]] = [
    (torch.optim.SGD, {"lr": 0.1, "momentum": 0.9}),
    (torch.optim.Adam, {"lr": 0.01}),
    (torch.optim.AdamW, {"lr": 0.01}),
    (torch.optim.Adagrad, {"lr": 0.1}),
] + [(c, parity_args(c)[0]) for c in DENSE]


def _data(step: int, shape: Tuple[int, ...], kind: str) -> torch.Tensor:
    gen = torch.Generator().manual_seed(50 + 7 * step + shape[0])
    if kind == "matmul_t":
        return torch.randn((3, shape[1]), generator=gen)
    if kind == "mul_t":
        return torch.randn(shape[::-1], generator=gen)
    return torch.randn(shape, generator=gen)


@pytest.mark.parametrize(
    "cls, kwargs", ROWS, ids=[f"{c.__name__}({','.join(k)})" for c, k in ROWS]
)
def test_every_layout_steps_exactly_through_the_context(world, cls, kwargs):
    rows = [r for r in PARAMS if cls is not torch.optim.Muon or len(r[0]) == 2]
    rrefs = [
        rpc.remote(owner, remote.make_laid_out_param, args=(shape, i, layout))
        for i, (shape, layout, _, owner) in enumerate(rows)
    ]
    local = [
        place(r.to_here().detach().contiguous(), layout)[0].requires_grad_(True)
        for r, (_, layout, _, _) in zip(rrefs, rows)
    ]
    ref_kwargs = {k: v for k, v in kwargs.items() if k not in ("fused", "foreach")}
    dist_opt = DistributedOptimizer(cls, rrefs, **kwargs)
    assert dist_opt.is_functional_optim
    ref = cls(local, **ref_kwargs)
    for step in range(STEPS):
        data = [_data(step, shape, kind) for shape, _, kind, _ in rows]
        with dist_autograd.context() as ctx:
            terms = [
                rpc.rpc_sync(owner, remote.remote_layout_term, args=(r, d, kind))
                for r, d, (_, _, kind, owner) in zip(rrefs, data, rows)
            ]
            dist_autograd.backward(ctx, [torch.stack(terms).sum()])
            if step == 0:
                # The gaps' parameters get contiguous gradients, laid out unlike themselves:
                # the memory a fused kernel walks from each pointer differs.
                reports = [rpc.rpc_sync(r.owner(), remote.layout_report, args=(r, ctx))
                           for r in rrefs]
                gaps = [k for k, row in enumerate(rows) if row[1] in ("slice", "as_strided")]
                assert all(reports[k][0] != reports[k][1] for k in gaps), reports
            dist_opt.step(ctx)
        for p in local:
            p.grad = None
        loss = torch.stack([
            remote.layout_term(p, d, kind) for p, d, (_, _, kind, _) in zip(local, data, rows)
        ]).sum()
        loss.backward()
        ref.step()
        for i, (r, p) in enumerate(zip(rrefs, local)):
            got = rpc.rpc_sync(r.owner(), remote.value, args=(r,))
            torch.testing.assert_close(
                got, p.detach(), rtol=1e-5, atol=1e-6,
                msg=lambda m, i=i: f"{rows[i][1]} parameter {i} after step {step}: {m}",
            )
    intact = [rpc.rpc_sync(r.owner(), remote.storage_intact, args=(r,)) for r in rrefs]
    assert all(intact), f"a step wrote outside a parameter: {intact}"
    assert all(outside_intact(p) for p in local)
