"""Trainer-side helpers: parameters on two owners, local copies, and lockstep training.

Four parameters live on worker1 and worker2; the same steps run on copies with a local
torch.optim optimizer, so every test can assert the distributed result against torch's.
"""
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed.autograd as dist_autograd
import torch.distributed.rpc as rpc
from torch import Tensor

from tests.distopt import remote

SHAPES = ((5, 3), (4, 2), (6, 3), (3, 2))
OWNERS = ("worker1", "worker1", "worker2", "worker2")
# Two groups, each spanning both owners.
GROUPS = ((0, 2), (1, 3))


def make_params(seed: int = 0) -> Tuple[List[rpc.RRef], List[Tensor]]:
    """Remote parameters and local leaf copies with the same values."""
    rrefs = [
        rpc.remote(o, remote.make_param, args=(s, seed + i))
        for i, (o, s) in enumerate(zip(OWNERS, SHAPES))
    ]
    local = [r.to_here().detach().clone().requires_grad_(True) for r in rrefs]
    return rrefs, local


def grouped(items: Sequence[Any], options: Sequence[Dict[str, Any]]) -> List[Dict[str, Any]]:
    """``items`` split into GROUPS, each with its options (as torch.optim takes groups)."""
    return [{"params": [items[i] for i in idx], **opts} for idx, opts in zip(GROUPS, options)]


def flat_order(items: Sequence[Any]) -> List[Any]:
    """``items`` in the order the grouped optimizer numbers them."""
    return [items[i] for idx in GROUPS for i in idx]


def step_data(step: int, shape: Tuple[int, ...]) -> Tensor:
    gen = torch.Generator().manual_seed(1000 + step * 7 + shape[0])
    return torch.randn(shape, generator=gen)


def backward(
    step: int, rrefs: Sequence[rpc.RRef], local: Sequence[Tensor], ctx: int,
    uses: Sequence[int] = (0, 1, 2, 3),
) -> float:
    """The same loss, distributed (into ``ctx``) and local (into ``.grad``); the local loss."""
    data = [step_data(step, s) for s in SHAPES]
    terms = [
        rpc.rpc_sync(OWNERS[i], remote.remote_term, args=(rrefs[i], data[i], False)) for i in uses
    ]
    dist_autograd.backward(ctx, [torch.stack(terms).sum()])
    for p in local:
        p.grad = None
    loss = torch.stack([remote.term(local[i], data[i], False) for i in uses]).sum()
    loss.backward()
    return float(loss.detach())


def train(
    dist_opt: Any,
    ref_opt: torch.optim.Optimizer,
    rrefs: Sequence[rpc.RRef],
    local: Sequence[Tensor],
    steps: int,
    first_step: int = 0,
    before_step: Optional[Callable[[int, int], None]] = None,
) -> None:
    """``steps`` lockstep steps; ``before_step(step, ctx)`` runs after backward."""
    for step in range(first_step, first_step + steps):
        with dist_autograd.context() as ctx:
            backward(step, rrefs, local, ctx)
            if before_step is not None:
                before_step(step, ctx)
            dist_opt.step(ctx)
        ref_opt.step()


def values(rrefs: Sequence[rpc.RRef]) -> List[Tensor]:
    """The remote parameters' current values."""
    return [rpc.rpc_sync(r.owner(), remote.value, args=(r,)) for r in rrefs]


def assert_params_equal(rrefs: Sequence[rpc.RRef], local: Sequence[Tensor], what: str = "") -> None:
    for i, (got, want) in enumerate(zip(values(rrefs), local)):
        torch.testing.assert_close(
            got, want.detach(), msg=lambda m, i=i: f"{what} parameter {i} on {OWNERS[i]}: {m}"
        )


def assert_state_dicts_equal(got: Dict[str, Any], want: Dict[str, Any]) -> None:
    """Equal state (tensors to float precision) and equal param groups."""
    assert sorted(got["state"]) == sorted(want["state"])
    for i in want["state"]:
        assert sorted(got["state"][i]) == sorted(want["state"][i]), i
        for key, value in want["state"][i].items():
            torch.testing.assert_close(
                torch.as_tensor(got["state"][i][key]), torch.as_tensor(value),
                msg=lambda m, i=i, key=key: f"state[{i}][{key!r}]: {m}",
            )
    assert len(got["param_groups"]) == len(want["param_groups"])
    for g, (a, b) in enumerate(zip(got["param_groups"], want["param_groups"])):
        assert a.keys() == b.keys(), (g, sorted(a.keys() ^ b.keys()))
        for key in b:
            va, vb = a[key], b[key]
            if isinstance(va, Tensor) or isinstance(vb, Tensor):
                torch.testing.assert_close(torch.as_tensor(va), torch.as_tensor(vb))
            elif isinstance(va, (tuple, list)):
                assert tuple(va) == tuple(vb), (g, key, va, vb)
            else:
                assert va == vb, (g, key, va, vb)
