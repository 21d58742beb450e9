"""Rank functions for tests/parallel/test_arrival.py: buckets rebuilt in arrival order.

The model registers its layers in one order and uses them in the reverse one, so backward
produces the gradients of the first-registered layers first: the construction's buckets
(reverse registration order) are exactly the wrong way round, and the first bucket's
reduction waits for the whole backward pass until the optimizer rebuilds them.
"""
import copy
from typing import Any, Dict, List

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from distopt.parallel import PowerSGD, TopK
from distopt.parallel import optimizer as dp_optimizer
from distopt.parallel.reducer import GradientReducer
from tests.parallel.training import whole_state_dict
from tests.state_hooks import hooks_seen

LAYERS = 6
WIDTH = 48
STEPS = 5
#: Small buckets: several of them (about two layers each) at construction.
CAP_MB = 2 * (WIDTH * WIDTH + WIDTH) * 4 / 2**20


class Reversed(torch.nn.Module):
    """Layers used in the reverse of their registration order; a head used last."""

    def __init__(self, width: int = WIDTH, layers: int = LAYERS, outputs: int = 1) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.Linear(width, width) for _ in range(layers))
        self.head = torch.nn.Linear(width, outputs)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in reversed(self.layers):
            x = torch.tanh(layer(x))
        return self.head(x)


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return Reversed()


def _batches(rank: int, steps: int) -> List[torch.Tensor]:
    g = torch.Generator().manual_seed(100 + rank)
    return [(torch.randn(8, WIDTH, generator=g), torch.randn(8, 1, generator=g))
            for _ in range(steps)]


class _Events:
    """Per backward pass: how many gradients had arrived when the first reduction could be
    issued (bucket 0 complete)."""

    def __init__(self) -> None:
        self.arrived = 0
        self.first_launch: List[int] = []
        self.launched = False

    def start(self) -> None:
        self.arrived = 0
        self.launched = False


def _instrument(events: _Events) -> Any:
    on_grad, launch = GradientReducer.on_grad, GradientReducer._launch

    def counted_on_grad(self, bucket, slot, param):
        events.arrived += 1
        return on_grad(self, bucket, slot, param)

    def counted_launch(self, bucket):
        # The communication thread issues the buckets in order: the first reduction
        # starts when bucket 0 is complete.
        if bucket.index == 0 and not events.launched:
            events.launched = True
            events.first_launch.append(events.arrived)
        return launch(self, bucket)

    GradientReducer.on_grad = counted_on_grad
    GradientReducer._launch = counted_launch
    return lambda: (setattr(GradientReducer, "on_grad", on_grad),
                    setattr(GradientReducer, "_launch", launch))


def _ddp_run(cls: type, kwargs: Dict[str, Any], batches: List[Any]) -> List[torch.Tensor]:
    model = _model()
    ddp = DistributedDataParallel(model, bucket_cap_mb=CAP_MB)
    opt = cls(model.parameters(), **kwargs)
    out = []
    for x, y in batches:
        opt.zero_grad()
        torch.nn.functional.mse_loss(ddp(x), y).backward()
        opt.step()
        out.append(torch.cat([p.detach().reshape(-1).clone() for p in model.parameters()]))
    return out


def parity(rank: int, world_size: int) -> Dict[str, Any]:
    """Every configuration against DDP + torch.optim after every step, the layouts, and
    when the first reduction launched in each backward pass."""
    batches = _batches(rank, STEPS)
    configs = {
        "sgd-overlap": (torch.optim.SGD, {"lr": 0.05, "momentum": 0.9}, {}),
        "sgd": (torch.optim.SGD, {"lr": 0.05, "momentum": 0.9}, {"overlap": False}),
        "adamw-overlap": (torch.optim.AdamW, {"lr": 0.01, "fused": True}, {}),
        "adamw-flat": (torch.optim.AdamW, {"lr": 0.01, "fused": True}, {"shard": "flat"}),
        "adam-param": (torch.optim.Adam, {"lr": 0.01, "fused": True}, {"shard": "param"}),
        "rprop-eager-param": (torch.optim.Rprop, {"lr": 0.01}, {"shard": "param"}),
        "adagrad-accumulate": (torch.optim.Adagrad, {"lr": 0.05},
                               {"backward_passes_per_step": 2}),
    }
    out: Dict[str, Any] = {}
    for name, (cls, kwargs, options) in configs.items():
        passes = options.get("backward_passes_per_step", 1)
        reference = _ddp_run(cls, kwargs, batches) if passes == 1 else None
        events = _Events()
        restore = _instrument(events)
        try:
            model = _model()
            opt = dp_optimizer.DataParallelOptimizer(
                _eager_class(cls) if "eager" in name else cls, model.parameters(),
                bucket_cap_mb=CAP_MB, **options, **kwargs)
            layouts, exact = [opt.bucket_layout()], []
            for step, (x, y) in enumerate(batches):
                opt.zero_grad()
                for k in range(passes):
                    events.start()
                    torch.nn.functional.mse_loss(model(x[k::passes]), y[k::passes]).backward()
                opt.step()
                layouts.append(opt.bucket_layout())
                if reference is not None:
                    now = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
                    exact.append(bool(torch.equal(now, reference[step])))
            out[name] = {
                "layouts": layouts, "exact": exact, "first_launch": events.first_launch,
                "params": torch.cat([p.detach().reshape(-1).clone() for p in model.parameters()]),
                "state": _flat_state(whole_state_dict(opt)),
                "grads_are_views": all(
                    any(p.grad is g for b in opt._engine.buckets for g in b.grads)
                    for p in model.parameters()
                ),
            }
            opt.close()
        finally:
            restore()
    out["arrival"] = _arrival_order(rank)
    out["carried"] = carried(rank, world_size)
    return out


def _train(model: torch.nn.Module, opt: Any, part: List[Any]) -> None:
    for x, y in part:
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()


def _resumed(make: Any, save: Any, load: Any, batches: List[Any], split: int) -> Dict[str, Any]:
    """Train ``make(model)`` on ``batches[:split]``, ``save(opt)``, train on the rest; then a
    new model with the saved parameters and a new optimizer that ``load(opt, saved)``s
    before its first step trains on the rest too: whether both end equal, the saved
    state, and the layouts (saved; the new one's as built, after loading, at the end)."""
    model = _model()
    opt = make(model)
    _train(model, opt, batches[:split])
    saved = save(opt)
    saved_params = [p.detach().clone() for p in model.parameters()]
    saved_layout = opt.bucket_layout()
    _train(model, opt, batches[split:])
    straight = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    opt.close()
    model = _model()
    with torch.no_grad():
        for p, v in zip(model.parameters(), saved_params):
            p.copy_(v)
    resumed = make(model)
    before = resumed.bucket_layout()
    load(resumed, saved)
    after = resumed.bucket_layout()
    _train(model, resumed, batches[split:])
    again = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    final = resumed.bucket_layout()
    resumed.close()
    return {"equal": bool(torch.equal(straight, again)), "saved": saved,
            "saved_layout": saved_layout, "before": before, "after": after, "final": final}


def _eager_class(cls: type) -> type:
    """A subclass of ``cls`` with no functional twin: it steps eagerly."""
    return type(f"Eager{cls.__name__}", (cls,), {})


def _flat_state(sd: Dict[str, Any]) -> Dict[str, torch.Tensor]:
    out = {}
    for i, entry in sd["state"].items():
        for key, value in entry.items():
            if isinstance(value, torch.Tensor):
                out[f"{i}.{key}"] = value.detach().clone()
    for i, value in sd.get("residuals", {}).items():
        out[f"residual.{i}"] = value.detach().clone()
    return out


def _arrival_order(rank: int) -> List[int]:
    """The global indices in the order their gradients arrive (one plain backward)."""
    model = _model()
    order: List[int] = []
    params = list(model.parameters())
    for i, p in enumerate(params):
        p.register_post_accumulate_grad_hook(lambda _p, i=i: order.append(i))
    x, y = _batches(rank, 1)[0]
    torch.nn.functional.mse_loss(model(x), y).backward()
    return order


def carried(rank: int, world_size: int) -> Dict[str, Any]:
    """What the rebuild carries: after the first step (the rebuild at its end) the state
    (whole, residuals included) equals that of an optimizer that keeps its buckets, for
    state loaded before the first step too; and the runs go on alike where the layout does
    not change what is computed."""
    batches = _batches(rank, 3)
    out: Dict[str, Any] = {}
    cases = {
        "adam-flat-loaded": (torch.optim.Adam, {"lr": 0.01}, {"shard": "flat"}, True),
        "sgd-topk": (torch.optim.SGD, {"lr": 0.05, "momentum": 0.9},
                     {"compression": TopK(0.5)}, False),
        "adam-param-loaded": (torch.optim.Adam, {"lr": 0.01}, {"shard": "param"}, True),
    }
    for name, (cls, kwargs, options, load_first) in cases.items():
        states = {}
        for rebuild in (True, False):
            model = _model()
            opt = dp_optimizer.DataParallelOptimizer(
                cls, model.parameters(), bucket_cap_mb=CAP_MB, rebuild_buckets=rebuild,
                **options, **kwargs)
            if load_first:
                # A state as a local torch.optim leaves it, loaded before the first step.
                local_model = _model()
                local = cls(local_model.parameters(), **kwargs)
                x, y = batches[0]
                torch.nn.functional.mse_loss(local_model(x), y).backward()
                local.step()
                opt.load_state_dict(copy.deepcopy(local.state_dict()))
            x, y = batches[1]
            opt.zero_grad()
            torch.nn.functional.mse_loss(model(x), y).backward()
            opt.step()
            states[rebuild] = (_flat_state(whole_state_dict(opt)), opt.bucket_layout(),
                               [p.grad.clone() for p in model.parameters()])
            opt.close()
        (s1, l1, g1), (s0, l0, g0) = states[True], states[False]
        out[name] = {
            "same_state": sorted(s1) == sorted(s0) and all(torch.equal(s1[k], s0[k]) for k in s1),
            "entries": len(s1),
            "same_grads": all(torch.equal(a, b) for a, b in zip(g1, g0)),
            "rebuilt": l1 != l0,
        }
    return out


def powersgd_resume(rank: int, world_size: int) -> Dict[str, Any]:
    """PowerSGD (error feedback, warm start) across a checkpoint: a run that saves after
    its buckets were rebuilt and goes on equals a new optimizer that loads the state before
    its first step (it takes the saved layout) and goes on."""
    batches = _batches(rank, 6)

    def make(model):
        return dp_optimizer.DataParallelOptimizer(
            torch.optim.SGD, model.parameters(), lr=0.05, momentum=0.9, bucket_cap_mb=CAP_MB,
            compression=PowerSGD(rank=2, start_iter=2, min_compression_rate=0.5))

    got = _resumed(make, lambda opt: copy.deepcopy(whole_state_dict(opt)),
                   lambda opt, saved: opt.load_state_dict(saved), batches, 4)
    return {
        "saved_layout": got["saved_layout"], "before": got["before"], "after": got["after"],
        "final": got["final"], "equal": got["equal"],
        "error_entries": len(got["saved"]["compression"]["error_dict"]),
    }


def joined_first(rank: int, world_size: int) -> Dict[str, Any]:
    """Under Join, rank 1 has no batch at all: the first step is shadowed, no rank rebuilds,
    and the run ends (no hang) with equal parameters on both ranks."""
    from torch.distributed.algorithms import Join

    batches = _batches(rank, 3 if rank == 0 else 0)
    model = _model()
    opt = dp_optimizer.DataParallelOptimizer(
        torch.optim.SGD, model.parameters(), lr=0.05, bucket_cap_mb=CAP_MB)
    first = opt.bucket_layout()
    with Join([opt]):
        for x, y in batches:
            opt.zero_grad()
            torch.nn.functional.mse_loss(model(x), y).backward()
            opt.step()
    # A new epoch, even: every rank steps; the buckets stay as they were.
    x, y = _batches(rank, 1)[0]
    opt.zero_grad()
    torch.nn.functional.mse_loss(model(x), y).backward()
    opt.step()
    params = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    every = [torch.empty_like(params) for _ in range(world_size)]
    dist.all_gather(every, params)
    out = {"kept": opt.bucket_layout() == first,
           "equal": all(torch.equal(every[0], e) for e in every)}
    opt.close()
    return out


class _WithNorm(Reversed):
    """``Reversed`` with a BatchNorm after the head's input: buffers to broadcast."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = torch.nn.BatchNorm1d(WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in reversed(self.layers):
            x = torch.tanh(layer(x))
        return self.head(self.norm(x))


def _flat(model: torch.nn.Module) -> torch.Tensor:
    return torch.cat([t.detach().reshape(-1) for t in
                      list(model.parameters()) + list(model.buffers())
                      if t.is_floating_point()])


def habits(rank: int, world_size: int, path: str) -> Dict[str, Any]:
    """Across the rebuild, against DDP + torch.optim after every step: a GradScaler whose
    first step overflows (skipped) and later ones do not; ``module=`` with BatchNorm
    buffers; and a sharded checkpoint saved after the rebuild, loaded by a new optimizer
    (its buckets as built) before its first step, going on as the uninterrupted run."""
    batches = _batches(rank, 4)
    out: Dict[str, Any] = {}

    # GradScaler: the first step overflows (inf scale), the next ones step.
    def scaled(make_opt, wrap):
        torch.manual_seed(0)
        model = Reversed()
        net, opt = wrap(model), make_opt(model)
        scaler = torch.amp.GradScaler("cpu", init_scale=1024.0, growth_interval=1)
        seen = []
        for step, (x, y) in enumerate(batches):
            opt.zero_grad()
            loss = torch.nn.functional.mse_loss(net(x), y)
            if step == 0:
                loss = loss * float("inf")  # inf gradients: the scaler skips this step
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            seen.append((torch.cat([p.detach().reshape(-1) for p in model.parameters()]),
                         float(scaler.get_scale())))
        return seen, opt

    ddp, _ = scaled(lambda m: torch.optim.Adam(m.parameters(), lr=0.01, fused=True),
                    lambda m: DistributedDataParallel(m, bucket_cap_mb=CAP_MB))
    mine, opt = scaled(lambda m: dp_optimizer.DataParallelOptimizer(
        torch.optim.Adam, m.parameters(), lr=0.01, fused=True, bucket_cap_mb=CAP_MB),
        lambda m: m)
    out["scaler"] = {"exact": [torch.equal(a[0], b[0]) and a[1] == b[1]
                               for a, b in zip(ddp, mine)],
                     "scales": [s for _, s in mine], "rebuilt": opt.bucket_layout()[0] != [13, 12, 11, 10, 9]}
    opt.close()

    # module=: BatchNorm statistics broadcast as DDP's broadcast_buffers.
    def buffered(use_ddp):
        torch.manual_seed(0)
        model = _WithNorm()
        with torch.no_grad():  # ranks start with other statistics: the broadcast shows
            model.norm.running_mean.fill_(float(rank))
        if use_ddp:
            net = DistributedDataParallel(model, bucket_cap_mb=CAP_MB)
            opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        else:
            net = model
            opt = dp_optimizer.DataParallelOptimizer(
                torch.optim.SGD, model.parameters(), lr=0.05, momentum=0.9,
                bucket_cap_mb=CAP_MB, module=model)
        seen = []
        for x, y in batches:
            opt.zero_grad()
            torch.nn.functional.mse_loss(net(x), y).backward()
            opt.step()
            seen.append(_flat(model))
        if not use_ddp:
            opt.close()
        return seen

    out["module"] = [torch.equal(a, b) for a, b in zip(buffered(True), buffered(False))]

    # A sharded checkpoint across the rebuild.
    def make(model):
        return dp_optimizer.DataParallelOptimizer(
            torch.optim.AdamW, model.parameters(), lr=0.01, fused=True, shard="flat",
            bucket_cap_mb=CAP_MB)

    got = _resumed(make, lambda opt: opt.save(path), lambda opt, _: opt.load(path),
                   batches, 2)
    out["checkpoint"] = {"equal": got["equal"],
                         "rebuilt_after_load": got["final"] != got["before"]}
    return out


def everything(rank: int, world_size: int, path: str) -> Dict[str, Any]:
    """The module's one world: every scenario above, in turn."""
    out = parity(rank, world_size)
    out["powersgd"] = powersgd_resume(rank, world_size)
    out["joined"] = joined_first(rank, world_size)
    out["habits"] = habits(rank, world_size, path)
    from distopt import local_optimizer

    model = _model()
    live = len(local_optimizer.live_by_id)
    opt = dp_optimizer.DataParallelOptimizer(torch.optim.Adam, model.parameters(), lr=0.01)
    # Its compiled steps are its own: nothing in the RPC owners' registry.
    out["registered"] = len(local_optimizer.live_by_id) - live
    torch.nn.functional.mse_loss(model(torch.ones(2, WIDTH)), torch.zeros(2, 1)).backward()
    opt.step()
    out["state_dict_hooks"] = hooks_seen(opt)
    opt.close()
    return out


class _ThreeReversed(torch.nn.Module):
    """Three weights used in the reverse of their registration order."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList(
            torch.nn.Linear(WIDTH, WIDTH, bias=False) for _ in range(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in reversed(self.layers):
            x = torch.tanh(layer(x))
        return x.sum(dim=1, keepdim=True)


def sharded_rank_without_pieces(rank: int, world_size: int) -> Dict[str, Any]:
    """``shard="param"`` on more ranks than parameters: a rank holds no pieces (no compiled
    steps) yet takes part in the rebuild's gather of the state; the same run with the
    construction's buckets beside it."""
    batches = _batches(rank, 3)
    out: Dict[str, Any] = {}
    for rebuild in (True, False):
        torch.manual_seed(0)
        model = _ThreeReversed()
        opt = dp_optimizer.DataParallelOptimizer(
            torch.optim.Adam, model.parameters(), lr=0.01, shard="param",
            bucket_cap_mb=CAP_MB, rebuild_buckets=rebuild)
        built = opt.bucket_layout()
        for x, y in batches:
            opt.zero_grad()
            torch.nn.functional.mse_loss(model(x), y).backward()
            opt.step()
        out[rebuild] = {"built": built, "layout": opt.bucket_layout(),
                        "holds_pieces": opt._engine.units.steps is not None,
                        "params": torch.cat([p.detach().flatten() for p in model.parameters()])}
        opt.close()
    return out
