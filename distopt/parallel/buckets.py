"""Flat gradient buckets: which parameters travel together, and the buffer they travel in.

Parameters are cut into buckets of at most ``bucket_cap_mb``, by (device, dtype), in the
order backward produces their gradients (``assign_buckets``); every rank cuts the same
buckets, so every rank issues the same collectives in the same order.

A bucket's buffer holds every gradient, one after the other, followed by one "used" flag per
parameter: the reduction sums the flags too, so after it every rank knows which parameters
got a gradient on some rank; the others keep the ``.grad`` this rank had (None, or a zero
tensor after ``zero_grad(set_to_none=False)``), as DDP's ``find_unused_parameters`` leaves
it.

``Bucket`` is the one interface every compression scheme reduces, for the optimizer and for
DDP's communication hook alike; torch's ``GradBucket`` meets it here only: a DDP bucket is
copied into a ``Bucket`` (``Bucket.of_ddp``, ``ddp_buffer``), and ``GradBucketView`` shows
torch's hooks (PowerSGD) a ``Bucket`` through ``GradBucket``'s six methods.
"""
import itertools
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch
from torch import Tensor

from distopt._torch import version

__all__ = ["Bucket", "GradBucketView", "assign_buckets", "dense_grad"]


class Bucket:
    """One flat buffer of gradients and the parameters it serves.

    Attributes:
        index: the position in the reduction order.
        params: the parameters, in the buffer's order.
        positions: each parameter's global index (torch.optim's numbering over the groups).
        numel: the number of gradient elements (the flags follow them).
        buffer: ``numel`` gradient elements, then ``len(params)`` flags.
        grads: views of ``buffer`` shaped like each parameter.
        offsets: where each parameter's gradient starts in ``buffer``.
        flags: the flag part of ``buffer``.
        used: per parameter, whether a backward pass of this window gave it a gradient here.
        hooked: per parameter, the number of the last backward pass whose hook saw it.
        pending: parameters the current reducing pass has not seen yet.
        launched: whether this window's reduction of the bucket has been started.
        last: whether it is the last bucket reduced in a step (torch's PowerSGD state
            counts a step there); ``assign_buckets`` marks it, DDP's hooks per call.
        kept: slot -> (``.grad``, its values) of each parameter this rank did not use in
            the window but that had a gradient when the bucket was filled: if no rank used
            it, ``leave_unused`` gives it back (DDP leaves such a ``.grad`` as it is).
        stepped: after the bucket was stepped in this window, the buffer's version and each
            parameter's ``.grad`` then (``changed_since_step``); None before.
        divisor: what this window's sum of gradients is divided by: None for the world
            size; under ``torch.distributed.algorithms.Join`` with
            ``divide_by_initial_world_size=False``, the number of ranks not yet joined.
        unused: after the reduction, the slots of parameters no rank gave a gradient and
            whose ``.grad`` is None here (not stepped).
        residual: with error feedback, what the compression has not sent yet (the
            gradient part's shape); else None.
        shard: with sharded state, this rank's part (``distopt.parallel.shard.Shard``).
        released: whether ``buffer``'s memory is released (``release``): its views must not
            be read until ``materialize``.
        watched: the tensor whose in-place changes count as a change of ``.grad`` after the
            step read it (``changed_since_step``): ``buffer``, or, with sharded gradients,
            this rank's gradient shard (``Shard.keep_gradients``).
        units: ``(unit, slots, gradients)`` per param group in the bucket: the compiled
            step ``unit`` updates the parameters at ``slots`` from ``gradients`` (for
            ``OptimizerInBackward``, a group's step: per parameter of the group, its slot
            and gradient here, or None).
    """

    def __init__(self, index: int, params: List[Tensor], positions: List[int]) -> None:
        self.index = index
        self.params = params
        self.positions = positions
        first = params[0]
        self.numel = sum(p.numel() for p in params)
        self.buffer = torch.zeros(
            self.numel + len(params), dtype=first.dtype, device=first.device
        )
        self.offsets = list(itertools.accumulate((p.numel() for p in params[:-1]), initial=0))
        self.grads = [self.buffer[o:o + p.numel()].view(p.shape)
                      for o, p in zip(self.offsets, params)]
        self.flags = self.buffer[self.numel:]
        self.used = [False] * len(params)
        self.hooked = [-1] * len(params)
        self.pending = len(params)
        self.launched = False
        self.last = False
        self.kept: Dict[int, Tuple[Tensor, Tensor]] = {}
        self.stepped: Optional[Tuple[int, List[Optional[Tensor]]]] = None
        self.divisor: Optional[int] = None
        self.unused: List[int] = []
        self.residual: Optional[Tensor] = None
        self.shard: Any = None
        self.units: List[Tuple[int, List[Any], List[Any]]] = []
        self.watched = self.buffer
        self.released = False

    @classmethod
    def of_ddp(cls, index: int, params: List[Tensor], ddp_buffer: Tensor) -> "Bucket":
        """A bucket for DDP's bucket ``index``: its gradient views laid out as DDP lays each
        gradient out (as the parameter is laid out in memory).

        Raises:
            ValueError: a sparse gradient; RuntimeError: ``ddp_buffer`` is not one dense
                gradient per parameter, back to back.
        """
        if ddp_buffer.layout != torch.strided:
            raise ValueError(
                f"Invalid gradient: DDP bucket {index} holds a {ddp_buffer.layout} gradient "
                f"(expected dense gradients: distopt's hooks reduce dense buckets; build "
                f"embeddings with sparse=False)"
            )
        bucket = cls(index, list(params), list(range(len(params))))
        expected = bucket.ddp_buffer()
        if expected.numel() != ddp_buffer.numel() or expected.dtype != ddp_buffer.dtype:
            raise RuntimeError(
                f"Invalid DDP bucket {index}: its buffer holds {ddp_buffer.numel()} "
                f"{ddp_buffer.dtype} elements, its parameters {bucket.numel} {bucket.dtype} "
                f"ones (expected one dense gradient per parameter, back to back)"
            )
        bucket.grads = [
            g if p.is_contiguous() else bucket.buffer.as_strided(p.shape, p.stride(), o)
            for g, p, o in zip(bucket.grads, bucket.params, bucket.offsets)
        ]
        bucket.used = [True] * len(params)
        return bucket

    def ddp_buffer(self) -> Tensor:
        """The gradient part of the buffer as DDP's bucket holds it: complex gradients as
        their real and imaginary parts (DDP's buffer of complex parameters is real)."""
        grads = self.buffer[:self.numel]
        return torch.view_as_real(grads).view(-1) if grads.is_complex() else grads

    @property
    def dtype(self) -> torch.dtype:
        return self.buffer.dtype

    def release(self) -> None:
        """Free ``buffer``'s memory (sharded gradients, once this rank's part is reduced out
        of it): every view of it (``grads``, ``flags``) keeps its shape but has no memory
        behind it until ``materialize``, so nothing outside this bucket may hold one."""
        self.buffer.untyped_storage().resize_(0)
        self.released = True

    def materialize(self) -> None:
        """Give ``buffer`` its memory back after ``release``, not zeroed: the reducing pass
        that calls it writes every slot (a gradient, or zeros) and the flags before the
        bucket is sent."""
        self.buffer.untyped_storage().resize_(self.buffer.numel() * self.buffer.element_size())
        self.released = False

    def reset(self) -> None:
        """Forget the window that ended (its gradients stay in the buffer)."""
        self.used = [False] * len(self.params)
        self.kept = {}
        self.stepped = None
        self.rearm()

    def rearm(self) -> None:
        """Wait again for every parameter before launching (``used`` is kept)."""
        self.pending = len(self.params)
        self.launched = False

    def mark_stepped(self) -> None:
        """Remember the gradients the step just read (see ``changed_since_step``)."""
        self.stepped = (version(self.watched), [p.grad for p in self.params])

    def changed_since_step(self) -> bool:
        """Whether a ``.grad`` was replaced, set to None or changed in place (in the buffer)
        since ``mark_stepped``."""
        if self.stepped is None:
            return False
        seen, grads = self.stepped
        return version(self.watched) != seen or any(
            p.grad is not g for p, g in zip(self.params, grads)
        )

    def fill_flags(self) -> None:
        """Write ``used`` into the flag part of the buffer."""
        self.flags.copy_(torch.tensor(self.used, dtype=self.flags.dtype))

    def keep(self, slot: int, grad: Tensor) -> None:
        """Remember the ``.grad`` of a parameter this rank did not use, before the
        reduction writes the average over it (a copy of its values if it is the bucket's
        view)."""
        self.kept[slot] = (grad, grad.clone() if grad is self.grads[slot] else grad)

    def leave_unused(self) -> List[int]:
        """After the reduction: give each parameter no rank used its ``.grad`` back as this
        rank had it (a zero tensor stays one, and is stepped, as under DDP with
        ``find_unused_parameters=True`` and torch.optim), and return the slots of those
        whose ``.grad`` is None (left untouched)."""
        untouched = []
        for k, flag in enumerate(self.flags.tolist()):
            if flag != 0:
                continue
            kept = self.kept.get(k)
            if kept is None:
                self.params[k].grad = None
                untouched.append(k)
            else:
                grad, values = kept
                with torch.no_grad():  # a gradient made with create_graph=True has a history
                    self.grads[k].copy_(values)  # what the step reads
                self.params[k].grad = grad
        return untouched


def dense_grad(bucket: Bucket, slot: int) -> Optional[Tensor]:
    """The ``.grad`` of ``bucket.params[slot]`` (None or a dense tensor).

    Raises:
        ValueError: a sparse gradient, naming the parameter's global index.
    """
    grad = bucket.params[slot].grad
    if grad is not None and grad.layout != torch.strided:
        raise ValueError(
            f"Invalid gradient of parameter {bucket.positions[slot]}: {grad.layout} "
            f"(expected a dense gradient)"
        )
    return grad


def assign_buckets(
    params: Sequence[Tensor],
    positions: Sequence[int],
    cap_bytes: int,
    arrival: Optional[Sequence[int]] = None,
    first_cap_bytes: Optional[int] = None,
) -> List[Bucket]:
    """Cut ``params`` into buckets, in reduction order.

    Args:
        params: the parameters that take gradients, in registration order.
        positions: their global indices.
        cap_bytes: the most gradient bytes a bucket holds (a larger parameter goes alone).
        arrival: the global indices in the order their gradients arrived in a backward
            pass (``DataParallelOptimizer`` rebuilds its buckets so after its first step, as
            DDP does); None: reverse registration order, the usual order of backward.
        first_cap_bytes: the cap of the first bucket of each (device, dtype), so that the
            first reduction starts early (DDP's rebuilt buckets: 1 MiB); None: ``cap_bytes``.

    Returns:
        The buckets, the first holding the parameters whose gradients come first.
    """
    if arrival is None:
        ordered = list(zip(reversed(list(params)), reversed(list(positions))))
    else:
        by_position = dict(zip(positions, params))
        ordered = [(by_position[i], i) for i in arrival]
    open_buckets: Dict[Tuple[torch.device, torch.dtype], Tuple[List[Tensor], List[int], int]] = {}
    started: Dict[Tuple[torch.device, torch.dtype], int] = {}  # closed buckets per kind
    closed: List[Tuple[List[Tensor], List[int]]] = []
    for p, i in ordered:
        key = (p.device, p.dtype)
        size = p.numel() * p.element_size()
        members, indices, used = open_buckets.get(key, ([], [], 0))
        cap = cap_bytes if first_cap_bytes is None or started.get(key, 0) else first_cap_bytes
        if members and used + size > cap:
            closed.append((members, indices))
            started[key] = started.get(key, 0) + 1
            members, indices, used = [], [], 0
        members.append(p)
        indices.append(i)
        open_buckets[key] = (members, indices, used + size)
    closed.extend((members, indices) for members, indices, _ in open_buckets.values())
    # Order by the first parameter each bucket serves.
    order = {id(p): k for k, (p, _) in enumerate(ordered)}
    closed.sort(key=lambda mi: order[id(mi[0][0])])
    buckets = [Bucket(k, members, indices) for k, (members, indices) in enumerate(closed)]
    if buckets:
        buckets[-1].last = True  # the communication thread issues in bucket order
    return buckets


class GradBucketView:
    """What torch's ``powerSGD_hook`` reads of DDP's ``GradBucket`` (its six methods), over
    the gradient part of a bucket; the flags that follow are not in it. A 0-dim gradient
    shows as one element (the hook reads ``shape[0]``); empty ones are left out."""

    def __init__(self, bucket: Bucket) -> None:
        self.bucket = bucket
        self._buffer = bucket.buffer[:bucket.numel]
        self._params = [p for p in bucket.params if p.numel() > 0]
        self._grads = [g.view(1) if g.dim() == 0 else g for g in bucket.grads if g.numel() > 0]

    def index(self) -> int:
        return self.bucket.index

    def buffer(self) -> Tensor:
        return self._buffer

    def gradients(self) -> List[Tensor]:
        return self._grads

    def parameters(self) -> List[Tensor]:
        return self._params

    def is_last(self) -> bool:
        return self.bucket.last

    def set_buffer(self, buffer: Tensor) -> None:
        self._buffer.copy_(buffer)
