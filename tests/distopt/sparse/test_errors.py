"""Optimizer arguments torch.optim rejects, and bad embeddings, fail on the trainer at once."""
import pytest
import torch
import torch.distributed.autograd as dist_autograd

from distopt import DistributedOptimizerError
from distopt.sparse import ShardedEmbedding, SparseAdagrad, SparseAdam, SparseSGD


@pytest.fixture(scope="module")
def emb(world):
    return ShardedEmbedding(6, 2, ["worker1", "worker2"], seed=0)


@pytest.mark.parametrize(
    "cls, kwargs, error, words",
    [
        (SparseSGD, {"lr": 0.1, "weight_decay": 0.01}, ValueError, "Invalid weight_decay: 0.01"),
        (SparseAdagrad, {"weight_decay": 0.1}, ValueError, "Invalid weight_decay: 0.1"),
        (SparseSGD, {"lr": -1.0}, ValueError, "Invalid learning rate"),
        (SparseSGD, {"lr": 0.1, "nesterov": True}, ValueError, "Nesterov"),
        (SparseAdam, {"betas": (1.5, 0.9)}, ValueError, "Invalid beta parameter"),
        (SparseAdagrad, {"eps": -1.0}, ValueError, "Invalid epsilon"),
        (SparseAdam, {"duplicates": "max"}, ValueError, "Invalid duplicates: 'max'"),
        (SparseAdam, {"lr": "fast"}, TypeError, r"^Invalid lr: 'fast' \(expected a float"),
        (SparseSGD, {"momentum": None}, TypeError, r"^Invalid momentum: None \(expected a float"),
        (SparseAdagrad, {"eps": "x"}, TypeError, r"^Invalid eps: 'x' \(expected a float"),
    ],
    ids=["sgd-wd", "adagrad-wd", "lr", "nesterov", "betas", "eps", "duplicates", "lr-type",
         "momentum-type", "eps-type"],
)
def test_bad_arguments_are_refused_before_any_owner(emb, rpc_calls, cls, kwargs, error, words):
    with pytest.raises(error, match=words):
        cls([emb], **kwargs)
    assert rpc_calls == []


def test_bad_embeddings(emb):
    with pytest.raises(ValueError, match="at least one"):
        SparseSGD([], lr=0.1)
    with pytest.raises(TypeError, match=r"embeddings\[1\]: Tensor"):
        SparseSGD([emb, torch.zeros(2)], lr=0.1)
    with pytest.raises(ValueError, match="same table"):
        SparseSGD([emb, emb], lr=0.1)


def test_single_embedding_and_defaults(emb):
    opt = SparseAdagrad(emb)
    assert opt.embeddings == [emb]
    group = opt.param_groups[0]
    assert (group["lr"], group["lr_decay"], group["eps"]) == (1e-2, 0.0, 1e-10)
    assert SparseAdam(emb).param_groups[0]["betas"] == (0.9, 0.999)
    assert SparseSGD(emb).param_groups[0]["lr"] == 1e-3


def test_bad_context_is_rejected_before_any_owner(emb):
    opt = SparseSGD([emb], lr=0.1, duplicates="mean")
    with pytest.raises(ValueError, match="context_id"):
        opt.step(123456789)


def test_owner_failure_names_the_worker(emb):
    # Row 0's gradient comes from an untracked lookup: worker1 has no count for it.
    opt = SparseSGD([emb], lr=0.1, duplicates="mean")
    with dist_autograd.context() as ctx:
        emb.track_lookups = False
        untracked = emb(torch.tensor([0]))
        emb.track_lookups = True
        tracked = emb(torch.tensor([1, 4]))
        dist_autograd.backward(ctx, [untracked.sum() + tracked.sum()])
        with pytest.raises(DistributedOptimizerError) as info:
            opt.step(ctx)
    assert list(info.value.failures) == ["worker1"]
    assert "RuntimeError: Invalid gradient" in info.value.failures["worker1"]
    # the averaging round failed before any owner stepped
    assert info.value.succeeded == [] and info.value.applied == {"worker1": "none"}
    assert str(info.value).splitlines()[-1] == (
        "  not applied on ['worker1'] (their parameters hold the previous step): nothing was "
        "stepped anywhere"
    )
