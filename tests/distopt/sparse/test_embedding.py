"""ShardedEmbedding: partitions, initialisation, lookups, row-sparse gradients, bad input."""
from typing import Any

import pytest
import torch
import torch.distributed.autograd as dist_autograd
import torch.distributed.rpc as rpc
import torch.nn.functional as F
from torch import nn

from distopt.sparse import ShardedEmbedding, embedding as embedding_module
from distopt.sparse.partition import HashPartition, RangePartition
from tests.distopt.sparse import remote

PARTITIONS = ["range", "hash"]


@pytest.mark.parametrize("cls", [RangePartition, HashPartition])
@pytest.mark.parametrize("rows, owners", [(11, 3), (12, 4), (5, 5), (7, 1)])
def test_partition_maps_every_row_to_one_place(cls, rows, owners):
    part = cls(rows, owners)
    every = torch.arange(rows)
    owner_of = part.owner_of(every)
    local = part.local_of(every, owner_of)
    assert sum(part.sizes) == rows and max(part.sizes) - min(part.sizes) <= 1
    for k in range(owners):
        held = part.global_rows(k)
        assert held.numel() == part.sizes[k]
        assert torch.equal(owner_of[held], torch.full_like(held, k))
        assert torch.equal(local[held], torch.arange(part.sizes[k]))


def test_hash_partition_deals_rows_round_robin():
    part = HashPartition(10, 3)
    rows = torch.tensor([0, 1, 2, 3, 9])
    assert part.owner_of(rows).tolist() == [0, 1, 2, 0, 0]
    assert part.local_of(rows, part.owner_of(rows)).tolist() == [0, 0, 0, 1, 3]


@pytest.mark.parametrize("partition", PARTITIONS)
@pytest.mark.parametrize("owners", [["worker1", "worker2"], ["worker3", "worker1", "worker2"]])
def test_initial_table_equals_seeded_nn_embedding(world, partition, owners):
    emb = ShardedEmbedding(11, 3, owners, partition=partition, seed=5)
    torch.manual_seed(5)
    assert torch.equal(emb.full_weight(), nn.Embedding(11, 3).weight.detach())
    assert emb.owners == owners
    assert len(emb.parameter_rrefs()) == len(owners)
    assert [r.owner_name() for r in emb.parameter_rrefs()] == owners
    assert sum(emb.shard_sizes) == 11


def test_seed_from_global_generator_is_reproducible(world):
    torch.manual_seed(3)
    a = ShardedEmbedding(6, 2, ["worker1", "worker2"]).full_weight()
    torch.manual_seed(3)
    b = ShardedEmbedding(6, 2, ["worker1", "worker2"]).full_weight()
    assert torch.equal(a, b)


@pytest.mark.parametrize("partition", PARTITIONS)
def test_lookup_equals_local_embedding_for_any_shape(world, partition):
    weight = torch.randn(10, 4, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    emb = ShardedEmbedding.from_pretrained(weight, ["worker1", "worker2"], partition=partition)
    assert emb.dtype == torch.float64
    assert torch.equal(emb.full_weight(), weight)
    for idx in (
        torch.tensor([3, 3, 9, 0, 4]),
        torch.tensor([[1, 2], [8, 1]], dtype=torch.int32),
        torch.tensor(7),  # 0-dim
        torch.tensor([0, 1, 2]),  # all on worker1 for "range"
        torch.empty(0, 2, dtype=torch.int64),
    ):
        got = emb(idx)
        assert got.shape == (*idx.shape, 4)
        assert torch.equal(got, F.embedding(idx.long(), weight)), idx


@pytest.mark.parametrize("partition", PARTITIONS)
def test_backward_sends_each_owner_only_its_rows(world, partition):
    owners = ["worker1", "worker2"]
    emb = ShardedEmbedding(1000, 8, owners, partition=partition, seed=1)
    idx = torch.tensor([[5, 990], [5, 17]])
    with dist_autograd.context() as ctx:
        rows = emb(idx)
        weights = torch.arange(4 * 8, dtype=torch.float32).view(2, 2, 8)
        dist_autograd.backward(ctx, [(rows * weights).sum()])
        grads = [
            rpc.rpc_sync(r.owner(), remote.context_gradient, args=(r, ctx))
            for r in emb.parameter_rrefs()
        ]
    flat, w = idx.reshape(-1), weights.reshape(-1, 8)
    owner_of = emb._partition.owner_of(flat)
    local = emb._partition.local_of(flat, owner_of)
    for k, grad in enumerate(grads):
        mine = owner_of == k
        if not bool(mine.any()):
            assert grad is None
            continue
        is_sparse, indices, values = grad
        assert is_sparse
        # Only the requested rows travelled: one gradient row per lookup, none table-sized.
        assert values.shape == (int(mine.sum()), 8)
        dense = torch.zeros(emb.shard_sizes[k], 8).index_add_(0, indices[0], values)
        want = torch.zeros(emb.shard_sizes[k], 8).index_add_(0, local[mine], w[mine])
        assert torch.equal(dense, want)


def test_lookup_outside_a_context_is_plain_inference(world):
    emb = ShardedEmbedding(4, 2, ["worker1"], seed=0)
    out = emb(torch.tensor([1, 1]))
    assert not out.requires_grad
    assert torch.equal(out[0], emb.full_weight()[1])


# ---------------------------------------------------------------- bad input, before any RPC


@pytest.fixture
def no_rpc(monkeypatch):
    """Fail the test if ShardedEmbedding makes any call to an owner."""

    def refuse(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("an RPC was made")

    monkeypatch.setattr(embedding_module.rpc, "rpc_async", refuse)
    monkeypatch.setattr(embedding_module, "fan_out", refuse)


@pytest.fixture(scope="module")
def small(world):
    return ShardedEmbedding(10, 2, ["worker1", "worker2"], partition="hash", seed=0)


@pytest.mark.parametrize(
    "idx, error, words",
    [
        (torch.tensor([1.0, 2.0]), TypeError, "dtype torch.float32"),
        (torch.tensor([True]), TypeError, "dtype torch.bool"),
        ([1, 2], TypeError, "list"),
        (torch.tensor([1, 10, -1]), IndexError, "Invalid index: 10 at flattened position 1"),
        (torch.tensor([[0, 1], [-3, 99]]), IndexError, "Invalid index: -3 at flattened position 2"),
    ],
    ids=["float", "bool", "list", "too-large", "negative"],
)
def test_bad_indices_raise_before_any_rpc(small, no_rpc, idx, error, words):
    with pytest.raises(error, match=words):
        small(idx)


@pytest.mark.parametrize(
    "kwargs, error, words",
    [
        ({"owners": ["worker1", "worker2", "worker1"]}, ValueError,
         "'worker1' is at positions 0 and 2"),
        ({"owners": ["worker1", "nobody"]}, ValueError, "'nobody' is not a worker"),
        ({"owners": []}, ValueError, "at least one worker"),
        ({"owners": "worker1"}, TypeError, "expected a list"),
        ({"partition": "modulo"}, ValueError, "Invalid partition: 'modulo'"),
        ({"num_embeddings": 1}, ValueError, "at least one row per owner"),
        ({"embedding_dim": 0}, ValueError, "Invalid embedding_dim: 0"),
        ({"num_embeddings": 5.0}, TypeError, "Invalid num_embeddings: 5.0"),
    ],
    ids=["duplicate", "unknown", "empty", "string", "partition", "too-few-rows", "dim", "float"],
)
def test_bad_construction_fails_before_any_shard(world, no_rpc, kwargs, error, words):
    args = {"num_embeddings": 10, "embedding_dim": 2, "owners": ["worker1", "worker2"]}
    args.update(kwargs)
    with pytest.raises(error, match=words):
        ShardedEmbedding(
            args.pop("num_embeddings"), args.pop("embedding_dim"), args.pop("owners"), **args
        )


def test_from_pretrained_rejects_bad_weights(world, no_rpc):
    with pytest.raises(TypeError, match="torch.int64"):
        ShardedEmbedding.from_pretrained(torch.zeros(4, 2, dtype=torch.int64), ["worker1"])
    with pytest.raises(ValueError, match=r"shape \(4,\)"):
        ShardedEmbedding.from_pretrained(torch.zeros(4), ["worker1"])
