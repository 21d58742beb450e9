"""Sharded optimizer state (ZeRO): which rank steps which elements of a bucket, and the
buffer the updated parameters are gathered in.

With ``shard="param"`` or ``"flat"`` every rank still receives the whole averaged gradient
(gloo's reduce_scatter sends what an all_reduce sends, so nothing is saved by scattering),
but each rank keeps optimizer state for, and steps, only its own *pieces*: ranges of
elements of the bucket's parameters. The updated pieces are then all-gathered into one
buffer per bucket, ``world_size`` equal parts, rank ``r``'s pieces one after the other in
part ``r``, and copied back into the parameters.

- ``"param"``: whole parameters. Each goes to the rank holding the least state so far
  (list scheduling over the whole model), so no rank holds more than ``S / W`` plus the
  largest parameter's state. Adafactor and Muon need this: their update depends on the
  parameter's shape.
- ``"flat"``: each bucket's elements are split into ``W`` runs of about equal length; a cut
  inside a parameter falls at a multiple of ``ALIGN`` elements from its start, because the
  fused kernels process a tensor in vector lanes and a shifted cut changes the last bit of
  some elements (measured: SGD with momentum cut at 32,003 of 64,001 elements differs, cut
  at 32,000 does not). Elementwise algorithms only.

Stepping a piece equals stepping its whole parameter, bit for bit, for every elementwise
class (the same elements meet the same operands in the same lanes), so sharded training
equals unsharded training exactly.
"""
from typing import Any, Dict, List, NamedTuple, Sequence, Tuple

import torch
from torch import Tensor

from distopt._torch import all_gather_flat
from distopt.parallel.buckets import Bucket

__all__ = [
    "ALIGN", "MODES", "SHAPED", "Piece", "Shard", "cut_state", "laid_out", "merge_pieces", "split",
    "state_size",
]

#: Cuts inside a parameter fall at multiples of this many elements from its start.
ALIGN = 64
MODES = ("param", "flat")
#: Classes whose update of an element depends on others of its parameter (its shape).
SHAPED = ("Adafactor", "Muon")


class Piece(NamedTuple):
    """Elements ``[start, stop)`` of ``bucket.params[slot]``, flattened."""

    slot: int
    start: int
    stop: int


class Shard:
    """One bucket split over the ranks.

    Attributes:
        pieces: per rank, its pieces in the order they lie in its part of ``buffer``.
        width: the elements of one rank's part.
        buffer: ``world_size * width`` elements: every rank's pieces after the gather.
        own: this rank's pieces.
        views: where each own piece lies in ``buffer`` (shaped like its parameter when it
            is the whole parameter and ``whole``): what the optimizer steps.
        grads: the matching views of the bucket's averaged gradient.
    """

    def __init__(self, bucket: Bucket, pieces: List[List[Piece]], rank: int, whole: bool) -> None:
        self.bucket = bucket
        self.pieces = pieces
        self.rank = rank
        longest = max(sum(p.stop - p.start for p in part) for part in pieces)
        self.width = -(-longest // ALIGN) * ALIGN
        self.buffer = bucket.buffer.new_zeros(len(pieces) * self.width)
        self._places: List[List[Tensor]] = []
        for r, part in enumerate(pieces):
            offset = r * self.width
            places = []
            for piece in part:
                n = piece.stop - piece.start
                places.append(self.buffer[offset:offset + n])
                offset += n
            self._places.append(places)
        self.own = pieces[rank]
        self.views = []
        self.grads = []
        for piece, place in zip(self.own, self._places[rank]):
            p = bucket.params[piece.slot]
            grad = bucket.grads[piece.slot]
            if piece.stop - piece.start == p.numel() and (whole or not p.is_contiguous()):
                self.views.append(laid_out(place, p))
                self.grads.append(grad)
            else:
                self.views.append(place)
                self.grads.append(grad.view(-1)[piece.start:piece.stop])
        self._part = self.buffer[rank * self.width:(rank + 1) * self.width]

    def load(self) -> None:
        """Copy this rank's pieces of the parameters into ``buffer`` (the parameters may
        have been changed since the last gather, e.g. by ``load_state_dict``)."""
        if not self.own:
            return
        params = self.bucket.params
        targets, sources = [], []
        with torch.no_grad():
            for piece, place, view in zip(self.own, self._places[self.rank], self.views):
                p = params[piece.slot]
                if p.is_contiguous():
                    targets.append(place)
                    sources.append(p.view(-1)[piece.start:piece.stop])
                else:  # whole, laid out as the parameter is
                    view.copy_(p)
            if targets:
                torch._foreach_copy_(targets, sources)

    def gather(self, group: Any) -> Any:
        """Start the all_gather of every rank's part (returns the work)."""
        return all_gather_flat(self.buffer, self._part, group=group, async_op=True)

    def store(self) -> None:
        """Copy every rank's pieces from ``buffer`` into the parameters."""
        params = self.bucket.params
        targets, sources = [], []
        with torch.no_grad():
            for part, places in zip(self.pieces, self._places):
                for piece, place in zip(part, places):
                    p = params[piece.slot]
                    if p.is_contiguous():
                        targets.append(p.view(-1)[piece.start:piece.stop])
                        sources.append(place)
                    else:  # whole, laid out as the parameter is
                        p.copy_(laid_out(place, p))
            if targets:
                torch._foreach_copy_(targets, sources)

    def gathered_bytes(self, world_size: int) -> int:
        """The bytes one rank sends for the gather (its part, to every other rank)."""
        return (world_size - 1) * self.width * self.buffer.element_size()


def laid_out(place: Tensor, p: Tensor) -> Tensor:
    """``place`` (``p.numel()`` elements of a flat buffer) seen with ``p``'s shape and, for
    a dense parameter in another memory order (transposed, channels_last), its strides: the
    kernels then meet the elements in the order they meet ``p``'s."""
    if not p.is_contiguous() and _dense(p):
        return place.as_strided(p.shape, p.stride())
    return place.view(p.shape)


def _dense(p: Tensor) -> bool:
    """Whether ``p``'s elements fill ``p.numel()`` consecutive places (in some order)."""
    expected = 1
    for size, stride in sorted(zip(p.shape, p.stride()), key=lambda t: t[1]):
        if size != 1 and stride != expected:
            return False
        expected *= size
    return True


def state_size(class_name: str, p: Tensor) -> int:
    """The elements of state ``p`` costs, relative to other parameters of one optimizer:
    Adafactor keeps a matrix's second moment as a row and a column vector."""
    if class_name == "Adafactor" and p.dim() >= 2:
        return p.numel() // p.shape[-1] + p.numel() // p.shape[-2]
    return p.numel()


def split(
    buckets: Sequence[Bucket], world_size: int, mode: str, weights: Sequence[Sequence[int]]
) -> List[List[List[Piece]]]:
    """Every bucket's pieces per rank.

    Args:
        buckets: the buckets, in reduction order.
        world_size: the number of ranks.
        mode: ``"param"`` or ``"flat"``.
        weights: per bucket, per parameter, the state bytes it costs (``state_size`` times
            the element size), for balancing ``"param"``.

    Returns:
        ``out[b][r]``: rank ``r``'s pieces of bucket ``b``.
    """
    if mode == "param":
        load = [0] * world_size
        out = []
        for bucket, costs in zip(buckets, weights):
            parts: List[List[Piece]] = [[] for _ in range(world_size)]
            order = sorted(range(len(bucket.params)), key=lambda k: -costs[k])
            for k in order:
                r = min(range(world_size), key=lambda q: (load[q], q))
                load[r] += costs[k]
                parts[r].append(Piece(k, 0, bucket.params[k].numel()))
            for part in parts:
                part.sort()
            out.append(parts)
        return out
    return [_split_flat(bucket, world_size) for bucket in buckets]


def _split_flat(bucket: Bucket, world_size: int) -> List[List[Piece]]:
    sizes = [p.numel() for p in bucket.params]
    total = sum(sizes)
    # A parameter in another memory order is not cut: a piece of it could not be laid out
    # as the parameter is.
    whole = [not p.is_contiguous() for p in bucket.params]
    cuts = [0]
    for r in range(1, world_size):
        target = total * r / world_size
        cuts.append(max(cuts[-1], _allowed_near(bucket.offsets, sizes, whole, target)))
    cuts.append(total)
    parts: List[List[Piece]] = []
    for r in range(world_size):
        lo, hi = cuts[r], cuts[r + 1]
        part = []
        for k, (offset, n) in enumerate(zip(bucket.offsets, sizes)):
            a, b = max(lo, offset), min(hi, offset + n)
            if a < b:
                part.append(Piece(k, a - offset, b - offset))
        parts.append(part)
    return parts


def _allowed_near(offsets: Sequence[int], sizes: Sequence[int], whole: Sequence[bool],
                  target: float) -> int:
    """The cut nearest ``target``: a parameter boundary, or a multiple of ALIGN elements
    from the start of the parameter it falls in (unless that one is ``whole``)."""
    for offset, n, keep in zip(offsets, sizes, whole):
        if offset <= target < offset + n:
            if keep:
                return offset if target - offset <= offset + n - target else offset + n
            below = offset + int((target - offset) // ALIGN) * ALIGN
            above = min(below + ALIGN, offset + n)
            return below if target - below <= above - target else above
    return offsets[-1] + sizes[-1] if offsets else 0


def cut_state(
    entry: Dict[str, Any], have: Tuple[int, int, torch.Size], want: Tuple[int, int, torch.Size],
    where: str,
) -> Dict[str, Any]:
    """The state of elements ``want`` of one parameter, from the state of elements ``have``
    (``(start, stop, shape)`` each, ``want`` inside ``have``).

    A tensor laid out like the elements (shape ``have[2]``) is cut; a 0-dim one (a step
    count, ASGD's ``eta``) is shared by every element and kept. Whole-to-whole keeps the
    entry as it is (Adafactor's factored moments have other shapes).

    Raises:
        ValueError: a tensor that can be neither, naming ``where`` and the key.
    """
    a, b, have_shape = have
    c, d, want_shape = want
    if (a, b) == (c, d):
        return {k: (v.reshape(want_shape) if isinstance(v, Tensor) and tuple(v.shape) == tuple(have_shape) else v)
                for k, v in entry.items()}
    out = {}
    for key, value in entry.items():
        if isinstance(value, Tensor) and value.dim() > 0:
            if tuple(value.shape) != tuple(have_shape):
                raise ValueError(
                    f"Invalid {where}[{key!r}]: shape {tuple(value.shape)} (expected "
                    f"{tuple(have_shape)}, laid out like the elements, to split it over ranks)"
                )
            out[key] = value.reshape(-1)[c - a:d - a].clone().view(want_shape)
        else:
            out[key] = value
    return out


def merge_pieces(
    parts: List[Tuple[int, int, Dict[str, Any]]], shape: torch.Size, flat: bool
) -> Dict[str, Any]:
    """One parameter's torch.optim state from its pieces' ``(start, stop, entry)``, in any
    order; ``flat``: the pieces' state tensors are 1-D (else each entry is whole already)."""
    if not flat:
        return parts[0][2]
    parts = sorted(parts, key=lambda t: t[0])
    out = {}
    for key, value in parts[0][2].items():
        if isinstance(value, Tensor) and value.dim() > 0:
            out[key] = torch.cat([e[key].reshape(-1) for _, _, e in parts]).view(shape)
        else:
            out[key] = value
    return out
