"""One process of the soak test (``tests/hosts/test_soak.py``): an owner or a trainer.

Run on its own test host as ``python -m tests.hosts.soak_node OUT_DIR STEPS SAMPLE_EVERY``
with ``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR`` and ``MASTER_PORT`` set (``host_env``): ranks
0 and 1 are ``owner1`` and ``owner2`` (rank 0 is the rendezvous and holds the barrier), the
other ranks ``trainer1`` .. ``trainer<n>``. Each trainer runs ``STEPS`` steps; after every
``SAMPLE_EVERY`` of them all trainers meet at a barrier while trainer1 samples each owner's
RSS, so the samples are taken with no step in flight.

Every step of a trainer, in one dist_autograd context:

- a shared parameter of ones on each owner, stepped by every trainer's own SGD
  DistributedOptimizer (lr 1) on ``sum(p)`` (gradient ones): after the run it holds
  ``1 - trainers * STEPS`` exactly, unless an update was lost;
- the trainer's own random parameters on both owners, stepped by its own Adam
  DistributedOptimizer on ``sum(p * x)`` with a fresh random ``x`` (gradient ``x``), and the
  same gradients fed to a local ``torch.optim.Adam(fused=True)`` over copies of the initial
  values, the kernel distopt's FunctionalAdam runs by default.

So both of an owner's step paths run: the shared parameters' five optimizers step under
their locks through the Python handler, each trainer's Adam (alone on its parameters)
through the TorchScript RPC without the owner's GIL.

A trainer writes ``OUT_DIR/trainer<k>.pt`` (the owners' values of its Adam parameters and
the replay's; trainer1 also the shared parameters and the RSS samples, in bytes, one
``[owner1, owner2]`` pair per barrier) and prints one JSON summary line. The test asserts
on those; this script only reports.
"""
import gc
import json
import os
import sys
import threading
import time
from typing import Dict, List, Tuple

import torch
import torch.distributed.autograd as dist_autograd
import torch.distributed.rpc as rpc
from torch import Tensor

OWNERS = ["owner1", "owner2"]
#: 16,384 elements: a step long enough that the five trainers' steps overlap on the owner.
#: torch.distributed.optim's GIL-free SGD in place of distopt's lost updates in 512 and
#: 6,256 of them in two soaks of 120 steps a trainer (64 x 64: in 16 of 4,096 after 600
#: steps, none after 120). Below 128 kB, so glibc serves it from the heap, as before.
SHARED_SHAPE = (128, 128)
ADAM_LR = 1e-2
RPC_TIMEOUT_S = 60.0
#: A barrier waits for the slowest trainer's whole phase; a dead trainer fails the test
#: sooner (its exit is seen by the test).
BARRIER_TIMEOUT_S = 300.0
#: Adam parameters on each owner, by trainer. Odd trainers keep the default flat buffers:
#: their sizes are multiples of 64 elements, because a flat step runs one kernel over the
#: whole buffer, so a member whose size is not a multiple of the CPU's vector width (8
#: floats with AVX2, 16 with AVX-512) has its last elements computed in the vector loop
#: instead of the scalar tail, and shifts every member after it: 1 ulp from torch.optim
#: (docs/guide/functional.md, "Flat parameter buffers"). Even trainers take odd sizes with
#: ``flat=False``.
FLAT_SHAPES: List[Tuple[int, ...]] = [(16, 8), (64,), (4, 48)]
ODD_SHAPES: List[Tuple[int, ...]] = [(7, 13), (33,), (5,)]


# ---------------------------------------------------------------- owner side


_shared_lock = threading.Lock()
_shared: Dict[str, rpc.RRef] = {}


def shared_parameter() -> rpc.RRef:
    """This owner's shared parameter of ones (made at the first call; one RRef for all)."""
    with _shared_lock:
        if "p" not in _shared:
            _shared["p"] = rpc.RRef(torch.ones(SHARED_SHAPE, requires_grad=True))
        return _shared["p"]


def make_param(shape: Tuple[int, ...], seed: int) -> Tensor:
    """A random parameter, on the worker that runs this (the trainer makes its replay's copy
    with the same call)."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=gen).requires_grad_(True)


def owner_forward(shared: rpc.RRef, params: List[rpc.RRef], xs: List[Tensor]) -> Tensor:
    """``sum(shared) + sum_i sum(p_i * x_i)``: gradient ones for ``shared``, ``x_i`` for
    ``p_i``."""
    loss = shared.local_value().sum()
    for p, x in zip(params, xs):
        loss = loss + (p.local_value() * x).sum()
    return loss


def value(param: rpc.RRef) -> Tensor:
    """A copy of the parameter's current value."""
    return param.local_value().detach().clone()


def is_exclusive(optimizer: rpc.RRef) -> bool:
    """Whether this owner's local optimizer is stepped without locks (``distopt.exclusive``)."""
    return optimizer.local_value().exclusive


def rss_bytes() -> int:
    """This process's resident set size (VmRSS) after a full garbage collection."""
    gc.collect()
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS in /proc/self/status")


_barrier_lock = threading.Lock()
_barrier_waiting: List[torch.futures.Future] = []


@rpc.functions.async_execution
def arrive(parties: int) -> torch.futures.Future:
    """A barrier on rank 0: completes once ``parties`` callers have arrived. Waiting callers
    hold a future, not an RPC thread."""
    future: torch.futures.Future = torch.futures.Future()
    with _barrier_lock:
        _barrier_waiting.append(future)
        if len(_barrier_waiting) < parties:
            return future
        released = list(_barrier_waiting)
        _barrier_waiting.clear()
    for f in released:
        f.set_result(None)
    return future


# ---------------------------------------------------------------- trainer side


def trainer(k: int, trainers: int, steps: int, sample_every: int, out_dir: str) -> None:
    """Trainer ``k`` (1-based): build, train, check against the replay, write results."""
    from distopt import DistributedOptimizer

    built = time.monotonic()
    flat = k % 2 == 1
    shapes = FLAT_SHAPES if flat else ODD_SHAPES
    shared = [rpc.rpc_sync(o, shared_parameter) for o in OWNERS]
    seeds = {(o, i): 1000 * k + 10 * j + i
             for j, o in enumerate(OWNERS) for i in range(len(shapes))}
    params = {o: [rpc.remote(o, make_param, args=(s, seeds[o, i])) for i, s in enumerate(shapes)]
              for o in OWNERS}
    replay_params = [make_param(s, seeds[o, i]) for o in OWNERS for i, s in enumerate(shapes)]
    sgd = DistributedOptimizer(torch.optim.SGD, shared, lr=1.0)
    adam = DistributedOptimizer(
        torch.optim.Adam, [p for o in OWNERS for p in params[o]], lr=ADAM_LR, flat=flat
    )
    replay = torch.optim.Adam(replay_params, lr=ADAM_LR, fused=True)
    gen = torch.Generator().manual_seed(k)

    report: Dict[str, object] = {
        "trainer": k, "flat": flat, "steps": steps, "setup_s": round(time.monotonic() - built, 2),
        "compiled": [sgd.is_functional_optim, adam.is_functional_optim],
    }
    rss: List[List[int]] = []
    start = time.monotonic()
    for step in range(1, steps + 1):
        xs = {o: [torch.randn(s, generator=gen) for s in shapes] for o in OWNERS}
        with dist_autograd.context() as ctx:
            losses = [rpc.rpc_async(o, owner_forward, args=(shared[j], params[o], xs[o]))
                      for j, o in enumerate(OWNERS)]
            loss = torch.stack([f.wait() for f in losses]).sum()
            dist_autograd.backward(ctx, [loss])
            sgd.step(ctx)
            adam.step(ctx)
        for p, x in zip(replay_params, [x for o in OWNERS for x in xs[o]]):
            p.grad = x
        replay.step()
        if step % sample_every == 0:
            # Every trainer is here: trainer1 samples with no step in flight, then all go on.
            rpc.rpc_sync(OWNERS[0], arrive, args=(trainers,), timeout=BARRIER_TIMEOUT_S)
            if k == 1:
                rss.append([rpc.rpc_sync(o, rss_bytes) for o in OWNERS])
            rpc.rpc_sync(OWNERS[0], arrive, args=(trainers,), timeout=BARRIER_TIMEOUT_S)
    report["steps_s"] = round(time.monotonic() - start, 2)
    report["exclusive"] = {
        name: [rpc.rpc_sync(r.owner(), is_exclusive, args=(r,)) for r in opt.remote_optimizers]
        for name, opt in (("sgd", sgd), ("adam", adam))
    }

    results: Dict[str, object] = {
        "adam": [rpc.rpc_sync(p.owner(), value, args=(p,)) for o in OWNERS for p in params[o]],
        "replay": [p.detach().clone() for p in replay_params],
    }
    if k == 1:
        results["shared"] = [rpc.rpc_sync(o, value, args=(r,)) for o, r in zip(OWNERS, shared)]
        results["rss"] = rss
        report["rss_mb"] = [[round(b / 2**20, 2) for b in sample] for sample in rss]
    torch.save(results, os.path.join(out_dir, f"trainer{k}.pt"))
    report["adam_equal"] = [torch.equal(a, b) for a, b in zip(results["adam"], results["replay"])]
    print(json.dumps(report), flush=True)


def main(argv: List[str]) -> int:
    out_dir, steps, sample_every = argv[1], int(argv[2]), int(argv[3])
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    trainers = world_size - len(OWNERS)
    if not 0 < sample_every <= steps or steps % sample_every:
        raise ValueError(f"Invalid steps: {steps!r} (expected a multiple of {sample_every})")
    torch.set_num_threads(1)
    name = OWNERS[rank] if rank < len(OWNERS) else f"trainer{rank - len(OWNERS) + 1}"
    options = rpc.TensorPipeRpcBackendOptions(
        init_method="env://", num_worker_threads=32, rpc_timeout=RPC_TIMEOUT_S
    )
    rpc.init_rpc(name, rank=rank, world_size=world_size, rpc_backend_options=options)
    try:
        if rank >= len(OWNERS):
            trainer(rank - len(OWNERS) + 1, trainers, steps, sample_every, out_dir)
    except BaseException:
        rpc.shutdown(graceful=False)
        raise
    rpc.shutdown()
    return 0


if __name__ == "__main__":
    # RPC pickles functions by module and name: import this file as tests.hosts.soak_node
    # so that every process resolves the same names, whatever __main__ is.
    from tests.hosts.soak_node import main as _main

    sys.exit(_main(sys.argv))
