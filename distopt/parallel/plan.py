"""The plan of a DataParallelOptimizer's buckets: which compiled unit steps what, and the
buckets cut anew (in the order the first step's gradients arrived, or as a saved state says).

Pure functions of the buckets: ``distopt.parallel.engine`` holds what they return.
"""
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch

from distopt.parallel import buffers as _buffers
from distopt.parallel.buckets import Bucket
from distopt.parallel.sync import collective_device
from distopt.parallel.units import Unit

__all__ = ["arrival_order", "cut_units", "layout_buckets"]


def cut_units(buckets: Sequence[Bucket], group_of: List[int], shard: Optional[str],
              options: List[Dict[str, Any]], n_groups: int,
              whole_sizes: bool = False) -> Tuple[List[Unit], List[List[int]]]:
    """One unit per (bucket, param group): what it steps (sharded: this rank's pieces,
    views of the shard's buffer), and each group's units. Sets each bucket's ``units``:
    (unit, slots, gradient views) per unit it holds. ``whole_sizes``: sharded units also
    get the element counts of the parameters their pieces are of (a blockwise class decides
    from them what it quantises)."""
    of_group: List[List[int]] = [[] for _ in range(n_groups)]
    units: List[Unit] = []
    for bucket in buckets:
        bucket.units = []
        if shard is None:
            members = list(zip(range(len(bucket.params)), bucket.params, bucket.grads))
        else:
            sh = bucket.shard
            members = [(pc.slot, v, g) for pc, v, g in zip(sh.own, sh.views, sh.grads)]
        by_group: Dict[int, List[Any]] = {}
        for member in members:
            by_group.setdefault(group_of[bucket.positions[member[0]]], []).append(member)
        for j, ms in sorted(by_group.items()):
            of_group[j].append(len(units))
            unit_options = options[j]
            if whole_sizes and shard is not None:
                sizes = [bucket.params[k].numel() for k, _, _ in ms]
                unit_options = {**options[j], "whole_sizes": sizes}
            units.append(Unit([t for _, t, _ in ms], [bucket.positions[k] for k, _, _ in ms],
                              unit_options))
            bucket.units.append((len(units) - 1, [k for k, _, _ in ms], [g for _, _, g in ms]))
    return units, of_group


def arrival_order(arrivals: List[int], buckets: Sequence[Bucket], world_size: int,
                  group: Any) -> List[int]:
    """The first step's arrival order (global indices) on the group's first rank, then
    the parameters whose gradient did not arrive; every rank takes it (one broadcast)."""
    present = [i for b in buckets for i in b.positions]
    order = list(dict.fromkeys(arrivals))
    got = set(order)
    order += [i for i in present if i not in got]
    if world_size > 1:
        box = torch.tensor(order, dtype=torch.int64, device=collective_device(group))
        _buffers.broadcast([box], 0, group)
        order = box.tolist()
    return order


def layout_buckets(bucketed: Dict[int, Any], layout: Any, where: str) -> List[Bucket]:
    """New buckets cut as ``layout`` (bucket -> global indices) says, over ``bucketed``
    (global index -> parameter); ValueError naming ``where`` where it cannot be."""
    flat = [i for ps in layout for i in ps] if isinstance(layout, list) and all(
        isinstance(ps, list) and ps for ps in layout) else None
    if flat is None or sorted(flat) != sorted(bucketed) or any(
        len({(bucketed[i].dtype, bucketed[i].device) for i in ps}) != 1 for ps in layout
    ):
        raise ValueError(
            f"Invalid {where}: {layout!r} (expected a list of non-empty buckets of "
            f"global indices, holding each of the parameters {sorted(bucketed)} once, one "
            f"dtype and device a bucket)"
        )
    new = [Bucket(k, [bucketed[i] for i in ps], list(ps)) for k, ps in enumerate(layout)]
    new[-1].last = True
    return new
