"""Averaging gradients over a process group, bucket by bucket, while backward runs.

One ``GradientReducer`` serves one DataParallelOptimizer, in windows that each end at
``step()``: the ``backward_passes_per_step``-th backward pass outside ``no_sync`` reduces,
the others accumulate in ``.grad``. The communication thread issues every collective in
bucket order (gloo requires the same order on every rank); sharded, also each bucket's
gather once it is stepped, right after the next bucket's reduction. The finishing thread
waits for each and hands each bucket to the sink (``reduced``, or ``store_gather``). At the end of the reducing pass
(the autograd engine's final callback) what the pass did not reach is flushed and every
bucket awaited, so ``.grad`` holds the averages when ``backward()`` returns, as under DDP;
``complete()`` (from ``step()``) does the same for a window whose reducing pass never came.
A pass that raises drops its final callback uncalled, which ends it too. A nested
(reentrant) backward that opens a pass is refused: its end is not the outer pass's.
"""
import logging
import queue
import threading
import weakref
from typing import Any, Callable, List, NamedTuple, Optional, Tuple

import torch
from torch import Tensor

from distopt._torch import backward_depth, queue_end_of_backward
from distopt.parallel.buckets import Bucket
from distopt.parallel.compression import Compression
from distopt.parallel.teardown import joined, start_thread
from distopt.profiling import profiler_range

logger = logging.getLogger(__name__)

__all__ = ["GradientReducer"]


class GradientReducer:
    """Hooks, the communication thread and the window bookkeeping.

    Args:
        buckets: the buckets, in reduction order.
        codec: how each bucket is reduced.
        group: the process group (None: the default one); ``rank``, ``world_size``: in it.
        passes_per_step: backward passes per reduction.
        sink: where each window goes (held weakly; ``distopt.parallel.engine``): its
            ``open_window()`` once per window before its first bucket is handed over
            (backward's thread, or ``complete``; may raise), its ``reduced(bucket, unused)``
            on the finishing thread with each reduced bucket and the slots of the
            parameters no rank gave a gradient whose ``.grad`` is None here; with
            ``gathers``, its ``start_gather(bucket)`` on the communication thread with a
            bucket ``reduced`` has stepped (returns what the finishing thread hands to its
            ``store_gather(bucket, pending)``, or None).
        gathers: sharded state: the sink gathers each bucket stepped during backward.
        record_arrival: note each parameter's global index as its gradient arrives in the
            first backward pass (``take_arrivals``).

    Attributes:
        no_sync: backward passes while it is True accumulate and do not count.
        reducing: this window's reduction has begun.
        broken: a backward pass of this window raised after its reduction had begun.
    """

    def __init__(
        self,
        buckets: List[Bucket],
        codec: Compression,
        group: Any,
        rank: int,
        world_size: int,
        passes_per_step: int,
        sink: Any,
        gathers: bool = False,
        record_arrival: bool = False,
    ) -> None:
        self.buckets = buckets
        self.codec = codec
        self.group = group
        self.rank = rank
        self.world_size = world_size
        self.passes_per_step = passes_per_step
        self._sink = weakref.ref(sink)
        self.gathers = gathers
        self.no_sync = False
        self.reducing = False
        self._pass = 0
        self._pass_open = False
        self.broken = False
        self._first: Optional[Tuple[Bucket, int]] = None
        self._guard: Optional[Tuple[Bucket, int, Tensor]] = None
        self.poisoned: Optional[int] = None
        self._pass_syncs = True
        self._pass_reduces = False
        self._passes = 0
        self._done = 0
        self._reduced = 0
        self._error: Optional[Tuple[str, BaseException]] = None
        self._cond = threading.Condition()
        self._ready: "queue.SimpleQueue[Optional[int]]" = queue.SimpleQueue()
        #: What the finishing thread completes, in issue order.
        self.issued: "queue.SimpleQueue[Optional[_Issued]]" = queue.SimpleQueue()
        self._threads: List[threading.Thread] = []
        self._recording = record_arrival
        self._arrivals: List[int] = []
        ref = weakref.ref(self)
        self._handles = [p.register_post_accumulate_grad_hook(_hook(ref, bucket, slot))
                         for bucket in buckets for slot, p in enumerate(bucket.params)]
        weakref.finalize(self, _stop, self._ready, self.issued, list(self._handles))

    # ------------------------------------------------------------ backward thread

    def on_grad(self, bucket: Bucket, slot: int, param: Tensor) -> None:
        """A parameter's gradient for this pass is complete."""
        if not self._pass_open:
            try:
                self._open_pass()
            except RuntimeError:
                self._refused(bucket, slot, param)
                raise
            self._first = (bucket, slot)
        if self._recording:
            self._arrivals.append(bucket.positions[slot])
        bucket.used[slot] = True
        if not self._pass_reduces:
            return
        if bucket.hooked[slot] == self._pass:
            # A second accumulation in one pass: a reentrant backward inside this one
            # reached the parameter, and the outer pass again.
            if bucket.launched:
                raise RuntimeError(
                    f"Invalid backward pass: parameter {bucket.positions[slot]} received a "
                    f"second gradient after its bucket's reduction had begun (a parameter "
                    f"used both inside and outside torch.utils.checkpoint(..., "
                    f"use_reentrant=True); expected use_reentrant=False)"
                )
            self._take(bucket, slot, param)
            return
        bucket.hooked[slot] = self._pass
        self._take(bucket, slot, param)
        bucket.pending -= 1
        if bucket.pending == 0:
            self._launch(bucket)

    def _open_pass(self) -> None:
        if backward_depth() > 1:
            raise RuntimeError(
                "Invalid backward pass: a nested (reentrant) backward, such as "
                "torch.utils.checkpoint(..., use_reentrant=True) runs, reached a parameter "
                "before the outer pass did, so the end of the outer pass cannot be awaited "
                "(expected torch.utils.checkpoint(..., use_reentrant=False))"
            )
        if self.reducing:
            if self.broken:
                raise RuntimeError(
                    "Invalid backward pass: the previous backward pass raised after the "
                    "reduction of this step's gradients had begun on this rank (expected "
                    "step() first: it reduces and applies the gradients that pass reached, on "
                    "every rank alike)"
                )
            raise RuntimeError(
                "Invalid backward pass: the gradients of this step are already being "
                "reduced (expected step() after every backward_passes_per_step backward "
                "passes, or the extra passes inside no_sync())"
            )
        syncs = not self.no_sync
        reduces = self.next_pass_reduces()
        if reduces:
            self._open_window()  # may raise: then this pass reduces nothing
            self.reducing = True
        self._pass += 1
        self._pass_syncs = syncs
        self._pass_reduces = reduces
        self._pass_open = True
        queue_end_of_backward(_EndOfPass(weakref.ref(self), self._pass))

    def _open_window(self) -> None:
        sink = self._sink()
        if sink is not None:
            sink.open_window()

    def end_of_pass(self, number: int) -> None:
        """The final callback of backward pass ``number`` ran (``_EndOfPass``)."""
        if self._pass_open and self._pass == number:
            self._end_of_pass()

    def pass_died(self, number: int) -> None:
        """Backward pass ``number`` raised before its final callback (``_EndOfPass``)."""
        if self._pass_open and self._pass == number:
            self._pass_died()

    def _end_of_pass(self) -> None:
        self._pass_open = False
        self._recording = False
        if self._pass_syncs:
            self._passes += 1
        if self._pass_reduces:
            self._flush(lambda bucket, slot: bucket.hooked[slot] != self._pass)
            self._wait()
            first = self._first
            if first is not None and not first[0].released and (
                first[0].grads[first[1]].numel() <= _GUARD_NUMEL
            ):
                # The parameter the next pass is likeliest to reach first: if that pass is
                # refused, its gradient has already gone in, and this takes it out again.
                self._guard = (first[0], first[1], first[0].grads[first[1]].clone())

    def _refused(self, bucket: Bucket, slot: int, param: Tensor) -> None:
        """A pass was refused in the hook of its first parameter, after the autograd engine
        had added that pass's gradient to its ``.grad``: undo it, or mark the step."""
        guard = self._guard
        if guard is not None and guard[0] is bucket and guard[1] == slot and (
            param.dtype == bucket.dtype  # else the model was cast: .grad cannot be the view
        ):
            view = bucket.grads[slot]
            view.copy_(guard[2])
            param.grad = view
            if bucket.stepped is not None:
                bucket.mark_stepped()  # as it was stepped: not the user's change
        else:
            self.poisoned = bucket.positions[slot]

    def _pass_died(self) -> None:
        """The open pass raised before its end: it counts for nothing. A reducing pass that
        launched buckets leaves the window to ``complete``, once they are reduced (the next
        pass must not add to a bucket in flight)."""
        self._pass_open = False
        self._recording = False
        if not self._pass_reduces:
            return
        if not any(bucket.launched for bucket in self.buckets):
            self.reducing = False
            for bucket in self.buckets:
                bucket.rearm()  # the next pass has a new number: ``hooked`` needs no reset
            return
        self.broken = True
        # The communication thread issues in bucket order: a launched prefix.
        self.wait_reduced(next((k for k, b in enumerate(self.buckets) if not b.launched),
                               len(self.buckets)))

    def _take(self, bucket: Bucket, slot: int, param: Tensor) -> None:
        """Put the parameter's accumulated gradient (or zeros) into its bucket slot."""
        if bucket.released:  # sharded gradients: its memory comes back for this window
            bucket.materialize()
        grad = param.grad
        view = bucket.grads[slot]
        if grad is None:
            view.zero_()
            # The average, if another rank used it, as DDP gives it (None again otherwise).
            param.grad = view
            return
        if grad is not view and grad.layout != torch.strided:
            raise ValueError(
                f"Invalid gradient of parameter {bucket.positions[slot]}: {grad.layout} "
                f"(expected a dense gradient: DataParallelOptimizer reduces dense gradients; "
                f"use a dense embedding, or distopt.sparse for sharded tables)"
            )
        if not bucket.used[slot]:
            bucket.keep(slot, grad)  # given back if no rank used the parameter
        if grad is view:
            return
        with torch.no_grad():  # a gradient made with create_graph=True has a history
            view.copy_(grad)
        param.grad = view

    def _flush(self, missing: Callable[[Bucket, int], bool]) -> None:
        for bucket in self.buckets:
            if bucket.launched:
                continue
            for slot, p in enumerate(bucket.params):
                if missing(bucket, slot):
                    self._take(bucket, slot, p)
            self._launch(bucket)

    def _launch(self, bucket: Bucket) -> None:
        bucket.fill_flags()
        bucket.launched = True
        if not self._threads:
            ref = weakref.ref(self)
            self._threads = [
                start_thread(target, (ref, jobs), f"distopt-dp-{name}-rank{self.rank}")
                for target, jobs, name in ((_communicate, self._ready, "comm"),
                                           (_finish, self.issued, "finish"))
            ]
        self._ready.put(bucket.index)

    # ------------------------------------------------------------ step()

    def next_pass_reduces(self) -> bool:
        """Whether a backward pass that starts now would reduce (not in ``no_sync``, and
        the last of ``passes_per_step``): DDP's ``require_backward_grad_sync``."""
        return not self.no_sync and self._passes + 1 >= self.passes_per_step

    def take_arrivals(self) -> List[int]:
        """The global indices in the order their gradients arrived in the first backward
        pass (each once), and stop recording."""
        self._recording = False
        arrivals, self._arrivals = self._arrivals, []
        return arrivals

    def shadow(self) -> None:
        """Reduce every bucket with zero gradients and no parameter used by this rank, and
        wait: a rank that has joined (``torch.distributed.algorithms.Join``) issues the
        collectives of the window the other ranks reduce, in the same order. Afterwards
        ``.grad`` holds the average of the parameters some rank used, and is None for the
        others (not stepped).

        Raises:
            RuntimeError: this rank's own window is being reduced (a reducing backward pass
                without its ``step()``), or a collective failed.
        """
        self._raise_error()
        if self.reducing:
            raise RuntimeError(
                "Invalid Join: this rank's last reducing backward pass was not followed by "
                "step(), so its gradients are still being reduced (expected step() after "
                "every backward_passes_per_step backward passes, before the loop ends)"
            )
        self.reducing = True
        for bucket in self.buckets:
            bucket.buffer.zero_()  # its gradients and "used" flags
            for slot, p in enumerate(bucket.params):
                p.grad = bucket.grads[slot]
            self._launch(bucket)
        self._wait()

    def complete(self) -> None:
        """Reduce what this window accumulated (if backward has not started it) and wait
        for every bucket.

        Raises:
            RuntimeError: a collective or an overlapped step failed, on this call and every
                later one (the ranks' collectives are out of step from then on).
        """
        self._raise_error()
        if not self.reducing:
            self._open_window()
            self.reducing = True
            self._flush(lambda bucket, slot: True)
        else:
            # Nothing left after a reducing pass that ended; after one that raised before
            # its end, what it left, so that no bucket waits for ever (another rank's error,
            # if any, comes back from the collectives).
            self._flush(lambda bucket, slot: bucket.hooked[slot] != self._pass)
        self._wait()

    def _wait(self) -> None:
        with self._cond:
            self._cond.wait_for(lambda: self._done >= len(self.buckets) or self._error is not None)
        self._raise_error()

    def reset(self) -> None:
        """Start the next window."""
        self._done = 0
        self._reduced = 0
        self._passes = 0
        self.reducing = False
        self.broken = False
        self._guard = None
        self.poisoned = None
        for bucket in self.buckets:
            bucket.reset()

    def _raise_error(self) -> None:
        if self._error is not None:
            what, exc = self._error
            hint = ""
            if not what.startswith("the step of"):  # a collective: another rank is involved
                hint = (
                    "; another rank may have died or raised, or the ranks may have run "
                    "different numbers of backward passes (uneven inputs): wrap the loop in "
                    "torch.distributed.algorithms.Join([opt]) so that ranks that run out of "
                    "batches shadow the others' reductions"
                )
            raise RuntimeError(
                f"DataParallelOptimizer on rank {self.rank} of {self.world_size}: {what} "
                f"failed: {type(exc).__name__}: {exc}{hint}"
            ) from exc

    def fail(self, what: str, exc: BaseException) -> None:
        with self._cond:
            if self._error is None:
                self._error = (what, exc)
                logger.error("rank %d: %s failed: %s", self.rank, what, exc)
            self._cond.notify_all()

    def bucket_done(self, reduced: bool) -> None:
        """A bucket was reduced (and stepped, if it steps here), or is finished."""
        with self._cond:
            if reduced:
                self._reduced += 1
            if not reduced or not self.gathers:
                self._done += 1
            self._cond.notify_all()

    def wait_reduced(self, count: int) -> bool:
        """Wait until ``count`` buckets of this window are reduced; False on an error."""
        with self._cond:
            self._cond.wait_for(lambda: self._reduced >= count or self._error is not None)
            return self._error is None

    def close(self, timeout_s: Optional[float] = None) -> bool:
        """Remove the hooks and stop the threads (after the collectives in flight, waiting
        up to ``timeout_s`` for each; None: as long as they take).

        Returns:
            Whether the threads have stopped and no collective failed: then nothing is in
            flight on ``group``, and the reducer lets go of it (``distopt.parallel.teardown``
            needs its last reference dropped to stop its worker threads).
        """
        _stop(self._ready, self.issued, self._handles)
        self._handles = []
        self._threads = joined(self._threads, timeout_s)
        idle = not self._threads and self._error is None
        if idle:
            self.group = None
        return idle

    @property
    def failed(self) -> Optional[Tuple[str, BaseException]]:
        """(what failed, the exception) once a collective or a step has failed, else None."""
        return self._error

    def reduced(self, bucket: Bucket, unused: List[int]) -> None:
        """The finishing thread: a bucket's average is in, to the sink."""
        sink = self._sink()
        if sink is not None:
            sink.reduced(bucket, unused)

    def start_gather(self, bucket: Bucket) -> Any:
        """The communication thread: a stepped bucket's gather, from the sink."""
        sink = self._sink()
        return None if sink is None else sink.start_gather(bucket)

    def store_gather(self, bucket: Bucket, pending: Any) -> None:
        """The finishing thread: a gather done, to the sink."""
        sink = self._sink()
        if sink is not None:
            sink.store_gather(bucket, pending)


#: The largest gradient (elements) copied each step to undo a refused pass (see _refused).
_GUARD_NUMEL = 1 << 20


class _Issued(NamedTuple):
    """A collective the communication thread issued, for the finishing thread."""

    gather: bool  #: a gather of stepped pieces (else a bucket's reduction)
    bucket: Bucket
    pending: Any  #: what completing it needs (the work, or the compression's pending state)


class _EndOfPass:
    """The final callback of one backward pass; dropped uncalled when the pass raises."""

    def __init__(self, ref: "weakref.ref[GradientReducer]", number: int) -> None:
        self.ref = ref
        self.number = number
        self.called = False

    def __call__(self) -> None:
        self.called = True
        reducer = self.ref()
        if reducer is not None:
            reducer.end_of_pass(self.number)

    def __del__(self) -> None:
        if self.called:
            return
        reducer = self.ref()
        if reducer is not None:
            reducer.pass_died(self.number)


def _hook(ref: "weakref.ref[GradientReducer]", bucket: Bucket, slot: int) -> Callable[[Tensor], None]:
    def hook(param: Tensor) -> None:
        reducer = ref()
        if reducer is not None:
            reducer.on_grad(bucket, slot, param)

    return hook


def _describe(bucket: Bucket) -> str:
    return f"bucket {bucket.index} ({bucket.numel} {bucket.dtype} gradient elements)"


def _communicate(ref: "weakref.ref[GradientReducer]", ready: "queue.SimpleQueue[Optional[int]]") -> None:
    """The communication thread: issue each window's buckets in order as they are ready."""
    arrived = set()
    following = 0
    while True:
        index = ready.get()
        if index is None:
            return
        reducer = ref()
        if reducer is None:
            return
        arrived.add(index)
        while following in arrived:
            bucket = reducer.buckets[following]
            try:
                with profiler_range("distopt.dp.reduce", bucket.index):
                    pending = reducer.codec.issue(bucket, reducer.group, reducer.world_size)
            except BaseException as exc:  # noqa: B902 - reported by step()
                reducer.fail(f"starting the reduction of {_describe(bucket)}", exc)
                del reducer, bucket
                return
            reducer.issued.put(_Issued(False, bucket, pending))
            del pending  # nothing of a step's collectives stays on this thread once it ends
            if reducer.gathers:
                # Each bucket's gather right after the next bucket's reduction (the last one
                # after its own): the same order on every rank, whatever the timing.
                last = following == len(reducer.buckets) - 1
                for k in ([following - 1] if following else []) + ([following] if last else []):
                    if not _issue_gather(reducer, k):
                        del reducer, bucket
                        return
            arrived.discard(following)
            following += 1
        if following == len(reducer.buckets):
            following = 0
        del reducer


def _issue_gather(reducer: GradientReducer, k: int) -> bool:
    """Start bucket ``k``'s gather once it is stepped; False (and stop) on an error."""
    if not reducer.wait_reduced(k + 1):
        return False
    bucket = reducer.buckets[k]
    try:
        pending = reducer.start_gather(bucket)
    except BaseException as exc:  # noqa: B902 - reported by step()
        reducer.fail(f"starting the gather of {_describe(bucket)}", exc)
        return False
    reducer.issued.put(_Issued(True, bucket, pending))
    return True


def _finish(ref: "weakref.ref[GradientReducer]", issued: "queue.SimpleQueue[Any]") -> None:
    """The finishing thread: wait for each reduction in order, then hand the bucket on."""
    while True:
        item = issued.get()
        if item is None:
            return
        reducer = ref()
        if reducer is None:
            return
        gathered, bucket, pending = item
        what = f"the {'gather' if gathered else 'reduction'} of {_describe(bucket)}"
        try:
            if gathered:
                reducer.store_gather(bucket, pending)
                reducer.bucket_done(False)
                del reducer, bucket, pending, item
                continue
            with profiler_range("distopt.dp.reduce.wait", bucket.index):
                reducer.codec.finish(pending, bucket, reducer.world_size)
            unused = bucket.leave_unused()
            what = f"the step of {_describe(bucket)}"
            reducer.reduced(bucket, unused)
        except BaseException as exc:  # noqa: B902 - reported by step()
            reducer.fail(what, exc)
            del reducer, bucket, pending, item
            return
        # Released before step() can return, which may be the script's last line: a work
        # released later, during interpreter teardown, takes the GIL and aborts (teardown).
        del bucket, pending, item
        reducer.bucket_done(True)
        del reducer


def _stop(ready: Any, issued: Any, handles: List[Any]) -> None:
    for handle in handles:
        handle.remove()
    ready.put(None)
    issued.put(None)
