"""The rank side of tests/parallel/test_hooks.py: distopt's compression and steps during
backward under torch's DDP, in one gloo world of 2 ranks (``hook_ranks`` runs every
scenario). DDP builds one bucket in its first iteration and rebuilds them after it, so every
run here crosses a rebuild.
"""
import inspect
import threading
import warnings
from typing import Any, Dict, List

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook import PowerSGDState, powerSGD_hook

from distopt.parallel import (
    Cast,
    DataParallelOptimizer,
    PowerSGD,
    Threshold,
    TopK,
    compression_hook,
    optimizer_hook,
)
from distopt.parallel import compression as compression_module
from tests.helpers import error_of
from tests.parallel import trace_scenarios
from tests.parallel.cases import CASES
from tests.parallel.training import (
    COMPLEX_CASES,
    SMALL_BUCKETS_MB,
    ZERO_GRAD_CASES,
    Branchy,
    ComplexModel,
    data,
    flat_params,
    groups_of,
    loss_of,
    make_model,
    train_complex,
    train_unused,
)
from tests.state_hooks import hooks_seen

STEPS = 4
#: torch.optim's options that run the kernels the compiled step runs, where foreach=False
#: does not (fused Adam, AdamW and Adagrad; foreach NAdam and RAdam): with them the
#: parameters agree bit for bit.
SAME_KERNELS = {
    "Adam": {"fused": True},
    "AdamW": {"fused": True},
    "Adagrad": {"fused": True},
    "NAdam": {"foreach": True},
    "RAdam": {"foreach": True},
}


def _ddp(model: torch.nn.Module, **options: Any) -> DDP:
    return DDP(model, bucket_cap_mb=SMALL_BUCKETS_MB, **options)


def _batch(rank: int, world_size: int, step: int, seed: int = 1):
    x, y = data(4 * world_size, seed=seed + step)
    return x.chunk(world_size)[rank], y.chunk(world_size)[rank]


def _flat_grads(model: torch.nn.Module) -> torch.Tensor:
    return torch.cat([p.grad.reshape(-1) for p in model.parameters()])


def _torch_kwargs(cls: type, kwargs: Dict[str, Any]) -> Dict[str, Any]:
    """The reference's arguments: single-tensor torch.optim (foreach=False) where it has one."""
    if "foreach" in inspect.signature(cls).parameters:
        return {**kwargs, "foreach": False}
    return kwargs


def hook_ranks(rank: int, world_size: int) -> Dict[str, Any]:
    """Every scenario, in one world."""
    return {"compression": compression_ranks(rank, world_size),
            "optimizer": optimizer_ranks(rank, world_size),
            "trace": trace_scenarios.hook_profiled(rank, world_size)}


def compression_ranks(rank: int, world_size: int) -> Dict[str, Any]:
    """Cast(bf16) against DataParallelOptimizer, None against plain DDP, TopK / Threshold
    error feedback through DDP's bucket rebuild."""
    out: Dict[str, Any] = {}
    dpo_group = dist.new_group()

    # Cast(bfloat16): the hook's and DataParallelOptimizer's averages, from equal parameters.
    model = make_model()
    ddp = _ddp(model)
    state, hook = compression_hook(Cast(torch.bfloat16))
    ddp.register_comm_hook(state, hook)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, foreach=False)
    other = make_model()
    dpo = DataParallelOptimizer(torch.optim.SGD, other.parameters(), lr=0.1, overlap=False,
                                compression=Cast(torch.bfloat16), process_group=dpo_group,
                                bucket_cap_mb=SMALL_BUCKETS_MB)
    cast: Dict[str, List[torch.Tensor]] = {"local": [], "hook": [], "dpo": []}
    for step in range(STEPS):
        xs, ys = _batch(rank, world_size, step)
        local = torch.autograd.grad(loss_of(model, xs, ys), list(model.parameters()))
        cast["local"].append(torch.cat([g.reshape(-1) for g in local]))
        with torch.no_grad():
            for p, q in zip(other.parameters(), model.parameters()):
                p.copy_(q)
        loss_of(ddp, xs, ys).backward()
        cast["hook"].append(_flat_grads(model))
        loss_of(other, xs, ys).backward()
        cast["dpo"].append(_flat_grads(other))
        dpo.step()
        dpo.zero_grad()
        opt.step()
        opt.zero_grad()
    dpo.close()
    out["cast"] = cast
    out["cast_rebuilds"] = state.rebuilds

    # No compression against DDP's own reduction, with momentum.
    runs = {}
    for name in ("hook", "hook_views", "ddp"):
        model = make_model()
        ddp = _ddp(model, gradient_as_bucket_view=name == "hook_views")
        if name != "ddp":
            ddp.register_comm_hook(*compression_hook(None))
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, foreach=False)
        grads = []
        for step in range(STEPS):
            xs, ys = _batch(rank, world_size, step)
            loss_of(ddp, xs, ys).backward()
            grads.append(_flat_grads(model))
            opt.step()
            opt.zero_grad()
        runs[name] = {"params": flat_params(model), "grads": torch.stack(grads)}
    out["plain"] = runs

    # PowerSGD: one bucket, against torch's own hook on DDP; several buckets, it completes.
    runs = {}
    for name in ("torch", "hook", "hook-buckets"):
        model = make_model()
        ddp = DDP(model) if name != "hook-buckets" else _ddp(model)
        if name == "torch":
            ddp.register_comm_hook(PowerSGDState(None, start_powerSGD_iter=2), powerSGD_hook)
        else:
            ddp.register_comm_hook(*compression_hook(PowerSGD(start_iter=2)))
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, foreach=False)
        for step in range(3 * STEPS):
            xs, ys = _batch(rank, world_size, step)
            loss_of(ddp, xs, ys).backward()
            opt.step()
            opt.zero_grad()
        runs[name] = {"params": flat_params(model), "buckets": len(ddp.reducer._get_zeros_like_grad_buckets())}
    out["powersgd"] = runs

    # Error feedback: residual + everything sent = the sum of this rank's gradients.
    for name, scheme in (("topk", TopK(0.1)), ("threshold", Threshold(0.02))):
        out[name] = _error_feedback(rank, world_size, scheme)

    # find_unused_parameters=True: with track_usage, a parameter this rank did not use keeps
    # its residual (here a large one, which TopK would send first otherwise).
    for track in (False, True):
        model = Branchy()
        ddp = DDP(model, find_unused_parameters=True)
        state, hook = compression_hook(TopK(0.3))
        ddp.register_comm_hook(state, hook)
        if track:
            state.track_usage(model.parameters())
        kept = []
        for step, use in enumerate((True, False, False, True)):
            if step == 1:
                state.set_residual(model.extra.weight, torch.full((1, 8), 5.0))
            xs, ys = _batch(rank, world_size, step)
            ((ddp(xs, use) - ys) ** 2).mean().backward()
            model.zero_grad()
            kept.append(float(state.residual(model.extra.weight).abs().sum()))
        out[f"unused_residual/{track}"] = kept
    return out


def _error_feedback(rank: int, world_size: int, scheme: Any) -> Dict[str, Any]:
    model = make_model()
    params = list(model.parameters())
    ddp = _ddp(model)
    state, hook = compression_hook(scheme)
    ddp.register_comm_hook(state, hook)
    opt = torch.optim.SGD(params, lr=0.05, foreach=False)
    position = {id(p): i for i, p in enumerate(params)}
    sent_now = [torch.zeros_like(p) for p in params]

    threads = set()

    def record(index, indices, values):
        threads.add(threading.get_ident())  # where the collectives are issued
        # Bucket coordinates -> parameters, with the layout the hook uses right now.
        bucket = state.buckets[index]
        flat = torch.zeros(bucket.numel).index_add_(0, indices, values)
        for p, o in zip(bucket.params, bucket.offsets):
            sent_now[position[id(p)]] += flat[o:o + p.numel()].view(p.shape)

    total = [torch.zeros_like(p) for p in params]
    sent_total = [torch.zeros_like(p) for p in params]
    sent, averaged = [], []
    compression_module.sent_hook = record
    try:
        for step in range(6):
            xs, ys = _batch(rank, world_size, step, seed=3)
            local = torch.autograd.grad(loss_of(model, xs, ys), params)
            total = [t + g for t, g in zip(total, local)]
            for s in sent_now:
                s.zero_()
            loss_of(ddp, xs, ys).backward()
            sent.append([s.clone() for s in sent_now])
            sent_total = [t + s for t, s in zip(sent_total, sent_now)]
            averaged.append([p.grad.clone() for p in params])
            opt.step()
            opt.zero_grad()
    finally:
        compression_module.sent_hook = None
    worst = max(float((state.residual(p) + s - t).abs().max())
                for p, s, t in zip(params, sent_total, total))
    return {
        "worst": worst,
        "scale": max(float(t.abs().max()) for t in total),
        "residual_norm": sum(float(state.residual(p).norm()) for p in params),
        "sent": sent,
        "averaged": averaged,
        "rebuilds": state.rebuilds,
        "issued_by_backward_caller": threads == {threading.get_ident()},
    }


def _train(model, ddp, opt, rank, world_size, steps, sched=None):
    for step in range(steps):
        xs, ys = _batch(rank, world_size, step)
        loss_of(ddp, xs, ys).backward()
        opt.step()
        opt.zero_grad()
        if sched is not None:
            sched.step()
    return flat_params(model)


#: name -> an edit of an OptimizerInBackward's param_groups (groups: the first layer's 2
#: parameters, then the other 4); test_hooks.HOOK_EDIT_ERRORS: what every refusal must say.
HOOK_EDITS = {
    "appended": lambda g: g[0]["params"].append(torch.nn.Parameter(torch.zeros(3))),
    "moved-from-group-1": lambda g: g[0]["params"].append(g[1]["params"].pop(0)),
    "group-appended": lambda g: g.append({**g[1], "params": [torch.nn.Parameter(torch.zeros(3))]}),
    "group-deleted": lambda g: g.__delitem__(1),
    "key-deleted": lambda g: g[1].pop("betas"),
}


def optimizer_ranks(rank: int, world_size: int) -> Dict[str, Any]:
    """Every dense class through optimizer_hook, DDP + torch.optim and DataParallelOptimizer;
    schedulers, lr changes, unused parameters, state_dict, errors."""
    out: Dict[str, Any] = {}
    dpo_group = dist.new_group()
    for cls, kwargs in CASES:
        biases = cls is not torch.optim.Muon
        result = {}
        model = make_model(biases)
        ddp = _ddp(model)
        opt = optimizer_hook(ddp, cls, groups_of(model, kwargs["lr"]), **kwargs)
        result["hook"] = _train(model, ddp, opt, rank, world_size, STEPS)
        result["rebuilds"] = opt.hook_state.rebuilds
        model = make_model(biases)
        ddp = _ddp(model)
        ref = cls(groups_of(model, kwargs["lr"]), **_torch_kwargs(cls, kwargs))
        result["torch"] = _train(model, ddp, ref, rank, world_size, STEPS)
        if cls.__name__ in SAME_KERNELS:
            model = make_model(biases)
            ddp = _ddp(model)
            ref = cls(groups_of(model, kwargs["lr"]), **kwargs, **SAME_KERNELS[cls.__name__])
            result["torch_same_kernels"] = _train(model, ddp, ref, rank, world_size, STEPS)
        model = make_model(biases)
        dpo = DataParallelOptimizer(cls, groups_of(model, kwargs["lr"]), process_group=dpo_group,
                                    bucket_cap_mb=SMALL_BUCKETS_MB, **kwargs)
        result["dpo"] = _train(model, model, dpo, rank, world_size, STEPS)
        dpo.close()
        out[cls.__name__] = result

    # An lr scheduler, then a hand-made change: against DataParallelOptimizer and torch.optim.
    def schedule(opt):
        return torch.optim.lr_scheduler.LambdaLR(opt, lambda e: 0.5 ** e)

    runs = {}
    for name in ("hook", "dpo", "torch"):
        model = make_model()
        ddp = model if name == "dpo" else _ddp(model)
        groups = groups_of(model, 1e-2)
        if name == "hook":
            opt = optimizer_hook(ddp, torch.optim.Adam, groups, lr=1e-2)
        elif name == "dpo":
            opt = DataParallelOptimizer(torch.optim.Adam, groups, lr=1e-2,
                                        process_group=dpo_group, bucket_cap_mb=SMALL_BUCKETS_MB)
        else:
            opt = torch.optim.Adam(groups, lr=1e-2, fused=True)  # the compiled step's kernel
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            _train(model, ddp, opt, rank, world_size, STEPS, schedule(opt))
        before = flat_params(model)
        opt.param_groups[1]["lr"] = 0.0  # the second group must not move now
        after = _train(model, ddp, opt, rank, world_size, 1)
        runs[name] = {"before": before, "after": after, "lrs": [g["lr"] for g in opt.param_groups],
                      "warnings": [str(w.message) for w in caught]}
        if name == "hook":
            runs[name]["first_group"] = sum(p.numel() for p in model[0].parameters())
            sd = opt.state_dict()
            runs[name]["state_keys"] = sorted(sd["state"][0])
            local = torch.optim.Adam(groups_of(make_model(), 1e-2), lr=1e-2)
            local.load_state_dict(sd)  # moves to torch.optim ...
            opt.load_state_dict(local.state_dict())  # ... and back
            again = opt.state_dict()
            runs[name]["round_trip"] = all(
                torch.equal(again["state"][i][k], v)
                for i, entry in sd["state"].items() for k, v in entry.items()
            ) and again["param_groups"] == sd["param_groups"]
            runs[name]["bad_state"] = error_of(lambda: opt.load_state_dict(
                {"state": {0: {"exp_avg": torch.zeros(2)}}, "param_groups": sd["param_groups"]}))
            opt.param_groups[0]["amsgrad"] = True
            runs[name]["amsgrad"] = error_of(
                lambda: loss_of(ddp, *_batch(rank, world_size, 0)).backward())
        if name == "dpo":
            opt.close()
    out["schedule"] = runs

    # find_unused_parameters=True: what no rank used is left alone, as torch.optim leaves
    # a parameter whose .grad DDP left None.
    uses = [(False, False), (True, False), (False, False), (True, True), (False, False)]
    unused = {}
    for name in ("hook", "torch"):
        model = Branchy()
        ddp = DDP(model, find_unused_parameters=True)
        if name == "hook":
            opt = optimizer_hook(ddp, torch.optim.Adam, model.parameters(), lr=1e-2)
        else:
            opt = torch.optim.Adam(model.parameters(), lr=1e-2, fused=True)
        extra = []
        for step, used in enumerate(uses):
            xs, ys = _batch(rank, world_size, step)
            loss_of_branch = ((ddp(xs, used[rank]) - ys) ** 2).mean()
            loss_of_branch.backward()
            opt.step()
            opt.zero_grad()
            extra.append(flat_params(model.extra))
        unused[name] = {"params": flat_params(model), "extra": extra}
    out["unused"] = unused

    # zero_grad(set_to_none=False), a layer no rank uses in some steps: its zero .grad, which
    # DDP leaves as it is, is stepped as torch.optim steps it.
    zero = {}
    for case, (cls, kwargs) in ZERO_GRAD_CASES.items():
        for views in (False, True):
            for name in ("hook", "torch"):
                model = Branchy(never=True)
                ddp = DDP(model, find_unused_parameters=True, gradient_as_bucket_view=views)
                if name == "hook":
                    opt = optimizer_hook(ddp, cls, model.parameters(), **kwargs)
                else:
                    opt = cls(model.parameters(), **kwargs)
                zero[f"{case}/{views}/{name}"] = train_unused(model, ddp, opt, rank)
    out["zero_grads"] = zero

    # Complex parameters (several buckets of three dtypes): the hook's steps, and DDP's
    # reduction through compression_hook(None), against DDP + torch.optim; a compression
    # that carries real gradients only refuses them, naming the parameter.
    runs = {}
    for case, (cls, kwargs) in COMPLEX_CASES.items():
        for name in ("hook", "none", "torch"):
            model = ComplexModel()
            ddp = _ddp(model)
            if name == "hook":
                opt = optimizer_hook(ddp, cls, model.parameters(), **kwargs)
            else:
                if name == "none":
                    ddp.register_comm_hook(*compression_hook(None))
                opt = cls(model.parameters(), **kwargs)
            runs[f"{case}/{name}"] = train_complex(model, ddp, opt, rank)
    out["complex"] = runs
    model = ComplexModel()
    ddp = _ddp(model)
    out["complex_refused"] = error_of(lambda: optimizer_hook(
        ddp, torch.optim.SGD, model.parameters(), lr=0.1, compression=Threshold(0.1)))
    ddp.register_comm_hook(*compression_hook(TopK(0.5)))
    out["complex_refused_in_backward"] = error_of(lambda: train_complex(
        model, ddp, torch.optim.SGD(model.parameters(), lr=0.1), rank, steps=1))
    dist.barrier()

    # TopK residuals are saved with the optimizer's state.
    model = make_model()
    ddp = _ddp(model)
    opt = optimizer_hook(ddp, torch.optim.SGD, model.parameters(), lr=0.1, compression=TopK(0.2))
    _train(model, ddp, opt, rank, world_size, 2)
    residuals = opt.state_dict()["residuals"]
    out["residual_shapes"] = {i: tuple(r.shape) for i, r in residuals.items()}
    out["param_shapes"] = [tuple(p.shape) for p in model.parameters()]
    # The DDP habit: rank 0's state_dict loaded on every rank warns, once, where the
    # residuals are another rank's (issue 36: before, silently)
    box = [opt.state_dict() if rank == 0 else None]
    dist.broadcast_object_list(box, src=0)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        for _ in range(2):
            opt.load_state_dict(box[0])
    out["residual_warnings"] = [str(w.message) for w in seen if w.category is UserWarning]

    # A step that fails reaches backward, naming the rank and the bucket (every collective
    # was issued and completes, on both ranks, so the group stays usable).
    model = make_model()
    ddp = _ddp(model)
    opt = optimizer_hook(ddp, torch.optim.SGD, model.parameters(), lr=0.1)

    def broken_step(group, grads):
        raise RuntimeError("injected step failure")

    opt._step_group = broken_step
    out["step_failure"] = error_of(lambda: loss_of(ddp, *_batch(rank, world_size, 0)).backward())
    dist.barrier()

    # Edits of param_groups the compiled steps cannot follow: refused at the next backward
    # (before any collective), step, state_dict and load_state_dict; nothing moves.
    out["edits"] = {}
    for name, edit in HOOK_EDITS.items():
        model = make_model()
        ddp = _ddp(model)
        opt = optimizer_hook(ddp, torch.optim.Adam, groups_of(model, 1e-2), lr=1e-2)
        _train(model, ddp, opt, rank, world_size, 1)
        sd = opt.state_dict()
        before = flat_params(model)
        edit(opt.param_groups)
        out["edits"][name] = {
            "backward": error_of(lambda: loss_of(ddp, *_batch(rank, world_size, 1)).backward()),
            "step": error_of(opt.step),
            "state_dict": error_of(opt.state_dict),
            "load_state_dict": error_of(lambda: opt.load_state_dict(sd)),
            "unchanged": torch.equal(flat_params(model), before),
        }
    dist.barrier()
    out["errors_duplicate"] = error_of(lambda: optimizer_hook(
        _ddp(make_model()), torch.optim.SGD, [{"params": [p]} for p in [*model[0].parameters(),
                                                                      model[0].weight]]))

    # A second step() with no backward pass in between is refused, nothing moving
    # (torch.optim would step the same gradients again; each bucket stepped once, during
    # backward); after zero_grad() it does nothing, as torch.optim.
    model = make_model()
    ddp = _ddp(model)
    opt = optimizer_hook(ddp, torch.optim.SGD, model.parameters(), lr=0.1, momentum=0.9)
    _train(model, ddp, opt, rank, world_size, 1)
    loss_of(ddp, *_batch(rank, world_size, 1)).backward()
    opt.step()
    before = flat_params(model)
    out["second_step"] = error_of(opt.step)
    out["second_step_unchanged"] = torch.equal(flat_params(model), before)
    opt.zero_grad()
    out["step_after_zero_grad"] = error_of(opt.step)

    # Errors, before any collective.
    model = make_model()
    frozen = torch.nn.Linear(2, 2)
    frozen.weight.requires_grad_(False)
    model.add_module("frozen", frozen)
    ddp = _ddp(model)
    errors = {
        "outsider": lambda: optimizer_hook(ddp, torch.optim.SGD,
                                           [torch.nn.Parameter(torch.zeros(3))], lr=0.1),
        "frozen": lambda: optimizer_hook(ddp, torch.optim.SGD, [frozen.weight], lr=0.1),
        "sparse_adam": lambda: optimizer_hook(ddp, torch.optim.SparseAdam, model.parameters()),
        "lbfgs": lambda: optimizer_hook(ddp, torch.optim.LBFGS, model.parameters()),
        "subclass": lambda: optimizer_hook(ddp, type("MyAdam", (torch.optim.Adam,), {}),
                                           model.parameters()),
        "not_ddp": lambda: optimizer_hook(model, torch.optim.SGD, model.parameters(), lr=0.1),
        "compression": lambda: compression_hook("topk"),
        "lr": lambda: optimizer_hook(ddp, torch.optim.SGD, model.parameters(), lr=-1.0),
        "model_as_params": lambda: optimizer_hook(ddp, torch.optim.SGD, model, lr=0.1),
        "optimizer_instance": lambda: optimizer_hook(
            ddp, torch.optim.SGD(model.parameters(), lr=0.1), model.parameters()),
    }
    out["errors"] = {name: error_of(fn) for name, fn in errors.items()}
    model = make_model(True)
    ddp = _ddp(model)
    opt = optimizer_hook(ddp, torch.optim.SGD, model.parameters(), lr=0.1, momentum=0.9)
    ddp(torch.ones(2, 6)).sum().backward()
    out["state_dict_hooks"] = hooks_seen(opt)
    return out
