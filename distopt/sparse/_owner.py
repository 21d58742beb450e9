"""The owner's side of a ShardedEmbedding: its shards, their lookups, and averaging.

A shard is a leaf tensor requiring grad, held by the RRef returned to the trainer (so it
lives as long as the trainer's ShardedEmbedding) and registered here under an integer id
that lookups send instead of the RRef: an int pickles cheaply, while an RRef sent back to
its owner costs the RRef protocol's extra messages at every lookup.

``duplicates="mean"`` needs, at step time, how many times each row was looked up in the
step's autograd context. The context's gradient cannot tell: the engine accumulates a
shard's gradients with sparse ``add``, whose CPU kernel merges entries of equal rows where
it meets them (measured on torch 2.13: lookups [0, 0, 7] and [0, 11, 0] leave 5 entries,
three of row 0, not four), so the sum of each row is right but its entry count is not. So
lookups made for averaging optimizers record their rows here, per context and shard, and
``average_duplicates`` turns the context's gradient into the per-row mean in place before
the optimizer steps.
"""
import itertools
import threading
import weakref
from typing import Dict, List, Optional, Tuple

import torch
import torch.distributed.autograd as dist_autograd
import torch.distributed.rpc as rpc
import torch.nn.functional as F
from torch import Tensor

from distopt.context import current_context_id, has_context
from distopt.errors import returns_failure
from distopt.local_optimizer import cuda_device_indices, synchronize_devices
from distopt.sparse.partition import Partition

# Weak: the trainer's RRef (through the OwnerRRef here) keeps a shard alive.
_shards: "weakref.WeakValueDictionary[int, Tensor]" = weakref.WeakValueDictionary()
_ids = itertools.count(1)
_ids_lock = threading.Lock()


def _register(shard: Tensor) -> Tuple[rpc.RRef, int]:
    with _ids_lock:
        shard_id = next(_ids)
        _shards[shard_id] = shard
    return rpc.RRef(shard), shard_id


def new_random_shard(
    partition: Partition,
    position: int,
    embedding_dim: int,
    seed: int,
    dtype: torch.dtype,
    device: Optional[str] = None,
) -> Tuple[rpc.RRef, int]:
    """RPC target: this owner's rows of a table drawn from N(0, 1) like ``nn.Embedding``.

    Every owner draws the whole table from a generator seeded with ``seed`` and keeps its
    rows, so the table equals ``torch.manual_seed(seed); nn.Embedding(n, d).weight``
    whatever the partition; the draw is transient (about 1 s and 512 MB for 2M x 64), on
    the CPU, and the rows kept move to ``device`` (None: stay on the CPU).

    Returns:
        (an RRef to the shard, its id here).
    """
    generator = torch.Generator().manual_seed(seed)
    table = torch.randn(partition.num_embeddings, embedding_dim, generator=generator, dtype=dtype)
    shard = table.index_select(0, partition.global_rows(position))
    del table
    if device is not None:
        shard = shard.to(device)
    return _register(shard.requires_grad_(True))


def new_shard_from(rows: Tensor, device: Optional[str] = None) -> Tuple[rpc.RRef, int]:
    """RPC target: a shard holding a copy of ``rows`` (``from_pretrained``), on ``device``
    (None: the CPU).

    Returns:
        (an RRef to the shard, its id here).
    """
    return _register(rows.detach().to(device or rows.device, copy=True).requires_grad_(True))


def shard_of(shard_id: int) -> Tensor:
    """The shard registered under ``shard_id``.

    Raises:
        RuntimeError: no live shard has that id (its ShardedEmbedding was freed).
    """
    shard = _shards.get(shard_id)
    if shard is None:
        raise RuntimeError(
            f"Invalid shard id: {shard_id!r} on {rpc.get_worker_info().name} (expected a live "
            f"ShardedEmbedding's shard)"
        )
    return shard


def lookup(shard_id: int, rows: Tensor, track: bool = False) -> Tensor:
    """RPC target: rows of a shard, whose backward yields a row-sparse gradient.

    Called inside the trainer's distributed autograd context, RPC records the send and
    receive; the backward pass sends back only the gradient of the returned rows, which
    ``embedding(..., sparse=True)`` turns into a sparse COO gradient of the shard holding
    only those rows.

    Args:
        shard_id: the shard.
        rows: the shard's rows to return (local numbers), repeats allowed.
        track: record ``rows`` under the current autograd context, for
            ``average_duplicates``.

    Returns:
        The rows, on the CPU (from a GPU shard, the copy is part of the autograd graph, so
        no TensorPipe device map is needed and the gradient returns to the GPU); outside an
        autograd context, detached (inference).
    """
    shard = shard_of(shard_id)
    rows = rows.to(shard.device)
    context_id = current_context_id()
    if context_id is None:  # no context: inference, nothing to differentiate
        return F.embedding(rows, shard.detach()).cpu()
    if track:
        _record(context_id, shard_id, rows)
    return F.embedding(rows, shard, sparse=True).cpu()


# (autograd context id, shard id) -> the rows each tracked lookup requested.
_lookups: Dict[Tuple[int, int], List[Tensor]] = {}
_lookups_lock = threading.Lock()
# Records of contexts that ended without an averaging step are dropped once there are
# more than this many keys (then the bound doubles, so pruning costs O(1) per lookup).
_prune_at = [64]


def _record(context_id: int, shard_id: int, rows: Tensor) -> None:
    with _lookups_lock:
        _lookups.setdefault((context_id, shard_id), []).append(rows)
        if len(_lookups) > _prune_at[0]:
            for key in [k for k in _lookups if not has_context(k[0])]:
                del _lookups[key]
            _prune_at[0] = max(64, 2 * len(_lookups))


def tracked_records() -> int:
    """How many (context, shard) lookup records this worker holds (for tests)."""
    with _lookups_lock:
        return len(_lookups)


@returns_failure
def average_duplicates(shard_ids: List[int], context_id: int) -> None:
    """RPC target: each shard's gradient in the context becomes the mean over its lookups.

    For a row looked up :math:`k` times in the context (tracked lookups, on any trainer
    thread or process), its summed gradient is divided by :math:`k`; the context's sparse
    gradient is replaced in place by a coalesced one, so the optimizer's step that follows
    reads the means. Costs a coalesce of the rows looked up, never an operation on the
    whole shard. The records are consumed: a second call for the same context leaves the
    gradients as they are.

    Returns:
        None, or a ``RemoteFailure`` naming what went wrong.
    """
    gradients = dist_autograd.get_gradients(context_id) if has_context(context_id) else {}
    shards = [shard_of(i) for i in shard_ids]
    # the backward pass's gradients are complete (see LocalOptimizer.synchronize)
    synchronize_devices(cuda_device_indices(shards))
    for shard_id, shard in zip(shard_ids, shards):
        with _lookups_lock:
            records = _lookups.pop((context_id, shard_id), None)
        grad = gradients.get(shard)
        if records is None or grad is None or not grad.is_sparse:
            continue
        with torch.no_grad():
            grad.copy_(_mean_rows(grad, torch.cat(records)))


def _mean_rows(grad: Tensor, looked_up: Tensor) -> Tensor:
    """``grad`` coalesced, each row divided by how often it occurs in ``looked_up``.

    Raises:
        RuntimeError: ``grad`` holds a row no tracked lookup requested (the shard got a
            gradient some other way), so no count is known for it.
    """
    rows, counts = torch.unique(looked_up, sorted=True, return_counts=True)
    summed = grad.coalesce()
    grad_rows = summed.indices()[0]
    at = torch.searchsorted(rows, grad_rows).clamp_(max=rows.numel() - 1)
    if not torch.equal(rows[at], grad_rows):
        raise RuntimeError(
            "Invalid gradient: the shard has gradient rows no lookup in this context requested "
            "(expected its gradient to come from ShardedEmbedding lookups only)"
        )
    values = summed.values()
    scale = counts[at].to(values.dtype).reshape([-1] + [1] * (values.dim() - 1))
    return torch.sparse_coo_tensor(
        summed.indices(), values / scale, summed.shape, is_coalesced=True
    )


def shard_value(shard_id: int) -> Tensor:
    """RPC target: a copy of a shard's current values, on the CPU."""
    return shard_of(shard_id).detach().to("cpu", copy=True)


