"""DistributedOptimizer state_dict / load_state_dict / save / load against local torch.save.

Three processes on this machine: a trainer and two owners, each owner holding one
parameter of ``--numel`` float32 elements (50M by default: 100M parameter elements in all,
so Adam's ``exp_avg`` and ``exp_avg_sq`` hold 200M elements, 800 MB). One step is taken so
that the state exists. The same state held locally (a torch.optim.Adam over two parameters
of the same size, stepped once) is written with ``torch.save`` and read with ``torch.load``
into a temporary directory on the local disk, with and without an fsync.

Prints a markdown table of medians over ``--repeats`` runs and the ratio of each operation
to local ``torch.save`` (the target for the sharded save is 1.5x or less).

Run: ``python benchmarks/checkpoint.py [--numel N] [--repeats N] [--dir PATH]``
"""
import argparse
import logging
import multiprocessing
import os
import shutil
import socket
import statistics
import sys
import tempfile
import time
from typing import Any, Callable, Dict, List, Tuple

_HERE = os.path.dirname(os.path.abspath(__file__))
_ROOT = os.path.dirname(_HERE)
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)

import torch  # noqa: E402
import torch.distributed.autograd as dist_autograd  # noqa: E402
import torch.distributed.rpc as rpc  # noqa: E402

from distopt import DistributedOptimizer  # noqa: E402

logger = logging.getLogger("benchmarks.checkpoint")
RPC_TIMEOUT_S = 600.0


def _options(port: int) -> rpc.TensorPipeRpcBackendOptions:
    return rpc.TensorPipeRpcBackendOptions(
        init_method=f"tcp://127.0.0.1:{port}", num_worker_threads=8, rpc_timeout=RPC_TIMEOUT_S
    )


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def run_owner(rank: int, port: int) -> None:
    """Process entry point: an owner that serves until shutdown."""
    torch.set_num_threads(1)
    rpc.init_rpc(f"owner{rank}", rank=rank, world_size=3, rpc_backend_options=_options(port))
    rpc.shutdown()


def make_param(numel: int, seed: int) -> torch.Tensor:
    """A parameter created on (and so owned by) the caller of this RPC."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(numel, generator=gen).requires_grad_(True)


def param_sum(rref: rpc.RRef) -> torch.Tensor:
    return rref.local_value().sum()


def timed(fn: Callable[[], Any], repeats: int) -> Tuple[float, Any]:
    """Median seconds of ``fn`` over ``repeats`` runs, and its last result."""
    times, result = [], None
    for _ in range(repeats):
        result = None  # free the previous result before the next run
        start = time.perf_counter()
        result = fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times), result


def state_bytes(sd: Dict[str, Any]) -> int:
    return sum(
        v.numel() * v.element_size()
        for entry in sd["state"].values() for v in entry.values() if isinstance(v, torch.Tensor)
    )


def dir_bytes(path: str) -> int:
    return sum(os.path.getsize(os.path.join(path, n)) for n in os.listdir(path))


def save_fsync(obj: Any, path: str) -> None:
    with open(path, "wb") as f:
        torch.save(obj, f)
        f.flush()
        os.fsync(f.fileno())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--numel", type=int, default=50_000_000, help="elements per parameter")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dir", default=None, help="a directory on the local disk")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    torch.set_num_threads(1)

    port = _free_port()
    ctx = multiprocessing.get_context("spawn")
    owners = [ctx.Process(target=run_owner, args=(r, port), daemon=True) for r in (1, 2)]
    for proc in owners:
        proc.start()
    rpc.init_rpc("trainer", rank=0, world_size=3, rpc_backend_options=_options(port))
    root = tempfile.mkdtemp(prefix="distopt-bench-", dir=args.dir)
    rows: List[Tuple[str, float, int]] = []
    try:
        rrefs = [rpc.remote(f"owner{r}", make_param, args=(args.numel, r)) for r in (1, 2)]
        opt = DistributedOptimizer(torch.optim.Adam, rrefs, lr=1e-3)
        with dist_autograd.context() as cid:
            losses = [rpc.rpc_sync(r.owner(), param_sum, args=(r,)) for r in rrefs]
            dist_autograd.backward(cid, [torch.stack(losses).sum()])
            opt.step(cid)

        n = args.repeats
        t, sd = timed(opt.state_dict, n)
        nbytes = state_bytes(sd)
        rows.append(("DistributedOptimizer.state_dict()", t, nbytes))
        t, _ = timed(lambda: opt.load_state_dict(sd), n)
        rows.append(("DistributedOptimizer.load_state_dict(sd)", t, nbytes))
        del sd
        shard_dir = os.path.join(root, "sharded")
        t, _ = timed(lambda: opt.save(shard_dir), n)
        rows.append(("DistributedOptimizer.save(dir) (2 shards, fsync)", t, dir_bytes(shard_dir)))
        t, _ = timed(lambda: opt.load(shard_dir), n)
        rows.append(("DistributedOptimizer.load(dir)", t, dir_bytes(shard_dir)))
        del opt
        rpc.shutdown()  # the owners' memory is free again for the local baseline

        local = [make_param(args.numel, r) for r in (1, 2)]
        adam = torch.optim.Adam(local, lr=1e-3)
        for p in local:
            p.grad = torch.ones_like(p)
        adam.step()
        local_sd = adam.state_dict()
        file = os.path.join(root, "local.pt")
        t_save, _ = timed(lambda: torch.save(local_sd, file), n)
        rows.append(("local torch.save(state_dict) (1 file)", t_save, os.path.getsize(file)))
        t, _ = timed(lambda: save_fsync(local_sd, file), n)
        rows.append(("local torch.save(state_dict) + fsync", t, os.path.getsize(file)))
        t, _ = timed(lambda: torch.load(file, weights_only=True), n)
        rows.append(("local torch.load(file)", t, os.path.getsize(file)))
    finally:
        if rpc.api._is_current_rpc_agent_set():
            rpc.shutdown()
        for proc in owners:
            proc.join(timeout=60)
        shutil.rmtree(root, ignore_errors=True)

    base = next(t for name, t, _ in rows if name.startswith("local torch.save(state_dict) (1"))
    print(
        f"Adam state of {2 * 2 * args.numel / 1e6:.0f}M elements ({2 * args.numel / 1e6:.0f}M "
        f"parameter elements over 2 owners), median of {args.repeats} runs, "
        f"torch {torch.__version__}, {os.cpu_count()} CPUs\n"
    )
    print("| operation | median s | MB | GB/s | vs local torch.save |")
    print("|---|---:|---:|---:|---:|")
    for name, t, nbytes in rows:
        gbs = nbytes / t / 1e9
        print(f"| {name} | {t:.3f} | {nbytes / 1e6:.0f} | {gbs:.2f} | {t / base:.2f}x |")


if __name__ == "__main__":
    main()
