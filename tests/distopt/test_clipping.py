"""clip_grad_norm_ / clip_grad_value_ over the context's gradients equal torch.nn.utils'.

Parameter 1 is left out of the loss, so it has no gradient (as ``.grad = None`` locally).
Clipping is followed by an SGD step with lr=1, so the parameters show that the context's
own gradients were scaled in place.
"""
import math

import pytest
import torch
import torch.distributed.autograd as dist_autograd
import torch.distributed.rpc as rpc

from distopt import DistributedOptimizer, clipping
from tests.distopt import harness, remote

USES = (0, 2, 3)


NORM_CASES = [
    (1.0, 2.0), (0.5, 1.0), (0.3, math.inf), (1e6, 2.0), (2.0, 3.0),
]
NORM_IDS = ["2-norm", "1-norm", "inf-norm", "below-max", "3-norm"]


@pytest.mark.parametrize("max_norm, norm_type", NORM_CASES, ids=NORM_IDS)
@pytest.mark.parametrize("foreach", [None, False], ids=["foreach", "per-tensor"])
def test_clip_grad_norm_matches_torch(world, max_norm, norm_type, foreach):
    rrefs, local = harness.make_params()
    opt = DistributedOptimizer(torch.optim.SGD, rrefs, lr=1.0)
    ref = torch.optim.SGD(local, lr=1.0)
    with dist_autograd.context() as ctx:
        harness.backward(0, rrefs, local, ctx, uses=USES)
        total = opt.clip_grad_norm_(ctx, max_norm, norm_type=norm_type, foreach=foreach)
        want = torch.nn.utils.clip_grad_norm_(local, max_norm, norm_type=norm_type)
        torch.testing.assert_close(total, want, rtol=0, atol=0)
        for i in USES:
            grad = rpc.rpc_sync(harness.OWNERS[i], remote.context_gradient, args=(rrefs[i], ctx))
            torch.testing.assert_close(grad, local[i].grad)
        assert rpc.rpc_sync("worker1", remote.context_gradient, args=(rrefs[1], ctx)) is None
        opt.step(ctx)
    ref.step()
    harness.assert_params_equal(rrefs, local)


def test_nonfinite_norm(world):
    rrefs = [rpc.remote(o, remote.make_ones, args=((4,),)) for o in ("worker1", "worker2")]
    local = [torch.ones(4, requires_grad=True) for _ in rrefs]
    opt = DistributedOptimizer(torch.optim.SGD, rrefs, lr=1.0)
    factors = (1.0, math.inf)
    with dist_autograd.context() as ctx:
        losses = [
            rpc.rpc_sync(r.owner(), remote.scaled_sum, args=(r, f))
            for r, f in zip(rrefs, factors)
        ]
        dist_autograd.backward(ctx, [torch.stack(losses).sum()])
        for p, f in zip(local, factors):
            (p * f).sum().backward()
        with pytest.raises(RuntimeError, match="non-finite"):
            opt.clip_grad_norm_(ctx, 1.0, error_if_nonfinite=True)
        with pytest.raises(RuntimeError, match="non-finite"):
            torch.nn.utils.clip_grad_norm_(local, 1.0, error_if_nonfinite=True)
        # Refused: the gradients are as they were.
        assert torch.equal(
            rpc.rpc_sync("worker1", remote.context_gradient, args=(rrefs[0], ctx)), torch.ones(4)
        )
        total = opt.clip_grad_norm_(ctx, 1.0)
        want = torch.nn.utils.clip_grad_norm_(local, 1.0)
        assert torch.isinf(total) and torch.equal(total, want)
        for r, p in zip(rrefs, local):
            grad = rpc.rpc_sync(r.owner(), remote.context_gradient, args=(r, ctx))
            torch.testing.assert_close(grad, p.grad, equal_nan=True)


@pytest.mark.parametrize("foreach", [None, False], ids=["foreach", "per-tensor"])
def test_clip_grad_value_matches_torch(world, foreach):
    rrefs, local = harness.make_params()
    opt = DistributedOptimizer(torch.optim.SGD, rrefs, lr=1.0)
    ref = torch.optim.SGD(local, lr=1.0)
    with dist_autograd.context() as ctx:
        harness.backward(0, rrefs, local, ctx, uses=USES)
        opt.clip_grad_value_(ctx, 0.2, foreach=foreach)
        torch.nn.utils.clip_grad_value_(local, 0.2)
        opt.step(ctx)
    ref.step()
    harness.assert_params_equal(rrefs, local)


def test_no_gradients_and_bad_context(world):
    rrefs, _ = harness.make_params()
    opt = DistributedOptimizer(torch.optim.SGD, rrefs, lr=1.0)
    with dist_autograd.context() as ctx:
        assert torch.equal(opt.clip_grad_norm_(ctx, 1.0), torch.tensor(0.0))
    with pytest.raises(ValueError, match="Invalid context_id: 123456789 "):
        opt.clip_grad_norm_(123456789, 1.0)
    with pytest.raises(ValueError, match="Invalid context_id: 123456789 "):
        opt.clip_grad_value_(123456789, 1.0)


def test_clip_grad_norm_takes_two_parallel_rounds(world, monkeypatch):
    rrefs, local = harness.make_params()
    opt = DistributedOptimizer(torch.optim.SGD, rrefs, lr=1.0)
    calls = []
    real = rpc.rpc_async
    with dist_autograd.context() as ctx:
        harness.backward(0, rrefs, local, ctx)
        monkeypatch.setattr(
            rpc, "rpc_async", lambda to, f, **k: calls.append(f) or real(to, f, **k)
        )
        opt.clip_grad_norm_(ctx, 1e-3)
    assert calls == [clipping.local_grad_norms] * 2 + [clipping.scale_local_grads] * 2
