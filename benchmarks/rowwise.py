"""Row-wise sparse optimizers: step time and state bytes per row, beside fbgemm's CPU step.

Two tables, one run. First the owner's step alone, in this process, on one table of
``--rows`` rows (100k) by ``--dim`` (64) and a gradient of ``--batch`` random indices
(4,096, rows repeating): fbgemm-gpu-cpu's EXACT_ROWWISE_ADAGRAD (the backward pass of its
sequence TBE on the host, which is where fbgemm applies the update; the forward is not
timed), distopt's compiled ``FunctionalRowWiseAdagrad`` and ``FunctionalPartialRowWiseAdam``,
and the compiled stand-ins of torch.optim.Adagrad and SparseAdam (what ``SparseAdagrad`` and
``SparseAdam`` step on each owner). Then the same step through RPC: ``RowWiseAdagrad``,
``PartialRowWiseAdam``, ``SparseAdagrad`` and ``SparseAdam`` over a ShardedEmbedding split
over two owner processes (hash partition), ``step(ctx)`` timed after an untimed lookup and
backward, the four interleaved so that they see the same background load. fbgemm's TBE has
no RPC path, so it appears in the first table only (PARTIAL_ROWWISE_ADAM has no CPU step in
fbgemm 1.8.0: "-").

State bytes per row: the state tensors' bytes over the rows, the per-table step counter
apart (a 4-byte float32 per table, or fbgemm's module-wide ``iter``).

Run: ``python benchmarks/rowwise.py [--rows N] [--dim D] [--batch B] [--repeats R]``
(about 40 s on 2 cores).
"""
import argparse
import multiprocessing
import os
import statistics
import sys
import time
from typing import Any, Callable, Dict, List, Tuple

# This folder's functional.py would shadow the functional package: import this folder's
# helpers as ``benchmarks.*`` from the repository root instead.
_HERE = os.path.dirname(os.path.abspath(__file__))
_ROOT = os.path.dirname(_HERE)
sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != _HERE]
if _ROOT not in [os.path.abspath(p or os.curdir) for p in sys.path]:
    sys.path.insert(0, _ROOT)

import torch  # noqa: E402
import torch.distributed.autograd as dist_autograd  # noqa: E402
import torch.distributed.rpc as rpc  # noqa: E402
from fbgemm_gpu.split_embedding_configs import EmbOptimType  # noqa: E402
from fbgemm_gpu.split_table_batched_embeddings_ops_common import (  # noqa: E402
    EmbeddingLocation,
    PoolingMode,
)
from fbgemm_gpu.split_table_batched_embeddings_ops_training import (  # noqa: E402
    SplitTableBatchedEmbeddingBagsCodegen,
)
from fbgemm_gpu.tbe.config.embedding_config import ComputeDevice  # noqa: E402

from benchmarks._machine import free_port, machine  # noqa: E402
from benchmarks._rpc_world import backend_options, run_owner  # noqa: E402
from distopt.sparse import (  # noqa: E402
    PartialRowWiseAdam,
    RowWiseAdagrad,
    ShardedEmbedding,
    SparseAdagrad,
    SparseAdam,
)
from functional import (  # noqa: E402
    FunctionalAdagrad,
    FunctionalPartialRowWiseAdam,
    FunctionalRowWiseAdagrad,
    FunctionalSparseAdam,
    script_optimizer,
)

OWNERS = ["owner1", "owner2"]
WARMUP = 3


def median_ms(step: Callable[[], float], repeats: int) -> float:
    """Median milliseconds of ``step()`` (which returns its own seconds), after a warm-up."""
    times = [step() for _ in range(repeats + WARMUP)][WARMUP:]
    return statistics.median(times) * 1e3


def state_bytes(state: Dict[Any, Dict[str, torch.Tensor]], rows: int) -> Tuple[float, int]:
    """(bytes per row of the row state, bytes of the 0-dim counters), over every entry."""
    per_row = counters = 0
    for entry in state.values():
        for value in entry.values():
            size = value.numel() * value.element_size()
            if value.dim() == 0:
                counters += size
            else:
                per_row += size
    return per_row / rows, counters


def local_cases(args: argparse.Namespace) -> List[Tuple[str, float, float, int]]:
    """(name, median step ms, state bytes per row, counter bytes) of each owner-side step."""
    gen = torch.Generator().manual_seed(0)
    table = torch.randn(args.rows, args.dim, generator=gen)
    batches = [torch.randint(0, args.rows, (args.batch,), generator=gen)
               for _ in range(args.repeats + WARMUP)]
    grads = [torch.randn(args.batch, args.dim, generator=gen) for _ in batches]
    out: List[Tuple[str, float, float, int]] = []

    tbe = SplitTableBatchedEmbeddingBagsCodegen(
        [(args.rows, args.dim, EmbeddingLocation.HOST, ComputeDevice.CPU)],
        optimizer=EmbOptimType.EXACT_ROWWISE_ADAGRAD, pooling_mode=PoolingMode.NONE,
        learning_rate=0.01, eps=1e-8)
    with torch.no_grad():
        tbe.split_embedding_weights()[0].copy_(table)
    steps = iter(range(len(batches)))

    def fbgemm_step() -> float:
        i = next(steps)
        rows = tbe(batches[i], torch.tensor([0, args.batch]))
        start = time.perf_counter()
        rows.backward(grads[i])
        return time.perf_counter() - start

    ms = median_ms(fbgemm_step, args.repeats)
    moments = tbe.split_optimizer_states()[0][0]
    out.append(("fbgemm EXACT_ROWWISE_ADAGRAD (CPU)", ms,
                moments.numel() * moments.element_size() / args.rows,
                tbe.iter.numel() * tbe.iter.element_size()))
    for name, cls, kwargs in (
        ("distopt FunctionalRowWiseAdagrad", FunctionalRowWiseAdagrad, {"lr": 0.01}),
        ("distopt FunctionalPartialRowWiseAdam", FunctionalPartialRowWiseAdam, {"lr": 0.01}),
        ("Adagrad, sparse (what SparseAdagrad steps)", FunctionalAdagrad, {"lr": 0.01}),
        ("SparseAdam (what SparseAdam steps)", FunctionalSparseAdam, {"lr": 0.01}),
    ):
        param = table.clone()
        optim = cls([param], **kwargs)
        scripted = script_optimizer(optim)
        steps = iter(range(len(batches)))

        def step() -> float:
            i = next(steps)
            grad = torch.sparse_coo_tensor(batches[i].unsqueeze(0), grads[i], param.shape)
            start = time.perf_counter()
            scripted.step([grad])
            return time.perf_counter() - start

        ms = median_ms(step, args.repeats)
        per_row, counters = state_bytes(scripted.optim.state, args.rows)
        out.append((name, ms, per_row, counters))
    return out


def rpc_cases(args: argparse.Namespace) -> List[Tuple[str, float]]:
    """(name, median ``step(ctx)`` ms) of each sharded-table optimizer, interleaved."""
    port = free_port()
    spawn = multiprocessing.get_context("spawn")
    owners = [spawn.Process(target=run_owner, args=(r, 3, port), daemon=True) for r in (1, 2)]
    for proc in owners:
        proc.start()
    rpc.init_rpc("trainer", rank=0, world_size=3, rpc_backend_options=backend_options(port, 600.0))
    makers: List[Tuple[str, Callable[[ShardedEmbedding], Any]]] = [
        ("RowWiseAdagrad", lambda e: RowWiseAdagrad(e, lr=0.01)),
        ("PartialRowWiseAdam", lambda e: PartialRowWiseAdam(e, lr=0.01)),
        ("SparseAdagrad", lambda e: SparseAdagrad(e, lr=0.01)),
        ("SparseAdam", lambda e: SparseAdam(e, lr=0.01)),
    ]
    try:
        runs = []
        for name, make in makers:
            emb = ShardedEmbedding(args.rows, args.dim, OWNERS, partition="hash", seed=1)
            runs.append((name, emb, make(emb)))
        batch = torch.randint(0, args.rows, (args.batch,),
                              generator=torch.Generator().manual_seed(1))
        times: Dict[str, List[float]] = {name: [] for name, _, _ in runs}
        for i in range(args.repeats + WARMUP):
            for name, emb, opt in runs:
                with dist_autograd.context() as ctx:
                    dist_autograd.backward(ctx, [emb(batch).pow(2).sum()])
                    start = time.perf_counter()
                    opt.step(ctx)
                    if i >= WARMUP:
                        times[name].append(time.perf_counter() - start)
        return [(name, statistics.median(ts) * 1e3) for name, ts in times.items()]
    finally:
        rpc.shutdown()
        for proc in owners:
            proc.join(timeout=60)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=100_000)
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--batch", type=int, default=4096, help="indices per step")
    parser.add_argument("--repeats", type=int, default=20, help="timed steps per case")
    args = parser.parse_args()
    torch.set_num_threads(1)
    print(f"Row-wise sparse steps: {args.batch} random indices into {args.rows:,} x {args.dim} "
          f"float32 rows, median of {args.repeats} steps; torch {torch.__version__}, "
          f"fbgemm-gpu-cpu {_fbgemm_version()}, 1 intra-op thread; {machine()}\n")
    local = local_cases(args)
    base = local[0][1]
    print("Owner-side step (one process, no RPC):\n")
    print("| step | ms | vs fbgemm | state bytes/row | counters (bytes) |")
    print("|---|---:|---:|---:|---:|")
    for name, ms, per_row, counters in local:
        print(f"| {name} | {ms:.2f} | {ms / base:.2f}x | {per_row:g} | {counters} |")
    print("\nThrough RPC: `step(ctx)` of a ShardedEmbedding over 2 owner processes "
          "(hash partition):\n")
    remote = rpc_cases(args)
    adagrad = dict(remote)["SparseAdagrad"]
    by_name = {name.split(" ")[1] if name.startswith("distopt") else name: per_row
               for name, _, per_row, _ in local}
    rows_state = {"RowWiseAdagrad": by_name["FunctionalRowWiseAdagrad"],
                  "PartialRowWiseAdam": by_name["FunctionalPartialRowWiseAdam"],
                  "SparseAdagrad": local[3][2], "SparseAdam": local[4][2]}
    print("| optimizer | step(ctx) ms | vs SparseAdagrad | state bytes/row |")
    print("|---|---:|---:|---:|")
    for name, ms in remote:
        print(f"| {name} | {ms:.2f} | {ms / adagrad:.2f}x | {rows_state[name]:g} |")


def _fbgemm_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("fbgemm-gpu-cpu")
    except PackageNotFoundError:  # pragma: no cover - the bench extra pins it
        return "?"


if __name__ == "__main__":
    main()
