r"""Sharded gradients (ZeRO-2): each bucket's average reduce-scattered into this rank's part.

``DataParallelOptimizer(..., shard="flat", shard_gradients=True)`` reduces with
``ReduceScatter`` instead of an all-reduce. ``shard="flat"`` cuts each bucket into one run of
elements per rank (``distopt.parallel.shard``); each rank receives only its own run, averaged,
into the bucket's ``Shard.grad_part``, which its step reads, and the bucket's buffer is
released (``Bucket.release``) until the next reducing pass fills it again. After the
reducing backward pass a rank holds ``1/W`` of the gradients (plus the alignment of the
cuts), where an all-reduce leaves all of them on every rank.

What ``.grad`` holds after the reduction: for each parameter this rank owns whole, a view of
its gradient shard, shaped like the parameter (the average, as with DDP); for every other
parameter in a bucket (owned by other ranks, or cut between ranks), None.

How it is sent: gloo (torch 2.13) has ``reduce_scatter_tensor``, but it sends what an
all_reduce sends (it is one, then a copy), and ``reduce_scatter`` of a list sums in another
order. So each rank sends every other rank that rank's run of its divided gradients with one
``all_to_all_single`` (``(W-1)/W`` of the bucket, half of what a ring all_reduce sends), the
"used" flags follow in a small all_reduce, and each rank sums what it received in the order
gloo's ring all_reduce of the whole buffer would have summed each element (``ring_starts``,
``ring_order``): the average equals ``shard="flat"``'s all-reduced one bit for bit, at any
world size.

A GradScaler checks the ``.grad`` it finds, which here is this rank's part only. So when a
window's buckets wait for ``step()`` (as a scaler's do), the ranks agree, after the last
bucket, on whether any averaged gradient is inf or NaN (one all_reduce of two flags), and a
rank whose own part is finite then writes one inf (or NaN) into the first gradient it owns
whole: every rank's scaler finds it, and skips alike. ``step()`` without a scaler, and
``clip_grad_norm_``, put the element back first.
"""
import math
from typing import Any, Dict, List, NamedTuple, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
from torch import Tensor

from distopt._torch import all_gather_flat
from distopt.parallel.buckets import Bucket, dense_grad
from distopt.parallel.compression import Compression, real_values

__all__ = ["GLOO_MAX_SEGMENT_BYTES", "ReduceScatter", "ring_order", "ring_starts"]

#: gloo's ring all_reduce cuts a buffer into segments of at most this many bytes (measured
#: on torch 2.13: the chunk boundaries of buffers from 10 to 7,000,003 float32 elements at
#: 3 ranks, float64, float16 and bfloat16 alike).
GLOO_MAX_SEGMENT_BYTES = 1 << 20


def ring_starts(elements: int, element_size: int, world_size: int) -> List[int]:
    """Where each rank's chunk of a buffer of ``elements`` begins in gloo's ring all_reduce,
    and the end: ``world_size`` chunks of whole segments, at least two segments a rank."""
    total = elements * element_size
    most = element_size * max(1, GLOO_MAX_SEGMENT_BYTES // element_size)
    segments = max(-(-total // most), 2 * world_size)
    segments = -(-segments // world_size) * world_size
    segment = -(-(-(-total // segments)) // element_size) * element_size
    chunk = segments // world_size * segment // element_size
    return [min(elements, c * chunk) for c in range(world_size)] + [elements]


def _length(pieces: Sequence[Any]) -> int:
    return sum(pc.stop - pc.start for pc in pieces)


def _whole(bucket: Bucket, piece: Any) -> bool:
    return piece.stop - piece.start == bucket.params[piece.slot].numel()


def _cut_slots(bucket: Bucket) -> List[int]:
    """The slots of the parameters no rank owns whole (cut between ranks)."""
    whole = {pc.slot for part in bucket.shard.pieces for pc in part if _whole(bucket, pc)}
    return [k for k in range(len(bucket.params)) if k not in whole]


def ring_order(chunk: int, world_size: int) -> List[int]:
    """The ranks in the order gloo's ring adds their values of chunk ``chunk``: the partial
    sum travels to the next lower rank, and ends at the chunk's own rank (measured: every
    element of buffers up to 3,000,001 float32 elements at 3 and 4 ranks)."""
    return [(chunk - k) % world_size for k in range(1, world_size)] + [chunk]


class _Pending(NamedTuple):
    received: Tensor  #: every rank's run of this rank's elements, rank after rank
    exchange: Any
    flags: Any


class _Poison(NamedTuple):
    """The element a rank overwrote with a non-finite value (``mark``), and what it held."""

    bucket: Bucket
    view: Tensor
    value: Tensor
    mark: float


class ReduceScatter(Compression):
    """Each bucket's average, reduce-scattered into this rank's ``Shard.grad_part``.

    Args:
        group, rank, world_size: where the ranks agree on non-finite gradients and clip (the
            communication thread's group, idle between steps); None before ``bound``.
        buckets: the buckets it reduces (empty before ``bound``).
    """

    takes_complex = True

    def __init__(self, group: Any = None, rank: int = 0, world_size: int = 1,
                 buckets: Sequence[Bucket] = ()) -> None:
        self.group = group
        self.rank = rank
        self.world_size = world_size
        self.buckets = list(buckets)
        self.poison: Optional[_Poison] = None

    def __repr__(self) -> str:
        return "ReduceScatter()"

    def bound(self, group: Any, rank: int, world_size: int,
              buckets: List[Bucket]) -> "ReduceScatter":
        return ReduceScatter(group, rank, world_size, buckets)

    def release_group(self) -> None:
        self.group = None
        self.buckets = []

    # ------------------------------------------------------------ the engine's hooks

    def prepare(self, buckets: Sequence[Bucket]) -> None:
        """Each bucket's gradient shard made, and its buffer released until backward."""
        for bucket in buckets:
            bucket.shard.keep_gradients()
            bucket.release()

    def issue(self, bucket: Bucket, group: Any, world_size: int) -> Any:
        values = real_values(bucket.buffer)
        values.div_(bucket.divisor or world_size)
        factor = values.numel() // bucket.buffer.numel()
        grads, flags = values[:bucket.numel * factor], values[bucket.numel * factor:]
        sizes = [factor * _length(part) for part in bucket.shard.pieces]
        mine = sizes[bucket.shard.rank]
        received = values.new_empty(world_size * mine)
        exchange = dist.all_to_all_single(received, grads, [mine] * world_size, sizes,
                                          group=group, async_op=True)
        return _Pending(received, exchange, dist.all_reduce(flags, group=group, async_op=True))

    def finish(self, pending: Any, bucket: Bucket, world_size: int) -> None:
        pending.exchange.wait()
        pending.flags.wait()
        shard = bucket.shard
        target = real_values(shard.grad_part)
        factor = target.numel() // shard.grad_part.numel()
        start, stop = (factor * e for e in shard.span)
        runs = pending.received.view(world_size, stop - start)
        length = factor * bucket.buffer.numel()  # what shard="flat" all-reduces
        starts = ring_starts(length, target.element_size(), world_size)
        for c in range(world_size):
            a, b = max(start, starts[c]), min(stop, starts[c + 1])
            if a >= b:
                continue
            order = ring_order(c, world_size)
            out = target[a - start:b - start]
            if world_size == 1:
                out.copy_(runs[0, a - start:b - start])
                continue
            torch.add(runs[order[0], a - start:b - start], runs[order[1], a - start:b - start],
                      out=out)
            for r in order[2:]:
                out.add_(runs[r, a - start:b - start])

    def settle(self, bucket: Bucket, unused: List[int]) -> None:
        """After ``Bucket.leave_unused``: the ``.grad`` this rank keeps (see the module's
        docstring), the given-back gradient of a parameter no rank used copied into this
        rank's pieces of it, and the bucket's buffer released."""
        shard = bucket.shard
        skipped = set(unused)
        flags = bucket.flags.tolist()
        for piece, grad in zip(shard.own, shard.grads):
            if flags[piece.slot] == 0 and piece.slot not in skipped:
                whole = bucket.grads[piece.slot].reshape(-1)
                grad.view(-1).copy_(whole[piece.start:piece.stop])
        for slot, p in enumerate(bucket.params):
            p.grad = None if slot in skipped else shard.whole_grads.get(slot)
        bucket.release()

    def window_reduced(self, buckets: Sequence[Bucket]) -> None:
        """Every bucket of a window that waits for ``step()`` is reduced (the finishing
        thread, nothing else in flight on the group): the ranks agree on inf / NaN, and a
        rank that found none in its part marks its first whole gradient (see the module)."""
        self.poison = None
        if self.world_size == 1:
            return
        parts = [b.shard.grad_part for b in buckets]
        found = torch.tensor([int(not all(bool(torch.isfinite(g).all()) for g in parts)),
                              int(any(bool(torch.isnan(g).any()) for g in parts))],
                             dtype=torch.int64, device=parts[0].device)
        # What this rank's scaler will see: the gradients it owns whole (a cut one's .grad
        # is None here).
        seen = not all(bool(torch.isfinite(g).all())
                       for b in buckets for g in b.shard.whole_grads.values())
        dist.all_reduce(found, op=dist.ReduceOp.MAX, group=self.group)
        if seen or not bool(found[0]):
            return
        mark = math.nan if bool(found[1]) else math.inf
        for bucket in buckets:
            for slot in sorted(bucket.shard.whole_grads):
                view = bucket.shard.whole_grads[slot].reshape(-1)[:1]
                if view.numel():
                    self._mark(_Poison(bucket, view, view.clone(), mark))
                    return

    def _mark(self, poison: _Poison) -> None:
        self.poison = poison
        poison.view.fill_(poison.mark)
        poison.bucket.mark_stepped()  # not the loop's change of .grad

    def unpoison(self) -> Optional[_Poison]:
        """Put the marked element back (``step()`` without a scaler, ``clip_grad_norm_``);
        returns what was marked, or None."""
        poison, self.poison = self.poison, None
        if poison is not None:
            poison.view.copy_(poison.value)
            poison.bucket.mark_stepped()
        return poison

    def repoison(self, poison: Optional[_Poison]) -> None:
        """Mark again the element ``unpoison`` put back, keeping what it holds now."""
        if poison is not None:
            self._mark(poison._replace(value=poison.view.clone()))

    def before_step(self, scaling: Optional[Any]) -> None:
        """Without a scaler the marked element is put back; with one, a scaler that could
        not have seen every gradient of this rank is refused (every rank alike: the cuts are
        the same everywhere)."""
        if scaling is None:
            self.unpoison()
            return
        buckets = self.buckets
        cut = [b.positions[k] for b in buckets for k in _cut_slots(b)]
        if scaling[0] is None and cut:
            raise RuntimeError(
                f"Invalid step: scaler.unscale_(opt) unscaled the .grad it found, but with "
                f"shard_gradients=True parameters {cut[:10]} are cut between ranks and have "
                f".grad None, so their pieces stayed scaled; nothing was stepped (expected "
                f"scaler.step(opt) without scaler.unscale_(opt); or shard_gradients=False)"
            )
        bare = [r for r in range(self.world_size)
                if not any(_whole(b, pc) for b in buckets for pc in b.shard.pieces[r])]
        if bare:
            raise RuntimeError(
                f"Invalid step: with shard_gradients=True a GradScaler checks the .grad of the "
                f"parameters a rank owns whole, and ranks {bare} own none (every parameter "
                f"they step is cut between ranks), so their scaler found no gradient to check; "
                f"nothing was stepped (expected a smaller bucket_cap_mb, so that each rank "
                f"owns some parameter whole, or shard_gradients=False)"
            )

    def take_user_grads(self, bucket: Bucket) -> List[int]:
        """A ``.grad`` the loop replaced goes into this rank's pieces of it; set to None, on
        a parameter this rank owns whole, its pieces are not stepped (for a parameter it
        does not own whole ``.grad`` is None already: what the reduction left is stepped)."""
        skipped = []
        shard = bucket.shard
        for piece, grad in zip(shard.own, shard.grads):
            p = bucket.params[piece.slot]
            expected = shard.whole_grads.get(piece.slot)
            if p.grad is expected:
                continue
            given = dense_grad(bucket, piece.slot)
            if given is None:
                skipped.append(piece.slot)
                continue
            with torch.no_grad():  # a gradient made with create_graph=True has a history
                grad.view(-1).copy_(given.reshape(-1)[piece.start:piece.stop])
        return skipped

    def clip_grad_norm_(self, buckets: Sequence[Bucket], params: List[Tensor], max_norm: float,
                        norm_type: float, error_if_nonfinite: bool,
                        foreach: Optional[bool]) -> Tensor:
        """As ``torch.nn.utils.clip_grad_norm_`` over every reduced gradient, bit for bit:
        each parameter's norm where its gradient lies (a parameter cut between ranks is
        gathered, one bucket at a time), the norms summed into place over the ranks (each is
        non-zero on one rank only, so the sum is exact), then the same total and factor."""
        poison = self.unpoison()
        norms = self._norms(buckets, float(norm_type))
        if not norms:
            total = torch.tensor(0.0)
        else:
            by_kind: Dict[Tuple[torch.device, torch.dtype], List[Tensor]] = {}
            for norm in norms:
                by_kind.setdefault((norm.device, norm.dtype), []).append(norm)
            ordered = [n for kind in by_kind.values() for n in kind]
            total = torch.linalg.vector_norm(
                torch.stack([n.to(norms[0].device) for n in ordered]), norm_type)
        if error_if_nonfinite and bool(torch.logical_or(total.isnan(), total.isinf())):
            self.repoison(poison)
            raise RuntimeError(
                f"The total norm of order {norm_type} for gradients from `parameters` is "
                f"non-finite, so it cannot be clipped. To disable this error and scale the "
                f"gradients by the non-finite norm anyway, set `error_if_nonfinite=False`"
            )
        factor = torch.clamp(max_norm / (total + 1e-6), max=1.0)
        with torch.no_grad():
            for bucket in buckets:
                skipped = set(bucket.unused)
                for piece, grad in zip(bucket.shard.own, bucket.shard.grads):
                    if piece.slot not in skipped:
                        grad.mul_(factor.to(grad.device))
        self.repoison(poison)
        return total

    def _norms(self, buckets: Sequence[Bucket], norm_type: float) -> List[Tensor]:
        """Each reduced gradient's norm, in global index order, the same on every rank."""
        here: Dict[int, Tensor] = {}  # of the gradients this rank owns whole
        everywhere: Dict[int, Tensor] = {}  # of the cut ones, gathered on every rank
        kinds: Dict[int, Tuple[torch.device, torch.dtype]] = {}
        for bucket in buckets:
            skipped = set(bucket.unused)
            for slot, grad in bucket.shard.whole_grads.items():
                if slot not in skipped:
                    here[bucket.positions[slot]] = torch.linalg.vector_norm(grad, norm_type)
            everywhere.update(self._cut_norms(bucket, norm_type))
            for i, p in zip(bucket.positions, bucket.params):
                kinds[i] = (p.device, p.dtype.to_real() if p.dtype.is_complex else p.dtype)
        used = sorted(i for b in buckets for k, i in enumerate(b.positions)
                      if k not in set(b.unused))
        if self.world_size == 1 or not used:
            return [here[i] if i in here else everywhere[i] for i in used]
        box = torch.zeros(len(used), dtype=torch.float64, device=buckets[0].buffer.device)
        for k, i in enumerate(used):
            if i in here:
                box[k] = here[i].to(torch.float64)
        dist.all_reduce(box, group=self.group)  # x + 0 + ... + 0: exact
        return [everywhere[i] if i in everywhere else box[k].to(*kinds[i])
                for k, i in enumerate(used)]

    def _cut_norms(self, bucket: Bucket, norm_type: float) -> Dict[int, Tensor]:
        """The norms of the bucket's gradients cut between ranks: their pieces gathered
        (every rank's, padded alike), each gradient joined whole on every rank."""
        skipped = set(bucket.unused)
        cut = [k for k in _cut_slots(bucket) if k not in skipped]
        if not cut:
            return {}
        shard = bucket.shard
        parts = [[pc for pc in part if pc.slot in cut] for part in shard.pieces]
        width = max(_length(part) for part in parts)
        mine = [g.view(-1) for pc, g in zip(shard.own, shard.grads) if pc.slot in cut]
        send = shard.grad_part.new_zeros(width)
        if mine:
            torch.cat(mine, out=send[:_length(parts[shard.rank])])
        every = send.new_empty(self.world_size * width)
        all_gather_flat(every, send, group=self.group)
        whole = {k: send.new_empty(bucket.params[k].numel()) for k in cut}
        for r, part in enumerate(parts):
            at = r * width
            for pc in part:
                whole[pc.slot][pc.start:pc.stop] = every[at:at + pc.stop - pc.start]
                at += pc.stop - pc.start
        return {bucket.positions[k]: torch.linalg.vector_norm(
            whole[k].view(bucket.params[k].shape), norm_type) for k in cut}

    def bytes_per_step(self, numels: List[Tuple[int, int]], dtype: torch.dtype,
                       world_size: int) -> float:
        real = dtype.to_real() if dtype.is_complex else dtype
        size = real.itemsize * (2 if dtype.is_complex else 1)
        spread = (world_size - 1) / world_size
        return float(sum(spread * n * size + 2.0 * spread * k * size for n, k in numels))
