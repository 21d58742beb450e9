"""The rank side of tests/parallel/test_parity.py: every dense class trained by
DataParallelOptimizer, against references computed on rank 0 from the same seeds: the whole
batch in one process with torch.optim, and, for exactness, one process averaging the ranks'
gradients itself."""
from typing import Any, Dict, List

import torch

from distopt.parallel import DataParallelOptimizer
from functional import functional_optim_map, script_optimizer
from tests.parallel.cases import CASES
from tests.parallel.training import (SMALL_BUCKETS_MB, data, eager_class, flat_params, groups_of,
                                     loss_of, make_model)


def _averaged_grads(model, x, y, world_size):
    """Each rank's gradient computed apart, divided by W, summed in rank order."""
    total = None
    for xs, ys in zip(x.chunk(world_size), y.chunk(world_size)):
        grads = torch.autograd.grad(loss_of(model, xs, ys), list(model.parameters()))
        grads = [g / world_size for g in grads]
        total = grads if total is None else [a + b for a, b in zip(total, grads)]
    return total


def parity(rank: int, world_size: int, steps: int, modes: List[str]) -> Dict[str, Any]:
    """Train every case in every mode; rank 0 also trains the references.

    Modes: "compiled-overlap", "compiled", "eager-overlap", "eager".

    Returns:
        ``{f"{class}/{mode}": {"params": final parameters, "concat": max |difference| from
        torch.optim on the whole batch, "exact": whether equal bit for bit to one process
        averaging the ranks' gradients}}`` (references on rank 0 only).
    """
    x, y = data(4 * world_size)
    xs, ys = x.chunk(world_size)[rank], y.chunk(world_size)[rank]
    out: Dict[str, Any] = {}
    for cls, kwargs in CASES:
        biases = cls is not torch.optim.Muon
        for mode in modes:
            model = make_model(biases)
            run_cls = eager_class(cls) if mode.startswith("eager") else cls
            opt = DataParallelOptimizer(
                run_cls, groups_of(model, kwargs["lr"]), bucket_cap_mb=SMALL_BUCKETS_MB,
                overlap=mode.endswith("overlap"), **kwargs,
            )
            assert opt.is_functional_optim == (not mode.startswith("eager"))
            assert len(opt.bucket_layout()) > 2
            for _ in range(steps):
                loss_of(model, xs, ys).backward()
                opt.step()
                opt.zero_grad()
            opt.close()
            result = {"params": flat_params(model)}
            if rank == 0:
                result["concat"] = _concat_reference(cls, kwargs, biases, x, y, steps, model)
                result["exact"] = _exact_reference(
                    cls, kwargs, biases, x, y, steps, world_size, model, mode
                )
            out[f"{cls.__name__}/{mode}"] = result
    return out


def _concat_reference(cls, kwargs, biases, x, y, steps, trained) -> float:
    model = make_model(biases)
    opt = cls(groups_of(model, kwargs["lr"]), **kwargs)
    for _ in range(steps):
        loss_of(model, x, y).backward()
        opt.step()
        opt.zero_grad()
    return float((flat_params(model) - flat_params(trained)).abs().max())


def _exact_reference(cls, kwargs, biases, x, y, steps, world_size, trained, mode) -> bool:
    model = make_model(biases)
    groups = groups_of(model, kwargs["lr"])
    if mode.startswith("eager"):
        opt = cls(groups, **kwargs)
        for _ in range(steps):
            for p, g in zip(model.parameters(), _averaged_grads(model, x, y, world_size)):
                p.grad = g
            opt.step()
    else:
        functional_cls = functional_optim_map[cls]
        optims = [
            script_optimizer(functional_cls(g["params"], **{**kwargs, **{
                k: v for k, v in g.items() if k != "params"}}))
            for g in groups
        ]
        sizes = [len(g["params"]) for g in groups]
        for _ in range(steps):
            grads = _averaged_grads(model, x, y, world_size)
            optims[0].step(grads[:sizes[0]])
            optims[1].step(grads[sizes[0]:])
    return bool(torch.equal(flat_params(model), flat_params(trained)))
