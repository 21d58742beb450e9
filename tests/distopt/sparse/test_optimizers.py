"""SparseSGD / SparseAdagrad / SparseAdam (and DistributedOptimizer over shards) equal torch.optim
on a local nn.Embedding(sparse=True), for both partitions, duplicates summed or averaged."""
from typing import Any, Dict

import pytest
import torch

from distopt import DistributedOptimizer
from distopt.sparse import SparseAdagrad, SparseAdam, SparseSGD
from tests.distopt.sparse import harness

# (id, distributed factory, torch.optim class, kwargs)
CASES = [
    ("sgd", SparseSGD, torch.optim.SGD, {"lr": 0.1}),
    ("sgd-momentum", SparseSGD, torch.optim.SGD, {"lr": 0.05, "momentum": 0.9, "dampening": 0.1}),
    ("sgd-nesterov-max", SparseSGD, torch.optim.SGD,
     {"lr": 0.05, "momentum": 0.5, "nesterov": True, "maximize": True}),
    ("adagrad", SparseAdagrad, torch.optim.Adagrad,
     {"lr": 0.1, "lr_decay": 0.01, "initial_accumulator_value": 0.1}),
    ("adam", SparseAdam, torch.optim.SparseAdam, {"lr": 0.05, "betas": (0.8, 0.99)}),
    ("adam-max", SparseAdam, torch.optim.SparseAdam, {"lr": 0.05, "maximize": True}),
]
# DistributedOptimizer over the shards: the sparse gradient reaches the functional sparse path.
PLAIN = [
    ("dist-sgd", torch.optim.SGD, {"lr": 0.1, "momentum": 0.9}),
    ("dist-adagrad", torch.optim.Adagrad, {"lr": 0.1}),
    ("dist-adam", torch.optim.SparseAdam, {"lr": 0.05}),
]
MEAN = [c for c in CASES if c[0] in ("sgd-momentum", "adagrad", "adam")]


def run_parity(factory: Any, torch_class: type, kwargs: Dict[str, Any], partition: str,
               mean: bool = False) -> None:
    sharded, local = harness.make_tables(partition)
    opt = factory(sharded, **kwargs)
    ref = torch_class([emb.weight for emb in local], **kwargs)
    harness.train(sharded, opt, local, ref, range(harness.STEPS), mean=mean)
    harness.assert_tables_equal(sharded, local)


@pytest.mark.parametrize("partition", ["range", "hash"])
@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_sparse_optimizers_equal_torch(world, case, partition):
    _, factory, torch_class, kwargs = case
    run_parity(factory, torch_class, kwargs, partition)


@pytest.mark.parametrize("case", PLAIN, ids=[c[0] for c in PLAIN])
def test_distributed_optimizer_over_shards_equals_torch(world, case):
    _, torch_class, kwargs = case

    def factory(sharded, **kw):
        rrefs = [r for emb in sharded for r in emb.parameter_rrefs()]
        opt = DistributedOptimizer(torch_class, rrefs, **kw)
        assert opt.is_functional_optim
        return opt

    run_parity(factory, torch_class, kwargs, "hash")


@pytest.mark.parametrize("partition", ["range", "hash"])
@pytest.mark.parametrize("case", MEAN, ids=[c[0] for c in MEAN])
def test_duplicates_mean_equals_averaged_gradients(world, case, partition):
    _, factory, torch_class, kwargs = case

    def mean_factory(sharded, **kw):
        opt = factory(sharded, duplicates="mean", **kw)
        assert opt.is_functional_optim and opt.duplicates == "mean"
        return opt

    run_parity(mean_factory, torch_class, kwargs, partition, mean=True)
