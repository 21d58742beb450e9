"""What each rank runs in the sharded-state tests (``shard="param"`` / ``"flat"``).

The reference for every number is the unsharded DataParallelOptimizer with the same
options (its parity with torch.optim is tested in test_parity.py): sharding must not change
a bit of the parameters or of the state_dict.
"""
import json
import math
import os
from typing import Any, Dict, List, Optional

import torch
import torch.distributed as dist

from distopt.parallel import Cast, DataParallelOptimizer, PowerSGD, TopK
from tests.helpers import identical
from tests.parallel import training
from tests.parallel.cases import CASES
from tests.parallel.training import eager_class, flat_params, whole_state_dict

#: Buckets of at most 1,200 float32 elements: the model below has four, one holding
#: several parameters, and the "flat" cuts fall inside parameters of 1,961 and 1,537.
BUCKETS_MB = 1200 * 4 / 2**20
SHAPED = ("Adafactor", "Muon")


def make_model(biases: bool = True, seed: int = 0) -> torch.nn.Module:
    return training.make_model(biases, seed, sizes=(37, 53, 29, 1))


def batch(rank: int, world_size: int, step: int, n: int = 8):
    g = torch.Generator().manual_seed(1000 * step + rank)
    x = torch.randn(n, 37, generator=g)
    return x, x[:, :1].tanh() - 0.5 * x[:, 1:2]


def groups(model: torch.nn.Module, lr: float) -> List[Dict[str, Any]]:
    first = list(model[0].parameters())
    rest = [p for p in model.parameters() if all(p is not q for q in first)]
    return [{"params": first}, {"params": rest, "lr": lr / 2}]


def train(opt, model, rank, world_size, steps, first=0, scheduler=None, passes=1, clip=None):
    for step in range(first, first + steps):
        for k in range(passes):
            x, y = batch(rank, world_size, 10 * step + k)
            ((model(x) - y) ** 2).mean().backward()
        if clip is not None:
            opt.clip_grad_norm_(clip)
        opt.step()
        opt.zero_grad()
        if scheduler is not None:
            scheduler.step()


def parity(rank: int, world_size: int, steps: int, overlaps: List[bool],
           names: Optional[List[str]] = None) -> Dict[str, Any]:
    """Every class (or those ``names``), sharded each way it can be, against the unsharded
    optimizer."""
    out: Dict[str, Any] = {}
    for cls, kwargs in CASES:
        if names is not None and cls.__name__ not in names:
            continue
        biases = cls is not torch.optim.Muon
        model = make_model(biases)
        ref = DataParallelOptimizer(cls, groups(model, kwargs["lr"]), bucket_cap_mb=BUCKETS_MB,
                                    **kwargs)
        train(ref, model, rank, world_size, steps)
        ref_params, ref_state = flat_params(model), ref.state_dict()
        total = ref.state_bytes()
        largest = max(
            sum(v.numel() * v.element_size() for v in e.values() if isinstance(v, torch.Tensor))
            for e in ref._engine.units.torch_state(copy=False).values()
        )
        ref.close()
        for shard in ("param", "flat"):
            if shard == "flat" and cls.__name__ in SHAPED:
                continue
            for overlap in overlaps:
                model = make_model(biases)
                opt = DataParallelOptimizer(
                    cls, groups(model, kwargs["lr"]), bucket_cap_mb=BUCKETS_MB, shard=shard,
                    overlap=overlap, **kwargs,
                )
                train(opt, model, rank, world_size, steps)
                out[f"{cls.__name__}/{shard}/{overlap}"] = {
                    "params": flat_params(model),
                    "exact": bool(torch.equal(flat_params(model), ref_params)),
                    "state_exact": identical(whole_state_dict(opt)["state"], ref_state["state"]),
                    "state_bytes": opt.state_bytes(),
                    "total": total,
                    "largest": largest,
                    "buckets": len(opt._engine.buckets),
                    "cut_inside": any(pc.start > 0 for b in opt._engine.buckets
                                      for part in b.shard.pieces for pc in part),
                }
                opt.close()
    return out


def features(rank: int, world_size: int) -> Dict[str, Any]:
    """Accumulation, a scheduler, compression, clipping, an unused parameter and a
    non-contiguous parameter, sharded both ways, against the unsharded optimizer with the same options."""
    configs = {
        "accumulate": {"backward_passes_per_step": 2},
        "scheduler": {},
        "bf16": {"compression": Cast(torch.bfloat16)},
        "topk": {"compression": TopK(0.1)},
        "powersgd": {"compression": PowerSGD(start_iter=2)},
        "no-overlap": {"overlap": False},
        "clip": {"overlap": False},
    }
    out: Dict[str, Any] = {}
    for name, options in configs.items():
        results = {}
        for shard in (None, "param", "flat"):
            model = make_model()
            opt = DataParallelOptimizer(torch.optim.AdamW, groups(model, 1e-2), lr=1e-2,
                                        bucket_cap_mb=BUCKETS_MB, shard=shard, **options)
            scheduler = None
            if name == "scheduler":
                scheduler = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
            train(opt, model, rank, world_size, 6, scheduler=scheduler,
                  passes=options.get("backward_passes_per_step", 1),
                  clip=0.05 if name == "clip" else None)
            results[shard] = (flat_params(model), whole_state_dict(opt))
            opt.close()
        out[name] = {
            shard: bool(torch.equal(results[shard][0], results[None][0]))
            and identical(results[shard][1]["state"], results[None][1]["state"])
            for shard in ("param", "flat")
        }
    # An eager class (no functional twin), "param" only: against the unsharded eager one,
    # and its state_dict and checkpoint.
    results = {}
    for shard in (None, "param"):
        model = make_model()
        opt = DataParallelOptimizer(eager_class(torch.optim.Adam), groups(model, 1e-2),
                                    lr=1e-2, bucket_cap_mb=BUCKETS_MB, shard=shard)
        train(opt, model, rank, world_size, 4)
        results[shard] = (flat_params(model), whole_state_dict(opt), opt.state_bytes())
        if shard is not None:
            opt.load_state_dict(results[None][1])
            reloaded = identical(whole_state_dict(opt)["state"], results[None][1]["state"])
        opt.close()
    out["eager"] = {"param": bool(torch.equal(results["param"][0], results[None][0]))
                    and identical(results["param"][1]["state"], results[None][1]["state"])
                    and reloaded
                    and results["param"][2] < 0.75 * results[None][2],
                    "flat": True}
    # Adafactor keeps a matrix's state as two vectors: balanced by state, not elements.
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(100, 100))] + [
        torch.nn.Parameter(torch.randn(500)) for _ in range(20)]
    held = {}
    for shard in (None, "param"):
        opt = DataParallelOptimizer(torch.optim.Adafactor, params, lr=1e-2, shard=shard)
        sum(((p - 1) ** 2).sum() for p in params).backward()
        opt.step()
        opt.zero_grad()
        held[shard] = opt.state_bytes()
        if shard is None:
            largest = max(sum(v.numel() * v.element_size() for v in e.values())
                          for e in opt._engine.units.torch_state(copy=False).values())
        opt.close()
    out["adafactor-bound"] = {
        "param": held["param"] <= math.ceil(held[None] / world_size) + largest, "flat": True,
    }
    # Parameters no rank uses (model[2], idle), and one laid out transposed.
    results = {}
    for shard in (None, "param", "flat"):
        torch.manual_seed(0)
        model = make_model()
        # 53 x 30 with strides (1, 53), and a channels_last conv weight: 1,590 and 735
        # elements, not multiples of the kernels' vector width, so the last elements are
        # stepped apart, and must be the same ones as when the whole parameter is stepped.
        odd = torch.nn.Parameter(torch.randn(30, 53).t())
        conv = torch.nn.Parameter(torch.randn(5, 3, 7, 7).to(memory_format=torch.channels_last))
        idle = torch.nn.Parameter(torch.randn(70))
        extra = [odd, conv, idle]
        opt = DataParallelOptimizer(torch.optim.SGD, list(model.parameters()) + extra,
                                    lr=1e-2, momentum=0.9, bucket_cap_mb=BUCKETS_MB, shard=shard)
        for step in range(8):
            x, y = batch(rank, world_size, step)
            h = model[1](model[0](x))
            loss = ((model[4](model[3](h @ odd[:, :29])) - y) ** 2).mean()
            (loss + x[:, :1].mean() * (conv ** 2).sum() * 1e-3).backward()
            opt.step()
            opt.zero_grad()
        results[shard] = (torch.cat([flat_params(model)] + [t.detach().reshape(-1) for t in extra]),
                          whole_state_dict(opt))
        assert not odd.is_contiguous() and not conv.is_contiguous()
        opt.close()
    out["odd"] = {
        shard: bool(torch.equal(results[shard][0], results[None][0]))
        and identical(results[shard][1]["state"], results[None][1]["state"])
        # model[2] (bypassed by the forward above) and ``idle`` have no state
        and sorted(results[shard][1]["state"]) == [0, 1, 4, 5, 6, 7]
        for shard in ("param", "flat")
    }
    return out


def save(rank: int, world_size: int, paths: Dict[str, str]) -> Dict[str, Any]:
    """Per shard mode (-> its directory): train 3 steps sharded, save; the state_dict at the
    save and the model."""
    out = {}
    for shard, path in paths.items():
        model = make_model()
        opt = DataParallelOptimizer(torch.optim.Adam, groups(model, 1e-2), lr=1e-2,
                                    bucket_cap_mb=BUCKETS_MB, shard=shard)
        empty = whole_state_dict(opt)  # at any time: before the first step too
        assert empty["state"] == {} and [g["lr"] for g in empty["param_groups"]] == [1e-2, 5e-3]
        train(opt, model, rank, world_size, 3)
        manifest = opt.save(path)
        out[shard] = {"model": {k: v.clone() for k, v in model.state_dict().items()},
                      "saved": whole_state_dict(opt), "files": sorted(os.listdir(path)),
                      "manifest": manifest}
        opt.close()
    return out


def resume(rank: int, world_size: int, paths: Dict[str, str],
           saved: Dict[str, Any]) -> Dict[str, Any]:
    """Load each checkpoint (saved by another world size) into "flat", "param", unsharded
    and eager "param" optimizers; each equals the saved state, and all then train alike
    (the eager one runs torch.optim's Adam: within float precision of the others)."""
    out = {}
    for source, path in paths.items():
        for shard in ("flat", "param", None, "eager"):
            model = make_model()
            model.load_state_dict(saved[source]["model"])
            cls = eager_class(torch.optim.Adam) if shard == "eager" else torch.optim.Adam
            opt = DataParallelOptimizer(cls, groups(model, 1e-2), lr=1e-2,
                                        bucket_cap_mb=BUCKETS_MB,
                                        shard="param" if shard == "eager" else shard)
            if shard == "eager":  # the checkpoint names its class, Adam
                opt.load_state_dict(saved[source]["saved"])
            else:
                opt.load(path)
            loaded = identical(whole_state_dict(opt)["state"], saved[source]["saved"]["state"])
            train(opt, model, rank, world_size, 3, first=3)
            out[f"{source}->{shard}"] = {"loaded": loaded, "params": flat_params(model)}
            opt.close()
    return out


def bad_arguments(rank: int, world_size: int) -> Dict[str, str]:
    model = make_model()
    calls = {
        "mode": lambda: DataParallelOptimizer(torch.optim.SGD, model.parameters(), lr=0.1,
                                              shard="rows"),
        "flat-adafactor": lambda: DataParallelOptimizer(torch.optim.Adafactor,
                                                        model.parameters(), shard="flat"),
        "eager": lambda: DataParallelOptimizer(eager_class(torch.optim.SGD), model.parameters(),
                                               lr=0.1, shard="flat"),
    }
    out = {}
    for name, call in calls.items():
        try:
            call()
        except (TypeError, ValueError) as exc:
            out[name] = str(exc)
    return out


def load_refuses_gaps(rank: int, world_size: int, path: str) -> str:
    """A shard file of the checkpoint is replaced by one missing a piece: load refuses on
    every rank and nothing changes."""
    model = make_model()
    opt = DataParallelOptimizer(torch.optim.Adam, model.parameters(), lr=1e-2,
                                bucket_cap_mb=BUCKETS_MB, shard="flat")
    train(opt, model, rank, world_size, 2)
    manifest = opt.save(path)
    before = whole_state_dict(opt)
    if rank == 0:
        name = os.path.join(path, f"dp-{manifest['generation']}-shard-rank1.pt")
        part = torch.load(name, weights_only=True)
        dropped = next(iter(part["pieces"]))
        del part["pieces"][dropped]
        torch.save(part, name)
        # ...and the manifest agrees with the new file: only the coverage check can tell.
        from distopt.checkpoint import crc32_of
        where = os.path.join(path, "manifest.json")
        with open(where) as f:
            recorded = json.load(f)
        recorded["files"][os.path.basename(name)] = {
            "bytes": os.path.getsize(name), "crc32": crc32_of(name)}
        with open(where, "w") as f:
            json.dump(recorded, f)
    dist.barrier()
    try:
        opt.load(path)
        message = ""
    except ValueError as exc:
        message = str(exc)
    assert identical(whole_state_dict(opt)["state"], before["state"])
    opt.close()
    return message


def memory_bound(total: int, largest: int, world_size: int, shard: str, buckets: int,
                 params: int) -> int:
    """The most state bytes one rank may hold: ceil(S / W) plus, "param", the largest
    parameter's state; "flat", per bucket the 64 elements a cut may move (ALIGN; 8 bytes of
    state per element for these classes at most), and the 0-dim state (step, mu_product,
    eta, mu: 16 bytes at most) of every piece, which a parameter cut in two has twice and a
    rank may hold for more parameters than its share."""
    bound = math.ceil(total / world_size)
    if shard == "param":
        return bound + largest
    return bound + buckets * 64 * 8 + 16 * (params + 2 * buckets)


# ---------------------------------------------------------------- sharded gradients (ZeRO-2)

#: The nanoGPT-shaped loop below: iterations, micro-batches per iteration (no_sync), clipping.
ZERO2_ITERS, ZERO2_ACCUM, ZERO2_CLIP = 3, 2, 0.5
#: Buckets of at most 500 float32 elements: TinyLM's 2,736 in 8, each rank owning some
#: parameter whole at 2 and 3 ranks, before and after the buckets are cut again (a
#: GradScaler needs one: ``distopt.parallel.scatter``; with 600 one rank at 3 owns none).
ZERO2_MB = 500 * 4 / 2**20
#: (name, optimizer options, clip, GradScaler, no_sync or backward_passes_per_step).
ZERO2_CONFIGS = [
    # from step 2 on, stepped during backward; the buckets cut again after step 1
    ("overlap", {}, False, False, "no_sync"),
    # one element of rank 0's gradient inf at step 1
    ("scaler", {"rebuild_buckets": False}, True, True, "no_sync"),
    ("no-overlap", {"overlap": False, "backward_passes_per_step": ZERO2_ACCUM,
                    "rebuild_buckets": False}, True, False, "passes"),
]


def _zero2_loop(model: torch.nn.Module, opt: Any, clip: bool, scaler: Any, accumulate: str,
                rank: int, probe: Dict[str, Any]) -> Dict[str, Any]:
    """nanoGPT's loop, with the optimizer's clip_grad_norm_; what it printed and the
    parameters after each iteration. ``probe`` gets the first reduced .grad and the
    gradient bytes held then."""
    import contextlib

    import torch.nn.functional as F

    from tests.parallel.model_scenarios import BATCH, SEQ, VOCAB

    params, norms, scales = [], [], []
    for it in range(ZERO2_ITERS):
        for micro in range(ZERO2_ACCUM):
            gen = torch.Generator().manual_seed(7000 + 100 * it + 10 * micro + rank)
            tokens = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=gen)
            torch.manual_seed(500 + 10 * it + micro + rank)  # dropout
            quiet = accumulate == "no_sync" and micro < ZERO2_ACCUM - 1
            overflow = None
            if scaler is not None and (it, micro, rank) == (1, 0, 0):
                # One element: its average is inf on every rank, in one rank's part only.
                weight = model.layer.self_attn.in_proj_weight
                overflow = weight.register_hook(lambda g: g.index_fill(0, torch.tensor([0]),
                                                                       math.inf))
            with opt.no_sync() if quiet else contextlib.nullcontext():
                logits = model(tokens[:, :-1])
                loss = F.cross_entropy(logits.reshape(-1, VOCAB),
                                       tokens[:, 1:].reshape(-1)) / ZERO2_ACCUM
                (scaler.scale(loss) if scaler is not None else loss).backward()
            if overflow is not None:
                overflow.remove()
        if not probe:
            probe["bytes"] = opt.gradient_bytes()
            probe["grads"] = [None if p.grad is None else p.grad.clone()
                              for g in opt.param_groups for p in g["params"]]
            probe["owned"] = sorted(b.positions[k] for b in opt._engine.buckets
                                    for k in (b.shard.whole_grads if b.shard else ()))
        if clip:
            norms.append(opt.clip_grad_norm_(ZERO2_CLIP))
        if scaler is not None:
            scaler.step(opt)
            scales.append(scaler.get_scale())
            scaler.update()
        else:
            opt.step()
        opt.zero_grad(set_to_none=True)
        params.append(flat_params(model))
    return {"params": params, "norms": norms, "scales": scales}


def zero2(rank: int, world_size: int, path: str, names: List[str]) -> Dict[str, Any]:
    """``shard_gradients=True`` against ``shard="flat"`` over those ``ZERO2_CONFIGS``
    ``names``: the parameters after every iteration, the clipping norms, the scaler's
    scales, the gathered state_dict, the .grad after the first reducing backward, the
    gradient bytes held then, opt.save's files; the refusals (rank 0, at 2 ranks); the sums
    in gloo's ring order and in rank order against gloo's all_reduce (at 3 ranks)."""
    from tests.parallel.model_scenarios import TinyLM
    from tests.parallel.real_loop_scenarios import ADAMW, _groups

    out: Dict[str, Any] = {}
    for name, options, clip, scaled, accumulate in ZERO2_CONFIGS:
        if name not in names:
            continue
        for sharded in (False, True):
            model = TinyLM()
            opt = DataParallelOptimizer(torch.optim.AdamW, _groups(model), module=model,
                                        shard="flat", shard_gradients=sharded,
                                        bucket_cap_mb=ZERO2_MB, **options, **ADAMW)
            scaler = torch.amp.GradScaler("cpu") if scaled else None
            probe: Dict[str, Any] = {}
            run = _zero2_loop(model, opt, clip, scaler, accumulate, rank, probe)
            run.update(probe)
            run["state"] = whole_state_dict(opt)
            run["wire"] = opt.bytes_per_step()
            run["buckets"] = [(b.numel + len(b.params)) * 4 for b in opt._engine.buckets]
            if name == "scaler":
                where = os.path.join(path, f"{sharded}")
                opt.save(where)
                # by name without the save's generation
                run["files"] = {f.split("-", 2)[2]: torch.load(os.path.join(where, f),
                                                               weights_only=True)
                                for f in sorted(os.listdir(where)) if f.endswith(".pt")}
                other = DataParallelOptimizer(torch.optim.AdamW, _groups(TinyLM()),
                                              shard="flat", shard_gradients=not sharded,
                                              bucket_cap_mb=ZERO2_MB, **ADAMW)
                other.load(where)  # each way round
                run["loaded"] = identical(whole_state_dict(other)["state"],
                                          run["state"]["state"])
                other.close()
            out[f"{name}/{sharded}"] = run
            opt.close()
    out["total"] = sum(p.numel() * p.element_size() for p in TinyLM().parameters())
    if world_size == 2:
        out["refused"] = _zero2_refusals(rank)
    else:
        out["ring"] = _ring_sums(rank, world_size)
    return out


def _ring_sums(rank: int, world_size: int) -> Dict[int, Dict[str, int]]:
    """Per buffer length (one of over ``2W`` of gloo's 1 MiB segments): how many elements
    of this rank's chunk differ from gloo's all_reduce when summed from an all_to_all in
    ``ring_order`` over ``ring_starts``, and in rank order."""
    from distopt.parallel.scatter import ring_order, ring_starts

    out = {}
    for length in (1003, 1_600_003):
        gen = torch.Generator().manual_seed(length + rank)
        x = torch.randn(length, generator=gen) * torch.exp(4 * torch.randn(length, generator=gen))
        reduced = x.clone()
        dist.all_reduce(reduced)
        starts = ring_starts(length, 4, world_size)
        a, b = starts[rank], starts[rank + 1]
        sizes = [starts[r + 1] - starts[r] for r in range(world_size)]
        runs = x.new_empty(world_size * (b - a))
        dist.all_to_all_single(runs, x, [b - a] * world_size, sizes)
        runs = runs.view(world_size, b - a)
        order = ring_order(rank, world_size)
        ring = runs[order[0]] + runs[order[1]]
        for r in order[2:]:
            ring += runs[r]
        plain = runs[0] + runs[1]
        for r in range(2, world_size):
            plain += runs[r]
        out[length] = {"ring": int((ring != reduced[a:b]).sum()),
                       "rank-order": int((plain != reduced[a:b]).sum()),
                       "chunks": len(starts) - 1, "elements": b - a}
    return out


def _zero2_refusals(rank: int) -> Dict[str, str]:
    """What ``shard_gradients=True`` refuses, each message (the constructor's before any
    collective; Join and scaler.unscale_ once built)."""
    from distopt.parallel import Threshold
    from torch.distributed.algorithms import Join

    from tests.helpers import error_of

    model = make_model()
    build = lambda **kw: DataParallelOptimizer(  # noqa: E731
        torch.optim.SGD, model.parameters(), lr=0.1, bucket_cap_mb=BUCKETS_MB, **kw)
    out = {name: error_of(lambda kw=kw: build(**kw)) for name, kw in {
        "param": {"shard": "param", "shard_gradients": True},
        "none": {"shard_gradients": True},
        "text": {"shard": "flat", "shard_gradients": "yes"},
        "topk": {"shard": "flat", "shard_gradients": True, "compression": TopK(0.1)},
        "powersgd": {"shard": "flat", "shard_gradients": True, "compression": PowerSGD()},
        "cast": {"shard": "flat", "shard_gradients": True,
                 "compression": Cast(torch.bfloat16)},
        "threshold": {"shard": "flat", "shard_gradients": True,
                      "compression": Threshold(0.1)},
    }.items()}
    opt = build(shard="flat", shard_gradients=True)
    out["join"] = error_of(lambda: Join([opt]).__enter__())
    scaler = torch.amp.GradScaler("cpu")
    x, y = batch(rank, 2, 0)
    before = flat_params(model)
    scaler.scale(((model(x) - y) ** 2).mean()).backward()
    scaler.unscale_(opt)
    out["unscale"] = error_of(lambda: scaler.step(opt))
    out["unscale-stepped"] = str(not torch.equal(before, flat_params(model)))
    opt.close()
    return out
