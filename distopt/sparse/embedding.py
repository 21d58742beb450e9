"""ShardedEmbedding: an embedding table whose rows live on several RPC workers.

The trainer holds no rows: it knows the partition (which owner holds which row) and one
RRef per shard. A lookup sends each owner that holds a requested row one ``rpc_async``
with its local row numbers, all in flight at once; inside a distributed autograd context,
RPC records the sends and receives, so the backward pass returns to each owner the
gradient of the rows it sent, and nothing else, which the owner's
``embedding(..., sparse=True)`` turns into a row-sparse gradient of its shard.

In a context, every lookup, an empty one included, is also joined with a trainer-local
leaf of the table that holds no rows (its marker); backward through any lookup leaves the
marker a gradient in the context, so ``tables_with_gradient`` tells, without asking an
owner, whether the table got a gradient, which is when torch.optim would step it.
"""
import logging
from typing import Any, Dict, List, Optional, Sequence, Tuple, Union

import torch
import torch.distributed.autograd as dist_autograd
import torch.distributed.rpc as rpc
from torch import Tensor, nn

from distopt import _torch
from distopt.context import current_context_id
from distopt.fanout import fan_out
from distopt.sparse import _owner
from distopt.sparse.partition import PARTITIONS, Partition, make_partition

logger = logging.getLogger(__name__)

#: An owner as the constructor takes it: a worker name or its WorkerInfo.
Owner = Union[str, rpc.WorkerInfo]

_INTEGER_DTYPES = (torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8)


class ShardedEmbedding(nn.Module):
    r"""A lookup table like :class:`torch.nn.Embedding`, its rows split over RPC workers.

    Row :math:`r` of the :math:`n \times d` table lives on one owner. With
    ``partition="range"`` owner :math:`k` of :math:`K` holds a contiguous block (the first
    :math:`n \bmod K` blocks one row longer); with ``partition="hash"`` it holds the rows
    :math:`r \equiv k \pmod K`, row :math:`r` being its row :math:`\lfloor r / K \rfloor`.
    Each owner keeps its shard as a leaf tensor requiring grad; ``parameter_rrefs()``
    gives them, in owner order, to :class:`distopt.DistributedOptimizer` or to
    :class:`distopt.sparse.SparseSGD` and its siblings.

    The table starts as ``nn.Embedding``'s does, :math:`\mathcal{N}(0, 1)`, and equals
    ``torch.manual_seed(seed); nn.Embedding(n, d).weight`` whatever the partition.

    Calling it looks rows up: one RPC per owner holding any requested row, in parallel.
    Inside a ``dist_autograd.context()`` the result is differentiable, and the backward
    pass sends each owner only the gradient of its requested rows (repeated rows repeated),
    never a table-sized tensor.

    Args:
        num_embeddings: rows in the table, at least one per owner.
        embedding_dim: size of each row.
        owners: the workers holding the rows (names or WorkerInfos), distinct.
        partition: ``"range"`` or ``"hash"``.
        seed: seed of the initial table; None draws one from torch's global generator on
            this process (so ``torch.manual_seed`` here makes it reproducible too).
        dtype: the table's dtype (default: ``torch.get_default_dtype()``).
        device: where each owner keeps its shard and its optimizer state (default: the
            CPU); ``"cuda"`` or ``"cuda:1"`` puts them on that GPU of every owner. The
            initial table is drawn on the CPU first, so it is the same on any device.
            Looked-up rows come back to the caller as CPU tensors (no TensorPipe device map
            needed); autograd carries their gradient back to the GPU shard.

    Raises:
        TypeError: a size is not an int.
        ValueError: a size is not positive, fewer rows than owners, an unknown partition,
            an owner named twice or not in the RPC world (all before any shard is created).
        RuntimeError: some owners failed to create their shard; names them.

    Example::

        >>> users = ShardedEmbedding(1_000_000, 64, ["worker1", "worker2"], partition="hash")
        >>> opt = SparseAdam([users], lr=1e-3)
        >>> with dist_autograd.context() as ctx:
        ...     loss = users(torch.tensor([[3, 17], [3, 99]])).pow(2).sum()
        ...     dist_autograd.backward(ctx, [loss])
        ...     opt.step(ctx)
    """

    def __init__(
        self,
        num_embeddings: int,
        embedding_dim: int,
        owners: Sequence[Owner],
        *,
        partition: str = "range",
        seed: Optional[int] = None,
        dtype: Optional[torch.dtype] = None,
        device: Optional[Union[str, torch.device]] = None,
    ) -> None:
        super().__init__()
        device = _shard_device(device)
        dtype = torch.get_default_dtype() if dtype is None else dtype
        self._setup(num_embeddings, embedding_dim, owners, partition, dtype)
        if seed is None:
            seed = int(torch.randint(0, 2**62, ()).item())
        if isinstance(seed, bool) or not isinstance(seed, int):
            raise TypeError(f"Invalid seed: {seed!r} (expected an int or None)")
        self._create(
            [
                (_owner.new_random_shard, (self._partition, k, embedding_dim, seed, dtype, device))
                for k in range(len(self._infos))
            ]
        )

    @classmethod
    def from_pretrained(
        cls,
        weight: Tensor,
        owners: Sequence[Owner],
        *,
        partition: str = "range",
        device: Optional[Union[str, torch.device]] = None,
    ) -> "ShardedEmbedding":
        """A ShardedEmbedding holding a copy of ``weight`` (trainable), split over ``owners``.

        Each owner receives only its rows, in parallel.

        Args:
            weight: the ``(num_embeddings, embedding_dim)`` table, floating point.
            owners: the workers holding the rows, distinct.
            partition: ``"range"`` or ``"hash"``.
            device: where the owners keep their shards, as for the constructor.

        Raises:
            TypeError: ``weight`` is not a floating-point tensor.
            ValueError: ``weight`` is not 2-D, or as the constructor.
        """
        if not isinstance(weight, Tensor) or not weight.is_floating_point():
            got = weight.dtype if isinstance(weight, Tensor) else type(weight).__name__
            raise TypeError(f"Invalid weight: {got} (expected a floating-point Tensor)")
        if weight.dim() != 2:
            raise ValueError(
                f"Invalid weight: shape {tuple(weight.shape)} (expected 2-D, "
                f"(num_embeddings, embedding_dim))"
            )
        device = _shard_device(device)
        self = cls.__new__(cls)
        nn.Module.__init__(self)
        self._setup(weight.shape[0], weight.shape[1], owners, partition, weight.dtype)
        rows = weight.detach()
        # index_select copies: RPC would send a view's whole storage.
        self._create(
            [
                (_owner.new_shard_from, (rows.index_select(0, self._partition.global_rows(k)).cpu(), device))
                for k in range(len(self._infos))
            ]
        )
        return self

    def _setup(
        self,
        num_embeddings: int,
        embedding_dim: int,
        owners: Sequence[Owner],
        partition: str,
        dtype: torch.dtype,
    ) -> None:
        """Check every argument and resolve the owners; no shard exists yet."""
        for name, value in (("num_embeddings", num_embeddings), ("embedding_dim", embedding_dim)):
            if isinstance(value, bool) or not isinstance(value, int):
                raise TypeError(f"Invalid {name}: {value!r} (expected an int)")
            if value < 1:
                raise ValueError(f"Invalid {name}: {value!r} (expected >= 1)")
        if partition not in PARTITIONS:
            raise ValueError(
                f"Invalid partition: {partition!r} (expected one of {list(PARTITIONS)!r})"
            )
        infos = _resolve_owners(owners)
        if num_embeddings < len(infos):
            raise ValueError(
                f"Invalid num_embeddings: {num_embeddings!r} (expected at least one row per "
                f"owner, >= {len(infos)})"
            )
        self.num_embeddings = num_embeddings
        self.embedding_dim = embedding_dim
        self.partition = partition
        self.dtype = dtype
        self._infos: List[rpc.WorkerInfo] = infos
        self._partition: Partition = make_partition(partition, num_embeddings, infos)
        self._rrefs: List[rpc.RRef] = []
        self._ids: List[int] = []
        #: Whether lookups record their rows on the owners, for ``duplicates="mean"``
        #: optimizers (set by them; off, a lookup costs nothing extra).
        self.track_lookups = False
        # A leaf with no rows, joined into every lookup made in a distributed autograd
        # context: backward through any of them leaves it a (rowless) gradient in that
        # context, which is how ``tables_with_gradient`` tells that the table got one.
        self._marker = torch.zeros(0, embedding_dim, dtype=dtype, requires_grad=True)

    def _create(self, calls: List[Tuple[Any, tuple]]) -> None:
        """Create every shard at once, one rpc_async per owner; keep their RRefs and ids.

        Raises:
            DistributedOptimizerError: some owners failed; the shards created elsewhere go
                with their RRefs.
        """
        done = fan_out("construction", {
            info.name: (info, func, args) for info, (func, args) in zip(self._infos, calls)
        })
        results = [done[info.name] for info in self._infos]
        self._rrefs = [rref for rref, _ in results]
        self._ids = [shard_id for _, shard_id in results]
        logger.info(
            "ShardedEmbedding %dx%d: %s partition over %s (rows %s)", self.num_embeddings,
            self.embedding_dim, self.partition, self.owners, self._partition.sizes,
        )

    @property
    def owners(self) -> List[str]:
        """The owners' worker names, in shard order."""
        return [info.name for info in self._infos]

    @property
    def shard_sizes(self) -> List[int]:
        """How many rows each owner holds, in shard order."""
        return list(self._partition.sizes)

    def parameter_rrefs(self) -> List[rpc.RRef]:
        """RRefs to the shards, one per owner in owner order, for an optimizer."""
        return list(self._rrefs)

    def forward(self, indices: Tensor) -> Tensor:
        """Look rows up: ``indices`` of any shape -> ``(*indices.shape, embedding_dim)``.

        Inside a distributed autograd context the result is differentiable even when
        ``indices`` is empty, as ``nn.Embedding``'s is: backward through it alone gives the
        table a gradient with no rows, and the optimizer's next step counts it.

        Args:
            indices: integer row numbers in ``[0, num_embeddings)``.

        Returns:
            The rows, in the order requested; differentiable inside a distributed autograd
            context.

        Raises:
            TypeError: ``indices`` is not an integer tensor (names its dtype).
            IndexError: an index is out of range (names the first one, in flattened
                order); raised before any RPC.
        """
        flat = self._check_indices(indices)
        shape = (*indices.shape, self.embedding_dim)
        marked = current_context_id() is not None
        if flat.numel() == 0:
            return self._joined([], marked).view(shape)
        owner_of = self._partition.owner_of(flat)
        local = self._partition.local_of(flat, owner_of)
        if len(self._infos) == 1:
            return self._joined([self._lookup(0, local).wait()], marked).view(shape)
        # Group the requests by owner (stable, so each owner sees its rows in request order).
        order = torch.argsort(owner_of, stable=True)
        counts = torch.bincount(owner_of, minlength=len(self._infos)).tolist()
        pieces = local.index_select(0, order).split(counts)
        futures = [self._lookup(k, piece) for k, piece in enumerate(pieces) if counts[k]]
        rows = self._joined([fut.wait() for fut in futures], marked)
        if len(futures) == 1:  # one owner: its rows are in request order already
            return rows.view(shape)
        position = torch.empty_like(order)
        position[order] = torch.arange(order.numel())
        return rows.index_select(0, position).view(shape)

    def _joined(self, pieces: List[Tensor], marked: bool) -> Tensor:
        """The owners' rows as one tensor; when ``marked``, joined with the table's marker
        (no rows), so that backward through them reaches it.

        The marker costs nothing where ``torch.cat`` joins several owners' rows anyway, and
        one copy of the rows where one owner serves the whole lookup.
        """
        if marked:
            return torch.cat([*pieces, self._marker])
        if len(pieces) == 1:
            return pieces[0]
        if not pieces:
            return torch.empty(0, self.embedding_dim, dtype=self.dtype)
        return torch.cat(pieces)

    def _lookup(self, k: int, local_rows: Tensor) -> torch.futures.Future:
        args: tuple = (self._ids[k], local_rows)
        if self.track_lookups:
            args = (*args, True)
        return rpc.rpc_async(self._infos[k], _owner.lookup, args=args)

    def shard_ids(self) -> List[Tuple[rpc.WorkerInfo, int]]:
        """(owner, shard id on that owner) for each shard, in owner order."""
        return list(zip(self._infos, self._ids))

    def _check_indices(self, indices: Any) -> Tensor:
        if not isinstance(indices, Tensor):
            raise TypeError(
                f"Invalid indices: {type(indices).__name__} (expected an integer Tensor)"
            )
        if indices.dtype not in _INTEGER_DTYPES:
            raise TypeError(
                f"Invalid indices: dtype {indices.dtype} (expected an integer dtype, such as "
                f"torch.int64)"
            )
        flat = indices.reshape(-1).to(torch.int64)
        if flat.numel():
            bad = (flat < 0) | (flat >= self.num_embeddings)
            if bool(bad.any()):
                at = int(bad.nonzero()[0, 0])
                raise IndexError(
                    f"Invalid index: {int(flat[at])} at flattened position {at} (expected "
                    f"0 <= index < {self.num_embeddings}, the num_embeddings)"
                )
        return flat

    def full_weight(self) -> Tensor:
        """A copy of the whole table, gathered from every owner in parallel (tests, export)."""
        done = fan_out("full_weight", {
            info.name: (info, _owner.shard_value, (i,)) for info, i in zip(self._infos, self._ids)
        })
        shards = [done[info.name] for info in self._infos]
        table = torch.empty(self.num_embeddings, self.embedding_dim, dtype=shards[0].dtype)
        for k, shard in enumerate(shards):
            table.index_copy_(0, self._partition.global_rows(k), shard)
        return table

    def extra_repr(self) -> str:
        return (
            f"{self.num_embeddings}, {self.embedding_dim}, owners={self.owners!r}, "
            f"partition={self.partition!r}"
        )


def _shard_device(device: Any) -> Optional[str]:
    """The shards' device as a string for the owners (None: the CPU), or TypeError / ValueError
    naming the argument."""
    if device is None:
        return None
    if not isinstance(device, (str, torch.device)):
        raise TypeError(f"Invalid device: {device!r} (expected a str, a torch.device or None)")
    try:
        parsed = torch.device(device)
    except RuntimeError:
        raise ValueError(f"Invalid device: {device!r} (expected a device such as 'cuda:0')") from None
    if parsed.type == "meta":
        raise ValueError(f"Invalid device: {device!r} (the meta device holds no rows)")
    return str(parsed)


def tables_with_gradient(embeddings: Sequence[ShardedEmbedding], context_id: int) -> List[bool]:
    """Whether each table got a gradient in the distributed autograd context ``context_id``.

    A table gets one when the backward pass reaches any of its lookups made in that
    context on this process, empty lookups included, and whatever rows they hold: the
    condition under which torch sets ``nn.Embedding.weight.grad``. One look at the context's
    gradients on this process (each table's marker), no RPC.

    Raises:
        RuntimeError: no such context on this process.
    """
    gradients = dist_autograd.get_gradients(context_id)
    return [emb._marker in gradients for emb in embeddings]


def _resolve_owners(owners: Sequence[Owner]) -> List[rpc.WorkerInfo]:
    """The owners' WorkerInfos, checked: a non-empty list of distinct, known workers.

    Raises:
        TypeError: ``owners`` is a single string, or an item is neither a name nor a
            WorkerInfo.
        ValueError: empty, a worker twice, or a name the RPC world does not know.
    """
    if isinstance(owners, (str, rpc.WorkerInfo)) or not isinstance(owners, Sequence):
        raise TypeError(
            f"Invalid owners: {owners!r} (expected a list of worker names or WorkerInfos)"
        )
    if not owners:
        raise ValueError("Invalid owners: [] (expected at least one worker)")
    if not _torch.rpc_initialized():
        raise RuntimeError(
            "Invalid state: torch.distributed.rpc is not initialized (expected rpc.init_rpc "
            "before a ShardedEmbedding is built)"
        )
    names: List[str] = []
    for i, owner in enumerate(owners):
        if isinstance(owner, rpc.WorkerInfo):
            names.append(owner.name)
        elif isinstance(owner, str):
            names.append(owner)
        else:
            raise TypeError(
                f"Invalid owners[{i}]: {owner!r} (expected a worker name or WorkerInfo)"
            )
    seen: Dict[str, int] = {}
    for i, name in enumerate(names):
        if name in seen:
            raise ValueError(
                f"Invalid owners: {names!r} (expected distinct workers; {name!r} is at "
                f"positions {seen[name]} and {i})"
            )
        seen[name] = i
    infos = []
    for name in names:
        try:
            infos.append(rpc.get_worker_info(name))
        except RuntimeError as exc:
            raise ValueError(
                f"Invalid owners: {name!r} is not a worker of this RPC world (expected one of "
                f"the names given to rpc.init_rpc)"
            ) from exc
    return infos
