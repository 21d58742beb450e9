r"""Gradient compression: how one bucket's gradients are averaged over the ranks.

Every scheme here runs in two halves: ``issue`` (on the communication thread: encode, start
the collective) and ``finish`` (wait, decode into the bucket's buffer, which then holds the
average of the ranks' gradients and, in its flag part, how many ranks used each parameter).

- no compression: the buffer is divided by the world size (``Bucket.divisor`` under Join)
  and all-reduced (SUM) in place; a complex one as its ``view_as_real``.
- ``Cast(dtype)``: the same in ``float16`` or ``bfloat16``; dividing first keeps float16 from
  overflowing where the sum of W gradients would.
- ``TopK(ratio)`` and ``Threshold(value)`` (Apache SINGA's sparsification with error
  correction): each rank keeps the residual :math:`r` of what it did not send, adds it to its
  next gradient, :math:`a = g + r`, sends the chosen elements of :math:`a` as packed
  (index, value) pairs through one all_gather, and keeps :math:`r \leftarrow a - \text{sent}`;
  so over any number of steps, residual + everything sent = the sum of the rank's gradients.
  Every rank adds every rank's pairs in rank order and divides by the world size, so all
  ranks hold the same average.
"""
import math
from typing import Any, Callable, Dict, Iterable, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
from torch import Tensor

from distopt._torch import all_gather_flat
from distopt.arguments import check_bool, check_number
from distopt.parallel.buckets import Bucket, dense_grad

__all__ = ["Cast", "Compression", "TopK", "Threshold", "real_values", "reduction_for"]

#: Test hook: called on the communication thread with ``(bucket index, indices, values)``
#: each time a sparsifying scheme sends; None in normal use.
sent_hook: Optional[Callable[[int, Tensor, Tensor], None]] = None

#: The packed rows of TopK / Threshold are padded to this many bytes, so that every rank's
#: row starts aligned for its index dtype.
_ALIGN = 8


class Compression:
    """How a bucket's gradients travel; subclasses are ``Cast``, ``TopK``, ``Threshold``,
    ``distopt.parallel.PowerSGD``.

    Attributes:
        error_feedback: whether each rank keeps a residual per parameter (``state_dict``
            holds it under ``"residuals"``).
        takes_complex: whether the scheme carries complex gradients (as their real and
            imaginary parts, as gloo reduces them); the sparsifying and factorizing schemes
            choose or factor real values and do not.
        bucket_wide: whether what a bucket sends for an element depends on the rest of the
            bucket (TopK chooses its k largest over the whole bucket): a run then reduces
            as another only over the same buckets, so ``state_dict`` records them
            (``"layout"``) for a resumed run to take. PowerSGD's state holds its own.
    """

    error_feedback = False
    takes_complex = False
    bucket_wide = False

    def bound(self, group: Any, rank: int, world_size: int, buckets: List[Bucket]) -> "Compression":
        """The scheme as one optimizer uses it, once its communication group is known (a
        scheme with state per optimizer returns a new object; the others themselves)."""
        return self

    def release_group(self) -> None:
        """The optimizer is closed: let go of the group ``bound`` was given (the state stays
        readable); its last reference stops its worker threads."""

    def state_dict(self) -> Optional[Dict[str, Any]]:
        """This rank's state of the scheme beyond ``residuals`` (None: it has none); it is
        saved per rank, under ``"compression"`` in the optimizer's ``state_dict``."""
        return None

    def carried_state(self) -> Any:
        """What the scheme bound to rebuilt buckets takes over (the optimizer cuts its
        buckets again after its first step): None, nothing (residuals are carried per
        parameter by the optimizer); a ``state_dict()`` for the new one's
        ``checked_loader``; or False: its state is per bucket and cannot follow, so the
        buckets stay as they are."""
        return None

    def checked_loader(self, state: Any) -> Callable[[], None]:
        """Check ``state`` (from ``state_dict``, or None when absent) and return what loads
        it; raise ValueError naming what does not fit, changing nothing."""
        return lambda: None

    def check_params(self, named: Iterable[Tuple[str, Tensor]]) -> None:
        """Raise ValueError naming the first complex parameter of ``(name, parameter)``
        pairs, unless the scheme carries complex gradients; call it before ``check_bucket``,
        which knows no names."""
        if self.takes_complex:
            return
        for name, p in named:
            if p.is_complex():
                raise ValueError(
                    f"Invalid params: {name} is complex ({p.dtype}) (expected real "
                    f"parameters: compression={self!r} carries real gradients only; "
                    f"complex ones travel with compression None or Cast)"
                )

    def check_bucket(self, bucket: Bucket) -> None:
        """Raise ValueError if the scheme cannot carry this bucket's dtype."""
        if not (bucket.dtype.is_floating_point or (self.takes_complex and bucket.dtype.is_complex)):
            raise ValueError(
                f"Invalid compression: {self!r} on {bucket.dtype} gradients (expected "
                f"floating-point parameters)"
            )

    def prepare(self, buckets: Sequence[Bucket]) -> None:
        """The buckets are cut (and, sharded, their shards attached): anything the scheme
        keeps per bucket."""

    def settle(self, bucket: Bucket, unused: List[int]) -> None:
        """After ``finish`` and ``Bucket.leave_unused``, before the bucket is stepped (the
        finishing thread): what ``.grad`` holds from now on. Here: the bucket's views."""

    def window_reduced(self, buckets: Sequence[Bucket]) -> None:
        """Every bucket of a window that waits for ``step()`` is reduced (the finishing
        thread, after the last bucket's ``settle``)."""

    def before_step(self, scaling: Optional[Any]) -> None:
        """``step()`` is about to step what the reduction left (``scaling``: a GradScaler's
        ``(grad_scale, found_inf)``, or None); raise RuntimeError, changing nothing, where
        the scheme cannot step it."""

    def take_user_grads(self, bucket: Bucket) -> List[int]:
        """Before a step that waited for ``step()``: what the loop left in ``.grad`` into
        what the step reads (as torch.optim steps ``.grad``); returns the slots whose
        ``.grad`` is None (not stepped)."""
        skipped = []
        for slot, (p, view) in enumerate(zip(bucket.params, bucket.grads)):
            if p.grad is view:
                continue
            grad = dense_grad(bucket, slot)
            if grad is None:
                skipped.append(slot)
            else:
                with torch.no_grad():  # a gradient made with create_graph=True has a history
                    view.copy_(grad)
        return skipped

    def clip_grad_norm_(self, buckets: Sequence[Bucket], params: List[Tensor], max_norm: float,
                        norm_type: float, error_if_nonfinite: bool,
                        foreach: Optional[bool]) -> Tensor:
        """Clip the reduced gradients of ``params`` (torch.optim's order) by their norm, as
        ``torch.nn.utils.clip_grad_norm_``; returns the norm."""
        return torch.nn.utils.clip_grad_norm_(params, max_norm, norm_type, error_if_nonfinite,
                                              foreach)

    def issue(self, bucket: Bucket, group: Any, world_size: int) -> Any:
        """Start reducing ``bucket`` (communication thread); returns what ``finish`` needs."""
        raise NotImplementedError

    def finish(self, pending: Any, bucket: Bucket, world_size: int) -> None:
        """Wait for the reduction and leave the average in ``bucket.buffer``."""
        raise NotImplementedError

    def bytes_per_step(self, numels: List[Tuple[int, int]], dtype: torch.dtype,
                       world_size: int) -> float:
        """The payload bytes one rank sends per step (the model the tests and the benchmark
        check against ``/proc/self/io``), for buckets of ``(gradient numel, parameters)``.

        Headers are left out: gloo adds about 580 bytes per all_reduce at 2 ranks.
        """
        raise NotImplementedError


class _Dense(Compression):
    """No compression (see the module's docstring)."""

    takes_complex = True

    def __init__(self, dtype: Optional[torch.dtype] = None) -> None:
        self.dtype = dtype

    def __repr__(self) -> str:
        return "None"

    def issue(self, bucket: Bucket, group: Any, world_size: int) -> Any:
        values = real_values(bucket.buffer)
        divisor = bucket.divisor or world_size
        if self.dtype is None or self.dtype == values.dtype:
            wire = values.div_(divisor)
        else:
            wire = values.div(divisor).to(self.dtype)
        return wire, dist.all_reduce(wire, group=group, async_op=True)

    def finish(self, pending: Any, bucket: Bucket, world_size: int) -> None:
        wire, work = pending
        work.wait()
        values = real_values(bucket.buffer)
        if wire.dtype != values.dtype:
            values.copy_(wire)

    def bytes_per_step(self, numels: List[Tuple[int, int]], dtype: torch.dtype,
                       world_size: int) -> float:
        real = dtype.to_real() if dtype.is_complex else dtype
        size = (self.dtype or real).itemsize * (2 if dtype.is_complex else 1)
        elements = sum(n + k for n, k in numels)
        return 2.0 * (world_size - 1) / world_size * elements * size


def reduction_for(compression: Optional[Compression]) -> Compression:
    """What reduces with ``compression``: no compression for None and for ``TopK(1.0)``
    (the same average, bit for bit, without the indices)."""
    if compression is None or (isinstance(compression, TopK) and compression.ratio == 1.0):
        return _Dense()
    return compression


class Cast(_Dense):
    """All-reduce the gradients in a lower precision: ``float16`` or ``bfloat16``.

    Each rank divides its gradients by the world size in their own precision, casts them,
    and the sum comes back cast to the parameters' dtype. bfloat16 works on CPU (gloo) too,
    unlike torch's ``bf16_compress_hook``. A complex gradient is cast part by part (its
    ``view_as_real``), where a plain cast to a real dtype would drop the imaginary part.

    Args:
        dtype: ``torch.float16`` or ``torch.bfloat16``.

    Raises:
        ValueError: another dtype.
    """

    def __init__(self, dtype: torch.dtype) -> None:
        if dtype not in (torch.float16, torch.bfloat16):
            raise ValueError(
                f"Invalid dtype: {dtype!r} (expected torch.float16 or torch.bfloat16)"
            )
        super().__init__(dtype)

    def __repr__(self) -> str:
        return f"Cast({self.dtype})"


class _Sparsify(Compression):
    """Send chosen (index, value) pairs of gradient plus residual; keep the rest."""

    def __init__(self, error_feedback: bool) -> None:
        check_bool("error_feedback", error_feedback)
        self.error_feedback = error_feedback

    def choose(self, accumulated: Tensor) -> Tensor:
        """The indices to send (int64)."""
        raise NotImplementedError

    def issue(self, bucket: Bucket, group: Any, world_size: int) -> Any:
        grads = bucket.buffer[:bucket.numel]
        residual = bucket.residual
        accumulated = grads
        if residual is not None:
            accumulated = residual.add_(grads)  # the residual is gradient + residual now...
        candidates = accumulated
        if residual is not None and not all(bucket.used):
            # A parameter this rank did not use keeps its residual: if no rank used it, it
            # is not stepped, and what was sent for it would be lost.
            candidates = accumulated.clone()
            for k, used in enumerate(bucket.used):
                if not used:
                    start = bucket.offsets[k]
                    candidates[start:start + bucket.params[k].numel()] = 0
        indices = self.choose(candidates)
        values = candidates[indices]
        if residual is not None:
            residual[indices] -= values  # ...and what is not sent, after this
        if sent_hook is not None:
            sent_hook(bucket.index, indices, values)
        index_dtype = _index_dtype(bucket)
        counts = self.exchange_counts(indices.numel(), group, world_size, grads.device)
        width = max(counts)
        row = _row_bytes(width, len(bucket.params), index_dtype, bucket.dtype)
        packed = torch.zeros(row, dtype=torch.uint8, device=grads.device)
        _pack(packed, width, indices.to(index_dtype), values, bucket.flags)
        out = torch.empty(world_size * row, dtype=torch.uint8, device=grads.device)
        work = all_gather_flat(out, packed, group=group, async_op=True)
        return out, work, counts, width, index_dtype

    def exchange_counts(self, count: int, group: Any, world_size: int,
                        device: torch.device) -> List[int]:
        """Every rank's number of pairs (a fixed number needs no exchange)."""
        return [count] * world_size

    def finish(self, pending: Any, bucket: Bucket, world_size: int) -> None:
        out, work, counts, width, index_dtype = pending
        work.wait()
        rows = out.view(world_size, -1)
        total = bucket.buffer[:bucket.numel].zero_()
        flags = torch.zeros(len(bucket.params), dtype=bucket.dtype, device=out.device)
        for r in range(world_size):
            indices, values, used = _unpack(rows[r], counts[r], width, len(bucket.params),
                                            index_dtype, bucket.dtype)
            total.index_add_(0, indices.long(), values)
            flags += used
        total.div_(bucket.divisor or world_size)
        bucket.flags.copy_(flags)

    def bytes_per_step(self, numels: List[Tuple[int, int]], dtype: torch.dtype,
                       world_size: int) -> float:
        index_dtype = torch.int64 if dtype == torch.float64 else torch.int32
        return float(sum((world_size - 1) * _row_bytes(self.count(n), k, index_dtype, dtype)
                         for n, k in numels))

    def count(self, numel: int) -> int:
        """How many pairs a bucket of ``numel`` elements sends (TopK's is fixed)."""
        raise NotImplementedError


class TopK(_Sparsify):
    """Send the ``ratio`` fraction of each bucket's elements largest in magnitude.

    Each rank sends ``ceil(ratio * numel)`` (index, value) pairs of gradient plus residual
    per bucket, chosen over the whole bucket. ``TopK(1.0)`` sends the dense buffer: it is
    no compression, bit for bit.

    Args:
        ratio: the fraction of elements sent, in (0, 1].
        error_feedback: keep what was not sent and add it to the next gradient.

    Raises:
        ValueError: ``ratio`` outside (0, 1]; TypeError: not a number.
    """

    bucket_wide = True

    def __init__(self, ratio: float, error_feedback: bool = True) -> None:
        check_number("ratio", ratio, "a float in (0, 1]", lambda r: 0.0 < r <= 1.0)
        super().__init__(error_feedback)
        self.ratio = float(ratio)

    def __repr__(self) -> str:
        return f"TopK({self.ratio}, error_feedback={self.error_feedback})"

    def count(self, numel: int) -> int:
        return min(numel, max(1, math.ceil(self.ratio * numel)))

    def choose(self, accumulated: Tensor) -> Tensor:
        n = accumulated.numel()
        k = self.count(n)
        magnitude = accumulated.abs()
        if n >= _SAMPLE and 8 * k <= n:
            # torch.topk over millions of elements is slow on CPU (110 ms for 6.3M): take
            # the candidates above a threshold that a strided sample puts at about 2k
            # elements; if there are at least k of them, the k largest are among them.
            sample = magnitude[::n // _SAMPLE]
            above = min(sample.numel() - 1, math.ceil(2.0 * k / n * sample.numel()) + 1)
            threshold = torch.kthvalue(sample, sample.numel() - above).values
            # not below: NaN is a candidate too (torch.topk ranks it above everything)
            candidates = torch.nonzero(~(magnitude < threshold)).view(-1)
            if candidates.numel() >= k:
                return candidates[torch.topk(magnitude[candidates], k, sorted=False)[1]]
        return torch.topk(magnitude, k, sorted=False)[1]


class Threshold(_Sparsify):
    """Send every element of gradient plus residual whose magnitude is at least ``value``.

    The number of pairs differs between ranks, so each bucket takes two collectives: the
    counts (8 bytes a rank), then the pairs padded to the largest count.

    Args:
        value: the magnitude threshold, finite and >= 0.
        error_feedback: keep what was not sent and add it to the next gradient.

    Raises:
        ValueError: ``value`` negative or not finite; TypeError: not a number.
    """

    def __init__(self, value: float, error_feedback: bool = True) -> None:
        check_number("value", value, "a finite float >= 0", lambda v: math.isfinite(v) and v >= 0)
        super().__init__(error_feedback)
        self.value = float(value)

    def __repr__(self) -> str:
        return f"Threshold({self.value}, error_feedback={self.error_feedback})"

    def choose(self, accumulated: Tensor) -> Tensor:
        return torch.nonzero(accumulated.abs() >= self.value).view(-1)

    def exchange_counts(self, count: int, group: Any, world_size: int,
                        device: torch.device) -> List[int]:
        # On the bucket's device: NCCL takes only CUDA tensors.
        mine = torch.tensor([count], dtype=torch.int64, device=device)
        every = torch.empty(world_size, dtype=torch.int64, device=device)
        all_gather_flat(every, mine, group=group)
        return [int(c) for c in every.tolist()]

    def count(self, numel: int) -> int:
        raise ValueError(
            "Invalid bytes_per_step for Threshold: its count depends on the gradients "
            "(expected TopK, Cast or no compression)"
        )


#: Buckets of at least this many elements choose their top k from a strided sample's hint.
_SAMPLE = 65536


def real_values(buffer: Tensor) -> Tensor:
    """``buffer`` (1-D), or its ``view_as_real`` flattened when complex: what is divided,
    cast and sent."""
    return (torch.view_as_real(buffer) if buffer.is_complex() else buffer).view(-1)


def _index_dtype(bucket: Bucket) -> torch.dtype:
    # Indices travel beside values of the bucket's dtype; int64 keeps float64 rows aligned.
    return torch.int64 if bucket.dtype == torch.float64 or bucket.numel >= 2**31 else torch.int32


def _row_bytes(count: int, flags: int, index_dtype: torch.dtype, dtype: torch.dtype) -> int:
    raw = count * index_dtype.itemsize + (count + flags) * dtype.itemsize
    return -(-raw // _ALIGN) * _ALIGN


def _pack(row: Tensor, width: int, indices: Tensor, values: Tensor, flags: Tensor) -> None:
    """Indices, values and flags as bytes in ``row``, laid out for ``width`` pairs (a rank
    with fewer leaves the rest of each part zero)."""
    isz, vsz = indices.element_size(), values.element_size()
    a = width * isz
    b = a + width * vsz
    row[:indices.numel() * isz].copy_(indices.contiguous().view(torch.uint8))
    row[a:a + values.numel() * vsz].copy_(values.contiguous().view(torch.uint8))
    row[b:b + flags.numel() * vsz].copy_(flags.contiguous().view(torch.uint8))


def _unpack(row: Tensor, count: int, width: int, flags: int, index_dtype: torch.dtype,
            dtype: torch.dtype) -> Tuple[Tensor, Tensor, Tensor]:
    """The first ``count`` pairs of a row packed for ``width`` pairs, and its flags."""
    isz, vsz = index_dtype.itemsize, dtype.itemsize
    a = width * isz
    b = a + width * vsz
    # Copies: a uint8 slice may not start where the wider dtype's alignment wants it.
    indices = row[:count * isz].clone().view(index_dtype)
    values = row[a:a + count * vsz].clone().view(dtype)
    used = row[b:b + flags * vsz].clone().view(dtype)
    return indices, values, used
