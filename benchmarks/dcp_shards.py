"""DataParallelOptimizer's state through torch.distributed.checkpoint: what each rank writes,
and which saves load where.

A model of four square ``Linear`` layers (``--width``, 724 by default: 2.1M parameter
elements) is trained 2 steps with Adam in a gloo world of N ranks (``shard`` None on 1 rank,
``"param"`` and ``"flat"`` on 2 and 3), then its optimizer state is saved three ways:

- ``dcp.save({"optim": opt.dcp_state_dict()})``: each rank hands DCP its own pieces;
- ``opt.save(dir)``: distopt's own checkpoint (one file per rank's shard, a manifest);
- the reference: what torch's ``get_state_dict`` + ``dcp.save`` need of a sharded
  optimizer, the whole state on every rank (``consolidate_state_dict(to=None)``; its bytes
  per rank are printed, it is not saved).

Per rank it prints the state the rank holds, the optimizer bytes DCP was handed to write
on that rank (a counting ``FileSystemWriter``), the size of its DCP file, and the medians
over ``--repeats`` of ``dcp.save`` and ``opt.save``. Then every checkpoint is loaded with
``opt.load_dcp`` on 1, 2 and 3 ranks with each ``shard`` mode, and each load's state is
compared with the saved one bit for bit (consolidated): the N -> M table.

Run: ``python benchmarks/dcp_shards.py [--width N] [--repeats N] [--markdown]``
"""
import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
from typing import Any, Dict, List

# The folder of this file holds functional.py, which would hide the ``functional`` package;
# take this folder off the path and put the repository root on it instead.
_HERE = os.path.dirname(os.path.abspath(__file__))
_ROOT = os.path.dirname(_HERE)
sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != _HERE]
if _ROOT not in [os.path.abspath(p or os.curdir) for p in sys.path]:
    sys.path.insert(0, _ROOT)

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.distributed.checkpoint as dcp  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402

from benchmarks._machine import free_port, machine  # noqa: E402
from distopt.parallel import DataParallelOptimizer  # noqa: E402
from tests.parallel.dcp_scenarios import CountingWriter  # noqa: E402

SAVES = [(1, None), (2, "param"), (2, "flat"), (3, "param"), (3, "flat")]
LOADS = [None, "param", "flat"]
MB = 1e6


def _model(width: int) -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(4)])


def _trained(width: int, shard: Any, rank: int) -> Any:
    model = _model(width)
    opt = DataParallelOptimizer(torch.optim.Adam, model.parameters(), lr=1e-3, shard=shard)
    g = torch.Generator().manual_seed(rank)
    for _ in range(2):
        model(torch.randn(8, width, generator=g)).square().mean().backward()
        opt.step()
        opt.zero_grad()
    return opt


def _whole(opt: Any) -> Dict[str, Any]:
    if opt.shard is not None:
        opt.consolidate_state_dict(to=None)
    return opt.state_dict()


def _timed(repeats: int, call: Any) -> float:
    times = []
    for _ in range(repeats):
        dist.barrier()
        start = time.perf_counter()
        call()
        dist.barrier()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _save(rank: int, world: int, shard: Any, args: Any, where: str) -> Dict[str, Any]:
    opt = _trained(args.width, shard, rank)
    writer = CountingWriter(os.path.join(where, "dcp"))
    dcp.save({"optim": opt.dcp_state_dict()}, storage_writer=writer)
    handed = writer.tensor_bytes
    fresh = iter(range(args.repeats))  # a new directory each time: DCP warns on overwrites
    dcp_s = _timed(args.repeats, lambda: dcp.save(
        {"optim": opt.dcp_state_dict()}, checkpoint_id=os.path.join(where, f"dcp-{next(fresh)}")))
    own_s = _timed(args.repeats, lambda: opt.save(os.path.join(where, "own")))
    whole = _whole(opt)
    whole_bytes = sum(v.numel() * v.element_size() for e in whole["state"].values()
                      for v in e.values())
    if rank == 0:
        torch.save(whole, os.path.join(where, "whole.pt"))
    mine = f"__{rank}_0.distcp"
    own_files = sum(os.path.getsize(os.path.join(where, "own", f))
                    for f in os.listdir(os.path.join(where, "own")) if f.endswith(f"rank{rank}.pt"))
    held = opt.state_bytes()
    opt.close()
    return {"held": held, "handed": handed, "whole": whole_bytes,
            "file": os.path.getsize(os.path.join(where, "dcp", mine)), "own_file": own_files,
            "dcp_s": dcp_s, "own_s": own_s}


def _load(rank: int, world: int, args: Any, path: str) -> Dict[Any, Any]:
    out = {}
    for n, saved_shard in SAVES:
        where = os.path.join(path, f"{n}-{saved_shard}")
        want = torch.load(os.path.join(where, "whole.pt"), weights_only=True)
        for shard in LOADS:
            opt = DataParallelOptimizer(torch.optim.Adam, _model(args.width).parameters(),
                                        lr=1e-3, shard=shard)
            dist.barrier()
            start = time.perf_counter()
            opt.load_dcp(os.path.join(where, "dcp"))
            took = time.perf_counter() - start
            got = _whole(opt)
            same = all(torch.equal(got["state"][i][k], want["state"][i][k])
                       for i in want["state"] for k in want["state"][i])
            out[(n, saved_shard, shard)] = (same and sorted(got["state"]) == sorted(want["state"]),
                                            took)
            opt.close()
    return out


def _rank(rank: int, world: int, port: int, job: str, args: Any, path: str,
          results: Any) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world)
    try:
        if job == "load":
            got = _load(rank, world, args, path)
        else:
            got = _save(rank, world, None if job == "None" else job, args, path)
        results.put((rank, got))
    finally:
        dist.destroy_process_group()


def _world(world: int, job: str, args: Any, path: str) -> List[Any]:
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_rank, args=(r, world, port, job, args, path, results))
             for r in range(world)]
    for p in procs:
        p.start()
    got = dict(results.get(timeout=600) for _ in procs)
    for p in procs:
        p.join(timeout=60)
    return [got[r] for r in range(world)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--width", type=int, default=724)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--markdown", action="store_true", help="(tables are markdown)")
    args = parser.parse_args()
    root = tempfile.mkdtemp(prefix="dcp-shards-")
    print(f"# DCP shards: 4 x Linear({args.width}, {args.width}), Adam, gloo; "
          f"{machine()}; torch {torch.__version__}; medians of {args.repeats}")
    print("\n| saved on | shard | rank | state held (MB) | handed to DCP (MB) | DCP file (MB) "
          "| opt.save files (MB) | whole state, torch's path (MB) | dcp.save (s) "
          "| opt.save (s) |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    try:
        for n, shard in SAVES:
            where = os.path.join(root, f"{n}-{shard}")
            os.makedirs(where)
            for r, got in enumerate(_world(n, str(shard), args, where)):
                print(f"| {n} | {shard} | {r} | {got['held'] / MB:.2f} | "
                      f"{got['handed'] / MB:.2f} | {got['file'] / MB:.2f} | "
                      f"{got['own_file'] / MB:.2f} | {got['whole'] / MB:.2f} | "
                      f"{got['dcp_s']:.3f} | {got['own_s']:.3f} |")
        loads = {m: _world(m, "load", args, root) for m in (1, 2, 3)}
        print("\nLoaded with opt.load_dcp (state equal to the saved one bit for bit: yes/no; "
              "median seconds over the ranks of the load)\n")
        heads = [f"{m} ranks, {s}" for m in (1, 2, 3) for s in LOADS]
        print("| saved on, shard | " + " | ".join(heads) + " |")
        print("|---|" + "---|" * len(heads))
        for n, shard in SAVES:
            cells = []
            for m in (1, 2, 3):
                for s in LOADS:
                    oks = [rank[(n, shard, s)] for rank in loads[m]]
                    ok = all(o for o, _ in oks)
                    cells.append(f"{'yes' if ok else 'NO'} "
                                 f"({statistics.median(t for _, t in oks):.3f} s)")
            print(f"| {n}, {shard} | " + " | ".join(cells) + " |")
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
