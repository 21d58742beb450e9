"""Partial synchronisation (Apache SINGA's ``backward_and_partial_update``).

With ``sync=RoundRobin(k)`` no gradient is reduced: every rank steps on its own gradients,
then averages one of ``k`` partitions of the parameters, in turn, so that each parameter is
averaged every ``k`` steps and a step sends about ``1/k`` of what parameter averaging sends.

What is averaged with a partition's parameters: every state tensor shaped like its parameter
(``exp_avg``, ``exp_avg_sq``, ``momentum_buffer``, ``square_avg``, ...), so that right after
its turn a partition is the same on every rank, model and optimizer alike; ``step`` counts
agree already. The averages are plain means, ``exp_avg_sq`` included.
"""
from typing import Any, Callable, Dict, List, Optional, Sequence

import torch
import torch.distributed as dist
from torch import Tensor

from distopt.arguments import check_number

__all__ = ["RoundRobin", "all_gather_named", "average_", "collective_device", "global_rank",
           "lost_agreement", "partition", "refuse_everywhere", "through_flat"]


class RoundRobin:
    """Average one of ``k`` parameter partitions per step, in turn.

    Args:
        k: the number of partitions, >= 1 (``RoundRobin(1)`` averages everything at every
            step: local SGD with period 1).

    Raises:
        ValueError: ``k`` < 1; TypeError: not an int.
    """

    def __init__(self, k: int) -> None:
        check_number("k", k, "an int >= 1", lambda n: n >= 1, integer=True)
        self.k = k

    def __repr__(self) -> str:
        return f"RoundRobin({self.k})"


def partition(params: Sequence[Tensor], k: int) -> List[List[int]]:
    """Cut ``params`` (in order) into ``k`` runs of about equal numel; returns positions.

    A run may be empty when there are fewer parameters than partitions.
    """
    total = sum(p.numel() for p in params)
    parts: List[List[int]] = [[] for _ in range(k)]
    seen = 0
    for i, p in enumerate(params):
        # The partition whose share of the elements this parameter's middle falls in.
        middle = seen + p.numel() / 2.0
        parts[min(k - 1, int(middle * k / max(total, 1)))].append(i)
        seen += p.numel()
    return parts


def average_(tensors: List[Tensor], group: Any, world_size: int) -> None:
    """Replace each tensor by its mean over the group's ranks, one all_reduce per dtype."""
    with torch.no_grad():
        through_flat(tensors, lambda flat: dist.all_reduce(flat.div_(world_size), group=group))


def through_flat(tensors: Sequence[Tensor], collective: Callable[[Tensor], Any]) -> None:
    """Run ``collective`` on one flat copy of ``tensors`` per (dtype, device) and copy what
    it leaves back into them."""
    by_kind: Dict[Any, List[Tensor]] = {}
    for t in tensors:
        by_kind.setdefault((t.dtype, t.device), []).append(t)
    for members in by_kind.values():
        flat = torch.cat([t.reshape(-1) for t in members])
        collective(flat)
        for t, part in zip(members, flat.split([t.numel() for t in members])):
            t.copy_(part.view_as(t))


def global_rank(group: Any, rank: int) -> int:
    """The global rank of ``group``'s rank ``rank`` (None: the default group)."""
    return dist.get_global_rank(group, rank) if group is not None else rank


def collective_device(group: Any) -> torch.device:
    """Where a small tensor for a collective on ``group`` must live: NCCL takes only CUDA
    tensors (on this process's current device), gloo CPU ones."""
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def all_gather_named(what: str, obj: Any, group: Any, rank: int, world_size: int) -> List[Any]:
    """Every rank's ``obj`` (one all_gather_object), each sent with ``what`` this rank is
    doing; a rank whose peer was doing something else (one rank in ``load_state_dict``, the
    other in ``consolidate_state_dict``) raises saying so, instead of misreading the other
    collective's payload.

    Raises:
        RuntimeError: the ranks were not all doing ``what``.
    """
    every: List[Any] = [None] * world_size
    dist.all_gather_object(every, (what, obj), group=group)
    others = {r: theirs[0] if isinstance(theirs, tuple) and len(theirs) == 2 else "another call"
              for r, theirs in enumerate(every) if not (isinstance(theirs, tuple)
                                                         and theirs[:1] == (what,))}
    if others:
        doing = "; ".join(f"rank {r} in {d}" for r, d in sorted(others.items()))
        raise RuntimeError(
            f"DataParallelOptimizer on rank {rank} of {world_size}: the ranks called different "
            f"collectives: this rank is in {what}, {doing} (expected every rank to call "
            f"{what} together)"
        )
    return [theirs[1] for theirs in every]


def lost_agreement(opt: Any, doing: str, exc: BaseException) -> RuntimeError:
    """The error when ``opt``'s ranks could not agree on ``doing`` (a collective failed)."""
    return RuntimeError(
        f"DataParallelOptimizer on rank {opt.rank} of {opt.world_size}: {doing} could not "
        f"agree with the other ranks (one died or timed out): {type(exc).__name__}: {exc}"
    )


def refuse_everywhere(opt: Any, error: Optional[BaseException], what: str, call: str,
                      doing: str) -> None:
    """Raise on every rank the same ValueError if any rank of ``opt``'s group refused its
    part of a load (``error``: this rank's reason, or None), naming each refusing rank and
    its reason; return if none did. One all_gather_object of the reasons: every rank calls
    it, and every rank decides alike.

    Args:
        what: what was refused, for the message ("checkpoint", "state_dict").
        call: the call every rank is in ("load()"), named if another rank is elsewhere.
        doing: what the ranks were doing, should the collective fail ("load from '<dir>'").

    Raises:
        ValueError: some rank refused; nothing changed on any rank.
        RuntimeError: the ranks could not agree (one died or timed out).
    """
    reason = None if error is None else str(error)
    every: List[Optional[str]] = [reason]
    if opt.world_size > 1:
        try:
            every = all_gather_named(call, reason, opt.process_group, opt.rank,
                                     opt.world_size)
        except RuntimeError as exc:
            if "called different collectives" in str(exc):
                raise
            raise lost_agreement(opt, doing, exc) from exc
        except Exception as exc:
            raise lost_agreement(opt, doing, exc) from exc
    by_reason: Dict[str, List[int]] = {}
    for rank, message in enumerate(every):
        if message is not None:
            by_reason.setdefault(message, []).append(rank)
    if not by_reason:
        return
    refusals = "; on ".join(
        f"{'rank' if len(ranks) == 1 else 'ranks'} {', '.join(map(str, ranks))}: {message}"
        for message, ranks in by_reason.items()
    )
    raise ValueError(f"Invalid {what} on {refusals} (nothing changed on any rank)") from error
