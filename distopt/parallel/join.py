"""Uneven inputs: a DataParallelOptimizer under ``torch.distributed.algorithms.Join``.

Under ``with Join([opt]):`` a rank that has left its loop runs ``main_hook`` once for each
iteration the others still run, and must issue that iteration's collectives, in order, on
the same group. An iteration is a forward that broadcasts the buffers (``module=``), a
step's reduction, or (once some rank has joined and the step waits for ``step()``) that
step. Each begins with a round on ``_forward_group``: the active ranks notify Join (pairing
with the all_reduce by which Join counts active ranks on the joined ones), then every rank
all-gathers (active, plan), so every rank learns the plan (the active ranks' must agree),
how many are active, and the source: the highest active rank, as DDP's.

A joined rank then receives the buffers; or reduces every bucket with zero gradients and no
parameter used (``GradientReducer.shadow``), stepping during backward if the others do; or
steps as they do in ``step()``, on what the source sends: its hyper-parameters, the
GradScaler's scaling and the gradients the step reads. So its parameters, optimizer state
and shard stay theirs. Zero gradients go through the compression (TopK / Threshold keep
their residuals; PowerSGD runs torch's hook on zeros, as DDP's join hook does); the sum is
divided by the world size, or with ``divide_by_initial_world_size=False`` by the active
ranks (``Bucket.divisor``). Refused: ``sync=RoundRobin``, and PowerSGD with
``divide_by_initial_world_size=False``. When every rank has joined, ``post_hook``
broadcasts the buffers from the highest last joiner, as DDP's final sync does.
"""
import itertools
import weakref
from typing import Any, Dict, NamedTuple, Optional, Tuple

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.algorithms.join import JoinHook

from distopt._torch import (
    all_gather_flat,
    end_join,
    is_first_joinable,
    notify_join_context_as_first,
    private_group,
)
from distopt.arguments import check_bool
from distopt.parallel import buffers as _buffers
from distopt.parallel.powersgd import PowerSGD
from distopt.parallel.sync import collective_device, global_rank

__all__ = ["JoinState", "Round", "buffers_round", "consolidate_round", "join_hook", "reduction_round",
           "register", "save_round", "send_step"]

#: What the active ranks are about to do, in a round: broadcast the buffers before a forward,
#: reduce (and step) one step's gradients, and whether the buckets step during backward.
_BUFFERS = 1
_REDUCE = 2
_IN_BACKWARD = 4
_STEP = 8
_SAVE = 16
_GATHER = 32
_WHAT = {_BUFFERS: "broadcast the module's buffers",
         _REDUCE: "reduce gradients, to step in step()",
         _REDUCE | _IN_BACKWARD: "reduce gradients and step during backward",
         _STEP: "step()",
         _SAVE: "save()",
         _GATHER: "consolidate_state_dict()"}

#: Every open DataParallelOptimizer of this process by its tag: the order of construction.
#: Every rank of a group builds its optimizers collectively, in one order, so a tag names
#: the same optimizer on every rank; a round says whose iteration it starts, and a joined
#: rank shadows that optimizer (``Join([opt1, opt2])``: rounds of both, in any order).
_OPTIMIZERS: "weakref.WeakValueDictionary[int, Any]" = weakref.WeakValueDictionary()
_TAGS = itertools.count()


#: The default group, and the group Join's collectives take for optimizers over it.
_SHARED_GROUP: Dict[str, Any] = {}


def group_for(process_group: Any) -> Any:
    """The group of Join's collectives for the DataParallelOptimizers over
    ``process_group``: that group when one was given (it is the optimizer's alone), else one
    private group of every rank, made at the first ``join_hook`` over the default group
    (as every rank builds its Join: a collective made in the same order everywhere) and
    shared by every later one, for the life of the default group. Not
    the default group itself: torch's Join would then take a DDP model beside these
    optimizers, whose join hook does not pair with their rounds."""
    if process_group is not None:
        return process_group
    world = dist.group.WORLD
    held = _SHARED_GROUP.get("world")
    if held is None or held[0] is not world:
        held = (world, private_group())
        _SHARED_GROUP["world"] = held
    return held[1]


class JoinState:
    """What one DataParallelOptimizer's engine keeps for Join.

    Attributes:
        tag: its number in the order of construction (``_OPTIMIZERS``).
        divide: Join's ``divide_by_initial_world_size`` (set by ``join_hook``).
        source: the highest active rank of the last round.
        packet: some rank has joined, and this step must send what it reads (``send_step``).
        shadowed: this rank shadowed an iteration of the optimizer in the Join block now
            open: then it is not the last to join, whatever its Join says (nested Joins,
            ``post_hook``).
    """

    __slots__ = ("tag", "divide", "source", "packet", "shadowed")

    def __init__(self) -> None:
        self.tag = -1
        self.divide = True
        self.source = 0
        self.packet = False
        self.shadowed = False


def register(engine: Any) -> None:
    """Give a new DataParallelOptimizer's engine its tag (``_OPTIMIZERS``)."""
    engine.join.tag = next(_TAGS)
    _OPTIMIZERS[engine.join.tag] = engine


class Round(NamedTuple):
    """What every rank learns at the start of a Join iteration."""

    plan: int  #: what the active ranks do (``_BUFFERS``, ``_REDUCE``, ``_IN_BACKWARD``, ``_STEP``)
    source: int  #: the highest active rank (in the optimizer's group)
    active: int  #: how many ranks have not joined
    opt: Any  #: the optimizer whose iteration it is


def join_hook(opt: Any, **kwargs: Any) -> JoinHook:
    """``DataParallelOptimizer.join_hook``, once ``opt`` is checked to train on uneven inputs
    (TypeError: ``divide_by_initial_world_size`` is not a bool)."""
    divide = kwargs.get("divide_by_initial_world_size", True)
    check_bool("divide_by_initial_world_size", divide)
    if opt.status.closed:
        raise ValueError(
            "Invalid Join: this DataParallelOptimizer is closed (expected an open one)"
        )
    if opt.sync is not None:
        raise ValueError(
            f"Invalid Join: sync={opt.sync!r} averages every rank's parameters, and a joined "
            f"rank's would pull the others' back (expected sync=None to train on uneven "
            f"inputs)"
        )
    if not divide and isinstance(opt.reduction, PowerSGD):
        raise ValueError(
            f"Invalid Join: divide_by_initial_world_size=False with compression="
            f"{opt.compression!r}: torch's powerSGD_hook divides by the group's size (expected "
            f"divide_by_initial_world_size=True, or another compression)"
        )
    if opt.shard_gradients:
        raise ValueError(
            "Invalid Join: shard_gradients=True releases each bucket's buffer once it is "
            "reduce-scattered, and a joined rank shadows the others' reductions from whole "
            "zero buckets (expected shard_gradients=False to train on uneven inputs)"
        )
    opt.join.divide = divide
    group_for(opt.process_group)  # every rank builds its Join alike: made here, if new
    return _JoinHook(opt)


def buffers_round(opt: Any) -> int:
    """An active rank's round before it broadcasts the buffers; returns the source."""
    return _round(opt, _BUFFERS).source


def reduction_round(opt: Any, in_backward: bool) -> Tuple[Optional[int], bool]:
    """An active rank's round before it reduces a step's gradients, whose buckets step
    during backward or not.

    Returns:
        The divisor (``Bucket.divisor``), and whether ``step()`` must call ``send_step``
        (some rank has joined, and the step waits for ``step()``).
    """
    step = _round(opt, _REDUCE | (_IN_BACKWARD if in_backward else 0))
    return _divisor(opt, step), step.active < opt.world_size and not in_backward


def send_step(opt: Any, scaling: Optional[Any]) -> None:
    """In an active rank's ``step()``, right before it steps: a round of its own, then
    what the step reads, from the source to the joined ranks (``_step_packet``)."""
    _round(opt, _STEP)
    _step_packet(opt, scaling, joined=False)


def save_round(opt: Any, path: str) -> None:
    """An active rank's round before ``save(path)``: joined ranks save with it."""
    _round(opt, _SAVE)
    _share(opt, path, joined=False)


def consolidate_round(opt: Any, to: Optional[int]) -> None:
    """An active rank's round before ``consolidate_state_dict(to)``: joined ranks gather
    with it."""
    _round(opt, _GATHER)
    _share(opt, to, joined=False)


class _JoinHook(JoinHook):
    """What a DataParallelOptimizer does on a rank that has joined."""

    def __init__(self, opt: Any) -> None:
        self.opt = opt

    def main_hook(self) -> None:
        """Shadow one iteration of the active ranks: the first DataParallelOptimizer given
        to ``Join`` shadows every round, whichever optimizer the active ranks run it for
        (each round is one of Join's iterations); the others' hooks do nothing."""
        if not is_first_joinable(self.opt.surface):
            return
        step = _round(self.opt, 0)
        opt = step.opt
        opt.join.shadowed = True
        if step.plan == _SAVE:
            from distopt.parallel import checkpoint as _checkpoint  # it imports this module

            _checkpoint.save(opt, _share(opt, None, joined=True))
        elif step.plan == _GATHER:
            opt.consolidate(_share(opt, None, joined=True))
        elif step.plan == _BUFFERS:
            _buffers.broadcast(list(opt.module.buffers()), step.source, opt.forward_group)
        elif step.plan == _STEP:
            opt.shadow_step(_step_packet(opt, None, joined=True))
        else:
            opt.shadow_reduction(_divisor(opt, step), bool(step.plan & _IN_BACKWARD))

    def post_hook(self, is_last_joiner: bool) -> None:
        """Every rank has joined: the buffers of the highest last joiner, as DDP's."""
        opt = self.opt
        end_join(opt.surface)  # back to the first rank
        # An outer Join of nested ones finds every rank joined at once: this rank's last
        # iteration of ``opt`` tells whether it joined before the others.
        is_last_joiner = is_last_joiner and not opt.join.shadowed
        opt.join.shadowed = False
        # Every rank broadcasts at its next forward (a joined rank's last forward is older).
        opt.sync_next_forward = True
        if opt.module is None or not opt.broadcast_buffers or opt.world_size == 1:
            return
        buffers = list(opt.module.buffers())
        if not buffers:
            return
        source = torch.tensor([opt.rank if is_last_joiner else -1], dtype=torch.int64,
                              device=collective_device(opt.process_group))
        dist.all_reduce(source, op=dist.ReduceOp.MAX, group=opt.forward_group)
        _buffers.broadcast(buffers, int(source.item()), opt.forward_group)


def _notify(opt: Any) -> None:
    """Tell Join this rank is active: Join's all_reduce, paired on a joined rank with the
    one that counts the active ranks before each iteration. Every round is an iteration,
    whichever optimizer runs it, so a second optimizer in one Join notifies as the first
    one does (``Join.notify_join_context`` does it for the first only)."""
    notify_join_context_as_first(opt.surface)


def _round(opt: Any, plan: int) -> Round:
    """The round that starts an iteration: ``plan`` on an active rank, 0 on a joined one.
    Every rank all-gathers (active, plan, optimizer tag) on ``opt.join_process_group``."""
    group = group_for(opt.process_group)
    device = collective_device(opt.process_group)
    if plan:
        _notify(opt)
    mine = torch.tensor([1 if plan else 0, plan, opt.join.tag if plan else -1],
                        dtype=torch.int64, device=device)
    every = torch.empty(3 * opt.world_size, dtype=torch.int64, device=device)
    all_gather_flat(every, mine, group=group)
    rows = every.view(opt.world_size, 3).tolist()
    active = [r for r, (on, _, _) in enumerate(rows) if on]
    plans = {(p, tag) for on, p, tag in rows if on}
    if len(plans) != 1:
        doing = "; ".join(
            f"ranks {[r for r in active if tuple(rows[r][1:]) == (p, tag)]} {_WHAT.get(p, p)} "
            f"(optimizer {tag})" for p, tag in sorted(plans)
        )
        raise RuntimeError(
            f"DataParallelOptimizer on rank {opt.rank} of {opt.world_size}: under Join, the "
            f"ranks not joined are about to do different things ({doing or 'none is active'})"
            f" (expected the same training loop on every rank, and the same "
            f"DataParallelOptimizers built in the same order)"
        )
    plan_of_all, tag = plans.pop()
    target = opt if tag == opt.join.tag else _OPTIMIZERS.get(tag)
    if target is None or target.world_size != opt.world_size:
        raise RuntimeError(
            f"DataParallelOptimizer on rank {opt.rank} of {opt.world_size}: under Join, the "
            f"active ranks run an iteration of their DataParallelOptimizer number {tag} (in "
            f"order of construction), which this rank does not hold open (expected the same "
            f"DataParallelOptimizers built in the same order on every rank, each given to "
            f"Join, and none closed before the Join block ends)"
        )
    if target.status.closed:
        raise RuntimeError(
            f"Invalid Join: DataParallelOptimizer number {tag} was closed on rank {opt.rank} "
            f"while the other ranks still train (expected close() after the Join block)"
        )
    step = Round(plan_of_all, max(active), len(active), target)
    target.join.source = step.source
    if step.plan == _REDUCE | _IN_BACKWARD and step.active < target.world_size:
        _share(target, None, joined=not plan)
    return step


def _divisor(opt: Any, step: Round) -> Optional[int]:
    return None if opt.join.divide else step.active


def _share(opt: Any, extra: Any, joined: bool) -> Any:
    """The source's hyper-parameters (``param_groups`` but ``params``) and ``extra`` to
    every rank (one ``broadcast_object_list``); a joined rank takes the hyper-parameters (a
    Tensor value in place, as a scheduler keeps it). Returns the source's ``extra``."""
    group = opt.forward_group
    values = [([{k: g[k] for k in opt.hyper_keys} for g in opt.param_groups], extra)]
    dist.broadcast_object_list(values, src=global_rank(group, opt.join.source), group=group)
    hyper, extra = values[0]
    if joined:
        for g, theirs in zip(opt.param_groups, hyper):
            for key, value in theirs.items():
                mine = g.get(key)
                if isinstance(mine, Tensor) and isinstance(value, Tensor) and (
                    mine.shape == value.shape
                ):
                    mine.copy_(value)
                else:
                    g[key] = value
    return extra


def _step_packet(opt: Any, scaling: Optional[Any], joined: bool) -> Optional[Any]:
    """What a step that waits for ``step()`` reads, from the source to every rank: the
    hyper-parameters, the GradScaler's scaling and each bucket's gradients (its flags: which
    ``.grad`` is None). Returns the scaling a joined rank steps with."""
    numbers = None
    if scaling is not None:
        numbers = tuple(None if t is None else (t.tolist(), t.dtype) for t in scaling)
    numbers = _share(opt, numbers, joined)
    group = opt.forward_group
    src = global_rank(opt.forward_group, opt.join.source)
    for bucket in opt.buckets:
        packet = torch.zeros_like(bucket.buffer)
        if opt.rank == opt.join.source:
            for slot, p in enumerate(bucket.params):
                if p.grad is not None:
                    start = bucket.offsets[slot]
                    with torch.no_grad():  # a gradient made with create_graph=True
                        packet[start:start + p.numel()].view_as(p).copy_(p.grad)
                    packet[bucket.numel + slot] = 1
        dist.broadcast(packet, src, group=group)
        if joined:
            bucket.buffer.copy_(packet)  # what the step reads; the flags are spent
            flags = packet[bucket.numel:].tolist()
            for slot, p in enumerate(bucket.params):
                p.grad = bucket.grads[slot] if flags[slot] != 0 else None
            bucket.unused = [slot for slot, flag in enumerate(flags) if flag == 0]
    if not joined or numbers is None:
        return None
    device = opt.buckets[0].buffer.device
    return tuple(None if n is None else torch.tensor(n[0], dtype=n[1], device=device)
                 for n in numbers)
