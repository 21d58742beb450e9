"""State lives with the shards: it matches torch.optim's, and state_dict / save round trips
continue training exactly."""
import pytest
import torch

from distopt.sparse import ShardedEmbedding, SparseAdagrad, SparseAdam, SparseSGD
from tests.distopt.sparse import harness

# (id, class, kwargs, torch.optim class, state keys)
CASES = [
    ("sgd-momentum", SparseSGD, {"lr": 0.05, "momentum": 0.9}, torch.optim.SGD,
     ("momentum_buffer",)),
    ("adagrad", SparseAdagrad, {"lr": 0.1}, torch.optim.Adagrad, ("sum", "step")),
    ("adam", SparseAdam, {"lr": 0.05}, torch.optim.SparseAdam, ("exp_avg", "exp_avg_sq", "step")),
    ("adam-mean", SparseAdam, {"lr": 0.05, "duplicates": "mean"}, torch.optim.SparseAdam,
     ("exp_avg", "exp_avg_sq", "step")),
]


def rebuild(sharded):
    """New tables holding the current values of ``sharded`` (same partition and owners)."""
    return [
        ShardedEmbedding.from_pretrained(emb.full_weight(), emb.owners, partition=emb.partition)
        for emb in sharded
    ]


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_state_is_torch_state_split_by_shard(world, case):
    _, cls, kwargs, torch_class, keys = case
    sharded, local = harness.make_tables("hash")
    opt = cls(sharded, **kwargs)
    ref_kwargs = {k: v for k, v in kwargs.items() if k != "duplicates"}
    ref = torch_class([emb.weight for emb in local], **ref_kwargs)
    harness.train(sharded, opt, local, ref, range(3), mean=kwargs.get("duplicates") == "mean")
    sd, ref_sd = opt.state_dict(), ref.state_dict()
    assert len(sd["state"]) == sum(len(emb.owners) for emb in sharded)
    i = 0
    for t, emb in enumerate(sharded):
        for k in range(len(emb.owners)):
            entry, want = sd["state"][i], ref_sd["state"][t]
            assert sorted(entry) == sorted(keys)
            rows = emb._partition.global_rows(k)
            for key in keys:
                if key == "step":
                    assert torch.as_tensor(entry[key]).item() == torch.as_tensor(want[key]).item()
                else:
                    torch.testing.assert_close(
                        entry[key].to_dense(), want[key].to_dense()[rows], msg=f"{t}/{k}/{key}"
                    )
            i += 1


@pytest.mark.parametrize("how", ["state_dict", "save"])
@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_round_trip_continues_exactly(world, tmp_path, case, how):
    _, cls, kwargs, _, _ = case
    sharded, _ = harness.make_tables("range")
    opt = cls(sharded, **kwargs)
    harness.train(sharded, opt, None, None, range(2))
    copies = rebuild(sharded)
    if how == "state_dict":
        saved = opt.state_dict()
    else:
        opt.save(str(tmp_path))
    harness.train(sharded, opt, None, None, range(2, 4))

    opt2 = cls(copies, **kwargs)
    if how == "state_dict":
        opt2.load_state_dict(saved)
    else:
        opt2.load(str(tmp_path))
    harness.train(copies, opt2, None, None, range(2, 4))
    for a, b in zip(sharded, copies):
        assert torch.equal(a.full_weight(), b.full_weight())


def test_rows_not_looked_up_keep_value_and_state(world):
    emb = ShardedEmbedding(8, 2, ["worker1", "worker2"], seed=0)
    opt = SparseAdam([emb], lr=0.1)
    before = emb.full_weight()
    with torch.distributed.autograd.context() as ctx:
        torch.distributed.autograd.backward(ctx, [emb(torch.tensor([1, 6])).sum()])
        opt.step(ctx)
    after = emb.full_weight()
    changed = (after != before).any(dim=1).nonzero().reshape(-1).tolist()
    assert changed == [1, 6]
    state = opt.state_dict()["state"]
    for k, rows in enumerate(([1], [2])):  # rows 1 and 6 are local rows 1 and 2
        nonzero = state[k]["exp_avg"].abs().sum(dim=1).nonzero().reshape(-1).tolist()
        assert nonzero == rows
