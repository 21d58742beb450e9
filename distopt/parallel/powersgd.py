r"""PowerSGD: low-rank gradient compression, by torch's own DDP communication hook.

``PowerSGD`` drives torch's ``powerSGD_hook`` and ``PowerSGDState``
(``torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook``) from a
DataParallelOptimizer's buckets: the algorithm, its error feedback, warm start and random
projections are torch's, called, not rewritten. Each 2-D (or higher, seen as
``shape[0] x rest``) gradient :math:`M` worth compressing travels as two thin factors,

.. math::
    P = \operatorname{orth}\Big(\sum_r M_r Q\Big), \qquad
    Q \leftarrow \frac{1}{W} \sum_r M_r^\top P, \qquad \bar M \approx P Q^\top,

one all_reduce of every :math:`P` and one of every :math:`Q` per bucket; the other
gradients (biases, small matrices) are all-reduced as they are. The first ``start_iter``
steps are plain all-reduces, as torch's hook does.

Why one bucket at a time: torch's hook issues its second and third collectives from gloo's
callback threads. With several buckets in flight those run in a different order on each
rank, which gloo answers by aborting the process. Here the communication thread waits for a
bucket's whole PowerSGD exchange before it issues the next bucket's, so every rank issues
every collective in the same order.
"""
import copy
import math
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook import (
    PowerSGDState,
    powerSGD_hook,
)

from distopt.arguments import check_bool, check_number
from distopt.parallel.buckets import Bucket, GradBucketView
from distopt.parallel.compression import Compression

__all__ = ["PowerSGD"]

#: The length of numpy's MT19937 key (the RandomState that seeds torch's random projections).
_MT_KEY_LENGTH = 624
_STATE_KEYS = ("iter", "error_dict", "p_memory_dict", "q_memory_dict", "rng")


class PowerSGD(Compression):
    r"""Low-rank compression of each bucket's matrices (Vogels et al., 2019), by torch's hook.

    Use it as ``DataParallelOptimizer(..., compression=PowerSGD(rank=4))``. The arguments
    are torch's ``PowerSGDState``'s, with its defaults where it has one
    (``start_iter`` is its ``start_powerSGD_iter``, ``rank`` its
    ``matrix_approximation_rank``; torch's default start of 1,000 steps becomes 2 here).

    With one bucket it equals DDP with ``register_comm_hook(PowerSGDState(...),
    powerSGD_hook)`` bit for bit. Each rank's state (step counter, error feedback, the
    warm-started factors, the random generator) is torch's ``PowerSGDState``; it is saved in
    ``state_dict()["compression"]`` and in checkpoints, per rank.

    A matrix whose gradient is zero on every rank (a parameter no rank used) orthogonalizes
    a zero vector: with ``orthogonalization_epsilon=0`` (torch's default) that gives NaN in
    that parameter's error feedback and warm-start factors. Give a small epsilon (1e-8)
    when some parameters go unused.

    Args:
        rank: the rank of each matrix's approximation (torch: matrix_approximation_rank).
        start_iter: steps of plain all-reduce before compression starts (torch:
            start_powerSGD_iter); >= 2 when error feedback or warm start is on, as torch
            requires.
        min_compression_rate: a matrix is compressed only when its elements exceed this
            many times those of its two factors.
        use_error_feedback: add what compression lost last step to this step's gradient.
        warm_start: start each step's power iteration from the last step's factors.
        orthogonalization_epsilon: added to each column norm before dividing by it.
        random_seed: the seed of the random projections (the same on every rank).

    Raises:
        ValueError / TypeError: a bad argument, named.
    """

    def __init__(
        self,
        rank: int = 1,
        start_iter: int = 2,
        min_compression_rate: float = 2,
        use_error_feedback: bool = True,
        warm_start: bool = True,
        orthogonalization_epsilon: float = 0,
        random_seed: int = 0,
    ) -> None:
        check_number("rank", rank, "an int >= 1", lambda n: n >= 1, integer=True)
        check_number("start_iter", start_iter, "an int >= 0", lambda n: n >= 0, integer=True)
        check_bool("use_error_feedback", use_error_feedback)
        check_bool("warm_start", warm_start)
        if (use_error_feedback or warm_start) and start_iter < 2:
            raise ValueError(
                f"Invalid start_iter: {start_iter!r} (expected >= 2 with use_error_feedback "
                f"or warm_start: torch's PowerSGDState requires it)"
            )
        for name, value in (("min_compression_rate", min_compression_rate),
                            ("orthogonalization_epsilon", orthogonalization_epsilon)):
            check_number(name, value, "a finite number >= 0",
                         lambda v: math.isfinite(v) and v >= 0)
        if isinstance(random_seed, bool) or not isinstance(random_seed, int) or not (
            0 <= random_seed < 2**32
        ):
            raise ValueError(
                f"Invalid random_seed: {random_seed!r} (expected an int in [0, 2**32))"
            )
        self.rank = rank
        self.start_iter = start_iter
        self.min_compression_rate = min_compression_rate
        self.use_error_feedback = use_error_feedback
        self.warm_start = warm_start
        self.orthogonalization_epsilon = orthogonalization_epsilon
        self.random_seed = random_seed
        self._state: Optional[PowerSGDState] = None
        self._buckets: List[Bucket] = []
        self._views: Dict[int, GradBucketView] = {}

    def __repr__(self) -> str:
        return (
            f"PowerSGD(rank={self.rank!r}, start_iter={self.start_iter!r}, "
            f"min_compression_rate={self.min_compression_rate!r}, "
            f"use_error_feedback={self.use_error_feedback!r}, warm_start={self.warm_start!r}, "
            f"orthogonalization_epsilon={self.orthogonalization_epsilon!r}, "
            f"random_seed={self.random_seed!r})"
        )

    @property
    def powersgd_state(self) -> Optional[PowerSGDState]:
        """torch's ``PowerSGDState`` of the optimizer this scheme is bound to (None before)."""
        return self._state

    # ------------------------------------------------------------ the Compression interface

    def bound(self, group: Any, rank: int, world_size: int, buckets: List[Bucket]) -> "PowerSGD":
        """A copy that owns one ``PowerSGDState`` on ``group`` for these buckets."""
        bound = copy.copy(self)
        bound._state = PowerSGDState(
            process_group=group,
            matrix_approximation_rank=self.rank,
            start_powerSGD_iter=self.start_iter,
            min_compression_rate=self.min_compression_rate,
            use_error_feedback=self.use_error_feedback,
            warm_start=self.warm_start,
            orthogonalization_epsilon=self.orthogonalization_epsilon,
            random_seed=self.random_seed,
        )
        bound._buckets = list(buckets)
        bound._views = {}
        return bound

    def release_group(self) -> None:
        if self._state is not None:
            self._state.process_group = None

    def check_bucket(self, bucket: Bucket) -> None:
        """Refuse what torch's hook cannot take: non-floating-point gradients, and CPU ones
        where CUDA is available (its last stage calls ``torch.cuda.synchronize`` on the
        bucket's device whenever CUDA is available, which raises for a CPU device)."""
        if not bucket.dtype.is_floating_point:
            raise ValueError(
                f"Invalid compression: {self!r} on {bucket.dtype} gradients (expected "
                f"floating-point parameters: PowerSGD factors real matrices)"
            )
        if bucket.buffer.device.type == "cpu" and torch.cuda.is_available():
            raise ValueError(
                f"Invalid compression: {self!r} on CPU parameters while CUDA is available "
                f"(expected CUDA parameters, or CUDA hidden: torch's powerSGD_hook calls "
                f"torch.cuda.synchronize on the bucket's device, which refuses a CPU one)"
            )

    def issue(self, bucket: Bucket, group: Any, world_size: int) -> Any:
        """Sum the flags (async), and run torch's hook on the gradients to the end."""
        flags = dist.all_reduce(bucket.flags, group=group, async_op=True)
        view = self._views.get(bucket.index)
        if view is None or view.bucket is not bucket:  # DDP's hooks rebuild their buckets
            view = self._views[bucket.index] = GradBucketView(bucket)
        # Waited for here, on the communication thread: the hook's later collectives are
        # issued from gloo's callback threads, and no other bucket's may be in flight then.
        result = powerSGD_hook(self._state, view).wait()
        grads = view.buffer()
        if result.data_ptr() != grads.data_ptr():
            grads.copy_(result)
        return flags

    def finish(self, pending: Any, bucket: Bucket, world_size: int) -> None:
        pending.wait()

    def bytes_per_step(self, numels: List[Tuple[int, int]], dtype: torch.dtype,
                       world_size: int) -> float:
        """The payload bytes one rank sends per step once compression has started: per
        bucket the flags, the uncompressed gradients, and every P and Q factor, each in one
        all_reduce (before ``start_iter`` a step sends what no compression sends).

        Raises:
            ValueError: the scheme is not bound to an optimizer (what it sends depends on
                each parameter's shape), or ``numels`` are not its buckets'.
        """
        if self._state is None:
            raise ValueError(
                f"Invalid bytes_per_step for {self!r}: what it sends depends on each "
                f"parameter's shape (expected the scheme bound to a DataParallelOptimizer)"
            )
        mine = [(b.numel, len(b.params)) for b in self._buckets]
        if list(map(tuple, numels)) != mine:
            raise ValueError(
                f"Invalid numels: {numels!r} (expected this optimizer's buckets: {mine!r})"
            )
        elements = sum(len(bucket.params) + sum(self.split(bucket)) for bucket in self._buckets)
        return 2.0 * (world_size - 1) / world_size * elements * dtype.itemsize

    def split(self, bucket: Bucket) -> Tuple[int, int, int]:
        """``(uncompressed elements, P elements, Q elements)`` of one bucket: a gradient of
        shape ``(n, ...)`` is an ``n x m`` matrix, compressed at rank ``r = min(n, m, rank)``
        when ``(n + m) r min_compression_rate < n m`` (torch's rule)."""
        plain = ps = qs = 0
        for g in GradBucketView(bucket).gradients():
            n = g.shape[0]
            m = g.numel() // n
            r = min(n, m, self.rank)
            if (n + m) * r * self.min_compression_rate < n * m:
                ps += n * r
                qs += m * r
            else:
                plain += g.numel()
        return plain, ps, qs

    # ------------------------------------------------------------ state

    def state_dict(self) -> Optional[Dict[str, Any]]:
        """This rank's PowerSGD state: ``layout`` (each bucket's parameters, as global
        indices: the dicts are per bucket), ``iter``, ``error_dict``, ``p_memory_dict``,
        ``q_memory_dict`` (bucket index -> tensor, copies) and ``rng`` (numpy's MT19937
        state as a tensor and numbers, so that ``torch.load(weights_only=True)`` reads it)."""
        state = self._state
        if state is None:
            return None
        _, key, pos, has_gauss, cached = state.rng.get_state()
        return {
            "layout": [list(b.positions) for b in self._buckets],
            "iter": int(state.iter),
            "error_dict": _copies(state.error_dict),
            "p_memory_dict": _copies(state.p_memory_dict),
            "q_memory_dict": _copies(state.q_memory_dict),
            "rng": {
                "key": torch.from_numpy(key.astype("int64")),
                "pos": int(pos),
                "has_gauss": int(has_gauss),
                "cached_gaussian": float(cached),
            },
        }

    def carried_state(self) -> Any:
        """The iteration count and the random generator, to a scheme bound to rebuilt
        buckets; False once error feedback or warm start hold factors per bucket (torch's
        ``start_powerSGD_iter > 1`` rule keeps them empty through the first step). Without
        warm start the P and Q memories are scratch, refilled at every step."""
        state = self._state
        if state is None:
            return None
        if state.error_dict or (self.warm_start and state.p_memory_dict):
            return False
        carried = self.state_dict()
        carried.update(error_dict={}, p_memory_dict={}, q_memory_dict={})
        del carried["layout"]  # the old buckets'
        return carried

    def checked_loader(self, state: Any) -> Callable[[], None]:
        """Check a ``state_dict()`` of this scheme against the buckets; return what loads it.

        None (a state_dict without ``"compression"``) loads nothing.

        Raises:
            ValueError: a missing or extra key, a bucket index, shape or dtype that does not
                fit, named; nothing has changed.
        """
        if state is None:
            return lambda: None
        where = "state_dict['compression']"
        if self._state is None:
            raise ValueError(
                f"Invalid {where}: {type(state).__name__} (expected None: this optimizer has "
                f"no buckets, so no PowerSGD state)"
            )
        _check_keys(where, {k: v for k, v in state.items() if k != "layout"}
                    if isinstance(state, dict) else state, _STATE_KEYS)
        layout = state.get("layout")
        mine = [list(b.positions) for b in self._buckets]
        if layout is not None and layout != mine:
            raise ValueError(
                f"Invalid {where}['layout']: {layout!r} (expected this optimizer's buckets "
                f"{mine!r}: the state is per bucket)"
            )
        it = state["iter"]
        if isinstance(it, bool) or not isinstance(it, int) or it < 0:
            raise ValueError(f"Invalid {where}['iter']: {it!r} (expected an int >= 0)")
        sizes = {b.index: self.split(b) for b in self._buckets}
        tensors = {}
        for key, length in (("error_dict", lambda i: self._buckets[i].numel),
                            ("p_memory_dict", lambda i: sizes[i][1]),
                            ("q_memory_dict", lambda i: sizes[i][2])):
            tensors[key] = self._checked_tensors(f"{where}[{key!r}]", state[key], length)
        if sorted(tensors["p_memory_dict"]) != sorted(tensors["q_memory_dict"]):
            raise ValueError(
                f"Invalid {where}['q_memory_dict']: buckets {sorted(tensors['q_memory_dict'])}"
                f" (expected those of p_memory_dict: {sorted(tensors['p_memory_dict'])})"
            )
        rng = _checked_rng(f"{where}['rng']", state["rng"])

        def load() -> None:
            self._state.iter = it
            for key, value in tensors.items():
                setattr(self._state, key, value)
            self._state.rng.set_state(rng)

        return load

    def _checked_tensors(self, where: str, value: Any,
                         length: Callable[[int], int]) -> Dict[int, Tensor]:
        """Copies of a (bucket index -> 1-D tensor) dict, on the buckets' devices."""
        if not isinstance(value, dict):
            raise ValueError(f"Invalid {where}: {type(value).__name__} (expected a dict of "
                             f"bucket index -> tensor)")
        out = {}
        for i, t in value.items():
            if isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < len(self._buckets):
                raise ValueError(f"Invalid {where}: bucket {i!r} (expected an index in "
                                 f"[0, {len(self._buckets)}))")
            bucket = self._buckets[i]
            expected = (length(i),)
            if not isinstance(t, Tensor) or tuple(t.shape) != expected or t.dtype != bucket.dtype:
                got = (f"{tuple(t.shape)} {t.dtype}" if isinstance(t, Tensor)
                       else type(t).__name__)
                raise ValueError(f"Invalid {where}[{i}]: {got} (expected a tensor of shape "
                                 f"{expected} and dtype {bucket.dtype})")
            out[i] = t.detach().to(bucket.buffer.device, copy=True)
        return out


def _copies(tensors: Dict[int, Tensor]) -> Dict[int, Tensor]:
    return {int(i): t.detach().clone() for i, t in sorted(tensors.items())}


def _checked_rng(where: str, value: Any) -> Tuple[Any, ...]:
    """numpy's ``RandomState.set_state`` tuple from a ``state_dict()['rng']``."""
    import numpy as np

    _check_keys(where, value, ("key", "pos", "has_gauss", "cached_gaussian"))
    key = value["key"]
    if not isinstance(key, Tensor) or tuple(key.shape) != (_MT_KEY_LENGTH,) or (
        key.dtype != torch.int64
    ) or bool(((key < 0) | (key >= 2**32)).any()):
        got = f"{tuple(key.shape)} {key.dtype}" if isinstance(key, Tensor) else type(key).__name__
        raise ValueError(f"Invalid {where}['key']: {got} (expected {_MT_KEY_LENGTH} int64 "
                         f"values in [0, 2**32))")
    pos, has_gauss, cached = value["pos"], value["has_gauss"], value["cached_gaussian"]
    if isinstance(pos, bool) or not isinstance(pos, int) or not 0 <= pos <= _MT_KEY_LENGTH:
        raise ValueError(f"Invalid {where}['pos']: {pos!r} (expected an int in "
                         f"[0, {_MT_KEY_LENGTH}])")
    if has_gauss not in (0, 1) or isinstance(has_gauss, bool):
        raise ValueError(f"Invalid {where}['has_gauss']: {has_gauss!r} (expected 0 or 1)")
    if isinstance(cached, bool) or not isinstance(cached, (int, float)):
        raise ValueError(f"Invalid {where}['cached_gaussian']: {cached!r} (expected a float)")
    return ("MT19937", key.cpu().numpy().astype(np.uint32), pos, has_gauss, float(cached))


def _check_keys(where: str, value: Any, keys: Tuple[str, ...]) -> None:
    if not isinstance(value, dict):
        raise ValueError(f"Invalid {where}: {type(value).__name__} (expected a dict with the "
                         f"keys {list(keys)!r})")
    missing = [k for k in keys if k not in value]
    extra = sorted(repr(k) for k in value if k not in keys)
    if missing or extra:
        what = ", ".join(([f"missing {missing!r}"] if missing else [])
                         + ([f"unexpected [{', '.join(extra)}]"] if extra else []))
        raise ValueError(f"Invalid {where}: {what} (expected the keys {list(keys)!r})")

