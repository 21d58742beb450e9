"""Code the CUDA RPC test runs on its processes (importable by name on every worker)."""
import io
import os
import traceback
from typing import Any, Dict, List, Tuple

import torch
import torch.distributed.autograd as dist_autograd
import torch.distributed.rpc as rpc
from torch import Tensor

NAMES = ["trainer", "owner1", "owner2"]
SHAPES = [(6, 5), (7,), (3, 4), (5, 2)]
STEPS = 5
CLIP_AT = 2
MAX_NORM = 0.5
TABLE = (20, 4)


def initial(k: int) -> Tensor:
    """Parameter ``k``'s starting values (CPU; moved to the device by whoever uses them)."""
    return torch.randn(SHAPES[k], generator=torch.Generator().manual_seed(100 + k))


def data(step: int, k: int) -> Tensor:
    return torch.randn(SHAPES[k], generator=torch.Generator().manual_seed(1000 * step + k))


def rows(step: int) -> Tensor:
    return torch.randint(0, TABLE[0], (6,), generator=torch.Generator().manual_seed(7 + step))


def term(p: Tensor, x: Tensor) -> Tensor:
    """One parameter's share of the loss, computed where ``p`` lives."""
    return torch.tanh(p * x.to(p.device)).sum()


def make_param(k: int, device: str) -> Tensor:
    return initial(k).to(device).requires_grad_(True)


def remote_term(p_rref: rpc.RRef, x: Tensor) -> Tensor:
    """On the owner: the term, returned on the parameter's device (a CUDA tensor crosses
    RPC through the device map)."""
    return term(p_rref.local_value(), x)


def value_on_cpu(p_rref: rpc.RRef) -> Tensor:
    return p_rref.local_value().detach().to("cpu", copy=True)


def device_of(p_rref: rpc.RRef) -> str:
    return str(p_rref.local_value().device)


#: The race check's parameter: large enough that an update still running on one CUDA stream
#: overlaps a read issued on another.
BIG = 1 << 25


def make_big(device: str) -> Tensor:
    return torch.zeros(BIG, device=device, requires_grad=True)


def extremes_and_sum(p_rref: rpc.RRef) -> Tuple[List[float], Tensor]:
    """On the owner: the parameter's (min, max), read on this request's streams, and a loss
    whose gradient is all ones (a CPU scalar: no device map needed)."""
    p = p_rref.local_value()
    seen = torch.stack([p.detach().min(), p.detach().max()]).cpu().tolist()
    return seen, p.sum().cpu()


def exclusive_flags() -> List[bool]:
    """On an owner: whether each live local optimizer may step on the TorchScript path."""
    from distopt.local_optimizer import live_by_id
    return [lo.exclusive for lo in live_by_id.values()]


def race(device: str) -> List[List[float]]:
    """SGD (lr 1, gradient all ones) on one large owner parameter: after n steps every
    element is exactly -n. Each forward reads the parameter's extremes at once on a new
    request's streams: they must already be -n, -n (the owner synchronized its device after
    the step), and the step must read complete gradients (before it, too)."""
    from distopt import DistributedOptimizer

    rref = rpc.remote("owner1", make_big, args=(device,))
    opt = DistributedOptimizer(torch.optim.SGD, [rref], lr=1.0)
    seen = []
    for _ in range(RACE_STEPS):
        with dist_autograd.context() as ctx:
            extremes, loss = rpc.rpc_sync("owner1", extremes_and_sum, args=(rref,))
            seen.append(extremes)
            dist_autograd.backward(ctx, [loss])
            opt.step(ctx)
    seen.append(rpc.rpc_sync("owner1", extremes_and_sum, args=(rref,))[0])
    return seen


RACE_STEPS = 8


def options(port: int, device: str, me: str) -> rpc.TensorPipeRpcBackendOptions:
    opts = rpc.TensorPipeRpcBackendOptions(init_method=f"tcp://127.0.0.1:{port}", rpc_timeout=60)
    if device.startswith("cuda"):
        for peer in NAMES:
            if peer != me:
                opts.set_device_map(peer, {0: 0})
    return opts


def run(rank: int, port: int, device: str, out: Any, folder: str) -> None:
    """Process entry point; rank 0 trains and puts its results (or a traceback) in ``out``."""
    torch.set_num_threads(1)
    name = NAMES[rank]
    rpc.init_rpc(name, rank=rank, world_size=len(NAMES), rpc_backend_options=options(port, device, name))
    try:
        if rank == 0:
            try:
                # As bytes: tensors put on a multiprocessing queue live in shared memory
                # that is gone once this process exits.
                buf = io.BytesIO()
                torch.save(train(device, folder), buf)
                out.put(("ok", buf.getvalue()))
            except BaseException:
                out.put(("error", traceback.format_exc()))
    finally:
        rpc.shutdown()


def train(device: str, folder: str) -> Dict[str, Any]:
    from distopt import DistributedOptimizer
    from distopt.sparse import ShardedEmbedding, SparseAdam

    owners = ["owner1", "owner2", "owner1", "owner2"]
    rrefs = [rpc.remote(o, make_param, args=(k, device)) for k, o in enumerate(owners)]
    opt = DistributedOptimizer(torch.optim.Adam, rrefs, lr=0.05)
    table = ShardedEmbedding(*TABLE, ["owner1", "owner2"], seed=11, device=device)
    sparse_opt = SparseAdam([table], lr=0.05)
    norms: List[float] = []
    for step in range(STEPS):
        with dist_autograd.context() as ctx:
            terms = [
                rpc.rpc_sync(o, remote_term, args=(r, data(step, k)))
                for k, (o, r) in enumerate(zip(owners, rrefs))
            ]
            loss = torch.stack([t.to("cpu") for t in terms]).sum()
            emb = table(rows(step)).pow(2).sum()
            dist_autograd.backward(ctx, [loss, emb])
            if step == CLIP_AT:
                norms.append(float(opt.clip_grad_norm_(ctx, MAX_NORM)))
            opt.step(ctx)
            sparse_opt.step(ctx)
    state = opt.state_dict()
    state_devices = sorted({
        str(v.device) for entry in state["state"].values() for v in entry.values()
        if isinstance(v, Tensor)
    })
    values = [rpc.rpc_sync(o, value_on_cpu, args=(r,)) for o, r in zip(owners, rrefs)]
    opt.save(os.path.join(folder, "ckpt"))
    # One more step changes the state; loading the checkpoint must bring back the saved one.
    with dist_autograd.context() as ctx:
        terms = [rpc.rpc_sync(o, remote_term, args=(r, data(STEPS, k)))
                 for k, (o, r) in enumerate(zip(owners, rrefs))]
        dist_autograd.backward(ctx, [torch.stack([t.to("cpu") for t in terms]).sum()])
        opt.step(ctx)
    opt.load(os.path.join(folder, "ckpt"))
    reloaded = opt.state_dict()
    exclusive = [rpc.rpc_sync(o, exclusive_flags) for o in ("owner1", "owner2")]
    return {
        "race": race(device),
        "exclusive": exclusive,
        "params": values,
        "devices": [rpc.rpc_sync(o, device_of, args=(r,)) for o, r in zip(owners, rrefs)],
        "norms": norms,
        "state": state,
        "state_devices": state_devices,
        "reloaded": reloaded,
        "table": table.full_weight(),
    }
