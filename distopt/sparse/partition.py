"""How a table's rows are split over its owners: contiguous blocks ("range") or modulo ("hash").

A partition maps a global row to (owner position, local row) with tensor arithmetic, so a
lookup of any batch costs a few vectorized ops on the trainer and nothing per row in Python.
"""
from typing import List, Sequence, Union

import torch
from torch import Tensor

#: The partitions ``make_partition`` knows, by name.
PARTITIONS = ("range", "hash")


class RangePartition:
    """Contiguous blocks of rows: owner ``k`` holds rows ``[starts[k], starts[k + 1])``.

    The first ``num_embeddings % num_owners`` owners hold one row more than the others, as
    :func:`torch.tensor_split` splits.

    Args:
        num_embeddings: rows in the table.
        num_owners: owners sharing it.
    """

    def __init__(self, num_embeddings: int, num_owners: int) -> None:
        self.num_embeddings = num_embeddings
        self.num_owners = num_owners
        base, extra = divmod(num_embeddings, num_owners)
        self.sizes: List[int] = [base + (1 if k < extra else 0) for k in range(num_owners)]
        starts = [0]
        for size in self.sizes:
            starts.append(starts[-1] + size)
        self.starts: List[int] = starts
        # The first row of owners 1..K-1: bucketize against them gives each row's owner.
        self._boundaries = torch.tensor(starts[1:-1], dtype=torch.int64)

    def owner_of(self, rows: Tensor) -> Tensor:
        """The owner position of each global row (int64, same shape)."""
        return torch.bucketize(rows, self._boundaries, right=True)

    def local_of(self, rows: Tensor, owners: Tensor) -> Tensor:
        """Each global row's row in its owner's shard, given ``owners = owner_of(rows)``."""
        starts = torch.tensor(self.starts[:-1], dtype=torch.int64)
        return rows - starts[owners]

    def global_rows(self, owner: int) -> Tensor:
        """The global rows owner ``owner`` holds, in the order of its shard."""
        return torch.arange(self.starts[owner], self.starts[owner + 1], dtype=torch.int64)


class HashPartition:
    """Rows dealt round-robin: row ``r`` is row ``r // K`` of owner ``r % K`` (K owners).

    Neighbouring rows land on different owners, which spreads hot id ranges (new users,
    popular items) over every owner.

    Args:
        num_embeddings: rows in the table.
        num_owners: owners sharing it.
    """

    def __init__(self, num_embeddings: int, num_owners: int) -> None:
        self.num_embeddings = num_embeddings
        self.num_owners = num_owners
        self.sizes: List[int] = [
            (num_embeddings - k + num_owners - 1) // num_owners for k in range(num_owners)
        ]

    def owner_of(self, rows: Tensor) -> Tensor:
        """The owner position of each global row (int64, same shape)."""
        return torch.remainder(rows, self.num_owners)

    def local_of(self, rows: Tensor, owners: Tensor) -> Tensor:
        """Each global row's row in its owner's shard, given ``owners = owner_of(rows)``."""
        return torch.div(rows, self.num_owners, rounding_mode="floor")

    def global_rows(self, owner: int) -> Tensor:
        """The global rows owner ``owner`` holds, in the order of its shard."""
        return torch.arange(owner, self.num_embeddings, self.num_owners, dtype=torch.int64)


#: Either partition: both have ``sizes``, ``owner_of``, ``local_of`` and ``global_rows``.
Partition = Union[RangePartition, HashPartition]


def make_partition(name: str, num_embeddings: int, owners: Sequence[object]) -> Partition:
    """The partition called ``name`` of ``num_embeddings`` rows over ``owners``.

    Raises:
        ValueError: an unknown name.
    """
    if name == "range":
        return RangePartition(num_embeddings, len(owners))
    if name == "hash":
        return HashPartition(num_embeddings, len(owners))
    raise ValueError(f"Invalid partition: {name!r} (expected one of {list(PARTITIONS)!r})")
