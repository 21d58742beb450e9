"""Row-sparse optimizers over ShardedEmbeddings: torch.optim's SGD, Adagrad and SparseAdam,
and fbgemm's row-wise Adagrad and partial row-wise Adam (``RowWiseAdagrad``,
``PartialRowWiseAdam``: their functional classes, which no torch.optim class stands for,
compiled on the owners; their state_dict keyed by table and global row).

Each is a :class:`distopt.DistributedOptimizer` over the embeddings' shards, so every owner
updates its own shard, in parallel, with distopt's compiled functional optimizer: the
gradient an owner finds in the autograd context is sparse, holding only the rows looked up
in that context, and the functional optimizers' sparse paths touch only those rows (and
their state), as torch.optim does for ``nn.Embedding(sparse=True)``. Everything else comes
from DistributedOptimizer unchanged: ``step(context_id)``, param groups and lr schedulers,
``state_dict`` / ``load_state_dict``, sharded ``save`` / ``load``, per-parameter locks
(concurrent trainers lose no row update) and errors that name the failing workers. The
state_dict and the checkpoint's manifest also record each table's partition
(``"partitions"``), and a load into tables partitioned otherwise is refused: a shard's
state belongs to the rows the partition gave it.

Parameters are numbered shard by shard: the shards of the first embedding in owner order,
then those of the next.

A table steps as one parameter. torch.optim keeps some state per parameter rather than per
row: SparseAdam's ``step`` (bias correction), Adagrad's ``step`` (``lr_decay``), and SGD's
momentum buffer, which moves every row it holds at each step. All of it advances whenever
the table's ``.grad`` is set, whichever rows that gradient holds. So at each step the
trainer names, in the step's one RPC per owner, the shards of every table that got a
gradient in the context; an owner whose shard got no rows steps it with a sparse gradient
holding none (``distopt.local_optimizer.empty_sparse_gradient``), which is what torch's
step does with the rest of the table, and every shard's count stays the table's count, in
``state_dict`` and checkpoints too. A table got a gradient when the backward pass reached any of its
lookups made in the context: empty lookups count (as ``nn.Embedding``'s), lookups whose
output never reached the loss and tables not looked up do not. The trainer tells that from
its own copy of the context, without an RPC: every lookup is joined with a leaf of the table
that holds no rows, and backward leaves that leaf a gradient in the context
(``distopt.sparse.embedding.tables_with_gradient``).

Where distopt still differs from torch:

- only these classes count table-wide: a plain DistributedOptimizer over
  ``parameter_rrefs()`` sees each shard as a parameter, stepped only when it got rows;
- the table counts the lookups made on the process that calls ``step`` (the one holding the
  ShardedEmbedding); a shard that got a gradient some other way (another process's copy of
  the table, the shard used directly through its RRef) steps alone, the others do not;
- a state_dict or checkpoint whose shards of one table hold different counts (written
  before counts were table-wide) loads as it is, and the counts stay apart;
- gradients live in each context, as after torch's default ``zero_grad(set_to_none=True)``:
  torch with ``set_to_none=False`` keeps a zeroed ``.grad`` and so steps (and counts) a
  table that a later step did not look up; here that table does not step.

One limit comes from torch's distributed autograd rather than from the optimizers: a lookup
whose output never reaches the loss, on an owner that gets some other gradient in the same
context, makes ``dist_autograd.backward`` wait until the RPC timeout (its FAST mode expects
a gradient for every RPC of the context on such an owner). Look up only what the loss uses.

``duplicates="mean"`` (DGL's rule) averages, rather than sums, the gradients of a row
looked up several times in one step. The context's accumulated gradient cannot count the
lookups (see ``distopt.sparse._owner``), so the embeddings record them on their owners and
``step`` first asks every owner, in parallel, to turn the context's gradients into
per-row means in place; then the usual step runs. That costs one more round of RPCs per
step. Clipping (``clip_grad_norm_``) before ``step`` sees the summed gradients.
"""
import os
import warnings
from typing import Any, Dict, List, Optional, Sequence, Set, Tuple, Union

import torch
import torch.distributed.rpc as rpc

from distopt import checkpoint
from distopt.arguments import check_arguments, probe_construction
from distopt.errors import DistributedOptimizerError, compose_error
from distopt.fanout import fan_out
from distopt.optimizer import DistributedOptimizer
from distopt.param_groups import check_groups
from distopt.sparse import _owner
from distopt.sparse.embedding import ShardedEmbedding, tables_with_gradient
from distopt.sparse.partition import make_partition
from functional import FunctionalPartialRowWiseAdam, FunctionalRowWiseAdagrad

#: What ``duplicates`` may be: torch's rule (sum) or DGL's (mean).
DUPLICATES = ("sum", "mean")

Embeddings = Union[ShardedEmbedding, Sequence[ShardedEmbedding]]


def _shard_rrefs(embeddings: Embeddings) -> Tuple[List[ShardedEmbedding], List[rpc.RRef]]:
    """The embeddings as a list, and their shards' RRefs in parameter order.

    Raises:
        TypeError: an item is not a ShardedEmbedding.
        ValueError: no embeddings, or one given twice.
    """
    if isinstance(embeddings, ShardedEmbedding):
        embeddings = [embeddings]
    if isinstance(embeddings, (str, bytes)) or not isinstance(embeddings, Sequence):
        raise TypeError(
            f"Invalid embeddings: {type(embeddings).__name__} (expected a list of "
            f"ShardedEmbedding)"
        )
    embeddings = list(embeddings)
    if not embeddings:
        raise ValueError("Invalid embeddings: [] (expected at least one ShardedEmbedding)")
    seen: Dict[int, int] = {}
    for i, emb in enumerate(embeddings):
        if not isinstance(emb, ShardedEmbedding):
            raise TypeError(
                f"Invalid embeddings[{i}]: {type(emb).__name__} (expected a ShardedEmbedding)"
            )
        if id(emb) in seen:
            raise ValueError(
                f"Invalid embeddings: embeddings[{seen[id(emb)]}] and embeddings[{i}] are the "
                f"same table (expected each table once)"
            )
        seen[id(emb)] = i
    return embeddings, [rref for emb in embeddings for rref in emb.parameter_rrefs()]


def _check_duplicates(duplicates: Any) -> None:
    if duplicates not in DUPLICATES:
        raise ValueError(
            f"Invalid duplicates: {duplicates!r} (expected one of {list(DUPLICATES)!r})"
        )


def _check_with_torch(torch_class: type, kwargs: Dict[str, Any]) -> None:
    """torch.optim's own argument checks, on the trainer, before any owner is contacted.

    Raises:
        ValueError: as ``torch_class`` raises it for these arguments.
    """
    probe_construction(torch_class, kwargs)  # torch.optim's own messages: users know them


class _SparseOptimizer(DistributedOptimizer):
    """What the three classes share: embeddings in, a DistributedOptimizer over their shards."""

    _torch_class: type = torch.optim.Optimizer

    def __init__(self, embeddings: Embeddings, duplicates: str, **kwargs: Any) -> None:
        embeddings, rrefs = _shard_rrefs(embeddings)
        _check_duplicates(duplicates)
        check_arguments(self._torch_class, (), kwargs)  # kinds first: torch's messages omit names
        _check_with_torch(self._torch_class, kwargs)
        # Shards stay as they are: their gradients are row-sparse (flat buffers are dense).
        super().__init__(self._torch_class, rrefs, flat=False, **kwargs)
        #: The tables this optimizer updates, in parameter order.
        self.embeddings: List[ShardedEmbedding] = embeddings
        #: How rows looked up several times in one step combine: ``"sum"`` or ``"mean"``.
        self.duplicates = duplicates
        # The global indices of each table's shards (parameters are numbered table by table).
        self._table_params: List[List[int]] = []
        for emb in embeddings:
            start = self._table_params[-1][-1] + 1 if self._table_params else 0
            self._table_params.append(list(range(start, start + len(emb.parameter_rrefs()))))
        self._shards_by_owner: Dict[str, Tuple[rpc.WorkerInfo, List[int]]] = {}
        for emb in embeddings:
            for info, shard_id in emb.shard_ids():
                self._shards_by_owner.setdefault(info.name, (info, []))[1].append(shard_id)
        if duplicates == "mean":
            for emb in embeddings:
                emb.track_lookups = True

    def _before_step(self, context_id: int) -> None:
        """With ``duplicates="mean"``, have every owner average its context gradients over
        the lookups (one parallel round of RPCs) before the step, under the step's lock.
        A failure there raises before any owner steps: the error says nothing was applied."""
        if self.duplicates != "mean":
            return
        try:
            fan_out("step", {
                name: (info, _owner.average_duplicates, (shard_ids, context_id))
                for name, (info, shard_ids) in self._shards_by_owner.items()
            })
        except DistributedOptimizerError as exc:
            raise compose_error(
                "step", exc.failures, [], {name: "none" for name in exc.failures}
            ) from exc.__cause__

    def _empty_gradient_params(self, context_id: int) -> Set[int]:
        """Every shard of every table that got a gradient in the context: each owner steps
        its shard, with a gradient holding no rows where the context gives it none, so the
        table steps as one parameter would (see the module's docstring)."""
        got = tables_with_gradient(self.embeddings, context_id)
        return {i for g, indices in zip(got, self._table_params) if g for i in indices}

    # ------------------------------------------------------------ state and checkpoints

    def _partitions(self) -> List[Dict[str, Any]]:
        """Per table, what decides which row each shard (parameter) holds: the partition,
        the rows and the number of owners (their names too, which do not decide it)."""
        return [{"partition": emb.partition, "num_embeddings": emb.num_embeddings,
                 "num_owners": len(emb.owners), "owners": list(emb.owners)}
                for emb in self.embeddings]

    def _check_partitions(self, saved: Any, where: str) -> None:
        """Refuse a state saved from tables partitioned otherwise: each shard's rows would
        be other rows, so each row's state would land on another row. A state without the
        record (saved before distopt wrote it) loads, with a warning.

        Raises:
            ValueError: naming the table and both partitions; before anything changes.
        """
        mine = self._partitions()
        if saved is None:
            warnings.warn(
                f"{type(self).__name__}: the {where} records no partition of its tables "
                f"(saved before distopt recorded them), so it cannot be checked: it is loaded "
                f"as if saved from tables partitioned as these are "
                f"({'; '.join(_described(t) for t in mine)})",
                UserWarning, stacklevel=3,
            )
            return
        if not isinstance(saved, list) or len(saved) != len(mine) or not all(
            isinstance(t, dict) for t in saved
        ):
            raise ValueError(
                f"Invalid {where}: partitions {saved!r} (expected one record per table: "
                f"{len(mine)})"
            )
        for t, (theirs, ours) in enumerate(zip(saved, mine)):
            if any(theirs.get(k) != ours[k] for k in ("partition", "num_embeddings",
                                                      "num_owners")):
                raise ValueError(
                    f"Invalid {where}: table {t} was saved with {_described(theirs)} "
                    f"(expected {_described(ours)}, this table's: each row's state would "
                    f"land on another row)"
                )

    def state_dict(self) -> Dict[str, Any]:  # type: ignore[override]
        """DistributedOptimizer's ``state_dict``, with ``"partitions"``: per table, its
        ``partition``, ``num_embeddings``, ``num_owners`` and ``owners``, which
        ``load_state_dict`` checks."""
        sd = super().state_dict()
        sd["partitions"] = self._partitions()
        return sd

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:  # type: ignore[override]
        """DistributedOptimizer's ``load_state_dict``, after checking that the state was
        saved from tables partitioned as these are (same partition, rows and number of
        owners; the owners' names may differ).

        Raises:
            ValueError: a table partitioned otherwise, naming both partitions, before
                anything changes; and DistributedOptimizer's errors.
        """
        if isinstance(state_dict, dict):
            self._check_partitions(state_dict.get("partitions"), "state_dict['partitions']")
        super().load_state_dict(state_dict)

    def save(self, path: str) -> Dict[str, Any]:
        """DistributedOptimizer's ``save``; the manifest also records ``"partitions"``
        (see ``state_dict``)."""
        with self._lock:
            check_groups(self.param_groups, self._built)
            return checkpoint.save(self._placement, self.param_groups, path,
                                   extra={"partitions": self._partitions()})

    def load(self, path: str) -> None:
        """DistributedOptimizer's ``load``, after checking the manifest's ``"partitions"``
        as ``load_state_dict`` does, before any owner reads its part.

        Raises:
            ValueError: a table partitioned otherwise, naming both partitions; and
                DistributedOptimizer's errors.
        """
        with self._lock:
            check_groups(self.param_groups, self._built)
            checkpoint.load(self._placement, self._trainer_groups(), path, check=lambda manifest:
                            self._check_partitions(manifest.get("partitions"),
                                                   f"checkpoint {os.path.abspath(path)!r}"))


def _described(record: Dict[str, Any]) -> str:
    """A table's partition record in words."""
    return (f"partition={record.get('partition')!r} of {record.get('num_embeddings')!r} rows "
            f"over {record.get('num_owners')!r} owners")


class SparseSGD(_SparseOptimizer):
    r"""SGD on the rows each step looked up, as torch.optim.SGD on ``nn.Embedding(sparse=True)``.

    With :math:`g_t` the row-sparse gradient of a table (rows looked up :math:`k` times
    summed, or averaged with ``duplicates="mean"``), momentum :math:`\mu`, dampening
    :math:`\tau` and learning rate :math:`\gamma`:

    .. math::
        b_t &= \begin{cases} g_t & t = 1 \\ \mu b_{t-1} + (1 - \tau) g_t & t > 1 \end{cases} \\
        \theta_t &= \theta_{t-1} - \gamma \, (g_t + \mu b_t \text{ (Nesterov) or } b_t)

    Without momentum only the rows looked up change. With momentum the buffer is sparse,
    as in torch, and at every step in which the table gets a gradient it decays and moves
    every row it has ever held, on every owner (the table steps as one parameter).

    Args:
        embeddings: the tables to train (one ShardedEmbedding or a list).
        lr: learning rate.
        momentum: momentum factor.
        dampening: dampening for momentum.
        weight_decay: must be 0: torch.optim.SGD cannot add weight decay to a sparse
            gradient.
        nesterov: use Nesterov momentum.
        maximize: maximize the objective instead of minimizing it.
        duplicates: ``"sum"`` (torch's rule) or ``"mean"`` (DGL's: a row looked up
            :math:`k` times in a step gets the mean of its :math:`k` gradients).

    Raises:
        TypeError: an item of ``embeddings`` is not a ShardedEmbedding.
        ValueError: a bad argument, as torch.optim.SGD says it, a non-zero
            ``weight_decay``, or an unknown ``duplicates``; before any owner is contacted.
        DistributedOptimizerError: some owners failed to create their optimizer.
    """

    _torch_class = torch.optim.SGD

    def __init__(
        self,
        embeddings: Embeddings,
        lr: float = 1e-3,
        momentum: float = 0.0,
        dampening: float = 0.0,
        weight_decay: float = 0.0,
        nesterov: bool = False,
        *,
        maximize: bool = False,
        duplicates: str = "sum",
    ) -> None:
        if weight_decay != 0:
            raise ValueError(
                f"Invalid weight_decay: {weight_decay!r} (expected 0: torch.optim.SGD cannot "
                f"add weight decay to sparse gradients)"
            )
        super().__init__(
            embeddings, duplicates, lr=lr, momentum=momentum, dampening=dampening,
            weight_decay=weight_decay, nesterov=nesterov, maximize=maximize,
        )


class SparseAdagrad(_SparseOptimizer):
    r"""Adagrad on the rows each step looked up, as torch.optim.Adagrad with sparse gradients.

    Only the rows looked up change, they and their ``sum``. With :math:`g_t` the row-sparse
    gradient (duplicates summed, or averaged with ``duplicates="mean"``), learning-rate
    decay :math:`\eta` and :math:`t` counting the table's steps (every step in which the
    table got a gradient, on every owner, whichever rows it held):

    .. math::
        s_t &= s_{t-1} + g_t^2 \\
        \theta_t &= \theta_{t-1} - \frac{\gamma}{1 + (t - 1) \eta} \frac{g_t}{\sqrt{s_t} + \epsilon}

    Args:
        embeddings: the tables to train (one ShardedEmbedding or a list).
        lr: learning rate.
        lr_decay: learning-rate decay per step.
        weight_decay: must be 0: torch.optim.Adagrad rejects weight decay with sparse
            gradients.
        initial_accumulator_value: starting value of ``sum``.
        eps: term added to the denominator.
        maximize: maximize the objective instead of minimizing it.
        duplicates: ``"sum"`` (torch's rule) or ``"mean"`` (DGL's).

    Raises:
        TypeError: an item of ``embeddings`` is not a ShardedEmbedding.
        ValueError: a bad argument, as torch.optim.Adagrad says it, a non-zero
            ``weight_decay``, or an unknown ``duplicates``; before any owner is contacted.
        DistributedOptimizerError: some owners failed to create their optimizer.
    """

    _torch_class = torch.optim.Adagrad

    def __init__(
        self,
        embeddings: Embeddings,
        lr: float = 1e-2,
        lr_decay: float = 0.0,
        weight_decay: float = 0.0,
        initial_accumulator_value: float = 0.0,
        eps: float = 1e-10,
        *,
        maximize: bool = False,
        duplicates: str = "sum",
    ) -> None:
        if weight_decay != 0:
            raise ValueError(
                f"Invalid weight_decay: {weight_decay!r} (expected 0: torch.optim.Adagrad "
                f"rejects weight decay with sparse gradients)"
            )
        super().__init__(
            embeddings, duplicates, lr=lr, lr_decay=lr_decay, weight_decay=weight_decay,
            initial_accumulator_value=initial_accumulator_value, eps=eps, maximize=maximize,
        )


class SparseAdam(_SparseOptimizer):
    r"""Lazy Adam on the rows each step looked up, as torch.optim.SparseAdam.

    Only the rows looked up change, they and their moments; rows not looked up keep their
    moments instead of decaying them. With :math:`g_t` the row-sparse gradient (duplicates
    summed, or averaged with ``duplicates="mean"``) and :math:`t` counting the table's
    steps (every step in which the table got a gradient, on every owner, whichever rows it
    held), on the rows it holds:

    .. math::
        m_t &= \beta_1 m_{t-1} + (1 - \beta_1) g_t, \quad
        v_t = \beta_2 v_{t-1} + (1 - \beta_2) g_t^2 \\
        \theta_t &= \theta_{t-1} - \gamma \frac{\sqrt{1 - \beta_2^t}}{1 - \beta_1^t}
            \frac{m_t}{\sqrt{v_t} + \epsilon}

    Args:
        embeddings: the tables to train (one ShardedEmbedding or a list).
        lr: learning rate.
        betas: decay rates of the moment averages.
        eps: term added to the denominator.
        maximize: maximize the objective instead of minimizing it.
        duplicates: ``"sum"`` (torch's rule) or ``"mean"`` (DGL's).

    Raises:
        TypeError: an item of ``embeddings`` is not a ShardedEmbedding.
        ValueError: a bad argument, as torch.optim.SparseAdam says it, or an unknown
            ``duplicates``; before any owner is contacted.
        DistributedOptimizerError: some owners failed to create their optimizer.
    """

    _torch_class = torch.optim.SparseAdam

    def __init__(
        self,
        embeddings: Embeddings,
        lr: float = 1e-3,
        betas: Tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        maximize: bool = False,
        *,
        duplicates: str = "sum",
    ) -> None:
        super().__init__(
            embeddings, duplicates, lr=lr, betas=betas, eps=eps, maximize=maximize
        )


class _RowWiseOptimizer(_SparseOptimizer):
    """What the row-wise classes share: their functional class compiled on the owners (no
    torch.optim class stands for it), and a state_dict keyed by table and global row, the
    same under every partition (see ``state_dict``)."""

    def _functional_stand_in(self, optimizer_class: type) -> Optional[type]:
        """The functional class itself (``_torch_class`` is one)."""
        return optimizer_class

    def state_dict(self) -> Dict[str, Any]:  # type: ignore[override]
        """The state keyed by table, whatever the partition: ``{"state": {table: {"step":
        ..., key: tensor with one row per global row of the table}}, "param_groups":
        [{..., "params": [0, 1, ...]}]}`` (one index per table). Loads into the same tables
        partitioned any other way, over any owners (``load_state_dict``). torch's
        state-dict hooks see the owners' state (one entry per shard) before it is keyed so.

        Raises:
            DistributedOptimizerError: some owners failed or could not be reached.
        """
        sharded = DistributedOptimizer.state_dict(self)
        state: Dict[int, Dict[str, Any]] = {}
        for t, (emb, indices) in enumerate(zip(self.embeddings, self._table_params)):
            entries = [sharded["state"].get(i) for i in indices]
            if any(entry is not None for entry in entries):
                state[t] = _table_state(emb, entries)
        group = dict(sharded["param_groups"][0])
        group["params"] = list(range(len(self.embeddings)))
        return {"state": state, "param_groups": [group]}

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:  # type: ignore[override]
        """Load a state_dict of ``state_dict``'s form, saved under any partition: each
        owner gets the rows its shard holds now.

        Raises:
            ValueError: not one entry per table, or a table's state of another number of
                rows, naming the table; before anything changes. And DistributedOptimizer's
                errors.
        """
        check_groups(self.param_groups, self._built)
        DistributedOptimizer.load_state_dict(self, self._sharded(state_dict))

    def _sharded(self, state_dict: Any) -> Dict[str, Any]:
        """``state_dict`` (keyed by table) as the owners' state, one entry per shard."""
        if not isinstance(state_dict, dict) or set(state_dict) != {"state", "param_groups"}:
            got = sorted(state_dict) if isinstance(state_dict, dict) else type(state_dict).__name__
            raise ValueError(
                f"Invalid state_dict: {got!r} (expected a dict with 'state' and "
                f"'param_groups', keyed by table as {type(self).__name__}.state_dict gives it)"
            )
        groups = state_dict["param_groups"]
        tables = list(range(len(self.embeddings)))
        if len(groups) != 1 or list(groups[0].get("params", [])) != tables:
            raise ValueError(
                f"Invalid state_dict: param_groups {[g.get('params') for g in groups]!r} "
                f"(expected one group over the tables, params {tables!r})"
            )
        state: Dict[int, Dict[str, Any]] = {}
        for t, entry in state_dict["state"].items():
            if t not in tables or not isinstance(entry, dict):
                raise ValueError(f"Invalid state_dict: state[{t!r}] (expected a table of {tables!r})")
            emb = self.embeddings[t]
            rows = _global_rows(emb)
            for k, i in enumerate(self._table_params[t]):
                state[i] = {key: _shard_of(value, rows[k], emb, t, key)
                            for key, value in entry.items()}
        group = dict(groups[0])
        group["params"] = [i for indices in self._table_params for i in indices]
        return {"state": state, "param_groups": [group]}


def _global_rows(emb: ShardedEmbedding) -> List[torch.Tensor]:
    """The global rows each shard of ``emb`` holds, in owner order."""
    partition = make_partition(emb.partition, emb.num_embeddings, emb.owners)
    return [partition.global_rows(k) for k in range(len(emb.owners))]


def _table_state(emb: ShardedEmbedding, entries: List[Any]) -> Dict[str, Any]:
    """The state of one table from its shards' entries: ``step`` as the shards keep it (a
    table's count is every shard's), row state in global row order."""
    first = next(entry for entry in entries if entry is not None)
    rows = _global_rows(emb)
    table: Dict[str, Any] = {}
    for key, value in first.items():
        if key == "step" or not isinstance(value, torch.Tensor) or value.dim() == 0:
            table[key] = value
            continue
        full = value.new_zeros((emb.num_embeddings, *value.shape[1:]))
        for k, entry in enumerate(entries):
            if entry is not None:
                full.index_copy_(0, rows[k], entry[key])
        table[key] = full
    return table


def _shard_of(value: Any, rows: torch.Tensor, emb: ShardedEmbedding, t: int, key: str) -> Any:
    """One shard's part of a table's saved state ``value`` (a step count as it is)."""
    if key == "step" or not isinstance(value, torch.Tensor) or value.dim() == 0:
        return value
    if value.shape[0] != emb.num_embeddings:
        raise ValueError(
            f"Invalid state_dict: state[{t}][{key!r}] has {value.shape[0]} rows (expected "
            f"{emb.num_embeddings}, the rows of table {t})"
        )
    return value.index_select(0, rows)


class RowWiseAdagrad(_RowWiseOptimizer):
    r"""Row-wise Adagrad on the rows each step looked up: fbgemm's ``EXACT_ROWWISE_ADAGRAD``.

    One float of state per row, ``momentum1``, the running sum of the row's mean squared
    gradient; see :class:`functional.FunctionalRowWiseAdagrad` for the rule. On float32
    tables the result equals fbgemm-gpu-cpu 1.8.0's CPU step bit for bit (weights and
    ``momentum1``, every ``weight_decay_mode``; measured in the tests). The gradient of a
    row looked up several times in a step is the sum of its lookups (fbgemm's "exact"),
    or their mean with ``duplicates="mean"``.

    ``step`` counts the table's steps (checkpointed; the rule does not read it).
    ``state_dict`` is keyed by table and global row, the same under every partition, and
    loads into the tables partitioned any other way (``save`` / ``load`` write each owner's
    shard and keep to one partition, as the other sparse classes).

    Args:
        embeddings: the tables to train (one ShardedEmbedding or a list).
        lr: learning rate, >= 0.
        eps: term added to the denominator, >= 0.
        weight_decay: weight decay factor, >= 0.
        weight_decay_mode: ``"none"``, ``"l2"`` (added to the gradient before its mean
            square, as fbgemm's L2) or ``"decouple"`` (the row shrunk by
            ``lr * weight_decay``, fbgemm's DECOUPLE).
        duplicates: ``"sum"`` (fbgemm's rule) or ``"mean"``.

    Raises:
        TypeError: an item of ``embeddings`` is not a ShardedEmbedding.
        ValueError: a bad argument (naming it and its value), before any owner is
            contacted.
        DistributedOptimizerError: some owners failed to create their optimizer.
    """

    _torch_class = FunctionalRowWiseAdagrad

    def __init__(
        self,
        embeddings: Embeddings,
        lr: float = 1e-2,
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        weight_decay_mode: str = "none",
        *,
        duplicates: str = "sum",
    ) -> None:
        super().__init__(embeddings, duplicates, lr=lr, eps=eps, weight_decay=weight_decay,
                         weight_decay_mode=weight_decay_mode)


class PartialRowWiseAdam(_RowWiseOptimizer):
    r"""Partial row-wise Adam on the rows each step looked up: fbgemm's ``PARTIAL_ROWWISE_ADAM``.

    The first moment per element (``momentum1``), the second per row (``momentum2``, the
    mean of the row's squared gradient), bias corrections from the table's step count, and
    fbgemm's weight decay (inside the learning rate, on the rows stepped); see
    :class:`functional.FunctionalPartialRowWiseAdam` for the rule. fbgemm-gpu-cpu 1.8.0 has
    no CPU step for it (its constructor refuses the optimizer on the CPU): the arithmetic
    follows its CUDA kernel's source. State, ``state_dict`` and ``duplicates`` as
    :class:`RowWiseAdagrad`.

    Args:
        embeddings: the tables to train (one ShardedEmbedding or a list).
        lr: learning rate, >= 0.
        betas: decay rates of the two moments, each in [0, 1).
        eps: term added to the denominator, >= 0.
        weight_decay: weight decay factor, >= 0.
        duplicates: ``"sum"`` (fbgemm's rule) or ``"mean"``.

    Raises:
        TypeError: an item of ``embeddings`` is not a ShardedEmbedding.
        ValueError: a bad argument (naming it and its value), before any owner is
            contacted.
        DistributedOptimizerError: some owners failed to create their optimizer.
    """

    _torch_class = FunctionalPartialRowWiseAdam

    def __init__(
        self,
        embeddings: Embeddings,
        lr: float = 1e-2,
        betas: Tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        *,
        duplicates: str = "sum",
    ) -> None:
        super().__init__(embeddings, duplicates, lr=lr, betas=betas, eps=eps,
                         weight_decay=weight_decay)
