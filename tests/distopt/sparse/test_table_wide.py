"""A sharded table steps as one parameter: the counts torch.optim keeps per parameter
(SparseAdam's ``step`` for bias correction, Adagrad's ``step`` for ``lr_decay``, and SGD's
momentum buffer, which moves every row it holds) advance on every owner whenever the table
gets a gradient, as they do for one local ``nn.Embedding(sparse=True)``.

Every step below leaves an owner of some table without rows, under both partitions, so
each shard's state would fall behind if it counted only its own gradients. Also covered:
empty lookups (a gradient with no rows: torch counts the step), lookups whose output never
reaches the loss, and tables not looked up at all (no gradient: torch does not count it).
"""
from typing import Any, Dict, List, Sequence, Tuple

import pytest
import torch
import torch.distributed.autograd as dist_autograd
from torch import Tensor, nn

from distopt.sparse import ShardedEmbedding, SparseAdagrad, SparseAdam, SparseSGD
from tests.distopt.sparse import harness

OWNERS = ["worker1", "worker2"]
#: (rows, dim) of the two tables. With 2 owners, "range" puts rows 0-4 of table 0 on the
#: first owner and 5-8 on the second (table 1: 0-3 and 4-6); "hash" puts even rows on the
#: first owner and odd rows on the second.
TABLES = ((9, 3), (7, 2))

#: One step: for each table, its lookups as (indices, whether the output enters the loss).
#: The comments say which owners of table 0 / table 1 get rows, as (range; hash). An unused
#: lookup is only ever on an owner that gets no gradient at all in that context: torch's
#: distributed autograd (FAST mode) waits for every RPC of the context on an owner that gets
#: some gradient, so an unused lookup beside used ones would stall backward (torch's limit).
Lookups = List[Tuple[List[Any], bool]]
STEPS: List[Tuple[Lookups, Lookups]] = [
    ([([1, 7], True)], [([0, 5], True)]),  # t0: both; 2nd only. t1: both; both
    ([([1, 2], True)], []),  # t0: 1st only; both. t1 not looked up: no gradient, no step
    ([([1, 2], True)], [([], True)]),  # t1: an empty lookup alone, a gradient with no rows
    ([([8], True)], [([3], False)]),  # t0: 2nd; 1st. t1 looked up, unused: no gradient
    ([([0, 2, 4], True), ([5], False)], [([0, 2], True)]),  # t0: 1st; 1st. t1: 1st; 1st
    ([([[5, 7], [7, 7]], True)], [([4], True)]),  # t0: 2nd; 2nd (2-D). t1: 2nd; 1st
    ([([], True), ([], False)], [([1, 1], True)]),  # t0: empty lookups only. t1: 1st; 2nd
]

# (id, distributed class, torch.optim class, kwargs)
CASES = [
    ("adam", SparseAdam, torch.optim.SparseAdam, {"lr": 0.05, "betas": (0.8, 0.99)}),
    ("adam-max", SparseAdam, torch.optim.SparseAdam, {"lr": 0.05, "maximize": True}),
    ("adagrad-decay", SparseAdagrad, torch.optim.Adagrad, {"lr": 0.1, "lr_decay": 0.5}),
    ("adagrad-decay-init", SparseAdagrad, torch.optim.Adagrad,
     {"lr": 0.1, "lr_decay": 0.05, "initial_accumulator_value": 0.1, "eps": 1e-6}),
    ("sgd", SparseSGD, torch.optim.SGD, {"lr": 0.1}),
    ("sgd-momentum", SparseSGD, torch.optim.SGD, {"lr": 0.05, "momentum": 0.9, "dampening": 0.1}),
    ("sgd-nesterov", SparseSGD, torch.optim.SGD, {"lr": 0.05, "momentum": 0.5, "nesterov": True}),
]
ROUND_TRIP = [c for c in CASES if c[0] in ("adam", "adagrad-decay-init", "sgd-momentum")]
#: Steps before a state_dict / save in the round-trip tests: owners were left out by then.
SAVE_AFTER = 4
#: The step before which the parity test halves the learning rate.
LR_CHANGE = 3


def make_tables(partition: str) -> Tuple[List[ShardedEmbedding], List[nn.Embedding]]:
    sharded = [
        ShardedEmbedding(n, d, OWNERS, partition=partition, seed=20 + t)
        for t, (n, d) in enumerate(TABLES)
    ]
    local = [
        nn.Embedding.from_pretrained(emb.full_weight(), freeze=False, sparse=True)
        for emb in sharded
    ]
    return sharded, local


def loss_of(tables: Sequence[Any], step: int) -> Tensor:
    """A non-linear loss of the used lookups of ``step``; unused ones are looked up too."""
    terms = []
    for t, lookups in enumerate(STEPS[step]):
        for j, (ids, used) in enumerate(lookups):
            rows = tables[t](torch.tensor(ids, dtype=torch.int64))
            target = harness.targets(10 * step + j, tuple(rows.shape))
            if used:
                terms.append((rows - target).pow(2).sum())
    return torch.stack(terms).sum()


def dist_step(sharded: Sequence[ShardedEmbedding], opt: Any, step: int) -> None:
    with dist_autograd.context() as ctx:
        dist_autograd.backward(ctx, [loss_of(sharded, step)])
        opt.step(ctx)


def local_step(local: Sequence[nn.Embedding], ref: torch.optim.Optimizer, step: int) -> None:
    ref.zero_grad()
    loss_of(local, step).backward()
    ref.step()


def assert_state_is_torch_state(
    sharded: Sequence[ShardedEmbedding], state_dict: Dict[str, Any],
    ref_state_dict: Dict[str, Any], what: str,
) -> None:
    """Each shard holds its rows of its table's torch.optim state, and the table's count."""
    state, want = state_dict["state"], ref_state_dict["state"]
    i = 0
    for t, emb in enumerate(sharded):
        for k in range(len(emb.owners)):
            where = f"{what}, table {t}, shard {k}"
            assert (i in state) == (t in want), where
            if t in want:
                assert sorted(state[i]) == sorted(want[t]), where
                rows = emb._partition.global_rows(k)
                for key, value in want[t].items():
                    got = state[i][key]
                    if key == "step":
                        assert float(got) == float(value), f"{where}: step {got} != {value}"
                    else:
                        torch.testing.assert_close(
                            got.to_dense(), value.to_dense()[rows],
                            msg=lambda m, where=where, key=key: f"{where}, {key}: {m}",
                        )
            i += 1


def assert_matches(
    sharded: Sequence[ShardedEmbedding], opt: Any, local: Sequence[nn.Embedding],
    ref: torch.optim.Optimizer, what: str,
) -> None:
    harness.assert_tables_equal(sharded, local, what)
    assert_state_is_torch_state(sharded, opt.state_dict(), ref.state_dict(), what)


@pytest.mark.parametrize("partition", ["range", "hash"])
@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_every_owner_steps_whenever_its_table_gets_a_gradient(world, case, partition):
    _, cls, torch_class, kwargs = case
    sharded, local = make_tables(partition)
    opt = cls(sharded, **kwargs)
    ref = torch_class([emb.weight for emb in local], **kwargs)
    for step in range(len(STEPS)):
        if step == LR_CHANGE:  # the change rides on the next step's RPCs (the locked path)
            for o in (opt, ref):
                o.param_groups[0]["lr"] *= 0.5
        dist_step(sharded, opt, step)
        local_step(local, ref, step)
        assert_matches(sharded, opt, local, ref, f"{partition} after step {step}")


def rebuild(sharded: Sequence[ShardedEmbedding]) -> List[ShardedEmbedding]:
    """New tables holding the current values of ``sharded`` (same partition and owners)."""
    return [
        ShardedEmbedding.from_pretrained(emb.full_weight(), emb.owners, partition=emb.partition)
        for emb in sharded
    ]


@pytest.mark.parametrize("how", ["state_dict", "save"])
@pytest.mark.parametrize("partition", ["range", "hash"])
@pytest.mark.parametrize("case", ROUND_TRIP, ids=[c[0] for c in ROUND_TRIP])
def test_round_trip_after_steps_that_left_owners_out(world, tmp_path, case, partition, how):
    _, cls, torch_class, kwargs = case
    sharded, local = make_tables(partition)
    opt = cls(sharded, **kwargs)
    ref = torch_class([emb.weight for emb in local], **kwargs)
    for step in range(SAVE_AFTER):
        dist_step(sharded, opt, step)
        local_step(local, ref, step)
    saved = opt.state_dict()
    # What torch.optim keeps per parameter, every shard keeps for its whole table.
    assert_state_is_torch_state(sharded, saved, ref.state_dict(), "saved")
    if how == "save":
        opt.save(str(tmp_path))
    copies = rebuild(sharded)
    opt2 = cls(copies, **kwargs)
    if how == "state_dict":
        opt2.load_state_dict(saved)
    else:
        opt2.load(str(tmp_path))
    assert_state_is_torch_state(copies, opt2.state_dict(), ref.state_dict(), "loaded")
    for step in range(SAVE_AFTER, len(STEPS)):
        dist_step(copies, opt2, step)
        local_step(local, ref, step)
        assert_matches(copies, opt2, local, ref, f"resumed {partition}, step {step}")


@pytest.mark.parametrize("shape", [(0,), (2, 0), (0, 3)], ids=["1d", "2d", "2d-empty-rows"])
def test_empty_lookup_behaves_as_nn_embedding(world, shape):
    emb = ShardedEmbedding(6, 3, OWNERS, seed=1)
    local = nn.Embedding.from_pretrained(emb.full_weight(), freeze=False, sparse=True)
    opt = SparseAdam([emb], lr=0.1)
    ref = torch.optim.SparseAdam([local.weight], lr=0.1)
    idx = torch.empty(shape, dtype=torch.int64)
    for ids in (torch.tensor([0, 4]), idx, idx):  # a real step, then steps with no rows
        want = local(ids)
        with dist_autograd.context() as ctx:
            got = emb(ids)
            assert got.requires_grad and want.requires_grad
            assert got.shape == want.shape and got.dtype == want.dtype
            dist_autograd.backward(ctx, [got.sum()])  # through the empty lookup alone
            opt.step(ctx)
        ref.zero_grad()
        want.sum().backward()
        ref.step()
        assert_matches([emb], opt, [local], ref, f"after {ids.tolist()}")
    assert ref.state_dict()["state"][0]["step"] == 3


def test_empty_lookup_outside_a_context_is_inference_like_any_lookup(world):
    emb = ShardedEmbedding(6, 3, OWNERS, seed=1)
    for ids in (torch.tensor([1, 4]), torch.empty(0, dtype=torch.int64)):
        out = emb(ids)
        assert not out.requires_grad and out.shape == (ids.numel(), 3)


def test_step_without_backward_or_lookups_counts_nothing(world):
    emb = ShardedEmbedding(6, 3, OWNERS, seed=1)
    opt = SparseAdam([emb], lr=0.1)
    before = emb.full_weight()
    with pytest.warns(UserWarning, match="holds no gradient of any of this optimizer's"):
        with dist_autograd.context() as ctx:
            emb(torch.tensor([1, 4]))  # looked up, never differentiated
            opt.step(ctx)
    with dist_autograd.context() as ctx:
        opt.step(ctx)  # not looked up at all (warned once per optimizer, above)
    assert opt.state_dict()["state"] == {}
    assert torch.equal(emb.full_weight(), before)
