"""Rank functions for tests/parallel/test_resume.py: resumes that must keep every rank's
state (issue 36, item 3).

The model uses its layers in the reverse of their registration order, so the buckets a
DataParallelOptimizer cuts at construction differ from those it cuts again after its first
step (in the order the gradients arrived): a state saved after that rebuild meets a new
optimizer whose buckets, and so whose shards, are not the saved ones.
"""
import copy
import io
import os
import warnings
from typing import Any, Dict, List

import torch

from distopt.parallel import DataParallelOptimizer, PowerSGD, TopK
from distopt.parallel import shard as shard_module
from tests.helpers import error_of, identical
from tests.parallel.arrival_scenarios import Reversed
from tests.parallel.training import eager_class, mse_steps, whole_state_dict

WIDTH = 8
LAYERS = 4
#: Two layers' gradients a bucket at most: two buckets, cut differently after the rebuild.
CAP_MB = 2 * (WIDTH * WIDTH + WIDTH) * 4 / 2**20
#: Steps before the save (the buckets rebuilt after the first; PowerSGD compressing from
#: the third, its error feedback and warm start then per bucket), and after it.
SAVED_AT, AFTER = 3, 2


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return Reversed(WIDTH, LAYERS, outputs=2)


def _batches(rank: int) -> List[Any]:
    g = torch.Generator().manual_seed(40 + rank)
    return [(torch.randn(4, WIDTH, generator=g), torch.randn(4, 2, generator=g))
            for _ in range(SAVED_AT + AFTER)]


def _params(model: torch.nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def _powersgd() -> PowerSGD:
    return PowerSGD(rank=1, min_compression_rate=0.5, random_seed=3)


#: name -> (optimizer class, its options, DataParallelOptimizer's options, compression)
RUNS: Dict[str, Any] = {
    "powersgd-param": (torch.optim.Adam, {"lr": 1e-2}, {"shard": "param"}, _powersgd),
    "powersgd-flat": (torch.optim.Adam, {"lr": 1e-2}, {"shard": "flat"}, _powersgd),
    "powersgd-eager-param": (eager_class(torch.optim.SGD), {"lr": 0.05, "momentum": 0.9},
                             {"shard": "param"}, _powersgd),
    "topk-param": (torch.optim.SGD, {"lr": 0.05, "momentum": 0.9}, {"shard": "param"},
                   lambda: TopK(0.3)),
    "topk-flat": (torch.optim.Adam, {"lr": 1e-2}, {"shard": "flat"}, lambda: TopK(0.3)),
    "topk": (torch.optim.Adam, {"lr": 1e-2}, {}, lambda: TopK(0.3)),
}
#: How a run is resumed: ``save`` / ``load``, or each rank's gathered ``state_dict()``
#: (through torch.save, weights_only=True) and ``load_state_dict``.
HOWS = ("save", "state_dict")


def resumes(rank: int, world_size: int, path: str) -> Dict[str, Any]:
    """Per run and way of resuming: whether the resumed run equals the uninterrupted one
    bit for bit, whether the state_dict right after the load equals the one saved, and the
    warnings the load gave."""
    batches = _batches(rank)
    out: Dict[str, Any] = {}
    for name, (cls, kwargs, options, compression) in RUNS.items():
        def make(model):
            return DataParallelOptimizer(cls, model.parameters(), bucket_cap_mb=CAP_MB,
                                         compression=compression(), **options, **kwargs)

        model = _model()
        opt = make(model)
        built = opt.bucket_layout()
        mse_steps(model, opt, batches[:SAVED_AT])
        where = os.path.join(path, name)
        opt.save(where)
        buf = io.BytesIO()
        saved_sd = whole_state_dict(opt)
        torch.save(saved_sd, buf)
        saved_params = [p.detach().clone() for p in model.parameters()]
        rebuilt = opt.bucket_layout() != built
        mse_steps(model, opt, batches[SAVED_AT:])
        straight = _params(model)
        opt.close()
        for how in HOWS:
            model = _model()
            with torch.no_grad():
                for p, v in zip(model.parameters(), saved_params):
                    p.copy_(v)
            resumed = make(model)
            with warnings.catch_warnings(record=True) as seen:
                warnings.simplefilter("always")
                if how == "save":
                    resumed.load(where)
                else:
                    buf.seek(0)
                    resumed.load_state_dict(torch.load(buf, weights_only=True))
            got: Dict[str, Any] = {"warnings": [str(w.message) for w in seen
                                                if w.category is UserWarning]}
            try:
                after_load = whole_state_dict(resumed)
                got["state_dict"] = "no error"
                got["same_state"] = identical(after_load, saved_sd)
                got["entries"] = (len(after_load["state"]), len(saved_sd["state"]))
            except Exception as exc:  # noqa: B902 - reported to the test
                got["state_dict"] = f"{type(exc).__name__}: {exc}"
            mse_steps(model, resumed, batches[SAVED_AT:])
            got["equal"] = bool(torch.equal(_params(model), straight))
            got["rebuilt"] = rebuilt
            resumed.close()
            out[f"{name}/{how}"] = got
    return out


def _one_matrix(shape: Any, shard: Any, compression: Any = None) -> Any:
    """A (shape) matrix and a bias under Adam; the optimizer."""
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(*shape)), torch.nn.Parameter(torch.randn(3))]
    return params, DataParallelOptimizer(torch.optim.Adam, params, lr=0.1, shard=shard,
                                         compression=compression)


def _stepped(params: List[torch.Tensor], opt: Any, rank: int) -> None:
    (params[0].sum() * (rank + 1) + params[1].sum()).backward()
    opt.step()
    opt.zero_grad()


def refusals(rank: int, world_size: int, path: str) -> Dict[str, Any]:
    """A (4, 16) parameter's state, saved unsharded or sharded, loaded into a (16, 4) one
    with ``shard="flat"`` (``load`` and ``load_state_dict``); a part only rank 1 refuses;
    what each rank raised, and whether the state stayed as it was and a step still runs."""
    out: Dict[str, Any] = {}
    for source in (None, "flat", "param"):
        params, opt = _one_matrix((4, 16), source)
        _stepped(params, opt, rank)
        where = os.path.join(path, f"refused-{source}")
        opt.save(where)
        sd = whole_state_dict(opt)
        opt.close()
        params, opt = _one_matrix((16, 4), "flat")
        _stepped(params, opt, rank)
        before = whole_state_dict(opt)
        out[f"{source}/load"] = error_of(lambda: opt.load(where))
        out[f"{source}/load_state_dict"] = error_of(lambda: opt.load_state_dict(sd))
        out[f"{source}/unchanged"] = identical(whole_state_dict(opt), before)
        _stepped(params, opt, rank)  # no rank was left waiting in a collective
        opt.close()
    # Rank 1's part only: its residuals file missing; a state entry of a parameter rank 1
    # holds (shard="param": the (4, 16) matrix) without one of its keys.
    params, opt = _one_matrix((4, 16), "param", TopK(0.5))
    _stepped(params, opt, rank)
    where = os.path.join(path, "one-rank")
    opt.save(where)
    sd = whole_state_dict(opt)
    out["holder"] = rank if 0 in shard_module.piece_index(opt._engine.buckets) else 1 - rank
    if rank == 0:
        name = next(n for n in os.listdir(where) if n.endswith("-residuals-rank1.pt"))
        os.remove(os.path.join(where, name))
        out["residuals_file"] = name
    torch.distributed.barrier()
    out["one-rank/load"] = error_of(lambda: opt.load(where))
    del sd["state"][0]["exp_avg_sq"]
    out["one-rank/load_state_dict"] = error_of(lambda: opt.load_state_dict(sd))
    _stepped(params, opt, rank)
    opt.close()
    return out


#: name -> (the compression, shard): rank 0's state_dict loaded on every rank.
HABITS = {"topk": (lambda: TopK(0.3), None), "powersgd": (_powersgd, None),
          "topk-flat": (lambda: TopK(0.3), "flat")}


def rank0_state_dict(opt: Any) -> Dict[str, Any]:
    """Rank 0's ``state_dict()`` on every rank, as a DDP script saves it (rank 0 only) and
    every rank loads it; sharded, consolidated to rank 0 first where the optimizer has
    ``consolidate_state_dict``."""
    rank = torch.distributed.get_rank()
    if opt.shard is not None and hasattr(opt, "consolidate_state_dict"):
        opt.consolidate_state_dict(to=0)
        sd = opt.state_dict() if rank == 0 else None
    else:
        sd = opt.state_dict()
    box = [copy.deepcopy(sd) if rank == 0 else None]
    torch.distributed.broadcast_object_list(box, src=0)
    return box[0]


def ddp_habit(rank: int, world_size: int) -> Dict[str, Any]:
    """Per ``HABITS`` case: rank 0's state_dict loaded twice on every rank; its record of
    whose residuals it holds, the warnings each load gave, and a step after them."""
    batches = _batches(rank)
    out: Dict[str, Any] = {}
    for name, (compression, shard) in HABITS.items():
        def make(model):
            return DataParallelOptimizer(torch.optim.Adam, model.parameters(), lr=1e-2,
                                         bucket_cap_mb=CAP_MB, compression=compression(),
                                         shard=shard)

        model = _model()
        opt = make(model)
        mse_steps(model, opt, batches[:SAVED_AT])
        sd = rank0_state_dict(opt)
        opt.close()
        model = _model()
        resumed = make(model)
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            resumed.load_state_dict(sd)
            resumed.load_state_dict(sd)
        mse_steps(model, resumed, batches[SAVED_AT:])
        resumed.close()
        out[name] = {"record": sd.get("residuals_of"),
                     "warnings": [str(w.message) for w in seen if w.category is UserWarning]}
    return out


def other_cap(rank: int, world_size: int, path: str) -> Dict[str, Any]:
    """A "flat" TopK run saved with one ``bucket_cap_mb`` and loaded by an optimizer built
    with another (it takes the saved layout): whether the resumed run equals the
    uninterrupted one; then rank 0 in ``load_state_dict`` while rank 1 consolidates: the
    error each rank gets."""
    batches = _batches(rank)
    cls, kwargs, options, compression = RUNS["topk-flat"]

    def make(model, cap):
        return DataParallelOptimizer(cls, model.parameters(), bucket_cap_mb=cap,
                                     compression=compression(), **options, **kwargs)

    model = _model()
    opt = make(model, CAP_MB)
    mse_steps(model, opt, batches[:SAVED_AT])
    where = os.path.join(path, "other-cap")
    opt.save(where)
    saved_params = [p.detach().clone() for p in model.parameters()]
    mse_steps(model, opt, batches[SAVED_AT:])
    straight = _params(model)
    opt.close()
    model = _model()
    with torch.no_grad():
        for p, v in zip(model.parameters(), saved_params):
            p.copy_(v)
    resumed = make(model, 2.5 * CAP_MB)
    out = {"load": error_of(lambda: resumed.load(where))}
    mse_steps(model, resumed, batches[SAVED_AT:])
    out["equal"] = bool(torch.equal(_params(model), straight))
    state = whole_state_dict(resumed)
    if rank == 0:
        out["mismatch"] = error_of(lambda: resumed.load_state_dict(state))
    else:
        out["mismatch"] = error_of(lambda: resumed.consolidate_state_dict(to=None))
    resumed.close()
    return out


def everything(rank: int, world_size: int, path: str) -> Dict[str, Any]:
    """The module's one world: every scenario above, in turn."""
    return {"resumes": resumes(rank, world_size, path),
            "refusals": refusals(rank, world_size, path),
            "habit": ddp_habit(rank, world_size),
            "other_cap": other_cap(rank, world_size, path)}
