"""Rank-side scenarios for the feature tests (bytes, compression, accumulation, failures,
state, clipping, RoundRobin, checkpoints, subgroups). Each returns plain data; see
``tests.parallel.training`` for the shared model and data."""
import contextlib
import json
import os
import shutil
import time
from typing import Any, Dict, Iterator, List

import torch
import torch.distributed as dist

from distopt.parallel import Cast, DataParallelOptimizer, PowerSGD, RoundRobin, Threshold, TopK
from distopt.parallel import compression as compression_module
from distopt.parallel.sync import partition
from tests.helpers import identical
from tests.parallel import trace_scenarios
from tests.parallel.training import (
    whole_state_dict,
    COMPLEX_CASES,
    SMALL_BUCKETS_MB,
    ZERO_GRAD_CASES,
    Branchy,
    ComplexModel,
    data,
    eager_class,
    flat_params,
    loss_of,
    make_model,
    train_complex,
    train_unused,
)


def wchar() -> int:
    with open("/proc/self/io") as f:
        for line in f:
            if line.startswith("wchar"):
                return int(line.split()[1])
    raise RuntimeError("no wchar in /proc/self/io")


# ---------------------------------------------------------------- bytes per step


def bytes_per_step(rank: int, world_size: int) -> Dict[str, Any]:
    """Measured (wchar) and modelled payload bytes of one training step per configuration."""
    torch.manual_seed(0)
    x = torch.randn(8, 1000)
    out: Dict[str, Any] = {}
    configs = {
        "plain": {},
        "fp16": {"compression": Cast(torch.float16)},
        "bf16": {"compression": Cast(torch.bfloat16)},
        "topk": {"compression": TopK(0.01)},
        "roundrobin": {"sync": RoundRobin(2)},
        "shard-param": {"shard": "param"},
        "shard-flat": {"shard": "flat"},
        "shard-flat-bf16": {"shard": "flat", "compression": Cast(torch.bfloat16)},
        "complex": {},
        "complex-bf16": {"compression": Cast(torch.bfloat16)},
    }
    for name, options in configs.items():
        torch.manual_seed(0)
        dtype = torch.complex64 if name.startswith("complex") else torch.float32
        model = torch.nn.Sequential(torch.nn.Linear(1000, 1000, dtype=dtype),
                                    torch.nn.Linear(1000, 1000, dtype=dtype))
        opt = DataParallelOptimizer(torch.optim.Adam, model.parameters(), lr=1e-3,
                                    bucket_cap_mb=3.0, **options)
        measured, modelled = [], []
        for step in range(6):
            dist.barrier()
            before = wchar()
            model(x.to(dtype)).abs().square().mean().backward()
            opt.step()
            after = wchar()
            opt.zero_grad()
            if step == 0:
                continue  # the first step creates the state (RoundRobin averages it too)
            measured.append(after - before)
            if name == "roundrobin":
                members = opt._engine.partitions[(opt._engine.round - 1) % 2]
                numel = sum(opt._engine.trained[m].numel() for m in members)
                # Parameter + exp_avg + exp_avg_sq, one all_reduce.
                modelled.append(2.0 * (world_size - 1) / world_size * numel * 3 * 4)
            else:
                modelled.append(opt.bytes_per_step())
        out[name] = {"measured": measured, "modelled": modelled, "buckets": len(opt._engine.buckets)}
        opt.close()
    return out


# ---------------------------------------------------------------- compression


def error_feedback(rank: int, world_size: int, scheme: str, overlap: bool) -> Dict[str, Any]:
    """Residual + everything sent == the sum of this rank's gradients, per parameter."""
    model = make_model()
    params = list(model.parameters())
    compression = TopK(0.1) if scheme == "topk" else Threshold(0.02)
    opt = DataParallelOptimizer(torch.optim.SGD, params, lr=0.05, compression=compression,
                                bucket_cap_mb=SMALL_BUCKETS_MB, overlap=overlap)
    sent = {b.index: torch.zeros(b.numel) for b in opt._engine.buckets}
    counts = []

    def record(index, indices, values):
        sent[index].index_add_(0, indices, values)
        counts.append(indices.numel())

    compression_module.sent_hook = record
    x, y = data(8 * world_size, seed=3)
    xs, ys = x.chunk(world_size)[rank], y.chunk(world_size)[rank]
    total = [torch.zeros_like(p) for p in params]
    try:
        for step in range(8):
            b = slice(step % 4, None, 1)
            loss = loss_of(model, xs[b], ys[b])
            grads = torch.autograd.grad(loss, params, retain_graph=True)
            total = [t + g for t, g in zip(total, grads)]
            loss.backward()
            opt.step()
            opt.zero_grad()
    finally:
        compression_module.sent_hook = None
    residuals = whole_state_dict(opt)["residuals"]
    index = {id(p): i for i, p in enumerate(params)}
    worst = 0.0
    for bucket in opt._engine.buckets:
        offset = 0
        for p in bucket.params:
            i = index[id(p)]
            part = sent[bucket.index][offset:offset + p.numel()].view(p.shape)
            worst = max(worst, float((residuals[i] + part - total[i]).abs().max()))
            offset += p.numel()
    scale = max(float(t.abs().max()) for t in total)
    return {"worst": worst, "scale": scale, "counts": counts,
            "residual_norm": float(sum(r.norm() for r in residuals.values()))}


def topk_convergence(rank: int, world_size: int, steps: int) -> Dict[str, float]:
    """Final whole-data loss of dense and TopK(0.01)-with-error-feedback runs."""
    g = torch.Generator().manual_seed(5)
    x = torch.randn(1024, 32, generator=g)
    w = torch.randn(32, 1, generator=g) / 4
    y = torch.tanh(x @ w) + 0.1 * torch.randn(1024, 1, generator=g)
    xs, ys = x.chunk(world_size)[rank], y.chunk(world_size)[rank]
    out = {}
    for name, compression in (("dense", None), ("topk", TopK(0.01))):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.Tanh(),
                                    torch.nn.Linear(64, 1))
        opt = DataParallelOptimizer(torch.optim.SGD, model.parameters(), lr=0.1,
                                    compression=compression)
        for _ in range(steps):
            loss_of(model, xs, ys).backward()
            opt.step()
            opt.zero_grad()
        with torch.no_grad():
            out[name] = float(loss_of(model, x, y))
        opt.close()
    return out


def cast_exact(rank: int, world_size: int, dtype_name: str) -> Dict[str, Any]:
    """Cast: the averaged gradient equals each rank's gradient divided, cast and summed."""
    dtype = getattr(torch, dtype_name)
    model = make_model()
    opt = DataParallelOptimizer(torch.optim.SGD, model.parameters(), lr=0.0,
                                compression=Cast(dtype), bucket_cap_mb=SMALL_BUCKETS_MB)
    x, y = data(4 * world_size)
    # Scaled so that a float16 sum of the undivided gradients would overflow.
    loss = loss_of(model, x.chunk(world_size)[rank], y.chunk(world_size)[rank]) * 4e4
    local = torch.autograd.grad(loss, list(model.parameters()), retain_graph=True)
    loss.backward()
    opt.step()
    return {"local": [g.clone() for g in local],
            "reduced": [p.grad.clone() for p in model.parameters()]}


# ---------------------------------------------------------------- accumulation


def accumulation(rank: int, world_size: int) -> Dict[str, Any]:
    """backward_passes_per_step=3, no_sync, and a step after fewer passes."""
    x, y = data(6 * world_size * 4, seed=7)
    micro = list(zip(x.chunk(6 * world_size * 4), y.chunk(6 * world_size * 4)))
    out: Dict[str, Any] = {}

    def batches(step: int, passes: int):
        # Step s, rank r, pass n -> micro-batch; one process sees them all.
        return [micro[(step * world_size + rank) * 3 + n] for n in range(passes)]

    for name in ("passes", "no_sync", "short"):
        model = make_model()
        n = 3 if name != "no_sync" else 1
        opt = DataParallelOptimizer(torch.optim.Adam, model.parameters(), lr=1e-2,
                                    backward_passes_per_step=n, bucket_cap_mb=SMALL_BUCKETS_MB)
        for step in range(4):
            passes = 2 if name == "short" and step % 2 else 3
            mbs = batches(step, passes)
            for k, (xb, yb) in enumerate(mbs):
                if name == "no_sync" and k < passes - 1:
                    with opt.no_sync():
                        (loss_of(model, xb, yb) / 3).backward()
                else:
                    (loss_of(model, xb, yb) / 3).backward()
            opt.step()
            opt.zero_grad()
        out[name] = flat_params(model)
        opt.close()
        if rank == 0:
            ref = make_model()
            ropt = torch.optim.Adam(ref.parameters(), lr=1e-2)
            for step in range(4):
                passes = 2 if name == "short" and step % 2 else 3
                for r in range(world_size):
                    for k in range(passes):
                        xb, yb = micro[(step * world_size + r) * 3 + k]
                        (loss_of(ref, xb, yb) / 3 / world_size).backward()
                ropt.step()
                ropt.zero_grad()
            out[name + "_reference"] = flat_params(ref)
    return out


def extra_pass(rank: int, world_size: int) -> str:
    """A backward pass after the reduction and before step() raises, naming the fix."""
    model = make_model()
    opt = DataParallelOptimizer(torch.optim.SGD, model.parameters(), lr=0.1)
    x, y = data(4)
    loss_of(model, x, y).backward()
    try:
        loss_of(model, x, y).backward()
    except RuntimeError as exc:
        message = str(exc)
    else:
        message = ""
    opt.step()
    return message


# ---------------------------------------------------------------- unused parameters


def unused_parameters(rank: int, world_size: int) -> Dict[str, Any]:
    """A layer only rank 0 uses and one no rank uses."""
    torch.manual_seed(0)
    trunk = torch.nn.Linear(6, 4)
    only_rank0 = torch.nn.Linear(4, 1)
    never = torch.nn.Linear(4, 1)
    head = torch.nn.Linear(4, 1)
    params = [*trunk.parameters(), *only_rank0.parameters(), *never.parameters(),
              *head.parameters()]
    start_never = [p.detach().clone() for p in never.parameters()]
    opt = DataParallelOptimizer(torch.optim.Adam, params, lr=1e-2, weight_decay=0.1,
                                bucket_cap_mb=SMALL_BUCKETS_MB)
    x, y = data(8, seed=2)
    xs, ys = x.chunk(world_size)[rank], y.chunk(world_size)[rank]

    def loss_for(r, xb, yb):
        h = torch.tanh(trunk(xb))
        out = head(h) + (only_rank0(h) if r == 0 else 0)
        return ((out - yb) ** 2).mean()

    for _ in range(5):
        loss_for(rank, xs, ys).backward()
        opt.step()
        opt.zero_grad(set_to_none=False)
    result = {
        "never_equal": all(torch.equal(a, b) for a, b in zip(start_never, never.parameters())),
        "never_grad_none": all(p.grad is None for p in never.parameters()),
        "params": torch.cat([p.detach().reshape(-1) for p in params]),
    }
    if rank == 0:
        torch.manual_seed(0)
        r_trunk, r_only, r_never, r_head = (torch.nn.Linear(6, 4), torch.nn.Linear(4, 1),
                                            torch.nn.Linear(4, 1), torch.nn.Linear(4, 1))
        r_params = [*r_trunk.parameters(), *r_only.parameters(), *r_never.parameters(),
                    *r_head.parameters()]
        ropt = torch.optim.Adam(r_params, lr=1e-2, weight_decay=0.1)
        for _ in range(5):
            for r in range(world_size):
                h = torch.tanh(r_trunk(x.chunk(world_size)[r]))
                out = r_head(h) + (r_only(h) if r == 0 else 0)
                (((out - y.chunk(world_size)[r]) ** 2).mean() / world_size).backward()
            ropt.step()
            ropt.zero_grad()
        result["reference"] = torch.cat([p.detach().reshape(-1) for p in r_params])
    return result


#: DataParallelOptimizer's runs: its options, and the DDP + torch.optim run it must equal.
ZERO_GRAD_RUNS = {
    "overlap": ({}, "ddp"),
    "no-overlap": ({"overlap": False}, "ddp"),
    "shard-param": ({"shard": "param"}, "ddp"),
    "shard-flat": ({"shard": "flat"}, "ddp"),
    "eager": ({}, "ddp"),
    "bf16": ({"compression": Cast(torch.bfloat16)}, "ddp-bf16"),
    "passes": ({"backward_passes_per_step": 2}, "ddp-no_sync"),
    "no_sync": ({}, "ddp-no_sync"),
}


def zero_grads_of_unused(rank: int, world_size: int) -> Dict[str, Any]:
    """``zero_grad(set_to_none=False)`` and a layer no rank uses in some steps: every
    ``ZERO_GRAD_RUNS`` run of DataParallelOptimizer and the DDP
    (``find_unused_parameters=True``) + torch.optim runs, per ``ZERO_GRAD_CASES`` case."""
    from torch.nn.parallel import DistributedDataParallel

    from distopt.parallel import compression_hook

    out: Dict[str, Any] = {}
    for case, (cls, kwargs) in ZERO_GRAD_CASES.items():
        for name in ("ddp", "ddp-bf16", "ddp-no_sync"):
            model = Branchy(never=True)
            ddp = DistributedDataParallel(model, find_unused_parameters=True)
            if name == "ddp-bf16":
                ddp.register_comm_hook(*compression_hook(Cast(torch.bfloat16)))
            opt = cls(model.parameters(), **kwargs)
            passes = 2 if name == "ddp-no_sync" else 1
            out[f"{case}/{name}"] = train_unused(model, ddp, opt, rank, passes, ddp.no_sync)
        for name, (options, _) in ZERO_GRAD_RUNS.items():
            model = Branchy(never=True)
            opt = DataParallelOptimizer(eager_class(cls) if name == "eager" else cls,
                                        model.parameters(), bucket_cap_mb=SMALL_BUCKETS_MB,
                                        **options, **kwargs)
            passes = 2 if name in ("passes", "no_sync") else 1
            quiet = opt.no_sync if name == "no_sync" else None
            out[f"{case}/{name}"] = train_unused(model, model, opt, rank, passes, quiet)
            opt.close()
    return out


def ddp_semantics(rank: int, world_size: int) -> Dict[str, Any]:
    """What DDP + torch.optim does, in one world: parameters some or no rank used, the zero
    gradients of unused layers, complex parameters, the GradScaler recipe, buffers, uneven
    inputs under Join (and, last, as it breaks a group of its own, uneven inputs without)."""
    from tests.parallel import buffer_join_scenarios
    from tests.parallel.scaler_scenarios import grad_scaler

    return {"unused": unused_parameters(rank, world_size),
            "zero_grads": zero_grads_of_unused(rank, world_size),
            "complex": complex_parameters(rank, world_size),
            "grad_scaler": grad_scaler(rank, world_size),
            "buffers": buffer_join_scenarios.buffers_like_ddp(rank, world_size),
            "join": buffer_join_scenarios.join_like_ddp(rank, world_size),
            "uneven": buffer_join_scenarios.uneven_without_join(rank, world_size)}


# ---------------------------------------------------------------- complex parameters


#: DataParallelOptimizer's runs on complex parameters (each against DDP + torch.optim).
COMPLEX_RUNS = {
    "overlap": {},
    "no-overlap": {"overlap": False},
    "shard-param": {"shard": "param"},
    "shard-flat": {"shard": "flat"},
    "eager": {},
}


def complex_parameters(rank: int, world_size: int) -> Dict[str, Any]:
    """A model with complex64 and complex128 parameters: DataParallelOptimizer (every
    ``COMPLEX_RUNS`` run) and DDP + torch.optim per ``COMPLEX_CASES`` case; Cast(bfloat16)'s
    averages; RoundRobin's averaged state; the compressions that refuse complex."""
    from torch.nn.parallel import DistributedDataParallel

    out: Dict[str, Any] = {}
    for case, (cls, kwargs) in COMPLEX_CASES.items():
        model = ComplexModel()
        opt = cls(model.parameters(), **kwargs)
        out[f"{case}/ddp"] = train_complex(model, DistributedDataParallel(model), opt, rank)
        for name, options in COMPLEX_RUNS.items():
            model = ComplexModel()
            opt = DataParallelOptimizer(eager_class(cls) if name == "eager" else cls,
                                        model.parameters(), bucket_cap_mb=SMALL_BUCKETS_MB,
                                        **options, **kwargs)
            if name == "shard-flat":
                out["flat_cut_inside_complex"] = any(
                    pc.stop - pc.start < b.params[pc.slot].numel()
                    for b in opt._engine.buckets for pc in b.shard.own if b.dtype.is_complex
                )
            out[f"{case}/{name}"] = train_complex(model, model, opt, rank)
            opt.close()

    # Cast(bfloat16): each part of a complex gradient halved, cast and summed.
    model = ComplexModel()
    opt = DataParallelOptimizer(torch.optim.SGD, model.parameters(), lr=0.0, overlap=False,
                                compression=Cast(torch.bfloat16), bucket_cap_mb=SMALL_BUCKETS_MB)
    x, y = data(4, seed=90 + rank)
    loss = ((model(x) - y) ** 2).mean()
    out["cast_local"] = [g.clone() for g in torch.autograd.grad(loss, list(model.parameters()),
                                                               retain_graph=True)]
    loss.backward()
    opt.step()
    out["cast_reduced"] = [p.grad.clone() for p in model.parameters()]
    out["cast_bytes"] = opt.bytes_per_step()
    out["cast_buckets"] = [(b.numel, len(b.params), b.dtype) for b in opt._engine.buckets]
    opt.close()

    # RoundRobin(1): the complex momentum buffers are averaged with their parameters.
    model = ComplexModel()
    opt = DataParallelOptimizer(torch.optim.SGD, model.parameters(), lr=0.05, momentum=0.9,
                                sync=RoundRobin(1))
    train_complex(model, model, opt, rank, steps=2)
    out["round_robin_state"] = whole_state_dict(opt)["state"]
    opt.close()

    params = ComplexModel().parameters
    out["refused"] = {
        name: _error_of(lambda c=compression: DataParallelOptimizer(
            torch.optim.SGD, params(), lr=0.1, compression=c), ValueError)
        for name, compression in (("topk", TopK(0.5)), ("threshold", Threshold(0.1)),
                                  ("powersgd", PowerSGD()))
    }
    return out


# ---------------------------------------------------------------- failures


class _RaiseOnRank(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, should_raise):
        ctx.should_raise = should_raise
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        if ctx.should_raise:
            raise ValueError("injected failure in backward")
        return grad, None


def raise_in_backward(rank: int, world_size: int, done: Any) -> Dict[str, Any]:
    """Rank 1 raises inside backward at step 2 and stays alive; the others' step fails."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Linear(8, 8),
                                torch.nn.Linear(8, 1))
    opt = DataParallelOptimizer(torch.optim.SGD, model.parameters(), lr=0.1,
                                bucket_cap_mb=SMALL_BUCKETS_MB)
    x, y = data(8)
    started = time.monotonic()
    try:
        for step in range(4):
            h = model[0](x)
            h = _RaiseOnRank.apply(h, rank == 1 and step == 2)
            loss = ((model[2](model[1](h)) - y) ** 2).mean()
            started = time.monotonic()
            loss.backward()
            opt.step()
            opt.zero_grad()
    except Exception as exc:  # what the user sees
        result = {"error": f"{type(exc).__name__}: {exc}", "seconds": time.monotonic() - started}
    else:
        result = {"error": "", "seconds": time.monotonic() - started}
    if rank == 1:
        done.wait(120)  # alive, silent, until the other ranks have reported
    else:
        done.set()
    return result


def aborts(rank: int, world_size: int) -> None:
    """Rank 1 aborts (as a C++ std::terminate would); rank 0 waits in a barrier."""
    if rank == 1:
        os.abort()
    dist.barrier()


def dies(rank: int, world_size: int) -> Dict[str, Any]:
    """Rank 1 exits at step 2; rank 0's step fails naming itself and the bucket."""
    model = make_model()
    opt = DataParallelOptimizer(torch.optim.Adam, model.parameters(), lr=1e-2,
                                bucket_cap_mb=SMALL_BUCKETS_MB)
    x, y = data(8)
    started = time.monotonic()
    try:
        for step in range(4):
            if rank == 1 and step == 2:
                os._exit(3)
            started = time.monotonic()
            loss_of(model, x, y).backward()
            opt.step()
            opt.zero_grad()
    except Exception as exc:
        first = f"{type(exc).__name__}: {exc}"
        try:
            opt.step()
        except Exception as again:
            second = f"{type(again).__name__}: {again}"
        import tempfile
        try:
            opt.save(tempfile.mkdtemp())
            saved = "no error"
        except Exception as exc_save:
            saved = f"{type(exc_save).__name__}: {exc_save}"
        return {"error": first, "again": second, "save": saved,
                "seconds": time.monotonic() - started}
    return {"error": "", "seconds": 0.0}


# ---------------------------------------------------------------- bad arguments


#: The methods of a process group that issue a collective or point-to-point operation: what
#: every torch.distributed function calls (all_gather -> allgather, all_gather_object ->
#: allgather, all_gather_into_tensor -> _allgather_base or all_gather_single, ...), however
#: the library spells it. Those the installed torch lacks are left out.
ISSUING = tuple(n for n in (
    "allreduce", "allreduce_coalesced", "allgather", "allgather_coalesced",
    "allgather_into_tensor_coalesced", "_allgather_base", "all_gather_single",
    "all_gather_single_coalesced", "broadcast", "reduce", "reduce_scatter",
    "_reduce_scatter_base", "reduce_scatter_single", "reduce_scatter_single_coalesced",
    "reduce_scatter_tensor_coalesced", "gather", "scatter", "alltoall", "alltoall_base",
    "all_to_all_single", "barrier", "monitored_barrier", "send", "recv", "recv_anysource",
) if hasattr(dist.ProcessGroup, n))


@contextlib.contextmanager
def collectives_issued(issued: List[str]) -> Iterator[None]:
    """Inside, each collective any process group issues is appended to ``issued`` by its
    method's name, and each group made (``new_group`` needs every rank) as "new_group";
    the originals are back on leaving."""
    # What each name is bound to as stored (a pybind method's own descriptor, which passes
    # ``self``; ``getattr`` on the class gives the bare function, which would not).
    patched = [(owner, name, owner.__dict__.get(name, _ABSENT), getattr(owner, name))
               for owner, names in ((dist.ProcessGroup, ISSUING), (dist, ("new_group",)))
               for name in names]

    def counting(real: Any, name: str) -> Any:
        def issue(*args: Any, **kwargs: Any) -> Any:
            issued.append(name)
            return real(*args, **kwargs)
        return issue

    try:
        for owner, name, _, real in patched:
            setattr(owner, name, counting(real, name))
        yield
    finally:
        for owner, name, stored, _ in patched:
            if stored is _ABSENT:  # inherited: the class's own entry goes
                delattr(owner, name)
            else:
                setattr(owner, name, stored)


_ABSENT = object()


def bad_arguments(rank: int, world_size: int) -> Dict[str, str]:
    """Each bad argument's exception, and the collectives issued while raising it (none:
    counted where every one passes, at the process groups' methods, and by the default
    group's own count of the collectives it ran)."""
    issued: List[str] = []
    with collectives_issued(issued):
        return _bad_arguments(rank, world_size, issued)


def _ran(group: Any) -> int:
    """How many collectives ``group`` has run (gloo numbers each one)."""
    return group._get_sequence_number_for_group()


def _bad_arguments(rank: int, world_size: int, issued: List[str]) -> Dict[str, str]:
    world = dist.group.WORLD
    model = make_model()
    params = list(model.parameters())
    pair = dist.new_group([0, 1]) if world_size > 2 else None
    cases = {
        "class_int": lambda: DataParallelOptimizer(int, params),
        "lbfgs": lambda: DataParallelOptimizer(torch.optim.LBFGS, params),
        "sparse_adam": lambda: DataParallelOptimizer(torch.optim.SparseAdam, params),
        "cap_zero": lambda: DataParallelOptimizer(torch.optim.SGD, params, bucket_cap_mb=0),
        "cap_nan": lambda: DataParallelOptimizer(torch.optim.SGD, params,
                                                 bucket_cap_mb=float("nan")),
        "cap_str": lambda: DataParallelOptimizer(torch.optim.SGD, params, bucket_cap_mb="25"),
        "compression_str": lambda: DataParallelOptimizer(torch.optim.SGD, params,
                                                         compression="topk"),
        "topk_zero": lambda: TopK(0.0),
        "topk_big": lambda: TopK(1.5),
        "topk_str": lambda: TopK("0.1"),
        "topk_feedback": lambda: TopK(0.1, error_feedback=1),
        "threshold_negative": lambda: Threshold(-1.0),
        "threshold_inf": lambda: Threshold(float("inf")),
        "cast_float64": lambda: Cast(torch.float64),
        "k_zero": lambda: RoundRobin(0),
        "k_float": lambda: RoundRobin(1.5),
        "passes_zero": lambda: DataParallelOptimizer(torch.optim.SGD, params,
                                                     backward_passes_per_step=0),
        "passes_bool": lambda: DataParallelOptimizer(torch.optim.SGD, params,
                                                     backward_passes_per_step=True),
        "sync_str": lambda: DataParallelOptimizer(torch.optim.SGD, params, sync="roundrobin"),
        "sync_and_compression": lambda: DataParallelOptimizer(
            torch.optim.SGD, params, sync=RoundRobin(2), compression=TopK(0.1)),
        "overlap_str": lambda: DataParallelOptimizer(torch.optim.SGD, params, overlap="yes"),
        "group_str": lambda: DataParallelOptimizer(torch.optim.SGD, params, process_group="g"),
        "no_params": lambda: DataParallelOptimizer(torch.optim.SGD, []),
        "tensor_params": lambda: DataParallelOptimizer(torch.optim.SGD, params[0]),
        "lr_negative": lambda: DataParallelOptimizer(torch.optim.SGD, params, lr=-1.0),
        "unknown_kwarg": lambda: DataParallelOptimizer(torch.optim.Adam, params, bogus=1),
        "lr_kind": lambda: DataParallelOptimizer(torch.optim.Adam, params, lr="fast"),
        "not_member": lambda: DataParallelOptimizer(torch.optim.SGD, params, process_group=pair),
        "duplicate": lambda: DataParallelOptimizer(torch.optim.SGD, [params[0], params[1],
                                                                     params[0]]),
        "duplicate_across_groups": lambda: DataParallelOptimizer(
            torch.optim.SGD, [{"params": [params[0]]}, {"params": [params[1], params[0]]}]),
        "module_not_module": lambda: DataParallelOptimizer(torch.optim.SGD, params,
                                                           module=params[0]),
        "module_other_model": lambda: DataParallelOptimizer(torch.optim.SGD, params,
                                                            module=make_model()),
        "module_trained_outside": lambda: DataParallelOptimizer(torch.optim.SGD, params[:2],
                                                                module=model),
        "broadcast_buffers_str": lambda: DataParallelOptimizer(
            torch.optim.SGD, params, module=model, broadcast_buffers="yes"),
        # the model for its parameters, an optimizer for its class: one line naming the fix
        "model_as_params": lambda: DataParallelOptimizer(torch.optim.AdamW, model),
        "optimizer_instance": lambda: DataParallelOptimizer(torch.optim.AdamW(params), params),
    }
    out = {}
    for name, make in cases.items():
        if name == "not_member" and (pair is None or rank < 2):
            continue
        before, ran = len(issued), _ran(world)
        try:
            make()
        except (TypeError, ValueError) as exc:
            out[name] = f"{type(exc).__name__}: {exc}"
        else:
            out[name] = "no error"
        if len(issued) != before or _ran(world) != ran:
            out[name] += f" (issued {issued[before:]}, {_ran(world) - ran} on the default group)"
    # A sparse gradient with compression: ValueError from backward, before any collective.
    emb = torch.nn.Embedding(10, 3, sparse=True)
    opt = DataParallelOptimizer(torch.optim.SGD, emb.parameters(), lr=0.1, compression=TopK(0.5))
    before = len(issued)
    try:
        emb(torch.tensor([1, 2])).sum().backward()
    except ValueError as exc:
        out["sparse_gradient"] = f"ValueError: {exc}"
    else:
        out["sparse_gradient"] = "no error"
    opt.close()
    if len(issued) != before:
        out["sparse_gradient"] += f" (issued {issued[before:]})"
    return out


# ---------------------------------------------------------------- torch.optim integration


def integration(rank: int, world_size: int) -> Dict[str, Any]:
    """lr schedulers, HyperparameterScheduler, step hooks, state_dict both ways."""
    from distopt.schedule import HyperparameterScheduler

    x, y = data(4 * world_size, seed=11)
    xs, ys = x.chunk(world_size)[rank], y.chunk(world_size)[rank]
    out: Dict[str, Any] = {}

    def train(opt, model, scheds, steps, batch_x, batch_y, scale=1.0):
        for _ in range(steps):
            (loss_of(model, batch_x, batch_y) * scale).backward()
            opt.step()
            opt.zero_grad()
            for s in scheds:
                s.step()

    # 1. OneCycleLR cycling SGD's momentum + weight_decay scheduled by HyperparameterScheduler.
    model = make_model()
    opt = DataParallelOptimizer(torch.optim.SGD, model.parameters(), lr=0.05, momentum=0.9,
                                weight_decay=1e-2, bucket_cap_mb=SMALL_BUCKETS_MB)
    calls = []
    opt.register_step_pre_hook(lambda o, a, k: calls.append("pre"))
    opt.register_step_post_hook(lambda o, a, k: calls.append("post"))
    scheds = [torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.1, total_steps=12),
              HyperparameterScheduler(opt, "weight_decay", lambda e: 0.8 ** e)]
    train(opt, model, scheds, 10, xs, ys)
    out["schedules"] = flat_params(model)
    out["hooks"] = calls
    out["momentum"] = opt.param_groups[0]["momentum"]
    if rank == 0:
        ref = make_model()
        ropt = torch.optim.SGD(ref.parameters(), lr=0.05, momentum=0.9, weight_decay=1e-2)
        rs = [torch.optim.lr_scheduler.OneCycleLR(ropt, max_lr=0.1, total_steps=12),
              HyperparameterScheduler(ropt, "weight_decay", lambda e: 0.8 ** e)]
        train(ropt, ref, rs, 10, x, y)
        out["schedules_reference"] = flat_params(ref)
        out["momentum_reference"] = ropt.param_groups[0]["momentum"]

    # 2. state_dict: DataParallelOptimizer -> torch.optim -> DataParallelOptimizer.
    model = make_model()
    opt = DataParallelOptimizer(torch.optim.Adam, model.parameters(), lr=1e-2, amsgrad=True,
                                bucket_cap_mb=SMALL_BUCKETS_MB)
    train(opt, model, [], 3, xs, ys)
    sd = whole_state_dict(opt)
    out["state_keys"] = sorted(sd["state"][0])
    local = make_model()
    with torch.no_grad():
        for p, q in zip(local.parameters(), model.parameters()):
            p.copy_(q)
    lopt = torch.optim.Adam(local.parameters(), lr=1e-2, amsgrad=True)
    lopt.load_state_dict(sd)
    train(lopt, local, [], 3, x, y)
    train(opt, model, [], 3, xs, ys)
    out["continued"] = flat_params(model)
    out["continued_reference"] = flat_params(local)
    fresh_model = make_model(seed=9)
    with torch.no_grad():
        for p, q in zip(fresh_model.parameters(), local.parameters()):
            p.copy_(q)
    fresh = DataParallelOptimizer(torch.optim.Adam, fresh_model.parameters(), lr=1e-2,
                                  amsgrad=True, bucket_cap_mb=SMALL_BUCKETS_MB)
    fresh.load_state_dict(lopt.state_dict())
    train(fresh, fresh_model, [], 2, xs, ys)
    train(lopt, local, [], 2, x, y)
    out["loaded"] = flat_params(fresh_model)
    out["loaded_reference"] = flat_params(local)
    # A state_dict of the wrong shape changes nothing.
    bad = lopt.state_dict()
    bad["state"][0]["exp_avg"] = torch.zeros(3)
    before = whole_state_dict(fresh)
    try:
        fresh.load_state_dict(bad)
    except ValueError as exc:
        out["bad_state"] = str(exc)
    after = whole_state_dict(fresh)
    out["bad_state_unchanged"] = all(
        torch.equal(before["state"][i][k], after["state"][i][k])
        for i in before["state"] for k in before["state"][i]
    )
    try:
        opt.param_groups[0]["amsgrad"] = False
        loss_of(model, xs, ys).backward()
    except ValueError as exc:
        out["fixed_key"] = str(exc)
    # 3. What a user's torch.profiler trace shows of the steps (tests.parallel.trace_scenarios).
    out["traces"] = trace_scenarios.profiled(rank, world_size)
    return out


def clipping(rank: int, world_size: int) -> Dict[str, Any]:
    """clip_grad_norm_ on the averaged gradients (overlap=False), refused with overlap."""
    x, y = data(4 * world_size, seed=4)
    xs, ys = x.chunk(world_size)[rank], y.chunk(world_size)[rank]
    model = make_model()
    opt = DataParallelOptimizer(torch.optim.SGD, model.parameters(), lr=0.1, momentum=0.9,
                                overlap=False, bucket_cap_mb=SMALL_BUCKETS_MB)
    norms = []
    for _ in range(5):
        loss_of(model, xs, ys).backward()
        norms.append(float(opt.clip_grad_norm_(0.05)))
        opt.step()
        opt.zero_grad()
    out: Dict[str, Any] = {"params": flat_params(model), "norms": norms}
    if rank == 0:
        ref = make_model()
        ropt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
        rnorms = []
        for _ in range(5):
            loss_of(ref, x, y).backward()
            rnorms.append(float(torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.05)))
            ropt.step()
            ropt.zero_grad()
        out["reference"] = flat_params(ref)
        out["reference_norms"] = rnorms
    model = make_model()
    overlapped = DataParallelOptimizer(torch.optim.SGD, model.parameters(), lr=0.1)
    for step in range(2):  # the first step waits for step() (a GradScaler may take it)
        loss_of(model, xs, ys).backward()
        if step == 1:
            try:
                overlapped.clip_grad_norm_(1.0)
            except RuntimeError as exc:
                out["overlap_error"] = str(exc)
        overlapped.step()
        overlapped.zero_grad()
    overlapped.close()
    # RoundRobin: the norm of every rank's gradients together, the same on each rank.
    model = make_model()
    rr = DataParallelOptimizer(torch.optim.SGD, model.parameters(), lr=0.1, sync=RoundRobin(2))
    loss_of(model, xs, ys).backward()
    local = float(torch.nn.utils.get_total_norm([p.grad for p in model.parameters()]))
    out["rr_norm"] = float(rr.clip_grad_norm_(1e-3))
    out["rr_local"] = local
    return out


# ---------------------------------------------------------------- RoundRobin


def round_robin(rank: int, world_size: int, k: int) -> Dict[str, Any]:
    """Local Adam steps, one partition averaged per step; rank 0 simulates every rank."""
    x, y = data(4 * world_size, seed=6)
    model = make_model()
    opt = DataParallelOptimizer(torch.optim.Adam, model.parameters(), lr=1e-2,
                                sync=RoundRobin(k))
    synced_equal = []
    for step in range(6):
        loss_of(model, x.chunk(world_size)[rank], y.chunk(world_size)[rank]).backward()
        opt.step()
        opt.zero_grad()
        synced_equal.append([m for m in opt._engine.partitions[step % k]])
    out: Dict[str, Any] = {"params": [p.detach().clone() for p in model.parameters()],
                           "partitions": opt._engine.partitions, "round": whole_state_dict(opt)["sync"]}
    if rank == 0:
        sims = [make_model() for _ in range(world_size)]
        opts = [torch.optim.Adam(s.parameters(), lr=1e-2) for s in sims]
        parts = partition(list(sims[0].parameters()), k)
        for step in range(6):
            for r, (s, o) in enumerate(zip(sims, opts)):
                loss_of(s, x.chunk(world_size)[r], y.chunk(world_size)[r]).backward()
                o.step()
                o.zero_grad()
            with torch.no_grad():
                for m in parts[step % k]:
                    ps = [list(s.parameters())[m] for s in sims]
                    mean = sum(p / world_size for p in ps)
                    for p in ps:
                        p.copy_(mean)
                    for key in ("exp_avg", "exp_avg_sq"):
                        ts = [o.state[p][key] for o, p in zip(opts, ps)]
                        mean = sum(t / world_size for t in ts)
                        for t in ts:
                            t.copy_(mean)
        out["reference"] = [[p.detach().clone() for p in s.parameters()] for s in sims]
    return out


# ---------------------------------------------------------------- checkpoints


def checkpoint(rank: int, world_size: int, path: str) -> Dict[str, Any]:
    """save / load with TopK residuals: a resumed run equals the uninterrupted one."""
    x, y = data(4 * world_size, seed=8)
    xs, ys = x.chunk(world_size)[rank], y.chunk(world_size)[rank]

    def build(model):
        return DataParallelOptimizer(torch.optim.Adam, model.parameters(), lr=1e-2,
                                     compression=TopK(0.2), bucket_cap_mb=SMALL_BUCKETS_MB)

    def train(model, opt, steps):
        for _ in range(steps):
            loss_of(model, xs, ys).backward()
            opt.step()
            opt.zero_grad()

    model = make_model()
    opt = build(model)
    train(model, opt, 3)
    opt.save(path)
    saved = [p.detach().clone() for p in model.parameters()]
    train(model, opt, 3)
    out: Dict[str, Any] = {"uninterrupted": flat_params(model), "files": sorted(os.listdir(path))}
    resumed_model = make_model(seed=5)
    with torch.no_grad():
        for p, q in zip(resumed_model.parameters(), saved):
            p.copy_(q)
    resumed = build(resumed_model)
    resumed.load(path)
    train(resumed_model, resumed, 3)
    out["resumed"] = flat_params(resumed_model)
    # A second save replaces the first; a manifest of another class is refused everywhere.
    opt.save(path)
    out["files_after_second_save"] = sorted(os.listdir(path))
    other = DataParallelOptimizer(torch.optim.SGD, make_model().parameters(), lr=0.1)
    try:
        other.load(path)
    except ValueError as exc:
        out["other_class"] = str(exc)
    # A flipped byte in the state file, then a residuals file gone: refused on every rank,
    # naming the file, before anything changes.
    state = next(n for n in out["files_after_second_save"] if "-state-" in n)
    residuals = next(n for n in out["files_after_second_save"] if n.endswith("residuals-rank1.pt"))
    before = whole_state_dict(resumed)
    # Copies of the checkpoint whose manifest names a file outside it: refused on every
    # rank, naming the file, before anything changes (the files themselves are truthful).
    dist.barrier()
    copies = {case: plant_outside(path, case) if rank == 0 else f"{path}-{case}/ckpt"
              for case in PLANTED}
    dist.barrier()
    out["planted"] = {}
    for case, copy in copies.items():
        try:
            resumed.load(copy)
            out["planted"][case] = "loaded"
        except ValueError as exc:
            out["planted"][case] = str(exc)
    dist.barrier()
    if rank == 0:
        with open(os.path.join(path, state), "r+b") as f:
            f.seek(os.path.getsize(os.path.join(path, state)) // 2)
            byte = f.read(1)
            f.seek(-1, os.SEEK_CUR)
            f.write(bytes([byte[0] ^ 0x01]))
    dist.barrier()
    for what, damage in (("flipped", None), ("missing", residuals)):
        if damage is not None:
            dist.barrier()
            if rank == 0:
                os.rename(os.path.join(path, damage), os.path.join(path, damage + ".away"))
            dist.barrier()
        try:
            resumed.load(path)
        except ValueError as exc:
            out[what] = str(exc)
        if damage is None and rank == 0:
            with open(os.path.join(path, state), "r+b") as f:  # put the byte back
                f.seek(os.path.getsize(os.path.join(path, state)) // 2)
                f.write(byte)
    out["state_unchanged"] = identical(whole_state_dict(resumed), before)
    out["state_file"], out["residuals_file"] = state, residuals
    dist.barrier()
    if rank == 0:
        with open(os.path.join(path, "manifest.json"), "w") as f:
            f.write("{not json")
    dist.barrier()
    try:
        resumed.load(path)
    except ValueError as exc:
        out["corrupt"] = str(exc)
    return out


#: The file-name corruptions ``plant_outside`` makes.
PLANTED = ("..", "absolute", "symlink")


def plant_outside(path: str, case: str) -> str:
    """Copy the checkpoint in ``path`` to ``<path>-<case>/ckpt`` and make its manifest name a
    file outside the copy, with a truthful size and CRC-32; return the copy.

    ``..``: a generation ``/../../x``, which builds ``dp-/../../x-state-rank0.pt`` (a ``dp-``
    folder in the copy makes that path lead to ``<path>-<case>/x-state-rank0.pt``);
    ``absolute``: the state file's entry under an absolute name beside it;
    ``symlink``: the state file a symlink to a copy outside.
    """
    base = f"{path}-{case}"
    copy = os.path.join(base, "ckpt")
    shutil.copytree(path, copy)
    where = os.path.join(copy, "manifest.json")
    with open(where) as f:
        manifest = json.load(f)
    generation = manifest["generation"]
    state = next(n for n in manifest["files"] if "-state-" in n)
    if case == "..":
        os.mkdir(os.path.join(copy, "dp-"))
        files = {}
        for name, record in manifest["files"].items():
            rest = name[len(f"dp-{generation}-"):]
            os.rename(os.path.join(copy, name), os.path.join(base, f"x-{rest}"))
            files[f"dp-/../../x-{rest}"] = record
        manifest["generation"], manifest["files"] = "/../../x", files
    elif case == "absolute":
        shutil.copy(os.path.join(copy, state), os.path.join(base, "y.pt"))
        manifest["files"][os.path.join(base, "y.pt")] = dict(manifest["files"][state])
    else:
        os.rename(os.path.join(copy, state), os.path.join(base, state))
        os.symlink(os.path.join(base, state), os.path.join(copy, state))
    with open(where, "w") as f:
        json.dump(manifest, f)
    return copy


# ---------------------------------------------------------------- subgroups


def subgroups(rank: int, world_size: int) -> Dict[str, Any]:
    """Ranks {0, 1} and {2, 3} train apart on different data, each in its own group."""
    pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    mine = pairs[rank // 2]
    x, y = data(8, seed=20 + rank // 2)
    xs, ys = x.chunk(2)[rank % 2], y.chunk(2)[rank % 2]
    model = make_model()
    opt = DataParallelOptimizer(torch.optim.AdamW, model.parameters(), lr=1e-2,
                                process_group=mine, bucket_cap_mb=SMALL_BUCKETS_MB)
    for _ in range(5):
        loss_of(model, xs, ys).backward()
        opt.step()
        opt.zero_grad()
    out = {"params": flat_params(model), "group_rank": opt.rank, "group_size": opt.world_size}
    if rank % 2 == 0:
        ref = make_model()
        ropt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
        for _ in range(5):
            loss_of(ref, x, y).backward()
            ropt.step()
            ropt.zero_grad()
        out["reference"] = flat_params(ref)
    return out


def raise_everywhere_then_step(rank: int, world_size: int) -> Dict[str, Any]:
    """Every rank's backward raises at step 1 (caught); step() still completes, and
    training goes on in step on every rank (no bucket waits for ever)."""
    model = make_model()
    opt = DataParallelOptimizer(torch.optim.SGD, model.parameters(), lr=0.1,
                                bucket_cap_mb=SMALL_BUCKETS_MB)
    x, y = data(8)
    losses, errors = [], []
    for step in range(4):
        h = _RaiseOnRank.apply(model[0](x), step == 1)
        loss = ((model[4](model[3](model[2](model[1](h)))) - y) ** 2).mean()
        try:
            loss.backward()
        except ValueError as exc:
            errors.append(str(exc))
        opt.step()
        opt.zero_grad()
        losses.append(float(loss.detach()))
    return {"losses": losses, "errors": errors, "params": flat_params(model)}


# ---------------------------------------------------------------- misuse


class _SyncStat(torch.autograd.Function):
    """Subtracts half the batch mean over every rank, in forward and backward (collectives
    on the default group, issued on the thread running backward)."""

    @staticmethod
    def forward(ctx, x):
        mean = x.detach().mean(0, keepdim=True).clone()
        dist.all_reduce(mean)
        return x - mean / (2 * dist.get_world_size())

    @staticmethod
    def backward(ctx, grad):
        mean = grad.mean(0, keepdim=True).clone()
        dist.all_reduce(mean)
        return grad - mean / (2 * dist.get_world_size())


def _error_of(call, error):
    """The message of the ``error`` that ``call()`` raises, or "no error"."""
    try:
        call()
    except error as exc:
        return str(exc)
    return "no error"


def _train_reference(steps, x, y, lr=0.1, momentum=0.9, clip=None, lrs=None, edit=None):
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=momentum)
    for step in range(steps):
        loss_of(model, x, y).backward()
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        if edit is not None:
            edit(model, step)
        if lrs is not None:
            opt.param_groups[0]["lr"] = lrs[step]
        opt.step()
        opt.zero_grad()
    return flat_params(model)


def _edit_grads(model: torch.nn.Module, step: int) -> None:
    """What training loops do to ``.grad`` between backward and step: replace it, set it to
    None (torch.optim skips the parameter), clip it in place."""
    if step == 0:
        for p in model.parameters():
            p.grad = p.grad * 0.5
    elif step == 1:
        model[0].weight.grad = None
    else:
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)


#: name -> an edit of param_groups the buckets cannot follow (groups: the first layer's
#: parameters, then the other four), given a parameter the optimizer was not built with.
GROUP_EDITS = {
    "appended": lambda g, new: g[0]["params"].append(new),
    "item-replaced": lambda g, new: g[0]["params"].__setitem__(1, new),
    "list-replaced": lambda g, new: g[1].__setitem__("params", g[1]["params"][:2]),
    "moved-from-group-1": lambda g, new: g[0]["params"].append(g[1]["params"].pop()),
    "group-appended": lambda g, new: g.append({**g[1], "params": [new]}),
    "group-deleted": lambda g, new: g.__delitem__(1),
    "key-deleted": lambda g, new: g[1].pop("momentum"),
}


def edited_groups(xs: torch.Tensor, ys: torch.Tensor, sgd: Dict[str, Any]) -> Dict[str, Any]:
    """Each of GROUP_EDITS after one step, compiled (overlap on and off) and eager: what the
    next backward, step, clip_grad_norm_ and state_dict raise, whether anything moved; then,
    restored, the refused iteration is run again and one more follows (3 steps in all)."""
    out: Dict[str, Any] = {}
    modes = {"overlap": (torch.optim.SGD, True), "no-overlap": (torch.optim.SGD, False),
             "eager": (eager_class(torch.optim.SGD), False)}
    for mode, (cls, overlap) in modes.items():
        for name, edit in GROUP_EDITS.items():
            model = make_model()
            first = list(model[0].parameters())
            rest = [p for p in model.parameters() if all(p is not q for q in first)]
            opt = DataParallelOptimizer(cls, [{"params": first}, {"params": rest}],
                                        overlap=overlap, bucket_cap_mb=SMALL_BUCKETS_MB, **sgd)
            loss_of(model, xs, ys).backward()
            opt.step()
            opt.zero_grad()
            kept = [dict(g, params=list(g["params"])) for g in opt.param_groups]
            before = flat_params(model)
            edit(opt.param_groups, torch.nn.Parameter(torch.zeros(3)))
            result = {
                "backward": _error_of(lambda: loss_of(model, xs, ys).backward(), ValueError),
                "step": _error_of(opt.step, ValueError),
                "clip": _error_of(lambda: opt.clip_grad_norm_(1.0), ValueError),
                "state_dict": _error_of(opt.state_dict, ValueError),
                "unchanged": torch.equal(flat_params(model), before),
            }
            opt.param_groups[:] = kept
            opt.zero_grad()  # the refused pass reduced nothing: it is run again
            for _ in range(2):
                loss_of(model, xs, ys).backward()
                opt.step()
                opt.zero_grad()
            opt.close()
            result["params"] = flat_params(model)
            out[f"{mode}/{name}"] = result
    return out


def misuse(rank: int, world_size: int) -> Dict[str, Any]:
    """What users do between backward and step, and around the optimizer's lifetime."""
    import gc
    import threading
    import warnings
    import weakref

    from torch.utils.checkpoint import checkpoint

    x, y = data(4 * world_size, seed=7)
    xs, ys = x.chunk(world_size)[rank], y.chunk(world_size)[rank]
    out: Dict[str, Any] = {}
    sgd = {"lr": 0.1, "momentum": 0.9}

    # .grad holds the average when backward returns: torch's own clipping works.
    model = make_model()
    opt = DataParallelOptimizer(torch.optim.SGD, model.parameters(), overlap=False,
                                bucket_cap_mb=SMALL_BUCKETS_MB, **sgd)
    for step in range(4):
        loss_of(model, xs, ys).backward()
        if step == 0:
            out["grads_after_backward"] = torch.cat([p.grad.reshape(-1) for p in model.parameters()])
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)
        opt.step()
        opt.zero_grad()
    out["torch_clip"] = flat_params(model)
    threads = list(opt._engine.reducer._threads)
    opt.close()
    out["threads_alive_after_close"] = [t.name for t in threads if t.is_alive()]
    out["threads_started"] = len(threads)

    # A learning rate set between backward and step applies to that step (overlap=False);
    # with overlap=True, to the next one, with a warning.
    lrs = [0.1, 0.05, 0.02, 0.01]
    for overlap in (False, True):
        model = make_model()
        opt = DataParallelOptimizer(torch.optim.SGD, model.parameters(), overlap=overlap,
                                    bucket_cap_mb=SMALL_BUCKETS_MB, **sgd)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for step in range(4):
                loss_of(model, xs, ys).backward()
                opt.param_groups[0]["lr"] = lrs[step]
                opt.step()
                opt.zero_grad()
        opt.close()
        out[f"late_lr/{overlap}"] = flat_params(model)
        out[f"late_lr_warnings/{overlap}"] = [str(w.message) for w in caught
                                            if "DataParallelOptimizer" in str(w.message)]

    # .grad changed between backward and step: overlap=False steps what the user left, as
    # torch.optim does; overlap=True stepped every bucket during backward, and says so.
    for overlap in (False, True):
        model = make_model()
        opt = DataParallelOptimizer(torch.optim.SGD, model.parameters(), overlap=overlap,
                                    bucket_cap_mb=SMALL_BUCKETS_MB, **sgd)
        if overlap:  # the first step waits for step() (a GradScaler may take it)
            loss_of(model, xs, ys).backward()
            opt.step()
            opt.zero_grad()
        errors = []
        for step in range(3):
            loss_of(model, xs, ys).backward()
            _edit_grads(model, step)
            errors.append(_error_of(opt.step, RuntimeError))
            opt.zero_grad()
        opt.close()
        out[f"edited_grads/{overlap}"] = {"params": flat_params(model), "errors": errors}

    # Every rank's backward raises mid-pass; the next backward is refused clearly until
    # step() finishes that step; then training goes on in step.
    model = make_model()
    opt = DataParallelOptimizer(torch.optim.SGD, model.parameters(),
                                bucket_cap_mb=SMALL_BUCKETS_MB, **sgd)
    loss_of(model, xs, ys).backward()  # the first step waits for step(): buckets step in
    opt.step()  # backward from the second on, as this case wants
    opt.zero_grad()
    try:
        h = _RaiseOnRank.apply(model[0](xs), True)
        ((model[4](model[3](model[2](model[1](h)))) - ys) ** 2).mean().backward()
    except ValueError:
        pass
    opt.zero_grad()
    out["after_raise"] = _error_of(lambda: loss_of(model, xs, ys).backward(), RuntimeError)
    opt.step()
    opt.zero_grad()
    for _ in range(2):
        loss_of(model, xs, ys).backward()
        opt.step()
        opt.zero_grad()
    opt.close()
    out["after_raise_params"] = flat_params(model)

    # An extra backward pass after the reduction is refused; the gradient it had already
    # added is taken out again (the parameter the last pass reached first), or the step is
    # dropped on every rank, saying so.
    for case in ("same_first", "other_first"):
        for overlap in (False, True):
            model = make_model()
            opt = DataParallelOptimizer(torch.optim.SGD, model.parameters(), overlap=overlap,
                                        bucket_cap_mb=SMALL_BUCKETS_MB, **sgd)
            log = []
            for step in range(3):
                loss_of(model, xs, ys).backward()
                if step == 1:
                    try:
                        if case == "same_first":
                            loss_of(model, xs, ys).backward()
                        else:  # reaches the first layer first
                            model[0](xs).square().mean().backward()
                        log.append("not refused")
                    except RuntimeError as exc:
                        log.append(str(exc))
                before = flat_params(model)
                try:
                    opt.step()
                    log.append("stepped")
                except RuntimeError as exc:
                    log.append(str(exc))
                    log.append(bool(torch.equal(before, flat_params(model))))
                opt.zero_grad()
            opt.close()
            out[f"extra_pass/{case}/{overlap}"] = {"log": log, "params": flat_params(model)}

    # Two optimizers over one model on the default group, and a layer whose backward
    # all_reduces on that group (as SyncBatchNorm's does): each optimizer's thread issues
    # on a group of its own, so nothing interleaves. An explicit group shared by two open
    # optimizers is refused.
    model = make_model()
    weights = [p for p in model.parameters() if p.dim() == 2]
    biases = [p for p in model.parameters() if p.dim() == 1]
    first_opt = DataParallelOptimizer(torch.optim.SGD, weights, bucket_cap_mb=SMALL_BUCKETS_MB, **sgd)
    second_opt = DataParallelOptimizer(torch.optim.Adam, biases, lr=0.01,
                                       bucket_cap_mb=SMALL_BUCKETS_MB)
    for _ in range(5):
        h = _SyncStat.apply(model[1](model[0](xs)))
        ((model[4](model[3](model[2](h))) - ys) ** 2).mean().backward()
        first_opt.step()
        second_opt.step()
        first_opt.zero_grad()
        second_opt.zero_grad()
    first_opt.close()
    second_opt.close()
    out["two_optimizers"] = flat_params(model)
    shared = dist.new_group([0, 1])
    one = DataParallelOptimizer(torch.optim.SGD, make_model().parameters(), lr=0.1,
                                process_group=shared)
    out["shared_group"] = _error_of(lambda: DataParallelOptimizer(
        torch.optim.SGD, make_model().parameters(), lr=0.1, process_group=shared), ValueError)
    one.close()

    # Activation checkpointing: non-reentrant works; reentrant works while the outer pass
    # reaches a parameter first, and is refused by name where a nested pass does.
    for mode in ("plain", "reentrant", "reentrant-all"):
        reentrant = mode != "plain"
        model = make_model()
        opt = DataParallelOptimizer(torch.optim.SGD, model.parameters(),
                                    bucket_cap_mb=SMALL_BUCKETS_MB, **sgd)
        try:
            for _ in range(3):
                inp = xs.clone().requires_grad_(reentrant)
                h = checkpoint(model[:2], inp, use_reentrant=reentrant)
                h = checkpoint(model[2:4], h, use_reentrant=reentrant)
                if mode == "reentrant-all":
                    h = checkpoint(model[4], h, use_reentrant=reentrant)
                else:
                    h = model[4](h)
                ((h - ys) ** 2).mean().backward()
                opt.step()
                opt.zero_grad()
            out[f"checkpoint/{mode}"] = flat_params(model)
        except RuntimeError as exc:
            out[f"checkpoint/{mode}"] = str(exc)
        opt.close()

    # Building a second optimizer over the same parameters closes the first (warning);
    # one dropped without close() is freed at once and its hooks with it (plain SGD:
    # no state lost by rebuilding).
    model = make_model()
    opt = DataParallelOptimizer(torch.optim.SGD, model.parameters(), lr=0.1)
    loss_of(model, xs, ys).backward()
    opt.step()
    opt.zero_grad()
    old = opt
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        opt = DataParallelOptimizer(torch.optim.SGD, model.parameters(), lr=0.1)
    out["rebind_warnings"] = [str(w.message) for w in caught
                                            if "DataParallelOptimizer" in str(w.message)]
    out["old_step"] = _error_of(old.step, RuntimeError)
    del old
    gc.disable()
    try:
        for _ in range(3):
            loss_of(model, xs, ys).backward()
            opt.step()
            opt.zero_grad()
            dropped = weakref.ref(opt)
            opt = DataParallelOptimizer(torch.optim.SGD, model.parameters(), lr=0.1)
            out["dropped_alive"] = out.get("dropped_alive", False) or dropped() is not None
    finally:
        gc.enable()
    opt.close()
    out["rebind_params"] = flat_params(model)

    # A parameter frozen at construction and unfrozen later is refused, not ignored.
    model = make_model()
    model[0].weight.requires_grad_(False)
    opt = DataParallelOptimizer(torch.optim.SGD, model.parameters(), **sgd)
    model[0].weight.requires_grad_(True)
    loss_of(model, xs, ys).backward()
    out["unfrozen"] = _error_of(opt.step, RuntimeError)
    opt.close()

    # TopK: a parameter no rank uses keeps its residual.
    model = make_model()
    opt = DataParallelOptimizer(torch.optim.SGD, model.parameters(), compression=TopK(0.3),
                                bucket_cap_mb=1.0, **sgd)
    residuals = []
    for use_last in (True, False, False):
        h = model[3](model[2](model[1](model[0](xs))))
        loss = ((model[4](h) - ys) ** 2).mean() if use_last else h.square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        residuals.append(whole_state_dict(opt)["residuals"][4].clone())
    opt.close()
    out["unused_residuals"] = residuals

    # Different models or hyper-parameters on different ranks are refused on every rank,
    # before any bucket.
    torch.manual_seed(0)
    other = torch.nn.Linear(6, 3 + rank)
    out["mismatch"] = _error_of(
        lambda: DataParallelOptimizer(torch.optim.SGD, other.parameters(), lr=0.1), ValueError)
    out["mismatch_lr"] = _error_of(lambda: DataParallelOptimizer(
        torch.optim.SGD, make_model().parameters(), lr=0.1 * (1 + rank)), ValueError)

    # RoundRobin optimizers are replaced like the others.
    model = make_model()
    rr = DataParallelOptimizer(torch.optim.SGD, model.parameters(), lr=0.1, sync=RoundRobin(2))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        rr2 = DataParallelOptimizer(torch.optim.SGD, model.parameters(), lr=0.1,
                                    sync=RoundRobin(2))
    out["rr_warnings"] = len([w for w in caught if "now closed" in str(w.message)])
    out["rr_old_step"] = _error_of(rr.step, RuntimeError)
    rr2.close()

    # A pass that raises before any bucket was sent counts for nothing (one bucket);
    # create_graph=True gradients reduce like any others.
    model = make_model()
    opt = DataParallelOptimizer(torch.optim.SGD, model.parameters(), **sgd)
    for step in range(3):
        if step == 1:
            try:
                h = _RaiseOnRank.apply(model[0](xs), True)
                ((model[4](model[3](model[2](model[1](h)))) - ys) ** 2).mean().backward()
            except ValueError:
                pass
            opt.zero_grad()
            continue
        loss_of(model, xs, ys).backward(create_graph=step == 2)
        opt.step()
        opt.zero_grad()
    opt.close()
    out["dead_pass_params"] = flat_params(model)
    out["edits"] = edited_groups(xs, ys, sgd)
    out["threads"] = sorted(t.name for t in threading.enumerate() if t.name.startswith("distopt-dp"))

    if rank == 0:
        out["reference_clip"] = _train_reference(4, x, y, clip=0.05)
        out["reference_lr"] = _train_reference(4, x, y, lrs=lrs)
        out["reference_edited"] = _train_reference(3, x, y, edit=_edit_grads)
        out["reference"] = _train_reference(3, x, y)
        out["reference_4"] = _train_reference(4, x, y)
        out["reference_plain_4"] = _train_reference(4, x, y, momentum=0.0)
        out["reference_2"] = _train_reference(2, x, y)
        model = make_model()
        out["reference_first_grads"] = torch.cat([
            g.reshape(-1) for g in torch.autograd.grad(loss_of(model, x, y), list(model.parameters()))
        ])
    return out


def ddp_and_optimizer(rank: int, world_size: int) -> Dict[str, Any]:
    """DDP and a DataParallelOptimizer over the same parameters, in both orders (DDP first;
    the optimizer first, as nanoGPT builds it), and the uses that stay allowed: DDP's ignored
    parameters in the optimizer, and a DDP built after the optimizer was closed."""
    from torch.nn.parallel import DistributedDataParallel

    out: Dict[str, Any] = {}
    model = make_model()
    ddp = DistributedDataParallel(model)
    out["ddp_first"] = _error_of(
        lambda: DataParallelOptimizer(torch.optim.AdamW, model.parameters()), RuntimeError)
    out["ddp_as_module"] = _error_of(
        lambda: DataParallelOptimizer(torch.optim.AdamW, model.parameters(), module=ddp),
        RuntimeError)
    del ddp

    model = make_model(seed=1)
    opt = DataParallelOptimizer(torch.optim.AdamW, model.parameters(), lr=0.1)
    before = [p.detach().clone() for p in model.parameters()]
    out["optimizer_first"] = _error_of(lambda: DistributedDataParallel(model), RuntimeError)
    # The optimizer still trains, alone, as DDP would: one step on this rank's batch.
    x = torch.randn(4, 6, generator=torch.Generator().manual_seed(rank))
    model(x).square().mean().backward()
    opt.step()
    ref = make_model(seed=1)
    ref_ddp = DistributedDataParallel(ref)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=0.1, fused=True)
    ref_ddp(x).square().mean().backward()
    ref_opt.step()
    out["trains_as_ddp"] = identical(list(model.parameters()), list(ref.parameters()))
    out["moved"] = not identical(list(model.parameters()), before)
    opt.close()
    out["after_close"] = _error_of(lambda: DistributedDataParallel(model), RuntimeError)

    model = make_model(seed=2)
    model._ddp_params_and_buffers_to_ignore = ["4.weight", "4.bias"]
    ddp = DistributedDataParallel(model)
    last = DataParallelOptimizer(torch.optim.SGD, model[4].parameters(), lr=0.1)
    out["ignored_allowed"] = _error_of(
        lambda: DataParallelOptimizer(torch.optim.SGD, model[0].parameters(), lr=0.1), RuntimeError)
    last.close()

    # What DDP averages, as its reducer picks it: a weight shared by two layers, ignored
    # under one name only, and a parameter whose all_reduce DDP delays, are both averaged.
    tied = torch.nn.ModuleDict({"a": torch.nn.Linear(4, 4), "b": torch.nn.Linear(4, 4)})
    tied.b.weight = tied.a.weight
    tied._ddp_params_and_buffers_to_ignore = ["a.weight"]
    tied_ddp = DistributedDataParallel(tied)
    out["tied"] = _error_of(
        lambda: DataParallelOptimizer(torch.optim.SGD, [tied.a.weight], lr=0.1), RuntimeError)
    delayed = make_model(seed=4)
    delayed_ddp = DistributedDataParallel(
        delayed, delay_all_reduce_named_params=[("4.weight", delayed[4].weight)],
        param_to_hook_all_reduce=delayed[4].weight)
    out["delayed"] = _error_of(
        lambda: DataParallelOptimizer(torch.optim.SGD, [delayed[4].weight], lr=0.1), RuntimeError)
    # Frozen when DDP was built: DDP never averages it, so an optimizer may train it later.
    frozen = make_model(seed=5)
    frozen[4].requires_grad_(False)
    frozen_ddp = DistributedDataParallel(frozen)
    frozen[4].requires_grad_(True)
    unfrozen = DataParallelOptimizer(torch.optim.SGD, frozen[4].parameters(), lr=0.1)
    unfrozen.close()
    # A refused DDP, still referenced (a traceback kept by pytest.raises or a REPL), leaves
    # later optimizers over other parameters alone; named parameters are taken as torch.optim
    # takes them.
    other = make_model(seed=6)
    opt = DataParallelOptimizer(torch.optim.SGD, other.parameters(), lr=0.1)
    try:
        DistributedDataParallel(other)
    except RuntimeError as refused:
        kept = refused  # noqa: F841 (keeps the half-built DDP alive in its traceback)
    named = make_model(seed=7)
    out["named_after_refusal"] = _error_of(
        lambda: DataParallelOptimizer(torch.optim.SGD, named.named_parameters(), lr=0.1).close(),
        Exception)
    opt.close()
    del tied_ddp, delayed_ddp, frozen_ddp
    return out


def freed_while_an_error_holds_its_engine(rank: int, world_size: int) -> Dict[str, Any]:
    """A refused backward pass kept as an exception (a notebook's ``sys.last_value``) holds
    the engine's frames; the optimizer is then dropped. The model must train on without it
    (forward with its buffers, backward), and DDP may wrap it, as once the optimizer is gone.
    Also where the warning of a newer optimizer over the same parameters points."""
    import gc
    import warnings

    from torch.nn.parallel import DistributedDataParallel

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.BatchNorm1d(4),
                                torch.nn.Linear(4, 1))
    x = torch.randn(8, 4) + rank
    opt = DataParallelOptimizer(torch.optim.AdamW, model.parameters(), lr=0.01, module=model)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        newer = DataParallelOptimizer(  # the line the warning must name
            torch.optim.AdamW, model.parameters(), lr=0.01, module=model)
    takeover = [(os.path.basename(w.filename), w.lineno) for w in caught
                if "belonged to another" in str(w.message)]
    del opt
    opt = newer
    model(x).sum().backward()
    opt.step()
    opt.zero_grad()
    weight_decay = opt.param_groups[0].pop("weight_decay")
    kept = None
    try:
        model(x).sum().backward()
    except ValueError as error:
        kept = error  # its traceback holds the engine
    opt.param_groups[0]["weight_decay"] = weight_decay
    del opt, newer
    gc.collect()
    here = freed_while_an_error_holds_its_engine.__code__.co_firstlineno
    out: Dict[str, Any] = {"refused": str(kept).split(":")[0], "takeover": takeover,
                           "scenario_line": here}
    loss = model(x).sum()
    loss.backward()
    out["trains"] = all(p.grad is not None for p in model.parameters())
    out["wrapped"] = type(DistributedDataParallel(model)).__name__
    del kept
    return out
