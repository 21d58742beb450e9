"""Rank-side scenarios for DDP's buffer broadcasts (``module=``) and uneven inputs (``Join``),
each against DDP + torch.optim in the same world (``feature_scenarios.ddp_semantics``), and
the error a rank gets when the ranks run different numbers of steps without Join.

References are DDP + torch.optim runs on the same data, with torch.optim's fused kernels
(those the compiled steps run), so that every comparison is bit for bit.
"""
import contextlib
import datetime
import time
from typing import Any, Dict, List

import torch
import torch.distributed as dist
from torch.distributed.algorithms import Join
from torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook import PowerSGDState, powerSGD_hook
from torch.nn.parallel import DistributedDataParallel

from distopt.parallel import Cast, DataParallelOptimizer, PowerSGD, RoundRobin, TopK
from distopt.parallel import compression_hook
from tests.parallel.training import (SMALL_BUCKETS_MB, eager_class, flat_params, make_model,
                                  whole_state_dict)


class BatchNormNet(torch.nn.Module):
    """A small CNN with BatchNorm (running statistics and a step count: buffers), and a
    frozen layer kept out of the optimizer, built differently on each rank (DDP broadcasts
    it at construction)."""

    def __init__(self, rank: int) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.conv = torch.nn.Conv2d(2, 4, 3, padding=1)
        self.bn = torch.nn.BatchNorm2d(4)
        self.head = torch.nn.Linear(64, 1)
        torch.manual_seed(100 + rank)
        self.frozen = torch.nn.Linear(1, 1)
        self.frozen.requires_grad_(False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.frozen(self.head(torch.relu(self.bn(self.conv(x))).flatten(1)))

    def trained(self) -> List[torch.Tensor]:
        return [p for p in self.parameters() if p.requires_grad]


def image_batch(rank: int, step: int, k: int = 0):
    g = torch.Generator().manual_seed(1000 * rank + 10 * step + k)
    return torch.randn(4, 2, 4, 4, generator=g) * (1 + rank), torch.randn(4, 1, generator=g)


SGD = {"lr": 0.05, "momentum": 0.9, "fused": True}
BN_STEPS = 5

#: DataParallelOptimizer's runs with module=: its options, how it trains, and the DDP run
#: (DDP's options, same training) it must equal on every rank, buffers after every step.
BUFFER_RUNS = {
    "overlap": ({}, "plain", "ddp"),
    "no-overlap": ({"overlap": False}, "plain", "ddp"),
    "shard-flat": ({"shard": "flat"}, "plain", "ddp"),
    "passes": ({"backward_passes_per_step": 2}, "passes", "ddp-no_sync"),
    "no_sync": ({}, "no_sync", "ddp-no_sync"),
    "eval": ({}, "eval", "ddp-eval"),
    "no-broadcast": ({"broadcast_buffers": False}, "plain", "ddp-no-broadcast"),
}
BUFFER_REFERENCES = {
    "ddp": ({}, "plain"),
    "ddp-no_sync": ({}, "no_sync"),
    "ddp-eval": ({}, "eval"),
    "ddp-no-broadcast": ({"broadcast_buffers": False}, "plain"),
}


def _train_bn(model: BatchNormNet, forward: Any, opt: Any, rank: int, how: str,
              quiet: Any) -> Dict[str, Any]:
    """``BN_STEPS`` steps; ``how``: "plain", "passes" / "no_sync" (two backward passes per
    step, the first inside ``quiet()`` for "no_sync"), "eval" (a forward under no_grad, in
    train mode, after each step). The buffers after each step, and the parameters."""
    buffers = []
    for step in range(BN_STEPS):
        passes = 2 if how in ("passes", "no_sync") else 1
        for k in range(passes):
            x, y = image_batch(rank, step, k)
            context = quiet() if how == "no_sync" and k < passes - 1 else contextlib.nullcontext()
            with context:
                ((forward(x) - y) ** 2).mean().backward()
        opt.step()
        opt.zero_grad()
        if how == "eval":
            with torch.no_grad():
                forward(image_batch(rank, 50 + step)[0])
        buffers.append([b.clone() for b in model.buffers()])
    return {"buffers": buffers, "params": flat_params(model)}


def buffers_like_ddp(rank: int, world_size: int) -> Dict[str, Any]:
    """BatchNorm statistics under DDP and under DataParallelOptimizer(module=model)."""
    out: Dict[str, Any] = {}
    for name, (options, how) in BUFFER_REFERENCES.items():
        model = BatchNormNet(rank)
        ddp = DistributedDataParallel(model, **options)
        opt = torch.optim.SGD(model.trained(), **SGD)
        out[name] = _train_bn(model, ddp, opt, rank, how, ddp.no_sync)
    for name, (options, how, _) in BUFFER_RUNS.items():
        model = BatchNormNet(rank)
        opt = DataParallelOptimizer(torch.optim.SGD, model.trained(), module=model,
                                    bucket_cap_mb=SMALL_BUCKETS_MB, **options, **SGD)
        out[name] = _train_bn(model, model, opt, rank, how, opt.no_sync)
        opt.close()
        out[name]["hooks_after_close"] = len(model._forward_pre_hooks)
    # Before: no module=, the buffers were each rank's own.
    model = BatchNormNet(rank)
    opt = DataParallelOptimizer(torch.optim.SGD, model.trained(), bucket_cap_mb=SMALL_BUCKETS_MB,
                                **SGD)
    out["without-module"] = _train_bn(model, model, opt, rank, "plain", None)
    opt.close()
    # Two forwards in eval mode before one backward: the second one's broadcast writes the
    # running statistics the first saved for backward (as DDP, unseen by autograd).
    model = BatchNormNet(rank)
    opt = DataParallelOptimizer(torch.optim.SGD, model.trained(), module=model, **SGD)
    model.eval()
    try:
        (model(image_batch(rank, 90)[0]).sum() + model(image_batch(rank, 91)[0]).sum()).backward()
        opt.step()
        out["eval_twice"] = "ok"
    except RuntimeError as exc:
        out["eval_twice"] = str(exc)
    opt.close()
    return out


# ---------------------------------------------------------------- uneven inputs


#: Batches per rank: rank 0 runs out last.
JOIN_BATCHES = (6, 4)

#: DataParallelOptimizer's runs under Join: options, Join's divide_by_initial_world_size,
#: and the DDP + torch.optim run (under Join too) whose last joiner it must equal on every
#: rank, parameters and optimizer state.
JOIN_RUNS = {
    "overlap": ({}, True, "ddp"),
    "no-overlap": ({"overlap": False}, True, "ddp"),
    "shard-param": ({"shard": "param"}, True, "ddp"),
    "shard-flat": ({"shard": "flat"}, True, "ddp"),
    "eager": ({}, True, "ddp"),
    "divide": ({}, False, "ddp-divide"),
    "divide-shard-flat": ({"shard": "flat"}, False, "ddp-divide"),
    "bf16": ({"compression": Cast(torch.bfloat16)}, True, "ddp-bf16"),
    "clip-schedule": ({"overlap": False}, True, "ddp-clip-schedule"),
    "module": ({}, True, "ddp-module"),
    "powersgd": ({"compression": PowerSGD(rank=1, start_iter=2), "bucket_cap_mb": 25.0}, True,
                 "ddp-powersgd"),
    "grad-scaler": ({}, True, "ddp-grad-scaler"),
    "shard-flat-grad-scaler-clip": ({"shard": "flat"}, True, "ddp-grad-scaler-clip"),
}
#: DDP's runs: Join's divide_by_initial_world_size, and what the run adds.
JOIN_REFERENCES = {
    "ddp": True, "ddp-divide": False, "ddp-bf16": True, "ddp-clip-schedule": True,
    "ddp-module": True, "ddp-powersgd": True, "ddp-grad-scaler": True,
    "ddp-grad-scaler-clip": True,
}


def _mlp_batch(rank: int, step: int):
    g = torch.Generator().manual_seed(500 + 100 * rank + step)
    return torch.randn(4, 6, generator=g), torch.randn(4, 1, generator=g)


def _train_joined(name: str, model: Any, forward: Any, opt: Any, joinable: Any, rank: int,
                  divide: bool) -> Dict[str, Any]:
    """This rank's batches under ``Join([joinable])``; the parameters, the buffers and the
    optimizer state after the block (the last with ``whole_state_dict(opt)``). Runs named
    "...clip-schedule" clip the gradients and step a StepLR; "...grad-scaler..." follow the
    AMP recipe (float16 autocast; rank 1's third step overflows; "...-clip": unscale_ and
    clip)."""
    schedule = scaler = None
    if name.endswith("clip-schedule"):
        schedule = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    if "grad-scaler" in name:
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10, growth_interval=2)
    started = time.monotonic()
    with Join([joinable], divide_by_initial_world_size=divide):
        for step in range(JOIN_BATCHES[rank]):
            if name.endswith("module"):
                x, y = image_batch(rank, step)
            else:
                x, y = _mlp_batch(rank, step)
            if scaler is None:
                ((forward(x) - y) ** 2).mean().backward()
            else:
                y = y + 1e3 if step == 2 and rank == 1 else y  # overflows float16
                with torch.autocast("cpu", dtype=torch.float16):
                    out = forward(x)
                scaler.scale(((out.float() - y) ** 2).mean()).backward()
                if name.endswith("clip"):
                    scaler.unscale_(opt)
            if schedule is not None or name.endswith("grad-scaler-clip"):
                torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
            if scaler is None:
                opt.step()
            else:
                scaler.step(opt)
                scaler.update()
            opt.zero_grad()
            if schedule is not None:
                schedule.step()
    return {"params": flat_params(model), "buffers": [b.clone() for b in model.buffers()],
            "state": {k: dict(v) for k, v in whole_state_dict(opt)["state"].items()},
            "seconds": time.monotonic() - started}


def _join_model(name: str, rank: int) -> Any:
    return BatchNormNet(rank) if name.endswith("module") else make_model()


def join_like_ddp(rank: int, world_size: int) -> Dict[str, Any]:
    """Uneven inputs under Join: DDP + torch.optim and DataParallelOptimizer (``JOIN_RUNS``);
    TopK's residuals on the joined rank; what Join refuses."""
    out: Dict[str, Any] = {}
    for name, divide in JOIN_REFERENCES.items():
        model = _join_model(name, rank)
        ddp = DistributedDataParallel(model)
        if name == "ddp-bf16":
            ddp.register_comm_hook(*compression_hook(Cast(torch.bfloat16)))
        if name == "ddp-powersgd":
            ddp.register_comm_hook(PowerSGDState(None, matrix_approximation_rank=1,
                                                 start_powerSGD_iter=2), powerSGD_hook)
        opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], **SGD)
        out[name] = _train_joined(name, model, ddp, opt, ddp, rank, divide)
    for name, (options, divide, _) in JOIN_RUNS.items():
        model = _join_model(name, rank)
        cls = eager_class(torch.optim.SGD) if name == "eager" else torch.optim.SGD
        options = {"bucket_cap_mb": SMALL_BUCKETS_MB, **options}
        if name == "module":
            options["module"] = model
        opt = DataParallelOptimizer(cls, [p for p in model.parameters() if p.requires_grad],
                                    **options, **SGD)
        out[name] = _train_joined(name, model, model, opt, opt, rank, divide)
        opt.close()

    # TopK with error feedback: a joined rank sends zeros and keeps its residuals.
    model = make_model()
    opt = DataParallelOptimizer(torch.optim.SGD, model.parameters(), compression=TopK(0.3),
                                bucket_cap_mb=SMALL_BUCKETS_MB, **SGD)
    residuals = []
    with Join([opt]):
        for step in range(JOIN_BATCHES[rank]):
            x, y = _mlp_batch(rank, step)
            ((model(x) - y) ** 2).mean().backward()
            opt.step()
            opt.zero_grad()
            residuals.append(whole_state_dict(opt)["residuals"])
    out["topk"] = {"params": flat_params(model), "residuals_at_join": residuals[-1],
                   "residuals_after": whole_state_dict(opt)["residuals"]}
    opt.close()

    # overlap=False, module=, a forward between backward and step(): each has its iteration
    # (DDP's Join cannot shadow that forward: no reference, the ranks must agree).
    model = BatchNormNet(rank)
    opt = DataParallelOptimizer(torch.optim.SGD, model.trained(), module=model, overlap=False,
                                bucket_cap_mb=SMALL_BUCKETS_MB, **SGD)
    with Join([opt]):
        for step in range(JOIN_BATCHES[rank]):
            x, y = image_batch(rank, step)
            ((model(x) - y) ** 2).mean().backward()
            with torch.no_grad():
                model(image_batch(rank, 70 + step)[0])
            opt.step()
            opt.zero_grad()
    buffers = [b.clone() for b in model.buffers()]
    for step in range(2):  # and training goes on after the block, outside Join
        x, y = image_batch(rank, 80 + step)
        ((model(x) - y) ** 2).mean().backward()
        opt.step()
        opt.zero_grad()
    out["forward-before-step"] = {"params": flat_params(model), "buffers": buffers}
    opt.close()

    refused = {}
    for what, options, kwargs in (
        ("round_robin", {"sync": RoundRobin(2)}, {}),
        ("powersgd_divide", {"compression": PowerSGD()}, {"divide_by_initial_world_size": False}),
    ):
        opt = DataParallelOptimizer(torch.optim.SGD, make_model().parameters(), lr=0.1, **options)
        try:
            Join([opt], **kwargs)
        except ValueError as exc:
            refused[what] = str(exc)
        else:
            refused[what] = "no error"
        opt.close()
    out["refused"] = refused
    return out


def uneven_without_join(rank: int, world_size: int) -> Dict[str, Any]:
    """Rank 0 runs two steps, rank 1 one, with no Join, on a group whose timeout is short:
    what rank 0's second backward raises, and when. Leaves that group broken: run it last."""
    group = dist.new_group(timeout=datetime.timedelta(seconds=2))
    model = make_model()
    opt = DataParallelOptimizer(torch.optim.SGD, model.parameters(), process_group=group,
                                lr=0.1)
    out = {"error": "no error", "seconds": 0.0}
    started = time.monotonic()
    try:
        for step in range(2 - rank):
            x, y = _mlp_batch(rank, step)
            started = time.monotonic()
            ((model(x) - y) ** 2).mean().backward()
            opt.step()
            opt.zero_grad()
    except RuntimeError as exc:
        out["error"] = str(exc)
    out["seconds"] = time.monotonic() - started
    opt.close()
    dist.barrier()  # rank 1 stays until rank 0 has its error
    return out
