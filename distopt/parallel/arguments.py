"""The data-parallel optimizers' argument checks: all of them before any collective."""
import math
import zlib
from typing import Any, Dict, List, Tuple

import torch
import torch.distributed as dist
from torch import Tensor

from distopt.arguments import check_bool, check_optimizer_class
from distopt.param_groups import distinct
from distopt.parallel import shard as _shard
from distopt.parallel.compression import Compression
from distopt.parallel.sync import RoundRobin, collective_device
from functional._validation import iterable_argument

__all__ = ["check_class", "check_compression", "check_options", "check_same_everywhere",
           "check_shard_gradients", "group_info", "param_groups"]


def check_class(optimizer_class: Any, eager: bool, why: str) -> None:
    """An optimizer class for dense gradients; ``why`` says why dense."""
    check_optimizer_class(optimizer_class, eager)
    if isinstance(optimizer_class, type) and issubclass(optimizer_class, torch.optim.SparseAdam):
        raise TypeError(
            f"Invalid optimizer_class: {optimizer_class.__name__} steps only sparse "
            f"gradients (expected a class for dense ones: {why})"
        )


def check_compression(compression: Any) -> None:
    if compression is not None and not isinstance(compression, Compression):
        raise TypeError(
            f"Invalid compression: {compression!r} (expected None, Cast, TopK, Threshold or "
            f"PowerSGD)"
        )


def check_options(bucket_cap_mb: Any, compression: Any, passes: Any, sync: Any, overlap: Any,
                  shard: Any, optimizer_class: type, eager: bool,
                  shard_gradients: Any = False) -> None:
    """``DataParallelOptimizer``'s own options."""
    if isinstance(bucket_cap_mb, bool) or not isinstance(bucket_cap_mb, (int, float)) or not (
        math.isfinite(bucket_cap_mb) and bucket_cap_mb > 0
    ):
        raise ValueError(f"Invalid bucket_cap_mb: {bucket_cap_mb!r} (expected a finite float > 0)")
    check_compression(compression)
    if isinstance(passes, bool) or not isinstance(passes, int) or passes < 1:
        raise ValueError(f"Invalid backward_passes_per_step: {passes!r} (expected an int >= 1)")
    if sync is not None and not isinstance(sync, RoundRobin):
        raise TypeError(f"Invalid sync: {sync!r} (expected None or RoundRobin(k))")
    if sync is not None and compression is not None:
        raise ValueError(
            f"Invalid compression: {compression!r} with sync={sync!r} (expected None: "
            f"RoundRobin averages parameters, not gradients)"
        )
    check_bool("overlap", overlap)
    check_shard_gradients(shard_gradients, shard, compression)
    if shard is None:
        return
    if shard not in _shard.MODES:
        raise ValueError(f"Invalid shard: {shard!r} (expected None, 'param' or 'flat')")
    if sync is not None:
        raise ValueError(
            f"Invalid shard: {shard!r} with sync={sync!r} (expected None: RoundRobin steps "
            f"every parameter on every rank)"
        )
    if eager and shard == "flat":
        raise ValueError(
            f"Invalid shard: 'flat' for {optimizer_class.__name__}, which has no functional "
            f"twin and steps whole parameters (expected shard='param', or a class of "
            f"functional_optim_map with TorchScript on)"
        )
    if shard == "flat" and optimizer_class.__name__ in _shard.SHAPED:
        raise ValueError(
            f"Invalid shard: 'flat' for {optimizer_class.__name__}, whose update depends on "
            f"each parameter's shape (expected shard='param', which keeps parameters whole)"
        )


def check_shard_gradients(shard_gradients: Any, shard: Any, compression: Any) -> None:
    """``shard_gradients=True`` needs ``shard="flat"`` (one run of elements per rank to
    scatter into) and no compression (the schemes send what they choose of every element)."""
    check_bool("shard_gradients", shard_gradients)
    if not shard_gradients:
        return
    if shard != "flat":
        raise ValueError(
            f"Invalid shard_gradients: True with shard={shard!r} (expected shard='flat': each "
            f"bucket is reduce-scattered into the run of elements a rank steps)"
        )
    if compression is not None:
        raise ValueError(
            f"Invalid compression: {compression!r} with shard_gradients=True (expected None: "
            f"a compressed bucket is sent whole, chosen, cast or factored over the whole "
            f"bucket, and cannot be reduce-scattered into each rank's run of elements)"
        )


def group_info(process_group: Any) -> Tuple[Any, int, int]:
    """``(process_group, this rank in it, its size)``, checked."""
    if not dist.is_available() or not dist.is_initialized():
        raise ValueError(
            f"Invalid process_group: {process_group!r} (expected torch.distributed to be "
            f"initialized first: torch.distributed.init_process_group)"
        )
    outside = ValueError(
        f"Invalid process_group: this rank ({dist.get_rank()}) is not one of its members "
        f"(expected a group this rank belongs to)"
    )
    if process_group is dist.GroupMember.NON_GROUP_MEMBER or (
        isinstance(process_group, int) and process_group == dist.GroupMember.NON_GROUP_MEMBER
    ):
        raise outside
    if process_group is not None and not isinstance(process_group, dist.ProcessGroup):
        raise TypeError(
            f"Invalid process_group: {process_group!r} (expected None or a "
            f"torch.distributed ProcessGroup)"
        )
    if dist.get_rank(process_group) < 0:
        raise outside
    return process_group, dist.get_rank(process_group), dist.get_world_size(process_group)


def param_groups(params: Any) -> List[Dict[str, Any]]:
    """The constructor's parameters as new group dicts (torch.optim's rules for the rest)."""
    if isinstance(params, Tensor):
        raise TypeError(
            f"Invalid params: a {type(params).__name__} (expected an iterable of Tensors or "
            f"of param group dicts, e.g. model.parameters())"
        )
    items = list(iterable_argument("params", params, "Tensors or of param group dicts"))
    if not items:
        raise ValueError("Invalid params: [] (expected at least one parameter)")
    if not isinstance(items[0], dict):
        items = [{"params": items}]
    groups = []
    for j, g in enumerate(items):
        if not isinstance(g, dict) or "params" not in g:
            raise TypeError(f"Invalid params[{j}]: {g!r} (expected a dict with 'params')")
        ps = g["params"]
        groups.append({**g, "params": [ps] if isinstance(ps, Tensor) else list(ps)})
    # As DistributedOptimizer refuses it (distopt.owner): torch.optim only warns of a tensor
    # given twice and steps it twice (functional.check_params).
    return distinct(groups, "params", "tensor")


def check_same_everywhere(opt: Any, params: List[Tensor], group_of: List[int],
                          cap_bytes: int, outside: List[Tensor]) -> None:
    """Every rank must build the same buckets (one all_gather of a signature), or the
    collectives would pair unlike buckets: DDP refuses mismatched models too. With
    ``module=``, its other parameters and its buffers must match as well (they are
    broadcast)."""
    if opt.world_size == 1:
        return
    module = None
    if opt.module is not None:
        module = ([(tuple(t.shape), str(t.dtype)) for t in outside],
                  [(tuple(b.shape), str(b.dtype)) for b in opt.module.buffers()],
                  opt.broadcast_buffers)
    layout = repr((
        [(tuple(p.shape), str(p.dtype), p.requires_grad, str(p.device.type), j)
         for p, j in zip(params, group_of)],
        [sorted((k, repr(v)) for k, v in g.items() if k != "params")
         for g in opt.param_groups],
        cap_bytes, repr(opt.compression), repr(opt.sync), opt.shard, opt.shard_gradients,
        opt.backward_passes_per_step, opt.optimizer_class.__name__, module,
    ))
    mine = torch.tensor([len(params), zlib.crc32(layout.encode())], dtype=torch.int64,
                        device=collective_device(opt.process_group))
    every = [torch.empty_like(mine) for _ in range(opt.world_size)]
    dist.all_gather(every, mine, group=opt.process_group)
    first = every[0].tolist()
    for r, theirs in enumerate(every):
        theirs = theirs.tolist()
        if theirs != first:
            raise ValueError(
                f"Invalid params: rank {r} of the process group built its "
                f"DataParallelOptimizer from {theirs[0]} parameters, rank 0 from "
                f"{first[0]}, and their shapes, dtypes, requires_grad, param groups, "
                f"hyper-parameters (lr, momentum, ...) or options (bucket_cap_mb, "
                f"compression, sync, shard, backward_passes_per_step, optimizer class, "
                f"module's buffers) differ (expected the same model and arguments on "
                f"every rank)"
            )
