"""``DistributedOptimizer(AdamW8bit / AdamW4bit, rrefs)``: the owners step the compiled twins
(``functional.blockwise_adam``) on real RPC with dist_autograd contexts, equal bit for bit to
the class stepping local copies, quantised (>= 4096 elements) and float32 parameters alike;
its state_dict holds the codes and scales and loads back."""
import pytest
import torch
import torch.distributed.autograd as dist_autograd
import torch.distributed.rpc as rpc

from distopt import DistributedOptimizer
from distopt.optim import AdamW4bit, AdamW8bit
from tests.distopt import remote

# Two quantised weights, one of them not a multiple of the block, and two float32 ones.
SHAPES = ((80, 64), (33, 150), (7, 3), (40,))
OWNERS = ("worker1", "worker2", "worker1", "worker2")


@pytest.mark.parametrize("cls", [AdamW8bit, AdamW4bit], ids=lambda c: c.__name__)
def test_owners_step_equal_to_the_class(world, cls):
    rrefs = [rpc.remote(o, remote.make_param, args=(s, i)) for i, (o, s) in enumerate(zip(OWNERS, SHAPES))]
    local = [r.to_here().detach().clone().requires_grad_(True) for r in rrefs]
    groups = [{"params": rrefs[:2], "weight_decay": 0.1}, {"params": rrefs[2:], "weight_decay": 0.0}]
    dist_opt = DistributedOptimizer(cls, groups, lr=1e-2)
    assert dist_opt.is_functional_optim
    reference = cls([{"params": local[:2], "weight_decay": 0.1},
                     {"params": local[2:], "weight_decay": 0.0}], lr=1e-2)
    for step in range(4):
        gen = torch.Generator().manual_seed(step)
        data = [torch.randn(s, generator=gen) for s in SHAPES]
        with dist_autograd.context() as ctx:
            terms = [rpc.rpc_sync(OWNERS[i], remote.remote_term, args=(rrefs[i], data[i], False))
                     for i in range(4)]
            dist_autograd.backward(ctx, [torch.stack(terms).sum()])
            dist_opt.step(ctx)
        reference.zero_grad()
        torch.stack([remote.term(local[i], data[i], False) for i in range(4)]).sum().backward()
        reference.step()
    for i, rref in enumerate(rrefs):
        assert torch.equal(rpc.rpc_sync(OWNERS[i], remote.value, args=(rref,)), local[i].detach()), i
    saved = dist_opt.state_dict()
    want = reference.state_dict()["state"]
    for i, entry in want.items():
        assert sorted(saved["state"][i]) == sorted(entry)
        for key, value in entry.items():
            assert torch.equal(saved["state"][i][key], value), (i, key)
    assert saved["state"][0]["exp_avg"].dtype == torch.uint8
    dist_opt.load_state_dict(saved)
