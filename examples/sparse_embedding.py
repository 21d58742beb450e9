"""A recommendation model whose user and item tables are sharded over two owners.

Three processes: ``trainer`` runs the training loop; ``owner1`` and ``owner2`` hold the
embedding tables, each split over both of them with ``distopt.sparse.ShardedEmbedding``
(users dealt round-robin, ``partition="hash"``; items in contiguous blocks, ``"range"``).
The model scores a (user, item) pair by the dot product of their rows; the loss is binary
cross-entropy against whether the user interacted with the item.

Every step looks up the batch's rows (one RPC per owner and table, in parallel) inside a
``torch.distributed.autograd`` context; the backward pass sends each owner only the
gradients of its rows, and a row-sparse optimizer (``SparseAdam`` by default) updates, on
each owner, only the rows of this batch. The synthetic interactions come from hidden
"true" user and item factors: user u interacted with item i when their dot product is
positive, observed with 5% label noise.

One machine (spawns the three processes on 127.0.0.1, a free port)::

    python examples/sparse_embedding.py
    python examples/sparse_embedding.py --optimizer SparseAdagrad --lr 0.1 --duplicates mean

Several machines: one process per role with ``torchrun`` (rank 0 is the trainer, ranks 1
and 2 the owners)::

    torchrun --nnodes 3 --nproc-per-node 1 --node-rank R \\
        --master-addr HOST0 --master-port 29500 examples/sparse_embedding.py
"""
import argparse
import os
import sys
import time
from typing import List, Optional, Tuple

import torch
import torch.distributed.autograd as dist_autograd
import torch.nn.functional as F
from torch import Tensor

try:
    import distopt  # noqa: F401
except ImportError:  # running from a clone that is not installed
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from distopt.sparse import ShardedEmbedding, SparseAdagrad, SparseAdam, SparseSGD

import _launch

WORKERS = ["trainer", "owner1", "owner2"]
OWNERS = WORKERS[1:]
OPTIMIZERS = {"SparseAdam": SparseAdam, "SparseAdagrad": SparseAdagrad, "SparseSGD": SparseSGD}


class Interactions:
    """Synthetic (user, item, clicked) triples from hidden factors, with label noise.

    Args:
        users: number of users.
        items: number of items.
        rank: size of the hidden factors.
        seed: seed of the factors and of every batch.
    """

    def __init__(self, users: int, items: int, rank: int, seed: int) -> None:
        self.gen = torch.Generator().manual_seed(seed)
        self.users, self.items = users, items
        self.user_factors = torch.randn(users, rank, generator=self.gen)
        self.item_factors = torch.randn(items, rank, generator=self.gen)

    def batch(self, size: int, noise: float = 0.05) -> Tuple[Tensor, Tensor, Tensor]:
        """``size`` random pairs (popular items drawn more often) and their labels."""
        users = torch.randint(0, self.users, (size,), generator=self.gen)
        # A skewed item distribution, as in real catalogues: item i ~ 1 / (i + 10).
        weights = 1.0 / (torch.arange(self.items, dtype=torch.float32) + 10.0)
        items = torch.multinomial(weights, size, replacement=True, generator=self.gen)
        truth = (self.user_factors[users] * self.item_factors[items]).sum(-1) > 0
        flip = torch.rand(size, generator=self.gen) < noise
        return users, items, (truth ^ flip).float()


def score(user_table: ShardedEmbedding, item_table: ShardedEmbedding, users: Tensor,
          items: Tensor) -> Tensor:
    """The model: one logit per pair, the dot product of the user's and the item's rows."""
    return (user_table(users) * item_table(items)).sum(-1)


def train(options: argparse.Namespace) -> None:
    """The trainer's loop: build the sharded tables, train, report."""
    data = Interactions(options.users, options.items, options.rank, options.seed)
    # Users: nn.Embedding's N(0, 1) start, drawn on the owners, dealt round-robin.
    user_table = ShardedEmbedding(
        options.users, options.dim, OWNERS, partition="hash", seed=options.seed
    )
    # Items: a small random start from the trainer, in contiguous blocks.
    init = 0.1 * torch.randn(options.items, options.dim,
                             generator=torch.Generator().manual_seed(options.seed + 1))
    item_table = ShardedEmbedding.from_pretrained(init, OWNERS, partition="range")
    opt = OPTIMIZERS[options.optimizer](
        [user_table, item_table], lr=options.lr, duplicates=options.duplicates
    )
    print(
        f"users {options.users} x {options.dim} over {user_table.owners} (hash, rows "
        f"{user_table.shard_sizes}); items {options.items} x {options.dim} (range, rows "
        f"{item_table.shard_sizes}); {options.optimizer}(lr={options.lr}, "
        f"duplicates={options.duplicates!r}); compiled: {opt.is_functional_optim}",
        flush=True,
    )
    held_out = data.batch(4096, noise=0.0)
    print("step      loss  accuracy  rows/step  steps/s", flush=True)
    window: List[float] = []
    first: Optional[float] = None
    last = 0.0
    start = time.perf_counter()
    for step in range(1, options.steps + 1):
        users, items, labels = data.batch(options.batch_size)
        with dist_autograd.context() as ctx:
            logits = score(user_table, item_table, users, items)
            loss = F.binary_cross_entropy_with_logits(logits, labels)
            dist_autograd.backward(ctx, [loss])
            opt.step(ctx)
        window.append(float(loss.detach()))
        if step % options.log_every == 0 or step == options.steps:
            mean_loss = sum(window) / len(window)
            first = mean_loss if first is None else first
            last = mean_loss
            with torch.no_grad():  # outside a context the lookups are plain inference
                accuracy = ((score(user_table, item_table, *held_out[:2]) > 0).float()
                            == held_out[2]).float().mean()
            rows = users.unique().numel() + items.unique().numel()
            rate = step / (time.perf_counter() - start)
            print(f"{step:4d}  {mean_loss:8.4f}  {float(accuracy):8.3f}  {rows:9d}  {rate:7.1f}",
                  flush=True)
            window = []
    print(f"loss: first {first:.4f} -> final {last:.4f}", flush=True)


def role(name: str, options: argparse.Namespace) -> None:
    """Run this process's part: the trainer trains; the owners only serve their shards."""
    if name == "trainer":
        train(options)


def parse_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument("--steps", type=int, default=300, help="training steps")
    parser.add_argument("--optimizer", choices=sorted(OPTIMIZERS), default="SparseAdam",
                        help="row-sparse optimizer from distopt.sparse")
    parser.add_argument("--lr", type=float, default=0.1, help="learning rate")
    parser.add_argument("--duplicates", choices=("sum", "mean"), default="sum",
                        help="how gradients of a row looked up several times in a step combine")
    parser.add_argument("--users", type=int, default=2_000, help="rows of the user table")
    parser.add_argument("--items", type=int, default=500, help="rows of the item table")
    parser.add_argument("--dim", type=int, default=16, help="embedding size")
    parser.add_argument("--rank", type=int, default=4, help="size of the hidden true factors")
    parser.add_argument("--batch-size", type=int, default=1024, help="interactions per step")
    parser.add_argument("--log-every", type=int, default=50, help="steps between progress lines")
    parser.add_argument("--seed", type=int, default=0, help="data and initialisation seed")
    _launch.add_network_arguments(parser)
    options = parser.parse_args(argv)
    for name in ("steps", "users", "items", "dim", "rank", "batch_size", "log_every"):
        if getattr(options, name) < 1:
            parser.error(
                f"Invalid --{name.replace('_', '-')}: {getattr(options, name)!r} (expected >= 1)"
            )
    if options.users < len(OWNERS) or options.items < len(OWNERS):
        parser.error(f"Invalid table size: expected at least {len(OWNERS)} rows per table")
    return options


def main(argv: Optional[List[str]] = None) -> None:
    options = parse_args(argv)
    _launch.run(WORKERS, role, options)


if __name__ == "__main__":
    main()
