"""Trainer-side helpers: sharded tables and local nn.Embedding copies trained in lockstep.

Every step looks up the same indices in the sharded tables (inside a distributed autograd
context) and in local ``nn.Embedding(sparse=True)`` copies, so tests assert distopt's
results against torch.optim's.
"""
from typing import Callable, List, Optional, Sequence, Tuple

import torch
import torch.distributed.autograd as dist_autograd
from torch import Tensor, nn

from distopt.sparse import ShardedEmbedding

#: (rows, dim) of the two tables every parity test trains together.
TABLES = ((23, 4), (9, 3))
OWNERS = ("worker1", "worker2")
STEPS = 4


def step_lookups(step: int) -> List[List[Tensor]]:
    """For each table, the index tensors looked up at ``step`` (several lookups per step).

    Indices repeat within a lookup and across lookups, and every step leaves some rows
    untouched (the first table's rows 20.. are never looked up; others come and go).
    """
    gen = torch.Generator().manual_seed(100 + step)
    first = [
        torch.randint(0, 20, (3, 4), generator=gen),  # 2-D, like a batch of bags
        torch.tensor([step, step, 7]),  # a row twice in one lookup, 7 at every step
    ]
    second = [torch.randint(0, 9, (5,), generator=gen, dtype=torch.int64).to(torch.int32)]
    return [first, second]


def targets(step: int, shape: Tuple[int, ...]) -> Tensor:
    gen = torch.Generator().manual_seed(7 * step + shape[-1])
    return torch.randn(shape, generator=gen)


def loss_of(lookup: Callable[[int, Tensor], Tensor], step: int) -> Tensor:
    """A non-linear loss of every lookup of ``step``; ``lookup(table, indices)`` -> rows."""
    terms = []
    for t, lookups in enumerate(step_lookups(step)):
        for j, idx in enumerate(lookups):
            rows = lookup(t, idx)
            terms.append((rows - targets(step + j, tuple(rows.shape))).pow(2).sum())
    return torch.stack(terms).sum()


def make_tables(
    partition: str, owners: Sequence[str] = OWNERS
) -> Tuple[List[ShardedEmbedding], List[nn.Embedding]]:
    """Sharded tables and local copies holding the same values."""
    sharded = [
        ShardedEmbedding(n, d, list(owners), partition=partition, seed=10 + i)
        for i, (n, d) in enumerate(TABLES)
    ]
    local = [
        nn.Embedding.from_pretrained(emb.full_weight(), freeze=False, sparse=True)
        for emb in sharded
    ]
    return sharded, local


def counts_per_row(step: int, table: int, num_rows: int) -> Tensor:
    """How many times each row of ``table`` is looked up at ``step`` (all lookups)."""
    idx = torch.cat([i.reshape(-1).to(torch.int64) for i in step_lookups(step)[table]])
    return torch.bincount(idx, minlength=num_rows)


def local_step(
    local: Sequence[nn.Embedding], ref: torch.optim.Optimizer, step: int, mean: bool = False
) -> None:
    """One torch.optim step on the local tables; ``mean`` divides each row's gradient by its
    number of lookups (the reference for ``duplicates="mean"``)."""
    ref.zero_grad()
    loss_of(lambda t, idx: local[t](idx.to(torch.int64)), step).backward()
    if mean:
        for t, emb in enumerate(local):
            grad = emb.weight.grad.coalesce()
            counts = counts_per_row(step, t, emb.num_embeddings).to(grad.dtype)
            rows = grad.indices()[0]
            values = grad.values() / counts[rows].unsqueeze(1)
            emb.weight.grad = torch.sparse_coo_tensor(grad.indices(), values, grad.shape)
    ref.step()


def dist_step(sharded: Sequence[ShardedEmbedding], opt: torch.optim.Optimizer, step: int) -> None:
    """The same step, distributed."""
    with dist_autograd.context() as ctx:
        loss = loss_of(lambda t, idx: sharded[t](idx), step)
        dist_autograd.backward(ctx, [loss])
        opt.step(ctx)


def train(
    sharded: Sequence[ShardedEmbedding],
    opt: torch.optim.Optimizer,
    local: Optional[Sequence[nn.Embedding]],
    ref: Optional[torch.optim.Optimizer],
    steps: range,
    mean: bool = False,
) -> None:
    """Lockstep steps (local ones only when ``ref`` is given)."""
    for step in steps:
        dist_step(sharded, opt, step)
        if ref is not None:
            local_step(local, ref, step, mean)


def assert_tables_equal(
    sharded: Sequence[ShardedEmbedding], local: Sequence[nn.Embedding], what: str = ""
) -> None:
    for t, (emb, ref) in enumerate(zip(sharded, local)):
        torch.testing.assert_close(
            emb.full_weight(), ref.weight.detach(),
            msg=lambda m, t=t: f"{what} table {t}: {m}",
        )
