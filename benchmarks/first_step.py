"""The first steps of a fresh process: distopt's compiled steps against torch.optim and DDP.

Every run is a fresh interpreter (this script started again with ``--child``), so that each
pays what a user's new process pays: TorchScript compiles an optimizer class once per
process, and its executor profiles a compiled method at the method's first call and
optimizes it at the second. Each child times, in ms:

- ``functional``: ``functional.script_optimizer(functional.FunctionalAdam(params))`` over 20
  parameters of 64 x 64 and 20 of 64 (construct: the compile), then steps 1, 2, 3 and the
  median of 50 later ones; beside it ``torch.optim.Adam(params, fused=True)``, the kernel the
  compiled step runs, in its own process.
- ``data-parallel``: a nanoGPT-shaped loop on a small GPT (tied embeddings, two pre-norm
  encoder layers; 16 parameters, 34,000 elements): decay / no-decay param groups, AdamW
  (betas 0.9, 0.95, fused), ``clip_grad_norm_(1.0)`` between backward and step, on gloo with
  ``--world`` ranks on 127.0.0.1, one intra-op thread each. ``DataParallelOptimizer`` against
  DDP + ``torch.optim.AdamW``. Construct is the optimizer's (and DDP's wrapper's)
  construction; steps 1, 2, 3 are iterations: forward + backward + clip + ``step()`` +
  ``zero_grad()``; each time is the larger of the ranks'.

Each child imports ``torch._dynamo`` before anything is timed: the first construction of any
torch.optim optimizer in a process imports it (about 0.8 s here, 1.5 s under load), on both
sides alike (``DataParallelOptimizer`` builds torch's class for its checks and defaults).

The table gives the median over ``--runs`` fresh processes per row, with the difference from
torch's row in ms (the ratio for the steady step). ``--no-jit`` adds the rows under ``PYTORCH_JIT=0`` (distopt's eager paths:
the functional class runs in Python, ``DataParallelOptimizer`` steps torch.optim's class).

Run: ``python benchmarks/first_step.py [--runs 5] [--world 1] [--no-jit] [--only functional]``.
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from typing import Any, Dict, List

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _ROOT not in [os.path.abspath(p or os.curdir) for p in sys.path]:
    sys.path.insert(0, _ROOT)

#: Steps timed after the first three, for the steady-state median.
STEADY = 50
VOCAB, WIDTH, SEQ, BATCH = 64, 32, 16, 4


def _functional(impl: str) -> Dict[str, float]:
    import torch

    import functional

    gen = torch.Generator().manual_seed(0)
    params = ([torch.randn(64, 64, generator=gen) for _ in range(20)]
              + [torch.randn(64, generator=gen) for _ in range(20)])
    grads = [[torch.randn(p.shape, generator=gen) for p in params] for _ in range(4)]
    start = time.perf_counter()
    if impl == "distopt":
        opt = functional.script_optimizer(functional.FunctionalAdam(params, lr=1e-3))

        def step(k: int) -> None:
            opt.step(grads[k % 4])
    else:
        opt = torch.optim.Adam(params, lr=1e-3, fused=True)

        def step(k: int) -> None:
            for p, g in zip(params, grads[k % 4]):
                p.grad = g
            opt.step()
    out = {"construct": time.perf_counter() - start}
    return {**out, **_steps(step)}


def _steps(step: Any) -> Dict[str, float]:
    out: Dict[str, float] = {}
    later: List[float] = []
    for k in range(3 + STEADY):
        start = time.perf_counter()
        step(k)
        took = time.perf_counter() - start
        if k < 3:
            out[f"step {k + 1}"] = took
        else:
            later.append(took)
    out["steady"] = statistics.median(later)
    return out


def _gpt() -> Any:
    import torch

    class GPT(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = torch.nn.Embedding(VOCAB, WIDTH)
            self.position = torch.nn.Embedding(SEQ, WIDTH)
            self.layers = torch.nn.Sequential(*[
                torch.nn.TransformerEncoderLayer(WIDTH, nhead=2, dim_feedforward=2 * WIDTH,
                                                 dropout=0.0, batch_first=True,
                                                 norm_first=True)
                for _ in range(2)
            ])
            self.norm = torch.nn.LayerNorm(WIDTH)
            self.head = torch.nn.Linear(WIDTH, VOCAB, bias=False)
            self.head.weight = self.embed.weight  # tied, as nanoGPT's

        def forward(self, tokens: torch.Tensor) -> torch.Tensor:
            h = self.embed(tokens) + self.position(torch.arange(tokens.shape[1]))
            return self.head(self.norm(self.layers(h)))

    torch.manual_seed(0)
    return GPT()


def _data_parallel(impl: str) -> Dict[str, float]:
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    from distopt.parallel import DataParallelOptimizer

    torch.set_num_threads(1)
    rank = int(os.environ["RANK"])
    dist.init_process_group("gloo", rank=rank, world_size=int(os.environ["WORLD_SIZE"]))
    model = _gpt()
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [{"params": [p for p in params if p.dim() >= 2], "weight_decay": 0.1},
              {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]
    options = {"lr": 6e-4, "betas": (0.9, 0.95), "fused": True}
    start = time.perf_counter()
    if impl == "distopt":
        opt = DataParallelOptimizer(torch.optim.AdamW, groups, module=model, **options)
        forward = model
    else:
        forward = torch.nn.parallel.DistributedDataParallel(model)
        opt = torch.optim.AdamW(groups, **options)
    out = {"construct": time.perf_counter() - start}
    gen = torch.Generator().manual_seed(100 + rank)
    batches = [torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=gen) for _ in range(4)]

    def step(k: int) -> None:
        tokens = batches[k % 4]
        logits = forward(tokens[:, :-1])
        F.cross_entropy(logits.reshape(-1, VOCAB), tokens[:, 1:].reshape(-1)).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)

    out.update(_steps(step))
    if impl == "distopt":
        opt.close()
    return out


def _child(kind: str, impl: str) -> None:
    import torch
    import torch._dynamo  # noqa: F401  (torch.optim's first construction imports it: not timed)

    torch.set_num_threads(1)
    result = _functional(impl) if kind == "functional" else _data_parallel(impl)
    print(json.dumps({k: v * 1e3 for k, v in result.items()}), flush=True)
    # No teardown: freeing DDP after its last all-reduce can deadlock in torch 2.13 (the
    # gloo thread, freeing that work, waits for the GIL that the freeing thread holds).
    os._exit(0)


def _one_run(kind: str, impl: str, world: int, jit: bool) -> Dict[str, float]:
    """One fresh process per rank; per key, the largest of the ranks' times."""
    from benchmarks._machine import free_port

    ranks = world if kind == "data-parallel" else 1
    port = str(free_port())
    procs = []
    for rank in range(ranks):
        env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port,
               "RANK": str(rank), "WORLD_SIZE": str(ranks), "PYTHONWARNINGS": "ignore"}
        if not jit:
            env["PYTORCH_JIT"] = "0"
        procs.append(subprocess.Popen(
            [sys.executable, os.path.abspath(__file__), "--child", kind, impl],
            env=env, stdout=subprocess.PIPE, text=True,
        ))
    results = []
    for proc in procs:
        out, _ = proc.communicate(timeout=600)
        if proc.returncode != 0:
            raise RuntimeError(f"{kind} {impl} rank exited with {proc.returncode}")
        results.append(json.loads(out.strip().splitlines()[-1]))
    return {k: max(r[k] for r in results) for k in results[0]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=5, help="fresh processes per row")
    parser.add_argument("--world", type=int, default=1, help="data-parallel ranks")
    parser.add_argument("--no-jit", action="store_true", help="add PYTORCH_JIT=0 rows")
    parser.add_argument("--only", choices=("functional", "data-parallel"), default=None)
    parser.add_argument("--child", nargs=2, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        _child(*args.child)
        return
    import torch

    from benchmarks._machine import machine

    print(f"machine: {machine()}; torch {torch.__version__}; load average "
          f"{os.getloadavg()[0]:.1f}; medians over {args.runs} fresh processes a row; ms")
    kinds = [args.only] if args.only else ["functional", "data-parallel"]
    for kind in kinds:
        rows = [("torch", "torch", True), ("distopt", "distopt", True)]
        if args.no_jit:
            rows.append(("distopt, PYTORCH_JIT=0", "distopt", False))
        # Rows in turns, one process of each per round: every row sees the same machine.
        runs: Dict[str, List[Dict[str, float]]] = {name: [] for name, _, _ in rows}
        for _ in range(args.runs):
            for name, impl, jit in rows:
                runs[name].append(_one_run(kind, impl, args.world, jit))
        keys = list(runs["torch"][0])
        world = f", {args.world} rank{'s' if args.world > 1 else ''}" if kind != "functional" else ""
        reference = "torch.optim.Adam(fused=True)" if kind == "functional" else "DDP + AdamW"
        print(f"\n{kind}{world} (torch: {reference})")
        print("| | " + " | ".join(keys) + " |")
        print("|---|" + "---:|" * len(keys))
        medians = {name: {k: statistics.median(r[k] for r in rs) for k in keys}
                   for name, rs in runs.items()}
        for name, med in medians.items():
            cells = []
            for k in keys:
                ref = medians["torch"][k]
                if k == "steady":
                    cell = f"{med[k]:.3f}" + ("" if name == "torch" else f" ({med[k] / ref:.2f}x)")
                else:
                    cell = f"{med[k]:.0f}" + ("" if name == "torch" else f" ({med[k] - ref:+.0f})")
                cells.append(cell)
            print(f"| {name} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
