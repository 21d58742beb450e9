"""What each rank runs in tests/parallel/test_blockwise.py: the 8-bit and 4-bit optimizers
of ``distopt.optim`` under data parallelism.

The reference is DDP + the class itself stepping eagerly (it equals bitsandbytes' AdamW8bit,
tests/optim/test_blockwise.py): DataParallelOptimizer steps its compiled twin, unsharded and
with ``shard="param"`` and ``"flat"`` (cuts inside the quantised weights, at block
boundaries), and must give the same bits, parameters and state. At 3 ranks gloo's
sums depend on how the gradients are bucketed, so there the sharded run is held to the
unsharded DataParallelOptimizer.
"""
import os
from typing import Any, Dict, List

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from distopt.optim import Adam8bit, AdamW4bit, AdamW8bit
from distopt.parallel import DataParallelOptimizer
from distopt.parallel.hooks import optimizer_hook
from tests.helpers import identical
from tests.parallel.training import flat_params, whole_state_dict

CLASSES = {"AdamW8bit": AdamW8bit, "Adam8bit": Adam8bit, "AdamW4bit": AdamW4bit}
STEPS = 3


def make_model() -> torch.nn.Module:
    """Two quantised weights (8,192 and 5,120 elements, neither a multiple of 256 apart from
    the first), two float32 biases, a LayerNorm's float32 pair."""
    torch.manual_seed(3)
    return torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.LayerNorm(128), torch.nn.GELU(),
                               torch.nn.Linear(128, 41))


def groups(model: torch.nn.Module) -> List[Dict[str, Any]]:
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    return [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}]


def batch(rank: int, step: int):
    g = torch.Generator().manual_seed(100 * step + rank)
    x = torch.randn(16, 64, generator=g)
    return x, torch.randint(0, 41, (16,), generator=g)


def train(model, opt, rank: int, first: int = 0, steps: int = STEPS, wrapped=None) -> None:
    net = wrapped if wrapped is not None else model
    dtype = next(model.parameters()).dtype
    for step in range(first, first + steps):
        x, y = batch(rank, step)
        torch.nn.functional.cross_entropy(net(x.to(dtype)).float(), y).backward()
        opt.step()
        opt.zero_grad()


#: At 3 ranks, the two layouts (8-bit and 4-bit codes); Adam8bit differs only in its decay.
THREE_RANKS = ("AdamW8bit", "AdamW4bit")


def parity(rank: int, world_size: int, path: str) -> Dict[str, Any]:
    out: Dict[str, Any] = {}
    for name, cls in CLASSES.items():
        if world_size == 3 and name not in THREE_RANKS:
            continue
        model = make_model()
        ddp = DDP(model)
        ref = cls(groups(model), lr=1e-2)
        train(model, ref, rank, wrapped=ddp)
        ref_params = flat_params(model)
        ref_state = ref.state_dict()["state"]
        for shard in (None, "param", "flat", "zero2"):
            model = make_model()
            opt = DataParallelOptimizer(cls, groups(model), lr=1e-2,
                                        shard="flat" if shard == "zero2" else shard,
                                        shard_gradients=shard == "zero2")
            train(model, opt, rank)
            state = whole_state_dict(opt)["state"]
            if shard is None:
                unsharded_params, unsharded_state = flat_params(model), state
            out[f"{name}/{shard}"] = {
                "exact": bool(torch.equal(flat_params(model), ref_params)),
                "state_exact": identical(state, ref_state),
                "exact_unsharded": bool(torch.equal(flat_params(model), unsharded_params)),
                "state_exact_unsharded": identical(state, unsharded_state),
                "dtypes": sorted({str(v.dtype) for e in state.values() for v in e.values()}),
                "cut_inside": shard in ("flat", "zero2") and any(
                    0 < pc.start < b.params[pc.slot].numel() and b.params[pc.slot].numel() >= 4096
                    for b in opt._engine.buckets for part in b.shard.pieces for pc in part),
            }
            if shard == "flat" and name == "AdamW8bit" and rank == 0:
                # whole_state_dict consolidated every rank's pieces on every rank
                torch.save(opt.state_dict(), os.path.join(path, f"w{world_size}.pt"))
            opt.close()
        model = make_model()
        hooked = DDP(model)
        opt = optimizer_hook(hooked, cls, groups(model), lr=1e-2)
        train(model, opt, rank, wrapped=hooked)
        out[f"{name}/hook"] = {
            "exact": bool(torch.equal(flat_params(model), ref_params)),
            "state_exact": identical(opt.state_dict()["state"], ref_state),
        }
    return out


def resume(rank: int, world_size: int, path: str, saved_by: int) -> Dict[str, Any]:
    """Load the AdamW8bit state saved by ``saved_by`` ranks (shard="flat") unsharded, with
    "param" and with "flat" cut for this world: each gives back the saved state whole."""
    dist.barrier()
    saved = torch.load(os.path.join(path, f"w{saved_by}.pt"), weights_only=True)
    results = []
    for shard in (None, "param", "flat"):
        model = make_model()
        opt = DataParallelOptimizer(AdamW8bit, groups(model), lr=1e-2, shard=shard)
        opt.load_state_dict(saved)
        loaded = whole_state_dict(opt)["state"]
        results.append(identical(loaded, saved["state"]))
        opt.close()
    return {"loaded_exact": results}



def mixed_blocks(rank: int, world_size: int) -> str:
    model = make_model()
    parts = groups(model)
    parts[1]["block_size"] = 128
    try:
        DataParallelOptimizer(AdamW8bit, parts, shard="flat")
    except ValueError as exc:
        return str(exc)
    return "constructed"


def bfloat16(rank: int, world_size: int) -> Dict[str, Any]:
    """A bfloat16 model (its biases and LayerNorm keep float32 moments, its weights float32
    scales), AdamW8bit in two groups: DataParallelOptimizer unsharded and "flat" against
    DDP + the class, through the buckets cut again at the first step (the state carried
    over in torch.optim's format) and a load_state_dict into a new optimizer."""
    model = make_model().to(torch.bfloat16)
    ddp = DDP(model)
    ref = AdamW8bit(groups(model), lr=1e-2)
    train(model, ref, rank, wrapped=ddp)
    want, want_state = flat_params(model), ref.state_dict()["state"]
    out: Dict[str, Any] = {}
    for shard in (None, "flat"):
        model = make_model().to(torch.bfloat16)
        opt = DataParallelOptimizer(AdamW8bit, groups(model), lr=1e-2, shard=shard)
        train(model, opt, rank)
        state = whole_state_dict(opt)
        again = DataParallelOptimizer(AdamW8bit, groups(model), lr=1e-2, shard=shard)
        again.load_state_dict(state)
        out[str(shard)] = [torch.equal(flat_params(model), want),
                           identical(state["state"], want_state),
                           identical(whole_state_dict(again)["state"], want_state)]
        opt.close()
        again.close()
    return out
