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
