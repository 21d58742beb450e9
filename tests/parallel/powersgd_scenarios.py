"""Rank-side scenarios of ``test_powersgd`` (module-level, so that spawn can find them).

Each takes ``(rank, world_size, ...)``, runs inside a gloo group (``tests.worlds``)
and returns plain data for the test to assert on.
"""
import io
import os
import threading
import weakref
from typing import Any, Dict, List

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook import (
    PowerSGDState,
    powerSGD_hook,
)

from distopt import _torch
from distopt.parallel import DataParallelOptimizer, PowerSGD
from tests.parallel.training import eager_class, flat_params, whole_state_dict
from tests.parallel.feature_scenarios import wchar

#: Large enough for one bucket, DDP's and ours (DDP's first bucket also holds at most 1 MiB).
ONE_BUCKET_MB = 100.0
OPTIMIZERS = {
    "SGD": (torch.optim.SGD, {"lr": 0.05, "momentum": 0.9, "fused": True}),
    "Adam": (torch.optim.Adam, {"lr": 1e-2, "fused": True}),
}


def make_model(seed: int = 0, width: int = 24) -> torch.nn.Module:
    """Three Linear layers: 2-D weights PowerSGD compresses at rank 1 and 2, biases it
    all-reduces as they are."""
    torch.manual_seed(seed)
    return torch.nn.Sequential(
        torch.nn.Linear(10, width), torch.nn.Tanh(),
        torch.nn.Linear(width, width), torch.nn.Tanh(),
        torch.nn.Linear(width, 3),
    )


def batches(rank: int, world_size: int, steps: int, passes: int = 1, seed: int = 1):
    """This rank's (x, y) for each step and backward pass (different every time)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(steps, passes, world_size, 6, 10, generator=g)
    y = torch.randn(steps, passes, world_size, 6, 3, generator=g)
    return [[(x[s, k, rank], y[s, k, rank]) for k in range(passes)] for s in range(steps)]


def loss_of(model: Any, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return ((model(x) - y) ** 2).mean()


def _train_ddp(rank, world_size, optimizer, steps, passes, psgd):
    cls, kwargs = OPTIMIZERS[optimizer]
    model = make_model()
    ddp = torch.nn.parallel.DistributedDataParallel(model, bucket_cap_mb=ONE_BUCKET_MB)
    ddp.register_comm_hook(PowerSGDState(None, **psgd), powerSGD_hook)
    opt = cls(model.parameters(), **kwargs)
    for step in batches(rank, world_size, steps, passes):
        for k, (x, y) in enumerate(step):
            if k < passes - 1:
                with ddp.no_sync():
                    loss_of(ddp, x, y).backward()
            else:
                loss_of(ddp, x, y).backward()
        opt.step()
        opt.zero_grad()
    data = ddp._get_ddp_logging_data()
    del ddp
    return flat_params(model), data.get("bucket_sizes")


def _train_ours(rank, world_size, optimizer, steps, passes, psgd, eager=False, **options):
    cls, kwargs = OPTIMIZERS[optimizer]
    model = make_model()
    opt = DataParallelOptimizer(
        eager_class(cls) if eager else cls, model.parameters(), bucket_cap_mb=ONE_BUCKET_MB,
        compression=PowerSGD(**psgd), backward_passes_per_step=passes, **options, **kwargs,
    )
    for step in batches(rank, world_size, steps, passes):
        for x, y in step:
            loss_of(model, x, y).backward()
        opt.step()
        opt.zero_grad()
    buckets = len(opt._engine.buckets)
    it = opt._engine.reduction.powersgd_state.iter
    opt.close()
    return flat_params(model), buckets, it


_TORCH_NAMES = {"rank": "matrix_approximation_rank", "start_iter": "start_powerSGD_iter"}


def against_ddp(rank: int, world_size: int, cases: List[Dict[str, Any]]) -> List[Dict[str, Any]]:
    """Each case trained under DDP + powerSGD_hook and under DataParallelOptimizer.

    One bucket each: what the hook's result depends on besides the values is the order of
    the matrices in the bucket (the random projections are drawn in that order). Ours is
    reverse registration; DDP's, from its second step on, the order gradients arrived in
    its first, also last layer first. Both run plain all-reduces before ``start_iter``.
    """
    out = []
    for case in cases:
        psgd = case.get("psgd", {})
        torch_psgd = {_TORCH_NAMES.get(k, k): v for k, v in psgd.items()}
        torch_psgd.setdefault("start_powerSGD_iter", 2)
        passes = case.get("passes", 1)
        ddp, ddp_buckets = _train_ddp(rank, world_size, case["optimizer"], case["steps"],
                                      passes, torch_psgd)
        ours, buckets, it = _train_ours(rank, world_size, case["optimizer"], case["steps"],
                                        passes, psgd, **case.get("options", {}))
        out.append({"ddp": ddp, "ours": ours, "buckets": buckets, "iter": it,
                    "ddp_buckets": ddp_buckets})
    return out


# ---------------------------------------------------------------- several buckets


#: Buckets of 300 float32 elements at most: make_model(width=16) takes three.
THREE_BUCKETS_MB = 1200 / 2**20


def many_runs(rank: int, world_size: int, runs: int, steps: int) -> Dict[str, Any]:
    """``runs`` fresh trainings of ``steps`` steps, in three buckets; and the thread on
    which each run's private group was freed (``destroyed_on``: "main", or the other thread's
    name; "alive" for one still referenced once every retired group was released)."""
    out: Dict[str, Any] = {"params": [], "buckets": [], "iter": [], "compressed": [],
                           "retired_while_held": [], "retired": []}
    # Whichever thread drops a group's last reference frees it (its Python object, then the
    # C++ group, whose destructor joins the gloo workers): the finalizer runs right there.
    destroyed_on: List[str] = []

    def freed_here() -> None:
        thread = threading.current_thread()
        destroyed_on.append("main" if thread is threading.main_thread() else thread.name)
    for run in range(runs):
        model = make_model(seed=run, width=16)
        opt = DataParallelOptimizer(
            torch.optim.SGD, model.parameters(), lr=0.05, momentum=0.9,
            bucket_cap_mb=THREE_BUCKETS_MB, compression=PowerSGD(random_seed=run),
        )
        for step in batches(rank, world_size, steps, seed=100 + run):
            x, y = step[0]
            loss_of(model, x, y).backward()
            opt.step()
            opt.zero_grad()
        state = opt._engine.reduction.powersgd_state
        out["params"].append(flat_params(model))
        out["buckets"].append(len(opt._engine.buckets))
        out["iter"].append(state.iter)
        out["compressed"].append(sorted(state.p_memory_dict))
        comm = opt._engine.comm_group
        weakref.finalize(comm, freed_here)
        opt.close()
        # destroyed, but still held by the codec's PowerSGD state: kept, not dropped
        out["retired_while_held"].append(any(g is comm for g in _torch._RETIRED))
        out["retired"].append(len(_torch._RETIRED))
        del comm, state
    # A group something else holds (as a pending callback's closure would) is kept until
    # released, then dropped by the next sweep on this thread.
    group = _torch.private_group()
    # Both ranks connected before either tears it down (destroying a group the other rank
    # is still connecting to fails that rank's new_group: "Connection closed by peer", 1 in
    # 100 runs of this world); every group an optimizer makes carries collectives first.
    dist.barrier(group=group)
    held, kept = [group], id(group)
    _torch.destroy_private_group(group)
    del group
    out["kept_while_held"] = any(id(g) == kept for g in _torch._RETIRED)
    held.clear()
    _torch._drop_retired()
    out["dropped_after_release"] = all(id(g) != kept for g in _torch._RETIRED)
    # What the exit does (distopt.parallel.teardown): release what is left, here.
    out["released"] = _torch.release_retired_groups(10.0)
    out["destroyed_on"] = destroyed_on + ["alive"] * (runs - len(destroyed_on))
    return out


# ---------------------------------------------------------------- bytes


def sent_bytes(rank: int, world_size: int, steps: int) -> Dict[str, Any]:
    """wchar over each step, the bound scheme's model and no compression's."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.Tanh(),
                                torch.nn.Linear(256, 256))
    opt = DataParallelOptimizer(torch.optim.Adam, model.parameters(), lr=1e-3,
                                bucket_cap_mb=0.3, compression=PowerSGD(rank=4))
    x = torch.randn(8, 256)
    measured: List[int] = []
    for _ in range(steps):
        dist.barrier()
        before = wchar()
        model(x).square().mean().backward()
        opt.step()
        measured.append(wchar() - before)
        opt.zero_grad()
    numels = [(b.numel, len(b.params)) for b in opt._engine.buckets]
    out = {
        "measured": measured,
        "modelled": opt._engine.reduction.bytes_per_step(numels, torch.float32, world_size),
        "buckets": len(opt._engine.buckets),
        "split": [opt._engine.reduction.split(b) for b in opt._engine.buckets],
        "p_sizes": {i: t.numel() for i, t in opt._engine.reduction.powersgd_state.p_memory_dict.items()},
        "q_sizes": {i: t.numel() for i, t in opt._engine.reduction.powersgd_state.q_memory_dict.items()},
    }
    out["dense"] = 2.0 * (world_size - 1) / world_size * 4 * sum(n + k for n, k in numels)
    try:
        PowerSGD().bytes_per_step(numels, torch.float32, world_size)
    except ValueError as exc:
        out["unbound"] = str(exc)
    opt.close()
    return out


# ---------------------------------------------------------------- state


def _build(model: torch.nn.Module, warm_start: bool) -> DataParallelOptimizer:
    return DataParallelOptimizer(
        torch.optim.Adam, model.parameters(), lr=1e-2, bucket_cap_mb=THREE_BUCKETS_MB,
        compression=PowerSGD(rank=2, warm_start=warm_start, random_seed=7),
    )


def _train(model, opt, data) -> None:
    for step in data:
        x, y = step[0]
        loss_of(model, x, y).backward()
        opt.step()
        opt.zero_grad()


def resumed(rank: int, world_size: int, path: str, saved_at: int, steps: int) -> Dict[str, Any]:
    """An uninterrupted run, and runs resumed at ``saved_at`` from ``save`` / ``load`` and
    from ``state_dict`` / ``load_state_dict`` (through torch.save, weights_only=True)."""
    out: Dict[str, Any] = {}
    data = batches(rank, world_size, steps, seed=9)
    for warm_start in (True, False):
        model = make_model(width=16)
        opt = _build(model, warm_start)
        _train(model, opt, data[:saved_at])
        opt.save(os.path.join(path, f"warm{warm_start}"))
        buf = io.BytesIO()
        torch.save(whole_state_dict(opt), buf)
        saved = [p.detach().clone() for p in model.parameters()]
        _train(model, opt, data[saved_at:])
        result = {"uninterrupted": flat_params(model)}
        compression = whole_state_dict(opt)["compression"]
        result["state"] = {
            "iter": compression["iter"],
            "error_dict": sorted(compression["error_dict"]),
            "p_memory_dict": sorted(compression["p_memory_dict"]),
        }
        opt.close()
        for how in ("save", "state_dict"):
            fresh = make_model(seed=3, width=16)
            with torch.no_grad():
                for p, q in zip(fresh.parameters(), saved):
                    p.copy_(q)
            opt = _build(fresh, warm_start)
            if how == "save":
                opt.load(os.path.join(path, f"warm{warm_start}"))
            else:
                buf.seek(0)
                opt.load_state_dict(torch.load(buf, weights_only=True))
            _train(fresh, opt, data[saved_at:])
            result[how] = flat_params(fresh)
            opt.close()
        out[f"warm_start={warm_start}"] = result
    return out


def refused_states(rank: int, world_size: int) -> Dict[str, str]:
    """Bad ``state_dict()['compression']`` parts, each refused naming the key, changing
    nothing; a parameter dtype PowerSGD cannot take, refused at construction."""
    model = make_model(width=16)
    opt = _build(model, True)
    _train(model, opt, batches(rank, world_size, 3))
    good = whole_state_dict(opt)
    before = io.BytesIO()
    torch.save(good, before)

    def changed(path: List[Any], value: Any) -> Dict[str, Any]:
        sd = torch.load(io.BytesIO(before.getvalue()), weights_only=True)
        target = sd
        for key in path[:-1]:
            target = target[key]
        if value is _DELETE:
            del target[path[-1]]
        else:
            target[path[-1]] = value
        return sd

    error = good["compression"]["error_dict"][0]
    cases = {
        "missing_key": (["compression", "q_memory_dict"], _DELETE),
        "iter": (["compression", "iter"], -1),
        "bucket_index": (["compression", "error_dict"], {5: error}),
        "shape": (["compression", "error_dict"], {0: error[:-1]}),
        "dtype": (["compression", "error_dict"], {0: error.double()}),
        "p_shape": (["compression", "p_memory_dict", 0], torch.zeros(3)),
        "p_without_q": (["compression", "q_memory_dict"], {}),
        "rng_key": (["compression", "rng", "key"], torch.zeros(10, dtype=torch.int64)),
        "rng_pos": (["compression", "rng", "pos"], 700),
    }
    out = {}
    for name, (path, value) in cases.items():
        try:
            opt.load_state_dict(changed(path, value))
        except ValueError as exc:
            out[name] = str(exc)
        else:
            out[name] = "no error"
    after = io.BytesIO()
    torch.save(whole_state_dict(opt), after)
    out["unchanged"] = before.getvalue() == after.getvalue()
    opt.close()
    complex_param = torch.nn.Parameter(torch.zeros(4, 4, dtype=torch.complex64))
    try:
        DataParallelOptimizer(torch.optim.SGD, [complex_param], lr=0.1, compression=PowerSGD())
    except ValueError as exc:
        out["complex"] = str(exc)
    return out


_DELETE = object()


def state_world(rank: int, world_size: int, path: str) -> Dict[str, Any]:
    """``resumed``, ``refused_states`` and ``sent_bytes`` in one world."""
    return {
        "resumed": resumed(rank, world_size, path, saved_at=5, steps=10),
        "refused": refused_states(rank, world_size),
        "bytes": sent_bytes(rank, world_size, steps=5),
    }
