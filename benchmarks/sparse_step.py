"""Row-sparse steps on a ShardedEmbedding: cost follows the rows touched, not the table size.

Three processes on this machine: a trainer and two owners. The same batch (``--batch``
random indices, 4,096 by default) is looked up in a table of ``--rows`` rows (100k) and in
one ``--scale`` times larger (2M), ``--dim`` wide (64), split over the two owners. For
SparseSGD, SparseAdagrad and SparseAdam (and SparseAdam with ``duplicates="mean"``, which
costs one more round of RPCs) it times ``step(ctx)`` alone, after an untimed lookup and
backward; the target is the larger table at most 1.5x the smaller one's time. For
comparison, a dense update of the same tables: DistributedOptimizer(torch.optim.Adam) over
the shards after a dense lookup (``nn.Embedding(sparse=False)``'s gradient, table-sized).

Steps on the two tables alternate, so both see the same background load. Prints a
markdown table of medians over ``--repeats`` steps, the ratio between the two table
sizes, and rows updated per second (batch indices / step time).

Run: ``python benchmarks/sparse_step.py [--rows N] [--scale K] [--batch B] [--repeats R]``
"""
import argparse
import logging
import multiprocessing
import os
import socket
import statistics
import sys
import time
from typing import Any, Callable, Dict, List, Tuple

_HERE = os.path.dirname(os.path.abspath(__file__))
_ROOT = os.path.dirname(_HERE)
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)

import torch  # noqa: E402
import torch.distributed.autograd as dist_autograd  # noqa: E402
import torch.distributed.rpc as rpc  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from distopt import DistributedOptimizer  # noqa: E402
from distopt.sparse import ShardedEmbedding, SparseAdagrad, SparseAdam, SparseSGD  # noqa: E402

logger = logging.getLogger("benchmarks.sparse_step")
RPC_TIMEOUT_S = 600.0
OWNERS = ["owner1", "owner2"]


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


def dense_lookup(shard_rref: rpc.RRef, rows: torch.Tensor) -> torch.Tensor:
    """RPC target: rows of a shard whose gradient is dense (the whole shard), as
    ``nn.Embedding(sparse=False)`` gives it."""
    return F.embedding(rows, shard_rref.local_value())


def lookup_dense(emb: ShardedEmbedding, indices: torch.Tensor) -> torch.Tensor:
    """``emb(indices)`` with a dense gradient: one RPC per owner, as ShardedEmbedding does."""
    part = emb._partition
    owner_of = part.owner_of(indices)
    local = part.local_of(indices, owner_of)
    outs, positions = [], []
    futures = []
    for k, rref in enumerate(emb.parameter_rrefs()):
        at = (owner_of == k).nonzero().reshape(-1)
        positions.append(at)
        futures.append(rpc.rpc_async(rref.owner(), dense_lookup, args=(rref, local[at])))
    outs = [f.wait() for f in futures]
    order = torch.cat(positions)
    where = torch.empty_like(order)
    where[order] = torch.arange(order.numel())
    return torch.cat(outs).index_select(0, where)


def one_step(
    opt: Any, lookup: Callable[[torch.Tensor], torch.Tensor], batch: torch.Tensor
) -> float:
    """Seconds of ``opt.step(ctx)`` after an untimed lookup and backward."""
    with dist_autograd.context() as ctx:
        dist_autograd.backward(ctx, [lookup(batch).pow(2).sum()])
        start = time.perf_counter()
        opt.step(ctx)
        return time.perf_counter() - start


def time_interleaved(
    runs: List[Tuple[Any, Callable[[torch.Tensor], torch.Tensor], torch.Tensor]], repeats: int
) -> List[float]:
    """Median step seconds of each (optimizer, lookup, batch), their steps interleaved.

    Interleaving makes every run see the same background load (other processes on the
    machine), so the ratio between runs is not skewed by load that changes over time.
    """
    times: List[List[float]] = [[] for _ in runs]
    for i in range(repeats + 3):
        for k, (opt, lookup, batch) in enumerate(runs):
            t = one_step(opt, lookup, batch)
            if i >= 3:  # warm-up: compiled code, first state
                times[k].append(t)
    return [statistics.median(ts) for ts in times]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=100_000, help="rows of the smaller table")
    parser.add_argument("--scale", type=int, default=20, help="the larger table is this x bigger")
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--batch", type=int, default=4096, help="indices per step")
    parser.add_argument("--repeats", type=int, default=30, help="timed steps per measurement")
    parser.add_argument("--no-dense", action="store_true", help="skip the dense comparison")
    parser.add_argument("--only", default="", help="run only optimizers whose name contains this")
    parser.add_argument("-v", "--verbose", action="store_true", help="log progress")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING)
    torch.set_num_threads(1)

    port = _free_port()
    ctx = multiprocessing.get_context("spawn")
    owners = [ctx.Process(target=run_owner, args=(r, port), daemon=True) for r in (1, 2)]
    for proc in owners:
        proc.start()
    rpc.init_rpc("trainer", rank=0, world_size=3, rpc_backend_options=_options(port))
    sizes = [args.rows, args.rows * args.scale]
    cases: List[Tuple[str, Callable[[List[ShardedEmbedding]], Any]]] = [
        ("SparseSGD", lambda e: SparseSGD(e, lr=0.1)),
        ("SparseAdagrad", lambda e: SparseAdagrad(e, lr=0.1)),
        ("SparseAdam", lambda e: SparseAdam(e, lr=1e-3)),
        ('SparseAdam, duplicates="mean"', lambda e: SparseAdam(e, lr=1e-3, duplicates="mean")),
    ]
    cases = [(name, make) for name, make in cases if args.only in name]
    results: Dict[str, List[float]] = {name: [] for name, _ in cases}
    dense: List[float] = []
    try:
        batches = [
            torch.randint(0, n, (args.batch,), generator=torch.Generator().manual_seed(0))
            for n in sizes
        ]
        for name, make in cases:
            tables = [ShardedEmbedding(n, args.dim, OWNERS, partition="hash", seed=1)
                      for n in sizes]
            runs = [(make([emb]), emb, batch) for emb, batch in zip(tables, batches)]
            results[name] = time_interleaved(runs, args.repeats)
            logger.info("%s: %s ms", name, [round(t * 1e3, 2) for t in results[name]])
            del runs, tables
        if not args.no_dense:
            tables = [ShardedEmbedding(n, args.dim, OWNERS, partition="hash", seed=1)
                      for n in sizes]
            runs = [
                (DistributedOptimizer(torch.optim.Adam, emb.parameter_rrefs(), lr=1e-3),
                 lambda b, emb=emb: lookup_dense(emb, b), batch)
                for emb, batch in zip(tables, batches)
            ]
            dense = time_interleaved(runs, max(3, args.repeats // 5))
            del runs, tables
    finally:
        rpc.shutdown()
        for proc in owners:
            proc.join(timeout=60)

    small, large = (f"{n / 1e6:g}M" if n >= 1e6 else f"{n / 1e3:g}k" for n in sizes)
    print(
        f"step(ctx) of {args.batch} indices x {args.dim} on tables of {small} and {large} rows "
        f"(2 owners, hash partition), median of {args.repeats} steps, torch {torch.__version__}, "
        f"{os.cpu_count()} CPUs\n"
    )
    print(f"| optimizer | {small} rows (ms) | {large} rows (ms) | {large} / {small} | "
          f"rows/s at {large} | target <= 1.5x |")
    print("|---|---:|---:|---:|---:|---|")
    rows = [(name, times) for name, times in results.items()]
    if dense:
        rows.append(("dense: DistributedOptimizer(Adam), dense gradient", dense))
    for name, (t_small, t_large) in rows:
        ratio = t_large / t_small
        target = "-" if name.startswith("dense") else ("met" if ratio <= 1.5 else "MISSED")
        print(
            f"| {name} | {t_small * 1e3:.2f} | {t_large * 1e3:.2f} | {ratio:.2f}x | "
            f"{args.batch / t_large:,.0f} | {target} |"
        )


if __name__ == "__main__":
    main()
