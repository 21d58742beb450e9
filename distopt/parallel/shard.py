"""Sharded optimizer state (ZeRO): which rank steps which elements of a bucket, and the
buffer the updated parameters are gathered in.

With ``shard="param"`` or ``"flat"`` every rank still receives the whole averaged gradient
(gloo's reduce_scatter sends what an all_reduce sends, so nothing is saved by scattering;
with ``shard_gradients=True``, ``"flat"`` only, each rank receives its own run through an
all_to_all instead: ``distopt.parallel.scatter``, ``Shard.keep_gradients``),
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
import itertools
import math
from typing import Any, Callable, Dict, Iterable, List, NamedTuple, Optional, Sequence, Tuple

import torch
from torch import Tensor

from distopt._torch import all_gather_flat
from distopt.parallel.buckets import Bucket
from distopt.parallel.sync import all_gather_named
from distopt.profiling import profiler_range
from functional.blockwise_adam import QUANTISED_KEYS, is_quantised_entry

__all__ = [
    "ALIGN", "Blocks", "MODES", "SHAPED", "blocks_of", "Piece", "Shard", "attach", "check_laid_out", "cut_state",
    "gather", "gather_all", "gathered_state", "laid_out", "merge_pieces", "own_pieces_of",
    "piece_index", "split", "state_size", "step_own", "store",
]

#: Cuts inside a parameter fall at multiples of this many elements from its start.
ALIGN = 64
MODES = ("param", "flat")
#: Classes whose update of an element depends on others of its parameter (its shape).
SHAPED = ("Adafactor", "Muon")


class Blocks(NamedTuple):
    """How a blockwise-quantised class lays its state out: ``bits`` per code (8, or 4 packed
    two to a byte) and ``size`` elements per scale. A ``"flat"`` cut falls at a multiple of
    ``size`` from its parameter's start, so a piece holds whole blocks (the last may be short)."""

    bits: int
    size: int


def blocks_of(optimizer_class: type, param_groups: Sequence[Dict[str, Any]]) -> Optional[Blocks]:
    """The ``Blocks`` of a blockwise-quantised class (its ``blockwise_bits`` and the groups'
    ``block_size``), None for any other class.

    Raises:
        ValueError: the groups' block sizes differ (a cut must respect every group's).
    """
    bits = getattr(optimizer_class, "blockwise_bits", None)
    if bits is None:
        return None
    sizes = sorted({int(g["block_size"]) for g in param_groups})
    if len(sizes) != 1:
        raise ValueError(
            f"Invalid block_size: {sizes} in the param groups of a sharded "
            f"{optimizer_class.__name__} (expected one block_size for every group)"
        )
    return Blocks(int(bits), sizes[0])



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
            sizes = [piece.stop - piece.start for piece in part]
            starts = itertools.accumulate(sizes, initial=r * self.width)
            self._places.append([self.buffer[o:o + n] for o, n in zip(starts, sizes)])
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
        #: This rank's part of ``buffer``, which the gather sends.
        self.part = self.buffer[rank * self.width:(rank + 1) * self.width]
        #: With sharded gradients (``keep_gradients``): this rank's averaged gradient, its
        #: pieces one after the other as in ``part``; and slot -> the view of it shaped like
        #: the parameter, for each parameter this rank owns whole. Else None and {}.
        self.grad_part: Optional[Tensor] = None
        self.whole_grads: Dict[int, Tensor] = {}

    @property
    def span(self) -> Tuple[int, int]:
        """Where this rank's pieces lie in the bucket's gradient elements, ``[start, stop)``
        (``"flat"`` cuts each bucket into one run of elements per rank)."""
        offsets = self.bucket.offsets
        if not self.own:
            before = [pc for part in self.pieces[:self.rank] for pc in part]
            start = offsets[before[-1].slot] + before[-1].stop if before else 0
            return start, start
        first, last = self.own[0], self.own[-1]
        return offsets[first.slot] + first.start, offsets[last.slot] + last.stop

    def keep_gradients(self) -> None:
        """Sharded gradients: this rank's averaged gradient lives in ``grad_part`` (its
        pieces as ``grads``, what the step reads), no longer in the bucket's buffer, which
        ``bucket.watched`` stops standing for."""
        bucket = self.bucket
        self.grad_part = bucket.buffer.new_zeros(self.width)
        self.grads, self.whole_grads = [], {}
        start = 0
        for piece in self.own:
            p = bucket.params[piece.slot]
            n = piece.stop - piece.start
            flat = self.grad_part[start:start + n]
            start += n
            if n == p.numel():
                self.whole_grads[piece.slot] = flat.view(p.shape)
            whole = n == p.numel() and not p.is_contiguous()
            # As the bucket's own gradient views: laid out in the parameter's logical order.
            self.grads.append(flat.view(p.shape) if whole else flat)
        bucket.watched = self.grad_part

    def load(self) -> None:
        """Copy this rank's pieces of the parameters into ``buffer`` (the parameters may
        have been changed since the last gather, e.g. by ``load_state_dict``)."""
        self._copy(zip(self.own, self._places[self.rank]), into_buffer=True)

    def store(self) -> None:
        """Copy every rank's pieces from ``buffer`` into the parameters."""
        self._copy([pair for part, places in zip(self.pieces, self._places)
                    for pair in zip(part, places)], into_buffer=False)

    def _copy(self, pairs: Iterable[Tuple[Piece, Tensor]], into_buffer: bool) -> None:
        params = self.bucket.params
        targets, sources = [], []
        with torch.no_grad():
            for piece, place in pairs:
                p = params[piece.slot]
                if p.is_contiguous():
                    flat = p.view(-1)[piece.start:piece.stop]
                    targets.append(place if into_buffer else flat)
                    sources.append(flat if into_buffer else place)
                elif into_buffer:  # whole, laid out as the parameter is
                    laid_out(place, p).copy_(p)
                else:
                    p.copy_(laid_out(place, p))
            if targets:
                torch._foreach_copy_(targets, sources)

    def gathered_bytes(self, world_size: int) -> int:
        """The bytes one rank sends for the gather (its part, to every other rank)."""
        return (world_size - 1) * self.width * self.buffer.element_size()


def attach(buckets: Sequence[Bucket], world_size: int, rank: int, mode: str,
           optimizer_class: type, blocks: Optional[Blocks] = None) -> None:
    """Give each bucket its ``Shard``, the state balanced by ``state_size`` over the ranks;
    ``blocks``: a blockwise-quantised class's layout, whose blocks no cut may split."""
    adafactor = getattr(torch.optim, "Adafactor", None)
    name = "Adafactor" if adafactor and issubclass(optimizer_class, adafactor) else ""
    align = ALIGN if blocks is None else math.lcm(ALIGN, blocks.size)
    pieces = split(buckets, world_size, mode, [
        [state_size(name, p) * p.element_size() for p in b.params] for b in buckets
    ], align)
    for bucket, parts in zip(buckets, pieces):
        bucket.shard = Shard(bucket, parts, rank, whole=mode == "param")


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
    buckets: Sequence[Bucket], world_size: int, mode: str, weights: Sequence[Sequence[int]],
    align: int = ALIGN,
) -> List[List[List[Piece]]]:
    """``out[b][r]``: rank ``r``'s pieces of bucket ``b``; ``weights[b][k]``: the state
    bytes parameter ``k`` of bucket ``b`` costs, for balancing ``"param"``; ``align``: a
    ``"flat"`` cut inside a parameter falls at a multiple of it from the parameter's start."""
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
    return [_split_flat(bucket, world_size, align) for bucket in buckets]


def _split_flat(bucket: Bucket, world_size: int, align: int) -> List[List[Piece]]:
    sizes = [p.numel() for p in bucket.params]
    total = sum(sizes)
    # A parameter in another memory order is not cut: a piece of it could not be laid out
    # as the parameter is.
    whole = [not p.is_contiguous() for p in bucket.params]
    cuts = [0]
    for r in range(1, world_size):
        target = total * r / world_size
        cuts.append(max(cuts[-1], _allowed_near(bucket.offsets, sizes, whole, target, align)))
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
                  target: float, align: int) -> int:
    """The cut nearest ``target``: a parameter boundary, or a multiple of ``align`` elements
    from the start of the parameter it falls in (unless that one is ``whole``)."""
    for offset, n, keep in zip(offsets, sizes, whole):
        if offset <= target < offset + n:
            if keep:
                return offset if target - offset <= offset + n - target else offset + n
            below = offset + int((target - offset) // align) * align
            above = min(below + align, offset + n)
            return below if target - below <= above - target else above
    return offsets[-1] + sizes[-1] if offsets else 0


def cut_state(
    entry: Dict[str, Any], have: Tuple[int, int, torch.Size], want: Tuple[int, int, torch.Size],
    where: str, blocks: Optional[Blocks] = None,
) -> Dict[str, Any]:
    """The state of elements ``want`` of one parameter, from the state of elements ``have``
    (``(start, stop, shape)`` each, ``want`` inside ``have``).

    A tensor laid out like the elements (shape ``have[2]``) is cut; a 0-dim one (a step
    count, ASGD's ``eta``) is shared by every element and kept. Whole-to-whole keeps the
    entry as it is (Adafactor's factored moments have other shapes). Blockwise-quantised
    codes and scales are cut at ``blocks``' boundaries (``cut_blocks``).

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
        if blocks is not None and is_quantised_entry(entry) and key in QUANTISED_KEYS:
            out[key] = cut_blocks(key, value, c - a, d - a, blocks)
        elif isinstance(value, Tensor) and value.dim() > 0:
            if tuple(value.shape) != tuple(have_shape):
                raise ValueError(
                    f"Invalid {where}[{key!r}]: shape {tuple(value.shape)} (expected "
                    f"{tuple(have_shape)}, laid out like the elements, to split it over ranks)"
                )
            out[key] = value.reshape(-1)[c - a:d - a].clone().view(want_shape)
        else:
            out[key] = value
    return out


def cut_blocks(key: str, value: Tensor, start: int, stop: int, blocks: Blocks) -> Tensor:
    """Elements ``[start, stop)`` (``start`` a multiple of ``blocks.size``) of blockwise state
    ``value``: their codes (one a byte at 8 bits, two at 4) or their blocks' scales."""
    if key.endswith("_absmax"):
        lo, hi = start // blocks.size, -(-stop // blocks.size)
    elif blocks.bits == 8:
        lo, hi = start, stop
    else:
        lo, hi = start // 2, -(-stop // 2)
    return value.reshape(-1)[lo:hi].clone()


def merge_pieces(
    parts: List[Tuple[int, int, Dict[str, Any]]], shape: torch.Size, flat: bool
) -> Dict[str, Any]:
    """One parameter's torch.optim state from its pieces' ``(start, stop, entry)``, in any
    order; ``flat``: the pieces' state tensors are 1-D (else each entry is whole already)."""
    if not flat:
        return parts[0][2]
    parts = sorted(parts, key=lambda t: t[0])
    out = {}
    quantised = is_quantised_entry(parts[0][2])
    for key, value in parts[0][2].items():
        if quantised and key in QUANTISED_KEYS:
            # whole blocks in each piece: the codes and scales follow one another
            out[key] = torch.cat([e[key].reshape(-1) for _, _, e in parts])
        elif isinstance(value, Tensor) and value.dim() > 0:
            out[key] = torch.cat([e[key].reshape(-1) for _, _, e in parts]).view(shape)
        else:
            out[key] = value
    return out


def gather(bucket: Bucket, group: Any) -> Any:
    """Start the gather of ``bucket``'s updated pieces on ``group``."""
    with profiler_range("distopt.dp.gather", bucket.index):
        return all_gather_flat(bucket.shard.buffer, bucket.shard.part, group=group,
                               async_op=True)


def store(bucket: Bucket, work: Any) -> None:
    """Wait for ``gather``'s work and copy the pieces into the parameters (None: a window
    that steps in ``step()``, which gathers then)."""
    if work is None:
        return
    with profiler_range("distopt.dp.gather.wait", bucket.index):
        work.wait()
        bucket.shard.store()


def gather_all(buckets: Sequence[Bucket], group: Any) -> None:
    """Gather every bucket's updated pieces (after a step outside backward)."""
    works = [gather(bucket, group) for bucket in buckets]
    for bucket, work in zip(buckets, works):
        store(bucket, work)


def piece_index(buckets: Sequence[Bucket]) -> Dict[int, Any]:
    """Global index -> (start, stop, shape of its state tensors) of this rank's pieces."""
    return {
        b.positions[pc.slot]: (pc.start, pc.stop, v.shape)
        for b in buckets for pc, v in zip(b.shard.own, b.shard.views)
    }


def gathered_state(opt: Any, mine: Dict[int, Dict[str, Any]]) -> Dict[int, Dict[str, Any]]:
    """The whole state in torch.optim's format, keyed by global index, from every rank's
    pieces ``mine`` of ``opt`` (one all_gather_object), joined."""
    pieces = piece_index(opt.buckets)
    mine = {i: (pieces[i][0], pieces[i][1], entry) for i, entry in mine.items()}
    every: List[Any] = [mine]
    if opt.world_size > 1:
        every = all_gather_named("consolidate_state_dict() (or a bucket rebuild)",
                                 mine, opt.process_group, opt.rank, opt.world_size)
    parts: Dict[int, List[Any]] = {}
    for theirs in every:
        for i, part in theirs.items():
            parts.setdefault(i, []).append(part)
    flat = opt.shard == "flat"
    return {i: merge_pieces(ps, opt.bucketed[i].shape, flat) for i, ps in parts.items()}


def own_pieces_of(opt: Any, state: Dict[int, Dict[str, Any]], saved_ids: Sequence[Any],
                  pieces: Optional[Dict[int, Any]] = None) -> Dict[int, Dict[str, Any]]:
    """This rank's pieces of a whole state of ``opt`` (torch.optim's format, global index
    keys); ``saved_ids`` name the entries in errors. ``pieces``: ``piece_index`` of the
    buckets the state goes to (default: ``opt``'s buckets now)."""
    out = {}
    if pieces is None:
        pieces = piece_index(opt.buckets)
    for i, want in pieces.items():
        if i in state:
            p = opt.bucketed[i]
            out[i] = cut_state(state[i], (0, p.numel(), p.shape), want,
                               f"state_dict['state'][{saved_ids[i]!r}]", opt.blocks)
    return out


def check_laid_out(opt: Any, state: Dict[int, Dict[str, Any]]) -> None:
    """With ``"flat"``, that every state tensor of a whole state (global index keys) but a
    0-dim one is shaped like its parameter, as the unsharded optimizer checks it: a flat
    piece would take any tensor of as many elements. Every rank checks every parameter's,
    so every rank decides alike.

    Raises:
        ValueError: naming the parameter, its shape and the tensor's.
    """
    if opt.shard != "flat":
        return
    for i, entry in sorted(state.items()):
        if i not in opt.bucketed or not isinstance(entry, dict):
            continue  # not trained here, or not an entry: the other checks name it
        shape = list(opt.bucketed[i].shape)
        if opt.blocks is not None and is_quantised_entry(entry):
            _check_blocks(i, entry, opt.bucketed[i].numel(), opt.blocks)
            continue
        for key, value in entry.items():
            if key == "step":
                continue  # 0-dim: the compiled steps' own check names any other shape
            if isinstance(value, Tensor) and value.dim() > 0 and list(value.shape) != shape:
                raise ValueError(
                    f"Invalid state[{i}][{key!r}]: shape {list(value.shape)} (expected {shape} "
                    f"for params[{i}] of shape {shape})"
                )


def _check_blocks(i: int, entry: Dict[str, Any], n: int, blocks: Blocks) -> None:
    """That the blockwise state of a parameter of ``n`` elements has its codes and scales."""
    codes = n if blocks.bits == 8 else -(-n // 2)
    for key in QUANTISED_KEYS:
        value = entry.get(key)
        want = -(-n // blocks.size) if key.endswith("_absmax") else codes
        if not isinstance(value, Tensor) or value.numel() != want:
            got = list(value.shape) if isinstance(value, Tensor) else type(value).__name__
            raise ValueError(
                f"Invalid state[{i}][{key!r}]: {got} (expected {want} values for params[{i}] "
                f"of {n} elements in blocks of {blocks.size} at {blocks.bits} bits)"
            )


def step_own(buckets: Sequence[Bucket], step: Callable[[], None]) -> None:
    """An eager optimizer's ``step()`` on this rank's parameters only: the others' ``.grad``
    is hidden (None: torch.optim skips them and makes no state for them); then this rank's
    pieces are copied into the buffers the gather sends."""
    hidden = []
    for bucket in buckets:
        own = {pc.slot for pc in bucket.shard.own}
        hidden.extend((p, p.grad) for k, p in enumerate(bucket.params) if k not in own)
    for p, _ in hidden:
        p.grad = None
    try:
        step()
    finally:
        for p, grad in hidden:
            p.grad = grad
    for bucket in buckets:
        bucket.shard.load()
