"""A table's state belongs to the rows its partition gave each shard: state_dicts and
checkpoints record the partitions, and a load into tables partitioned otherwise is refused
before anything changes (issue 36, item 3)."""
import os
import warnings

import pytest
import torch

from distopt.sparse import ShardedEmbedding, SparseAdagrad, SparseAdam, SparseSGD
from tests.distopt.sparse import harness
from tests.helpers import assert_identical

CASES = [
    ("adam", SparseAdam, {"lr": 0.05}),
    ("adagrad", SparseAdagrad, {"lr": 0.1}),
    ("sgd-momentum", SparseSGD, {"lr": 0.05, "momentum": 0.9}),
]
RECORD = [{"partition": "range", "num_embeddings": n, "num_owners": 2,
           "owners": list(harness.OWNERS)} for n, _ in harness.TABLES]
REFUSED = ("table 0 was saved with partition='range' of 23 rows over 2 owners (expected "
           "partition='hash' of 23 rows over 2 owners, this table's: each row's state would "
           "land on another row)")


def dense(value):
    """``value`` with every sparse tensor made dense (momentum buffers are sparse)."""
    if isinstance(value, torch.Tensor):
        return value.to_dense() if value.is_sparse else value
    if isinstance(value, dict):
        return {k: dense(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(dense(v) for v in value)
    return value


def copies(sharded, partition):
    """New tables holding the values of ``sharded``, partitioned by ``partition``."""
    return [ShardedEmbedding.from_pretrained(emb.full_weight(), emb.owners, partition=partition)
            for emb in sharded]


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_a_range_state_is_refused_by_hash_tables_before_anything_changes(world, tmp_path, case):
    _, cls, kwargs = case
    sharded, _ = harness.make_tables("range")
    opt = cls(sharded, **kwargs)
    harness.train(sharded, opt, None, None, range(2))
    saved = opt.state_dict()
    assert saved["partitions"] == RECORD
    opt.save(str(tmp_path))

    hashed = copies(sharded, "hash")
    other = cls(hashed, **kwargs)
    harness.train(hashed, other, None, None, range(1))
    before = other.state_dict()
    with pytest.raises(ValueError) as raised:
        other.load_state_dict(saved)
    assert str(raised.value) == f"Invalid state_dict['partitions']: {REFUSED}"
    with pytest.raises(ValueError) as raised:
        other.load(str(tmp_path))
    assert str(raised.value) == (
        f"Invalid checkpoint {os.path.abspath(str(tmp_path))!r}: {REFUSED}")
    assert_identical(dense(other.state_dict()), dense(before))


def test_a_state_without_the_record_loads_with_a_warning(world):
    sharded, _ = harness.make_tables("range")
    opt = SparseAdam(sharded, lr=0.05)
    harness.train(sharded, opt, None, None, range(2))
    saved = opt.state_dict()
    del saved["partitions"]  # as saved before the record was written
    resumed_tables = copies(sharded, "range")
    resumed = SparseAdam(resumed_tables, lr=0.05)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        resumed.load_state_dict(saved)
    assert [str(w.message) for w in seen if w.category is UserWarning] == [
        "SparseAdam: the state_dict['partitions'] records no partition of its tables (saved "
        "before distopt recorded them), so it cannot be checked: it is loaded as if saved from "
        "tables partitioned as these are (partition='range' of 23 rows over 2 owners; "
        "partition='range' of 9 rows over 2 owners)"]
    harness.train(sharded, opt, None, None, range(2, 4))
    harness.train(resumed_tables, resumed, None, None, range(2, 4))
    for a, b in zip(sharded, resumed_tables):
        assert torch.equal(a.full_weight(), b.full_weight())


def test_a_checkpoint_of_another_row_count_names_the_partitions(world, tmp_path):
    """``load`` checks the partitions before the shapes, so a table of one more row is
    refused naming both partitions (before: "parameter 1 has shape (11, 4) ...")."""
    sharded, _ = harness.make_tables("range")
    opt = SparseAdam(sharded, lr=0.05)
    harness.train(sharded, opt, None, None, range(1))
    opt.save(str(tmp_path))
    bigger = [ShardedEmbedding.from_pretrained(
        torch.cat([emb.full_weight(), emb.full_weight()[:1]]), emb.owners, partition="range")
        if k == 0 else ShardedEmbedding.from_pretrained(emb.full_weight(), emb.owners,
                                                        partition="range")
        for k, emb in enumerate(sharded)]
    other = SparseAdam(bigger, lr=0.05)
    with pytest.raises(ValueError) as raised:
        other.load(str(tmp_path))
    rows = harness.TABLES[0][0]
    assert str(raised.value) == (
        f"Invalid checkpoint {os.path.abspath(str(tmp_path))!r}: table 0 was saved with "
        f"partition='range' of {rows} rows over 2 owners (expected partition='range' of "
        f"{rows + 1} rows over 2 owners, this table's: each row's state would land on "
        f"another row)")
