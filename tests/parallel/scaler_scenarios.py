"""Rank-side GradScaler scenarios (module-level, so that spawn can find them): the standard
AMP recipe, ``scaler.scale(loss).backward(); scaler.step(opt); scaler.update()``, with
DataParallelOptimizer in every configuration and with DDP + torch.optim, in one world.

The forward runs under ``torch.autocast("cpu", dtype=torch.float16)``; on the steps of
``OVERFLOWS`` one rank's targets are off by 1e3, so that its scaled gradient overflows
float16 in backward: the average is inf on every rank, the step is skipped and the scale
backs off. ``growth_interval=2`` makes the scale grow between them (from 2**10: no other
step overflows).
"""
import contextlib
from typing import Any, Callable, Dict, Optional

import torch

from distopt.parallel import DataParallelOptimizer, optimizer_hook
from tests.parallel.training import (SMALL_BUCKETS_MB, data, eager_class, flat_params, make_model,
                                  whole_state_dict)

STEPS = 6

#: case -> (class, keyword arguments, the steps whose gradients overflow). torch.optim is
#: given the kernel the compiled step runs: fused=True for SGD and Adam (which then take
#: the scaler's grad_scale and found_inf themselves), foreach for RMSprop (unscaled by
#: GradScaler.unscale_ and not stepped after an inf). SGD's first step does not overflow:
#: torch 2.13's fused SGD keeps the unwritten momentum buffer of a skipped first step and
#: steps the next update with it.
CASES = {
    "Adam": (torch.optim.Adam, {"lr": 1e-2, "fused": True}, (0, 3)),
    "SGD": (torch.optim.SGD, {"lr": 0.05, "momentum": 0.9, "fused": True}, (2, 4)),
    "RMSprop": (torch.optim.RMSprop, {"lr": 1e-2, "foreach": True}, (0, 3)),
}

#: DataParallelOptimizer's runs: its options, how a step goes (``passes``: backward passes
#: per step; ``quiet``: all but the last inside ``opt.no_sync()``; ``clip``: after
#: ``scaler.unscale_(opt)``, torch's ``clip_grad_norm_`` or the optimizer's own), and the
#: DDP + torch.optim run it must equal bit for bit.
RUNS = {
    "overlap": ({}, {}, "ddp"),
    "no-overlap": ({"overlap": False}, {}, "ddp"),
    "shard-param": ({"shard": "param"}, {}, "ddp"),
    "shard-flat": ({"shard": "flat"}, {}, "ddp"),
    "no-overlap-shard-flat": ({"overlap": False, "shard": "flat"}, {}, "ddp"),
    "eager": ({}, {}, "ddp"),
    "passes": ({"backward_passes_per_step": 2}, {"passes": 2}, "ddp-no_sync"),
    "no_sync": ({}, {"passes": 2, "quiet": True}, "ddp-no_sync"),
    "torch-clip": ({}, {"clip": "torch"}, "ddp-clip"),
    "own-clip": ({}, {"clip": "own"}, "ddp-clip"),
    "no-overlap-torch-clip": ({"overlap": False}, {"clip": "torch"}, "ddp-clip"),
    "shard-param-own-clip": ({"shard": "param"}, {"clip": "own"}, "ddp-clip"),
}

#: How each DDP run steps.
DDP_RUNS = {"ddp": {}, "ddp-no_sync": {"passes": 2, "quiet": True}, "ddp-clip": {"clip": "torch"}}

MAX_NORM = 0.5
INIT_SCALE = 2.0 ** 10


def _scaler() -> torch.amp.GradScaler:
    return torch.amp.GradScaler("cpu", init_scale=INIT_SCALE, growth_interval=2)


def _train(model: torch.nn.Module, forward: Any, opt: Any, rank: int, overflows: Any,
           passes: int = 1, quiet: Optional[Callable[[], Any]] = None,
           clip: Optional[str] = None) -> Dict[str, Any]:
    """``STEPS`` steps of the AMP recipe; the parameters, the optimizer's state and the
    scale after each step."""
    scaler = _scaler()
    scales = []
    for step in range(STEPS):
        for k in range(passes):
            x, y = data(4, seed=90 + 10 * step + 3 * rank + k)
            if step in overflows and rank == step % 2 and k == passes - 1:
                y = y + 1e3  # 0.5 * 1e3 * 2**10 overflows float16 in backward
            last = k == passes - 1
            with quiet() if quiet is not None and not last else contextlib.nullcontext():
                with torch.autocast("cpu", dtype=torch.float16):
                    out = forward(x)
                scaler.scale(((out.float() - y) ** 2).mean() / passes).backward()
        if clip is not None:
            scaler.unscale_(opt)
            if clip == "own":
                opt.clip_grad_norm_(MAX_NORM)
            else:
                torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
        scaler.step(opt)
        scaler.update()
        scales.append(scaler.get_scale())
        opt.zero_grad()
    return {"params": flat_params(model), "state": whole_state_dict(opt)["state"], "scales": scales}


def _refusals(rank: int) -> Dict[str, str]:
    """What a GradScaler cannot be given: a step whose buckets were stepped during backward
    (the previous step came without the scaler), a step before the reduction (fewer passes
    than backward_passes_per_step), an OptimizerInBackward; and that training then goes on."""
    from torch.nn.parallel import DistributedDataParallel

    out: Dict[str, Any] = {}
    x, y = data(4, seed=40 + rank)

    def scaled_backward(model: Any, scaler: Any) -> None:
        with torch.autocast("cpu", dtype=torch.float16):
            out_ = model(x)
        scaler.scale(((out_.float() - y) ** 2).mean()).backward()

    model = make_model()
    opt = DataParallelOptimizer(torch.optim.SGD, model.parameters(), lr=0.05,
                                bucket_cap_mb=SMALL_BUCKETS_MB)
    scaler = _scaler()
    ((model(x) - y) ** 2).mean().backward()
    opt.step()  # without the scaler: the next step's buckets step during backward
    opt.zero_grad()
    scaled_backward(model, scaler)
    try:
        scaler.step(opt)
        out["late"] = "no error"
    except RuntimeError as exc:
        out["late"] = str(exc)
    out["late_attributes"] = [a for a in ("grad_scale", "found_inf") if hasattr(opt, a)]
    opt.zero_grad()
    scaler = _scaler()
    scaled_backward(model, scaler)  # now the step waits for the scaler
    scaler.step(opt)
    scaler.update()
    out["late_then_finite"] = bool(torch.isfinite(flat_params(model)).all())
    opt.close()

    model = make_model()
    opt = DataParallelOptimizer(torch.optim.SGD, model.parameters(), lr=0.05,
                                backward_passes_per_step=2, bucket_cap_mb=SMALL_BUCKETS_MB)
    scaler = _scaler()
    scaled_backward(model, scaler)
    before = flat_params(model)
    try:
        scaler.step(opt)
        out["short"] = "no error"
    except RuntimeError as exc:
        out["short"] = str(exc)
    out["short_unchanged"] = bool(torch.equal(before, flat_params(model)))
    scaled_backward(model, scaler)  # the reducing pass: the step goes through
    scaler.step(opt)
    scaler.update()
    out["short_then_stepped"] = not torch.equal(before, flat_params(model))
    opt.close()

    model = make_model()
    ddp = DistributedDataParallel(model)
    opt = optimizer_hook(ddp, torch.optim.SGD, model.parameters(), lr=0.05)
    scaler = _scaler()
    scaled_backward(ddp, scaler)
    try:
        scaler.step(opt)
        out["in_backward"] = "no error"
    except RuntimeError as exc:
        out["in_backward"] = str(exc)
    out["in_backward_attributes"] = [a for a in ("grad_scale", "found_inf") if hasattr(opt, a)]
    return out


def grad_scaler(rank: int, world_size: int) -> Dict[str, Any]:
    """Every ``RUNS`` run of DataParallelOptimizer and every ``DDP_RUNS`` run of DDP +
    torch.optim, per ``CASES`` case, under a GradScaler; and ``_refusals``."""
    from torch.nn.parallel import DistributedDataParallel

    out: Dict[str, Any] = {}
    for case, (cls, kwargs, overflows) in CASES.items():
        for name, how in DDP_RUNS.items():
            model = make_model()
            ddp = DistributedDataParallel(model)
            opt = cls(model.parameters(), **kwargs)
            quiet = ddp.no_sync if how.get("quiet") else None
            out[f"{case}/{name}"] = _train(model, ddp, opt, rank, overflows,
                                           how.get("passes", 1), quiet, how.get("clip"))
        for name, (options, how, _) in RUNS.items():
            model = make_model()
            opt = DataParallelOptimizer(eager_class(cls) if name == "eager" else cls,
                                        model.parameters(), bucket_cap_mb=SMALL_BUCKETS_MB,
                                        **options, **kwargs)
            quiet = opt.no_sync if how.get("quiet") else None
            try:  # every rank raises alike: the next run starts in step
                out[f"{case}/{name}"] = _train(model, model, opt, rank, overflows,
                                               how.get("passes", 1), quiet, how.get("clip"))
                out[f"{case}/{name}"]["buckets"] = len(opt._engine.buckets)
            except RuntimeError as exc:
                out[f"{case}/{name}"] = {"error": str(exc)}
            opt.close()
    try:
        out["refusals"] = _refusals(rank)
    except RuntimeError as exc:
        out["refusals"] = {"error": str(exc)}
    return out
