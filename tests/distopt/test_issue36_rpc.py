"""An owner's step bumps autograd version counters as torch.optim's does; a failed step says
exactly what it applied where (issue 36, items 6 and 7).

Values are asserted against torch.optim run locally on copies, version counts against
torch.optim's own counts on those copies.
"""
from typing import List, Sequence, Tuple

import pytest
import torch
import torch.distributed.autograd as dist_autograd
import torch.distributed.rpc as rpc
from torch import Tensor

from distopt import DistributedOptimizer, DistributedOptimizerError, compiled_steps, owner
from distopt.sparse import ShardedEmbedding, SparseAdam, SparseSGD
from functional import functional_optim_map
from tests.distopt import remote
from tests.distopt.test_concurrency import run_in_threads

#: The message torch's autograd raises when a tensor saved for backward changed in place.
INPLACE = "modified by an inplace operation"


def param(owner: str, shape: Tuple[int, ...], seed: int) -> Tuple[rpc.RRef, Tensor]:
    """A random parameter on ``owner`` and a local leaf copy."""
    rref = rpc.remote(owner, remote.make_param, args=(shape, seed))
    return rref, rref.to_here().detach().clone().requires_grad_(True)


def values(rrefs: Sequence[rpc.RRef]) -> List[Tensor]:
    return [rpc.rpc_sync(r.owner(), remote.value, args=(r,)) for r in rrefs]


def versions(rrefs: Sequence[rpc.RRef]) -> List[int]:
    return [rpc.rpc_sync(r.owner(), remote.version, args=(r,)) for r in rrefs]


def data(shape: Tuple[int, ...], seed: int) -> Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed))


def dense_terms(rrefs: Sequence[rpc.RRef], seed: int) -> List[Tensor]:
    """``sum(tanh(p * x))`` of each parameter on its owner (``x`` from ``seed``; the shapes
    are read first: an RPC in the context whose result the loss does not use would make
    the backward pass wait for its gradient until the RPC timeout)."""
    shapes = [tuple(v.shape) for v in values(rrefs)]
    return [
        rpc.rpc_sync(r.owner(), remote.remote_term, args=(r, data(s, seed + i), False))
        for i, (r, s) in enumerate(zip(rrefs, shapes))
    ]


def local_step(optim: torch.optim.Optimizer, params: Sequence[Tensor], seed: int) -> None:
    """``dense_terms``' loss on local copies, then one torch.optim step."""
    optim.zero_grad()
    torch.stack([
        remote.term(p, data(tuple(p.shape), seed + i), False) for i, p in enumerate(params)
    ]).sum().backward()
    optim.step()


# ---------------------------------------------------------------- 7: version counters

VERSION_CASES = [
    # (id, class, kwargs, flat): every kind of owner step the compiled path has, and eager
    ("sgd-flat", torch.optim.SGD, {"lr": 0.1, "momentum": 0.9}, True),
    ("sgd-fused", torch.optim.SGD, {"lr": 0.1, "momentum": 0.9}, False),
    ("adam-fused", torch.optim.Adam, {"lr": 0.1}, False),
    ("adamw-flat", torch.optim.AdamW, {"lr": 0.1}, True),
    ("adam-foreach", torch.optim.Adam, {"lr": 0.1, "foreach": True}, False),
    ("rmsprop-native-kernel", torch.optim.RMSprop, {"lr": 0.1}, False),
    ("nadam-flat-native-kernel", torch.optim.NAdam, {"lr": 0.1}, True),
    ("eager", remote.PlainSGD, {"lr": 0.1}, False),
]
# Each compiled case on both paths; an eager optimizer always steps on the locked one.
VERSION_RUNS = [
    (f"{case[0]}-{path}", *case[1:], path)
    for case in VERSION_CASES for path in ("exclusive", "locked")
    if path == "locked" or case[1] is not remote.PlainSGD
]


@pytest.mark.parametrize(
    "cls, kwargs, flat, path", [r[1:] for r in VERSION_RUNS], ids=[r[0] for r in VERSION_RUNS]
)
def test_owner_step_bumps_versions_as_torch_optim(world, rpc_calls, cls, kwargs, flat, path):
    made = [param("worker1", s, 40 + i) for i, s in enumerate([(5, 3), (4, 2), (3,)])]
    rrefs, local = [m[0] for m in made], [m[1] for m in made]
    opt = DistributedOptimizer(cls, rrefs, flat=flat, **kwargs)
    ref = cls(local, **kwargs)
    for step in range(2):
        if path == "locked":  # a change travels with the step, through the locked Python path
            opt.param_groups[0]["lr"] = ref.param_groups[0]["lr"] = 0.05 / (step + 1)
        before, torch_before = versions(rrefs), [p._version for p in local]
        with dist_autograd.context() as ctx:
            # the third parameter gets no gradient: torch.optim leaves it alone
            dist_autograd.backward(ctx, [torch.stack(dense_terms(rrefs[:2], step)).sum()])
            opt.step(ctx)
        local_step(ref, local[:2], step)
        bumps = [a - b for a, b in zip(versions(rrefs), before)]
        torch_bumps = [p._version - v for p, v in zip(local, torch_before)]
        assert [b > 0 for b in bumps] == [b > 0 for b in torch_bumps] == [True, True, False]
        if cls is remote.PlainSGD:
            assert bumps == torch_bumps  # torch.optim's class itself
        elif not compiled_steps._STEP_OPS:
            pass  # without the native ops every stepped parameter gets one bump more
        elif kwargs.get("foreach") or torch_bumps[0] == 1:
            assert bumps == torch_bumps  # the same count where the kernels' count is torch's
        else:
            assert bumps == [1, 1, 0], torch_bumps  # torch.optim's 2: one in-place op each
    for got, want in zip(values(rrefs), local):
        torch.testing.assert_close(got, want.detach())
    locked = [args for _, func, args in rpc_calls if func is owner.step_local_optimizer]
    assert len(locked) == (2 if path == "locked" else 0)


@pytest.mark.parametrize("cls", [SparseSGD, SparseAdam], ids=["sgd", "adam"])
def test_sparse_optimizers_bump_every_shard_they_step(world, cls):
    emb = ShardedEmbedding(12, 3, ["worker1", "worker2"], seed=5)
    local = torch.nn.Embedding.from_pretrained(emb.full_weight(), freeze=False, sparse=True)
    torch_cls = {SparseSGD: torch.optim.SGD, SparseAdam: torch.optim.SparseAdam}[cls]
    opt, ref = cls([emb], lr=0.1), torch_cls(local.parameters(), lr=0.1)
    shards = emb.parameter_rrefs()
    rows = torch.tensor([0, 1, 1])  # rows of the first shard only: the second steps empty
    for _ in range(2):
        before, torch_before = versions(shards), local.weight._version
        with dist_autograd.context() as ctx:
            dist_autograd.backward(ctx, [emb(rows).pow(2).sum()])
            opt.step(ctx)
        ref.zero_grad()
        local(rows).pow(2).sum().backward()
        ref.step()
        assert local.weight._version - torch_before == 1
        bumps = [a - b for a, b in zip(versions(shards), before)]
        # (without the native ops a stepped parameter gets one bump more: at least 1 each)
        assert bumps == [1, 1] if compiled_steps._STEP_OPS else min(bumps) >= 1, bumps
    torch.testing.assert_close(emb.full_weight(), local.weight.detach())


@pytest.mark.parametrize(
    "library", ["distopt-flat", "distopt-fused", "distopt-eager", "torch"]
)
def test_a_step_between_forward_and_backward_fails_the_backward_as_torchs(world, library):
    """pytorch/examples' parameter server: trainer A's forward saved ``p`` on the owner,
    trainer B (another process) steps ``p``; A's backward must not run on B's values."""
    rref = rpc.remote("worker1", remote.make_ones, args=((4,),))
    if library == "torch":
        trainer_b = (remote.torch_sum_steps, ([rref], 1, 1.0))
    else:
        cls = remote.PlainSGD if library == "distopt-eager" else torch.optim.SGD
        kwargs = {"lr": 1.0, "flat": library == "distopt-flat"}
        trainer_b = (remote.train_sum_steps, (cls, [rref], 1, kwargs))
    with dist_autograd.context() as ctx:
        loss = rpc.rpc_sync("worker1", remote.square_sum, args=(rref,))  # saves p (ones)
        # B's one step, called from a thread outside A's context (an RPC made in a context
        # takes the context along)
        run_in_threads([lambda: rpc.rpc_sync("worker3", trainer_b[0], args=trainer_b[1])])
        assert torch.equal(values([rref])[0], torch.zeros(4))  # B's step: p = 1 - 1
        with pytest.raises(RuntimeError, match=INPLACE):
            dist_autograd.backward(ctx, [loss])  # else: gradient 2 * 0 where 2 * 1 was saved


# ---------------------------------------------------------------- 6: what a failed step applied


def _adam_world(path: str, monkeypatch) -> Tuple[DistributedOptimizer, List[rpc.RRef], Tensor]:
    """Adam (lr 0.1) over group 0 = [d1 on worker1, d2 on worker2], group 1 = [e2 on
    worker2]; returns the optimizer, the RRefs (global order) and a local copy of d1."""
    if path == "eager":
        monkeypatch.delitem(functional_optim_map, torch.optim.Adam)
    (d1, local_d1), (d2, _), (e2, _) = (
        param("worker1", (5, 3), 1), param("worker2", (4, 2), 2), param("worker2", (6, 3), 3)
    )
    opt = DistributedOptimizer(
        torch.optim.Adam, [{"params": [d1, d2]}, {"params": [e2]}],
        lr=0.2 if path == "locked" else 0.1,
    )
    assert opt.is_functional_optim == (path != "eager")
    if path == "locked":  # the change travels with the step: the locked Python path
        opt.param_groups[0]["lr"] = 0.1
    return opt, [d1, d2, e2], local_d1


REFUSALS = {
    "sparse": "RuntimeError: Invalid gradient of parameter 2 (param group 1) on worker2: sparse "
              "(expected dense: Adam does not support sparse gradients); nothing was stepped "
              "on worker2",
    "shape": "ValueError: Invalid gradient of parameter 2 (param group 1) on worker2: shape "
             "[5, 3] (expected [6, 3], the parameter's); nothing was stepped on worker2",
}


@pytest.mark.parametrize("cause", ["sparse", "shape"])
@pytest.mark.parametrize("path", ["exclusive", "locked", "eager"])
def test_a_gradient_an_owner_cannot_take_steps_nothing_there(world, monkeypatch, path, cause):
    opt, rrefs, local_d1 = _adam_world(path, monkeypatch)
    before, before_versions = values(rrefs), versions(rrefs)
    with dist_autograd.context() as ctx:
        terms = dense_terms(rrefs[:2], 0)
        if cause == "sparse":  # e2 looked up as an embedding: a sparse gradient under Adam
            rows = torch.tensor([0, 4, 4])
            terms.append(rpc.rpc_sync("worker2", remote.remote_term, args=(rrefs[2], rows, True)))
        else:
            terms += dense_terms(rrefs[2:], 2)
        dist_autograd.backward(ctx, [torch.stack(terms).sum()])
        if cause == "shape":
            rpc.rpc_sync("worker2", remote.resize_gradient, args=(rrefs[2], ctx, (5, 3)))
        with pytest.raises(DistributedOptimizerError) as info:
            opt.step(ctx)
    assert info.value.failures == {"worker2": REFUSALS[cause]}
    assert info.value.succeeded == ["worker1"]
    assert str(info.value).splitlines()[2] == (
        "  applied on ['worker1'] (every parameter there with a gradient stepped); not "
        "applied on ['worker2'] (their parameters hold the previous step): the parameters "
        "now mix this step and the previous one; load() the last checkpoint to get back to "
        "one consistent state"
    )
    # worker2 changed nothing: not d2 (group 0, which steps first), not e2
    after = values(rrefs)
    assert torch.equal(after[1], before[1]) and torch.equal(after[2], before[2])
    assert versions(rrefs)[1:] == before_versions[1:]
    # worker1 applied torch.optim's step: d1 moved by lr (Adam's first step), state step 1
    local_step(torch.optim.Adam([local_d1], lr=0.1), [local_d1], 0)
    torch.testing.assert_close(after[0], local_d1.detach())
    state = opt.state_dict()["state"]
    assert sorted(state) == [0] and float(state[0]["step"]) == 1.0


def test_an_eager_step_failing_part_way_says_which_parameters_changed(world):
    (a1, _), (a2, _), (b1, _), (b2, _) = (
        param("worker1", (5, 3), 11), param("worker2", (4, 2), 12),
        param("worker1", (3, 3), 13), param("worker2", (2, 2), 14),
    )
    rrefs = [a1, a2, b1, b2]
    opt = DistributedOptimizer(
        remote.FailsInSecondGroupOnWorker2, [{"params": [a1, a2]}, {"params": [b1, b2]}], lr=0.5
    )
    before = values(rrefs)
    with pytest.raises(DistributedOptimizerError) as info:
        remote.sum_step(opt, rrefs)  # every gradient is ones
    assert info.value.failures == {
        "worker2": "RuntimeError: step refused in param group 1 on worker2 (part-way through "
                   "the step on worker2: parameters [1] changed in place, parameters [3] did "
                   "not, by their autograd version counters)"
    }
    assert str(info.value).splitlines()[2] == (
        "  applied on ['worker1'] (every parameter there with a gradient stepped); partly "
        "applied on ['worker2'] (see its line): the parameters now mix this step and the "
        "previous one; load() the last checkpoint to get back to one consistent state"
    )
    after = values(rrefs)
    for i, moved in enumerate([True, True, True, False]):
        assert torch.equal(after[i], before[i] - 0.5 if moved else before[i]), i


@pytest.mark.parametrize("path", ["exclusive", "locked"])
def test_a_compiled_step_failing_part_way_says_which_groups_stepped(world, path):
    """SGD with Nesterov momentum refuses a sparse gradient on a dense momentum buffer (as
    torch.optim.SGD fails on it): a cause only the owner's state shows, met in group 1 after
    group 0 stepped there."""
    (a1, l1), (a2, l2), (e2, _) = (
        param("worker1", (5, 3), 21), param("worker2", (4, 2), 22), param("worker2", (6, 3), 23)
    )
    kwargs = {"lr": 0.1, "momentum": 0.9, "nesterov": True}
    opt = DistributedOptimizer(torch.optim.SGD, [{"params": [a1, a2]}, {"params": [e2]}], **kwargs)
    ref = torch.optim.SGD([l1, l2], **kwargs)
    with dist_autograd.context() as ctx:  # dense gradients: dense momentum buffers
        dist_autograd.backward(ctx, [torch.stack(dense_terms([a1, a2, e2], 0)).sum()])
        opt.step(ctx)
    local_step(ref, [l1, l2], 0)
    if path == "locked":
        opt.param_groups[0]["lr"] = ref.param_groups[0]["lr"] = 0.05
    e2_before = values([e2])[0]
    with dist_autograd.context() as ctx:
        terms = dense_terms([a1, a2], 1)
        terms.append(rpc.rpc_sync("worker2", remote.remote_term,
                                  args=(e2, torch.tensor([1, 2]), True)))
        dist_autograd.backward(ctx, [torch.stack(terms).sum()])
        with pytest.raises(DistributedOptimizerError) as info:
            opt.step(ctx)
    local_step(ref, [l1, l2], 1)
    assert info.value.failures == {
        "worker2": "RuntimeError: add(sparse, dense) is not supported. Use add(dense, sparse) "
                   "instead. (Invalid gradients[2]: a sparse gradient with nesterov=True, and a "
                   "dense momentum buffer in state[2]; torch.optim.SGD fails the same way.) "
                   "(part-way through the step on worker2: param group 0 (parameters [1]) "
                   "stepped; param group 1 (parameters [2]) raised this, unchanged if its own "
                   "checks refused the step, else partly stepped)"
    }
    assert "partly applied on ['worker2'] (see its line)" in str(info.value).splitlines()[2]
    got = values([a1, a2, e2])
    torch.testing.assert_close(got[0], l1.detach())
    torch.testing.assert_close(got[1], l2.detach())  # group 0 stepped on worker2 too
    assert torch.equal(got[2], e2_before)
