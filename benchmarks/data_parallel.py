"""DataParallelOptimizer against torch DDP, with and without compression, one run.

Two ranks on 127.0.0.1 (gloo), one intra-op thread each (``torch.set_num_threads(1)``: two
processes on two cores). The model is an MLP of ``--params-millions`` million parameters
(Linear 1024 x 1024 layers, ReLU between), trained on one fixed batch of ``--batch`` rows
per rank (mean squared error against fixed random targets); every configuration starts
from the same weights. Per configuration: ``--warmup`` steps, then ``--steps`` timed steps,
each timed with ``time.perf_counter`` around forward + backward + ``step()`` +
``zero_grad()``. A step's time is the larger of the two ranks' times for it; the table
gives the median over the timed steps.

Configurations, side by side:

- local: ``torch.optim.Adam(foreach=True)`` with no communication; both ranks run it at once,
  each on its own batch (one process's worth of work per core): the floor. Also with
  ``fused=True``, closer to what DataParallelOptimizer runs (compiled fused Adam per bucket).
- DDP: ``torch.nn.parallel.DistributedDataParallel`` (default 25 MB buckets) +
  ``torch.optim.Adam(foreach=True)``; and DDP + torch's ``ZeroRedundancyOptimizer(Adam,
  foreach=True)`` (sharded state, stepped after backward: its ``overlap_with_ddp=True``
  refuses gloo).
- DataParallelOptimizer(torch.optim.Adam) with ``overlap=True`` (each bucket stepped as soon
  as its average arrives) and ``overlap=False``; each also under a ``GradScaler`` (the AMP
  recipe, with a float32 forward so that the scaler's own cost shows, not that of float16
  matmuls on a CPU), beside DDP + ``torch.optim.Adam(fused=True)`` with and without one (the
  kernel DataParallelOptimizer runs); then, overlapped, ``Cast(bfloat16)``,
  ``Cast(float16)``, ``TopK(0.01)`` (error feedback), ``sync=RoundRobin(4)``, and sharded
  state, ``shard="param"`` and ``shard="flat"`` (each bucket stepped and all-gathered during
  backward), and ``shard="flat", shard_gradients=True`` (ZeRO-2: each bucket
  reduce-scattered, one all_to_all, into the rank's part, its buffer released).

Gradient memory: ``grad B/rank`` is what a rank holds in gradients right after the
backward of one more, untimed, step (the reduction done): ``gradient_bytes()`` for
DataParallelOptimizer (bucket buffers, gradient shards, any ``.grad`` elsewhere); for DDP and
the local rows the ``.grad`` tensors only (DDP's own bucket buffers, as many bytes again,
are not visible to it).

Bytes: ``sent`` is the change of ``wchar`` in /proc/self/io over the timed steps, per step,
averaged over the two ranks (gloo on loopback writes every byte it sends through the
process's sockets; every thread counts; nothing else writes while a phase is timed).
``payload`` is the model of the bytes one rank sends per step: ``bytes_per_step`` of the
compression for DataParallelOptimizer's buckets, ``2 (W-1)/W x 4 x numel`` for DDP, and for
RoundRobin(4) one partition's parameters with Adam's ``exp_avg`` and ``exp_avg_sq`` in one
all-reduce, ``2 (W-1)/W x 4 x 3 x numel(partition)``, averaged over the 4 rounds.

Modelled steps at 1, 10 and 100 Gbit/s, for a network slower than loopback: ``compute +
payload x 8 / bandwidth``, where ``compute`` is the same configuration's median step when
each rank runs it alone, in a process group of its own (both ranks at once, as in the real
run): forward, backward, the compression's own work and the optimizer step, with nothing
on the wire. The model adds the wire time serially: it leaves out the overlap of
communication with backward, so it is an upper bound for every row alike; the ratio in
brackets is to DDP's modelled step at the same bandwidth.

``--arrival``: instead, the buckets' order. The MLP's layers are used in the reverse of
their registration order (``ReversedMLP``), so backward produces the first-registered
layers' gradients first, and the construction's buckets (reverse registration order, as
DDP's) are the wrong way round. Per step: the time from the start of backward to the first
reduction handed to the communication thread (DataParallelOptimizer: bucket 0 complete, as
its thread issues the buckets in order; DDP: the first call of a comm hook that records the
time and runs torch's ``allreduce_hook``), and the step's time; for
DataParallelOptimizer(Adam) with ``rebuild_buckets=False`` (the buckets as built, before)
and with the default (rebuilt in arrival order after the first step, after), and DDP +
Adam(fused) (which rebuilds its buckets after the first step too).

``--timeline FILE.png``: instead, a picture of a step. For DataParallelOptimizer(Adam) with
``overlap=True`` (default buckets, and ``bucket_cap_mb=5``: one layer a bucket) and DDP +
Adam(fused), each rank runs ``--warmup`` steps, then ``TIMELINE_STEPS`` steps under
``torch.profiler`` (``profile_all_threads=True``: distopt's threads start before it); FILE.png
gets one lane per thread per rank (forward, the autograd engine's functions and the
``backward()`` call on the main thread; distopt's ``distopt.dp.*`` ranges on its
communication and finishing threads; gloo's all_reduce on its threads), from the end of a
barrier both ranks leave together. The table printed beside it: each configuration's backward
compute, the time an all_reduce runs, and the share of it inside backward's compute.
Drawing needs matplotlib, an extra: ``pip install -e ".[bench]"``.

Run: ``python benchmarks/data_parallel.py [--steps N] [--warmup N] [--params-millions M]
[--batch B] [--markdown] [--arrival | --timeline FILE.png]``; the report (with
``--markdown``, markdown only) goes to stdout
and ends with the run time; progress is logged to stderr. The defaults take about 130 s
on 2 cores (127 s with the GradScaler rows, the cores shared with other work).
"""
import argparse
import datetime
import gc
import io
import logging
import multiprocessing
import os
import statistics
import sys
import time
import traceback
import warnings
from typing import Any, Callable, Dict, List, Optional, Tuple

# The folder of this file holds functional.py, which would hide the ``functional`` package;
# take this folder off the path and put the repository root on it instead.
_HERE = os.path.dirname(os.path.abspath(__file__))
_ROOT = os.path.dirname(_HERE)
sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != _HERE]
if _ROOT not in [os.path.abspath(p or os.curdir) for p in sys.path]:
    sys.path.insert(0, _ROOT)

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402

from distopt.parallel import Cast, DataParallelOptimizer, RoundRobin, TopK  # noqa: E402
with warnings.catch_warnings():  # torch.distributed.optim compiles its own classes at import
    warnings.filterwarnings("ignore", message="`torch.jit.", category=DeprecationWarning)
    from torch.distributed.optim import ZeroRedundancyOptimizer  # noqa: E402
from distopt.parallel.sync import partition  # noqa: E402
from distopt.profiling import all_threads_config  # noqa: E402
from benchmarks._machine import free_port, machine, wchar  # noqa: E402
from benchmarks._plot import pyplot  # noqa: E402

logger = logging.getLogger("benchmarks.data_parallel")

WORLD_SIZE = 2
WIDTH = 1024
LR = 1e-3
BANDWIDTHS_GBIT = (1, 10, 100)
#: The seconds a collective waits for a lost peer.
TIMEOUT_S = 120.0

#: name -> (kind, DataParallelOptimizer keyword arguments, or the torch.optim ones of "local"
#: and "ddp"; ``"scaler": True``: the step is the GradScaler recipe); in the order of the
#: table.
CONFIGS: Dict[str, Tuple[str, Dict[str, Any]]] = {
    "local Adam(foreach), no communication": ("local", {"foreach": True}),
    "local Adam(fused), no communication": ("local", {"fused": True}),
    "DDP + Adam(foreach)": ("ddp", {}),
    "DDP + ZeroRedundancyOptimizer(Adam)": ("zero", {}),
    "DPO(Adam) overlap=True": ("dpo", {}),
    "DPO(Adam) overlap=False": ("dpo", {"overlap": False}),
    "DDP + Adam(fused)": ("ddp", {"fused": True}),
    "DDP + Adam(fused) + GradScaler": ("ddp", {"fused": True, "scaler": True}),
    "DPO(Adam) overlap=True + GradScaler": ("dpo", {"scaler": True}),
    "DPO(Adam) overlap=False + GradScaler": ("dpo", {"overlap": False, "scaler": True}),
    "DPO(Adam) Cast(bf16)": ("dpo", {"compression": Cast(torch.bfloat16)}),
    "DPO(Adam) Cast(fp16)": ("dpo", {"compression": Cast(torch.float16)}),
    "DPO(Adam) TopK(0.01)": ("dpo", {"compression": TopK(0.01)}),
    "DPO(Adam) RoundRobin(4)": ("dpo", {"sync": RoundRobin(4)}),
    "DPO(Adam) shard=param": ("dpo", {"shard": "param"}),
    "DPO(Adam) shard=flat": ("dpo", {"shard": "flat"}),
    "DPO(Adam) shard=flat shard_gradients": ("dpo", {"shard": "flat", "shard_gradients": True}),
}


# ---------------------------------------------------------------- on the ranks



#: ``--arrival``'s configurations: name -> (kind, keyword arguments), in the table's order.
ARRIVAL_CONFIGS: Dict[str, Tuple[str, Dict[str, Any]]] = {
    "DDP + Adam(fused)": ("ddp", {"fused": True}),
    "DPO(Adam), buckets as built (rebuild_buckets=False)": ("dpo", {"rebuild_buckets": False}),
    "DPO(Adam), buckets rebuilt in arrival order (default)": ("dpo", {}),
}


class ReversedMLP(nn.Module):
    """``layers`` Linear(1024, 1024), ReLU between, used in the reverse of their
    registration order; the same weights every time."""

    def __init__(self, layers: int) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layers = nn.ModuleList(nn.Linear(WIDTH, WIDTH) for _ in range(layers))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for k, layer in enumerate(reversed(self.layers)):
            x = layer(F.relu(x) if k else x)
        return x


def arrival_phase(kind: str, options: Dict[str, Any], layers: int, world_size: int,
                  batch: Tuple[torch.Tensor, torch.Tensor], warmup: int,
                  steps: int) -> Dict[str, Any]:
    """Warm-up and timed steps on ``ReversedMLP``: each step's seconds, and the seconds
    from the start of its backward to its first reduction."""
    from distopt.parallel.reducer import GradientReducer
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    model = ReversedMLP(layers)
    first: List[Optional[float]] = [None]
    launch = GradientReducer._launch
    if kind == "ddp":
        net: nn.Module = nn.parallel.DistributedDataParallel(model)

        def hook(state: Any, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
            if first[0] is None:
                first[0] = time.perf_counter()
            return default_hooks.allreduce_hook(None, bucket)

        net.register_comm_hook(None, hook)
        opt: torch.optim.Optimizer = torch.optim.Adam(net.parameters(), lr=LR, **options)
    else:
        net = model
        opt = DataParallelOptimizer(torch.optim.Adam, model.parameters(), lr=LR, **options)

        def timed_launch(reducer: Any, bucket: Any) -> None:
            if bucket.index == 0 and first[0] is None:
                first[0] = time.perf_counter()
            launch(reducer, bucket)

        GradientReducer._launch = timed_launch  # type: ignore[assignment]
    x, y = batch

    def one_step() -> Tuple[float, float]:
        first[0] = None
        start = time.perf_counter()
        loss = F.mse_loss(net(x), y)
        backward = time.perf_counter()
        loss.backward()
        opt.step()
        opt.zero_grad()
        end = time.perf_counter()
        return end - start, (first[0] if first[0] is not None else end) - backward

    try:
        for _ in range(warmup):
            one_step()
        dist.barrier()
        timed = [one_step() for _ in range(steps)]
    finally:
        GradientReducer._launch = launch  # type: ignore[assignment]
    buckets = None
    if isinstance(opt, DataParallelOptimizer):
        buckets = [len(b) for b in opt.bucket_layout()]
        opt.close()
    return {"times": [t for t, _ in timed], "first": [f for _, f in timed],
            "buckets": buckets}


def rank_batch(rank: int, rows: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """This rank's fixed batch (inputs, targets)."""
    gen = torch.Generator().manual_seed(1 + rank)  # each rank its own batch
    return (torch.randn(rows, WIDTH, generator=gen), torch.randn(rows, WIDTH, generator=gen))


def _measure_each(rank: int, world_size: int, options: argparse.Namespace,
                  configs: Dict[str, Any], phase: Callable[..., Any], *extra: Any) -> Dict[str, Any]:
    """``phase(kind, kwargs, layers, world_size, batch, warmup, *extra)`` for every config."""
    layers = layer_count(options.params_millions)
    batch = rank_batch(rank, options.batch)
    out: Dict[str, Any] = {"layers": layers}
    for name, (kind, kwargs) in configs.items():
        if rank == 0:
            logger.info("%s", name)
        out[name] = phase(kind, kwargs, layers, world_size, batch, options.warmup, *extra)
        gc.collect()
    return out


def measure_arrival(rank: int, world_size: int, options: argparse.Namespace) -> Dict[str, Any]:
    return _measure_each(rank, world_size, options, ARRIVAL_CONFIGS, arrival_phase, options.steps)


def arrival_report(ranks: List[Dict[str, Any]], options: argparse.Namespace) -> List[str]:
    first = ranks[0]
    lines = [
        f"machine: {machine()}; torch {torch.__version__}; {WORLD_SIZE} ranks on 127.0.0.1 "
        f"(gloo), 1 intra-op thread each; ReversedMLP {first['layers']} x Linear({WIDTH}, "
        f"{WIDTH}) used in the reverse of their registration order, batch {options.batch} "
        f"per rank; Adam lr={LR}; {options.warmup} warm-up + {options.steps} timed steps; "
        f"medians over steps of the slower rank's time",
        "",
    ]
    table = [["config", "backward start -> first reduction ms", "step ms", "/ DDP step",
              "buckets (parameters each)"]]
    ddp = median_ms([r["DDP + Adam(fused)"]["times"] for r in ranks])
    for name in ARRIVAL_CONFIGS:
        step = median_ms([r[name]["times"] for r in ranks])
        to_first = median_ms([r[name]["first"] for r in ranks])
        buckets = first[name]["buckets"]
        table.append([name, f"{to_first:.1f}", f"{step:.1f}", f"{step / ddp:.2f}",
                      "-" if buckets is None else str(buckets)])
    lines.extend(table_lines(table, options.markdown, left=(0, 4)))
    return lines


# ---------------------------------------------------------------- --timeline

#: ``--timeline``'s configurations: name -> (kind, keyword arguments), drawn top to bottom.
TIMELINE_CONFIGS: Dict[str, Tuple[str, Dict[str, Any]]] = {
    "DataParallelOptimizer(Adam), overlap=True": ("dpo", {}),
    "DataParallelOptimizer(Adam), overlap=True, bucket_cap_mb=5": ("dpo", {"bucket_cap_mb": 5}),
    "DDP + torch.optim.Adam(fused=True)": ("ddp", {"fused": True}),
}
#: Steps profiled per configuration, after ``--warmup``.
TIMELINE_STEPS = 2
#: The benchmark's own ranges around each part of a step (on the thread running it).
STEP_PARTS = ("forward", "backward", "optimizer step")
#: The autograd engine's range around each backward function it runs.
ENGINE = "autograd::engine::evaluate_function"
#: gloo's range around the work of one all_reduce, on gloo's own threads.
GLOO = "gloo:all_reduce"


def _drawn(name: str) -> bool:
    return (name in STEP_PARTS or name == GLOO or name == "timeline.barrier"
            or name.startswith((ENGINE, "distopt.dp.")))


def timeline_phase(kind: str, options: Dict[str, Any], layers: int, world_size: int,
                   batch: Tuple[torch.Tensor, torch.Tensor], warmup: int) -> Dict[str, Any]:
    """``TIMELINE_STEPS`` steps under ``torch.profiler`` (every thread: distopt's threads
    start at the first backward, before the profiler); the ranges drawn, as (name, thread,
    start ms, end ms) from the end of a barrier both ranks leave together."""
    model, opt, _ = build(kind, options, layers, None, world_size)
    x, y = batch
    record = torch.profiler.record_function

    def one_step() -> None:
        with record("forward"):
            loss = F.mse_loss(model(x), y)
        with record("backward"):
            loss.backward()
        with record("optimizer step"):
            opt.step()
        opt.zero_grad()

    for _ in range(warmup):
        one_step()
    config = all_threads_config()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU],
                                experimental_config=config) as prof:
        with record("timeline.barrier"):
            dist.barrier()
        for _ in range(TIMELINE_STEPS):
            one_step()
    kept = [(e.name, e.thread, e.time_range.start, e.time_range.end)
            for e in prof.events() if _drawn(e.name)]
    zero = max(end for name, _, _, end in kept if name == "timeline.barrier")
    buckets = None
    if isinstance(opt, DataParallelOptimizer):
        buckets = len(opt.bucket_layout())
        opt.close()
    return {"events": [(n, t, (s - zero) / 1e3, (e - zero) / 1e3)
                       for n, t, s, e in kept if n != "timeline.barrier"],
            "buckets": buckets}


def measure_timeline(rank: int, world_size: int, options: argparse.Namespace) -> Dict[str, Any]:
    return _measure_each(rank, world_size, options, TIMELINE_CONFIGS, timeline_phase)


def _lanes(events: List[Tuple[str, int, float, float]]) -> List[Tuple[str, List[Any]]]:
    """One rank's events by thread, as (lane label, events), main thread first: the
    threads told apart by what runs on them (the profiler numbers threads, names none)."""
    by_thread: Dict[int, List[Any]] = {}
    for event in events:
        by_thread.setdefault(event[1], []).append(event)

    def role(items: List[Any]) -> Tuple[int, str]:
        names = {n for n, _, _, _ in items}
        if "backward" in names:
            return 0, "main thread"
        if any(n.startswith("distopt.dp.reduce[") for n in names):
            return 1, "distopt communication thread"
        if any(n.startswith("distopt.dp.reduce.wait[") for n in names):
            return 2, "distopt finishing thread"
        if GLOO in names:
            return 3, "gloo threads"
        return 4, "other thread"

    merged: Dict[Tuple[int, str], List[Any]] = {}
    for items in by_thread.values():
        merged.setdefault(role(items), []).extend(items)  # gloo's threads share one lane
    return [(label, items) for (_, label), items in sorted(merged.items())]


#: Colours of the timeline's bars, by what runs.
_COLOURS = {
    "forward": "#b0b0b0", "backward (autograd engine)": "#4c72b0",
    "optimizer step": "#8172b2", "reduction issued": "#dd8452",
    "reduction awaited": "#f0c29e", "bucket step": "#55a868", "gloo all_reduce": "#c44e52",
}


def _kind(name: str) -> Optional[str]:
    if name == "forward":
        return "forward"
    if name.startswith(ENGINE):
        return "backward (autograd engine)"
    if name == "optimizer step":
        return "optimizer step"
    if name.startswith("distopt.dp.reduce.wait["):
        return "reduction awaited"
    if name.startswith("distopt.dp.reduce["):
        return "reduction issued"
    if name.startswith("distopt.dp.step["):
        return "bucket step"
    if name == GLOO:
        return "gloo all_reduce"
    return None  # "backward" (the whole call, waits included) is drawn as an outline


def draw_timeline(ranks: List[Dict[str, Any]], options: argparse.Namespace) -> None:
    """One panel per configuration, one lane per thread per rank."""
    plt = pyplot("--timeline")
    panels = []
    for name in TIMELINE_CONFIGS:
        lanes = [(f"rank {r} {label}", items) for r, result in enumerate(ranks)
                 for label, items in _lanes(result[name]["events"])]
        panels.append((name, lanes))
    heights = [len(lanes) for _, lanes in panels]
    fig, axes = plt.subplots(len(panels), 1, figsize=(12, 1.6 + 0.5 * sum(heights)),
                             gridspec_kw={"height_ratios": heights})
    for ax, (title, lanes) in zip(axes, panels):  # each panel on its own time scale
        end = max(e for _, items in lanes for _, _, _, e in items)
        for row, (_, items) in enumerate(lanes):
            y = len(lanes) - 1 - row
            for name, _, start, stop in items:
                if name == "backward":
                    ax.broken_barh([(start, stop - start)], (y - 0.42, 0.84),
                                   facecolors="none", edgecolors="#4c72b0", linewidth=0.8)
                    continue
                kind = _kind(name)
                if kind is None:
                    continue
                alpha = 0.85 if kind.startswith("gloo") else 1.0  # gloo's threads overlap
                ax.broken_barh([(start, max(stop - start, end * 1e-3))], (y - 0.32, 0.64),
                               facecolors=_COLOURS[kind], alpha=alpha)
                if "[bucket " in name and stop - start > end * 0.012:
                    ax.text((start + stop) / 2, y, name.split("[bucket ")[1].rstrip("]"),
                            ha="center", va="center", fontsize=7)
        ax.set_yticks(range(len(lanes)))
        ax.set_yticklabels([label for label, _ in reversed(lanes)], fontsize=8)
        ax.set_title(title, fontsize=10, loc="left")
        ax.grid(axis="x", alpha=0.3)
    axes[-1].set_xlabel("ms from a barrier both ranks leave together "
                        f"({TIMELINE_STEPS} steps after {options.warmup} warm-up steps)")
    handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c in _COLOURS.values()]
    handles.append(plt.Rectangle((0, 0), 1, 1, facecolor="none", edgecolor="#4c72b0"))
    labels = list(_COLOURS) + ["backward() call (until every bucket is averaged)"]
    fig.legend(handles, labels, loc="lower center", ncol=4, fontsize=8, frameon=False)
    first = ranks[0]
    fig.suptitle(
        f"{WORLD_SIZE} ranks, gloo on 127.0.0.1, {machine()}, torch {torch.__version__}: MLP "
        f"{first['layers']} x Linear({WIDTH}, {WIDTH}), batch {options.batch} per rank, Adam; "
        f"bars: torch.profiler ranges (numbers: buckets)", fontsize=9)
    fig.tight_layout(rect=(0, 0.07, 1, 0.97))
    fig.savefig(options.timeline, dpi=110)
    plt.close(fig)


def _union(spans: List[Tuple[float, float]]) -> List[Tuple[float, float]]:
    """The spans merged where they overlap (gloo runs all_reduces on two threads)."""
    out: List[Tuple[float, float]] = []
    for s, e in sorted(spans):
        if out and s <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], e))
        else:
            out.append((s, e))
    return out


def _overlap(events: List[Tuple[str, int, float, float]]) -> List[Tuple[float, float, float]]:
    """Per step: (autograd compute ms, ms with an all_reduce running, the share of those ms
    inside the compute's span)."""
    steps = sorted((s, e) for n, _, s, e in events if n == "backward")
    out = []
    for k, (start, stop) in enumerate(steps):
        until = steps[k + 1][0] if k + 1 < len(steps) else float("inf")
        engine = [(s, e) for n, _, s, e in events if n.startswith(ENGINE) and start <= s <= stop]
        first, last = min(s for s, _ in engine), max(e for _, e in engine)
        reduce = _union([(s, e) for n, _, s, e in events if n == GLOO and start <= s < until])
        total = sum(e - s for s, e in reduce)
        inside = sum(max(0.0, min(e, last) - max(s, first)) for s, e in reduce)
        out.append((last - first, total, inside / total if total else 0.0))
    return out


def timeline_report(ranks: List[Dict[str, Any]], options: argparse.Namespace) -> List[str]:
    lines = [
        f"machine: {machine()}; torch {torch.__version__}; {WORLD_SIZE} ranks on 127.0.0.1 "
        f"(gloo), 1 intra-op thread each; MLP {ranks[0]['layers']} x Linear({WIDTH}, {WIDTH}), "
        f"batch {options.batch} per rank; {options.warmup} warm-up + {TIMELINE_STEPS} "
        f"profiled steps; timeline: {options.timeline}",
        "",
    ]
    table = [["config", "buckets", "backward compute ms", "all_reduce running ms",
              "of it during backward compute"]]
    for name in TIMELINE_CONFIGS:
        rows = [row for result in ranks for row in _overlap(result[name]["events"])]
        buckets = ranks[0][name]["buckets"]
        table.append([name, "DDP's" if buckets is None else str(buckets),
                      f"{statistics.median(r[0] for r in rows):.1f}",
                      f"{statistics.median(r[1] for r in rows):.1f}",
                      f"{100 * statistics.median(r[2] for r in rows):.0f}%"])
    lines.extend(table_lines(table, options.markdown))
    lines.append("")
    lines.append("medians over the profiled steps of both ranks; backward compute: the "
                 "autograd engine's first to last function on the main thread; all_reduce "
                 "running: the time some gloo all_reduce range is open on gloo's threads, "
                 "and its share inside that span")
    draw_timeline(ranks, options)
    return lines


def layer_count(params_millions: float) -> int:
    return max(1, round(params_millions * 1e6 / (WIDTH * WIDTH + WIDTH)))


def make_model(layers: int) -> nn.Module:
    """``layers`` Linear(1024, 1024), ReLU between; the same weights every time."""
    torch.manual_seed(0)
    parts: List[nn.Module] = []
    for i in range(layers):
        if i:
            parts.append(nn.ReLU())
        parts.append(nn.Linear(WIDTH, WIDTH))
    return nn.Sequential(*parts)


def build(kind: str, options: Dict[str, Any], layers: int, group: Any,
          world_size: int) -> Tuple[nn.Module, torch.optim.Optimizer, Optional[float]]:
    """The model to call, its optimizer, and the payload model (bytes per step and rank)."""
    model = make_model(layers)
    numel = sum(p.numel() for p in model.parameters())
    dense = 2.0 * (world_size - 1) / world_size * 4 * numel
    if kind == "local":
        return model, torch.optim.Adam(model.parameters(), lr=LR, **options), None
    if kind == "ddp":
        ddp = nn.parallel.DistributedDataParallel(model, process_group=group)
        kwargs = options or {"foreach": True}
        return ddp, torch.optim.Adam(ddp.parameters(), lr=LR, **kwargs), dense
    if kind == "zero":
        # overlap_with_ddp=True is refused on gloo: ZeRO steps after backward, then each
        # owner broadcasts its parameters (on average (W-1)/W of them leave each rank).
        ddp = nn.parallel.DistributedDataParallel(model, process_group=group)
        zero = ZeroRedundancyOptimizer(ddp.parameters(), optimizer_class=torch.optim.Adam,
                                       process_group=group, lr=LR, foreach=True)
        return ddp, zero, dense + (world_size - 1) / world_size * 4 * numel
    opt = DataParallelOptimizer(torch.optim.Adam, model.parameters(), lr=LR,
                                process_group=group, **options)
    if opt.sync is not None:
        params = list(model.parameters())
        parts = partition(params, opt.sync.k)
        per_round = [sum(params[i].numel() for i in part) for part in parts]
        payload = 2.0 * (world_size - 1) / world_size * 4 * 3 * statistics.mean(per_round)
    else:
        payload = opt.bytes_per_step()
    return model, opt, payload


def state_bytes(opt: torch.optim.Optimizer) -> int:
    """The optimizer state this rank holds (tensors, step counts included)."""
    if isinstance(opt, DataParallelOptimizer):
        return opt.state_bytes()
    inner = opt.optim if isinstance(opt, ZeroRedundancyOptimizer) else opt
    return sum(v.numel() * v.element_size() for entry in inner.state.values()
               for v in entry.values() if isinstance(v, torch.Tensor))


def run_phase(kind: str, options: Dict[str, Any], layers: int, group: Any, world_size: int,
              batch: Tuple[torch.Tensor, torch.Tensor], warmup: int,
              steps: int) -> Dict[str, Any]:
    """Warm-up and timed steps of one configuration; every step's seconds and the bytes."""
    options = dict(options)
    # The AMP recipe with a float32 forward: the scaler's own cost, not float16 matmuls'.
    scaler = torch.amp.GradScaler("cpu") if options.pop("scaler", False) else None
    model, opt, payload = build(kind, options, layers, group, world_size)
    x, y = batch

    grads: List[int] = []

    def one_step(probe: bool = False) -> float:
        start = time.perf_counter()
        loss = F.mse_loss(model(x), y)
        (loss if scaler is None else scaler.scale(loss)).backward()
        if probe:  # after backward, its reduction done
            grads.append(gradient_bytes(model, opt))
        if scaler is None:
            opt.step()
        else:
            scaler.step(opt)
            scaler.update()
        opt.zero_grad()
        return time.perf_counter() - start

    for _ in range(warmup):
        one_step()
    dist.barrier()  # both ranks start the timed steps together
    before = wchar()
    times = [one_step() for _ in range(steps)]
    sent = (wchar() - before) / steps
    held = state_bytes(opt)
    one_step(probe=True)  # untimed
    if isinstance(opt, DataParallelOptimizer):
        opt.close()  # its hooks and threads; the model and optimizer go when this returns
    return {"times": times, "sent": sent, "payload": payload, "state": held, "grads": grads[0]}


def gradient_bytes(model: nn.Module, opt: torch.optim.Optimizer) -> int:
    """The gradient bytes this rank holds (see the module's docstring)."""
    if isinstance(opt, DataParallelOptimizer):
        return opt.gradient_bytes()
    storages = {p.grad.untyped_storage().data_ptr(): p.grad.untyped_storage().nbytes()
                for p in model.parameters() if p.grad is not None}
    return sum(storages.values())


def measure(rank: int, world_size: int, options: argparse.Namespace) -> Dict[str, Any]:
    """Every configuration on this rank: with the other rank, then alone."""
    layers = layer_count(options.params_millions)
    batch = rank_batch(rank, options.batch)
    # A group of one per rank (every rank creates every group, in the same order).
    alone = [dist.new_group([r]) for r in range(world_size)][rank]
    out: Dict[str, Any] = {"layers": layers,
                           "numel": sum(p.numel() for p in make_model(layers).parameters())}
    for name, (kind, kwargs) in chosen(options).items():
        if rank == 0:
            logger.info("%s", name)
        together = run_phase(kind, kwargs, layers, None, world_size, batch, options.warmup,
                             options.steps)
        gc.collect()
        if kind == "local":
            out[name] = {"together": together, "alone": None}
            continue
        single = run_phase(kind, kwargs, layers, alone, 1, batch, options.warmup, options.steps)
        gc.collect()
        out[name] = {"together": together, "alone": single}
    return out


def chosen(options: argparse.Namespace) -> Dict[str, Tuple[str, Dict[str, Any]]]:
    """The configurations ``--only`` names (a part of their names), with the DDP row the
    others are compared to; all of them without it."""
    if not options.only:
        return CONFIGS
    return {name: config for name, config in CONFIGS.items()
            if name == "DDP + Adam(foreach)" or any(part in name for part in options.only)}


def _rank_main(rank: int, world_size: int, port: int, options: argparse.Namespace,
               results: Any) -> None:
    torch.set_num_threads(1)  # two processes on two cores: one intra-op thread each
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr,
                        format=f"rank {rank}: %(name)s: %(message)s")
    logger.setLevel(logging.INFO if options.verbose else logging.WARNING)
    warnings.filterwarnings("ignore", message=".*torch.jit.script.*deprecated")
    try:
        dist.init_process_group(
            "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size,
            timeout=datetime.timedelta(seconds=TIMEOUT_S),
        )
        out = _mode(options)[0](rank, world_size, options)
        buf = io.BytesIO()
        torch.save(out, buf)
        results.put((rank, True, buf.getvalue()))
        dist.destroy_process_group()
    except BaseException:  # noqa: B902 - reported by the parent
        results.put((rank, False, traceback.format_exc()))
    # Flush the result, then skip the interpreter's teardown: after a failure, gloo's
    # threads of the broken group can block it (as in tests/worlds.py).
    results.close()
    results.join_thread()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _mode(options: argparse.Namespace) -> Tuple[Any, Any]:
    """What the ranks measure and what reports it: the tables, ``--arrival`` or
    ``--timeline``."""
    if options.arrival:
        return measure_arrival, arrival_report
    if options.timeline:
        return measure_timeline, timeline_report
    return measure, report


def run_world(options: argparse.Namespace) -> List[Dict[str, Any]]:
    """Spawn the ranks; every rank's results, in rank order."""
    ctx = multiprocessing.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_rank_main, args=(r, WORLD_SIZE, port, options, results))
             for r in range(WORLD_SIZE)]
    for p in procs:
        p.start()
    out: List[Any] = [None] * WORLD_SIZE
    failures = []
    try:
        for _ in range(WORLD_SIZE):
            rank, ok, value = results.get(timeout=30 * 60)
            if ok:
                out[rank] = torch.load(io.BytesIO(value), weights_only=False)
            else:
                failures.append(f"rank {rank}:\n{value}")
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    if failures:
        raise RuntimeError("\n".join(failures))
    return out


# ---------------------------------------------------------------- the report





def table_lines(table: List[List[str]], markdown: bool, left: Tuple[int, ...] = (0,)) -> List[str]:
    """``table`` (a header row, then rows) as markdown, or as aligned text; the columns in
    ``left`` are text, the others numbers (right-aligned)."""
    if markdown:
        rule = ["---" if i in left else "---:" for i in range(len(table[0]))]
        return ["| " + " | ".join(cells) + " |" for cells in [table[0], rule] + table[1:]]
    widths = [max(len(r[i]) for r in table) for i in range(len(table[0]))]
    return ["  ".join(c.ljust(w) if i == 0 else c.rjust(w)
                      for i, (c, w) in enumerate(zip(cells, widths))) for cells in table]


def median_ms(per_rank: List[List[float]]) -> float:
    """The median over steps of the slowest rank's time for each step, in ms."""
    return statistics.median(max(ts) for ts in zip(*per_rank)) * 1e3


def human_bytes(n: Optional[float]) -> str:
    if n is None:
        return "-"
    for unit, size in (("MB", 1e6), ("kB", 1e3)):
        if n >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n:.0f} B"


def report(ranks: List[Dict[str, Any]], options: argparse.Namespace) -> List[str]:
    md = options.markdown
    lines: List[str] = []

    table: List[List[str]] = []

    def row(*cells: str) -> None:
        table.append(list(cells))

    first = ranks[0]
    lines.append(
        f"machine: {machine()}; torch {torch.__version__}; {WORLD_SIZE} ranks on 127.0.0.1 "
        f"(gloo), 1 intra-op thread each; MLP {first['layers']} x Linear({WIDTH}, {WIDTH}) = "
        f"{first['numel'] / 1e6:.2f}M parameters, batch {options.batch} per rank; Adam "
        f"lr={LR}; {options.warmup} warm-up + {options.steps} timed steps; step = median over "
        f"steps of the slower rank's forward+backward+step+zero_grad"
    )
    lines.append("")
    headers = ["config", "step ms", "/ DDP", "sent B/step/rank (wchar)", "payload B (model)",
               "state B/rank (max)", "grad B/rank (max)", "compute ms (alone)"] + [f"modelled ms @{g} Gbit/s (/ DDP)" for g in BANDWIDTHS_GBIT]
    row(*headers)
    rows: Dict[str, Dict[str, Any]] = {}
    for name in chosen(options):
        together = [r[name]["together"] for r in ranks]
        alone = [r[name]["alone"] for r in ranks]
        entry = {
            "ms": median_ms([t["times"] for t in together]),
            "sent": statistics.mean(t["sent"] for t in together),
            "payload": together[0]["payload"],
            "compute": median_ms([a["times"] for a in alone]) if alone[0] else None,
            "state": max(t["state"] for t in together),
            "grads": max(t["grads"] for t in together),
        }
        if entry["payload"] is not None:
            entry["modelled"] = [entry["compute"] + entry["payload"] * 8 / (g * 1e9) * 1e3
                                 for g in BANDWIDTHS_GBIT]
        rows[name] = entry
    ddp = rows["DDP + Adam(foreach)"]
    for name, entry in rows.items():
        modelled = ["-"] * len(BANDWIDTHS_GBIT)
        if "modelled" in entry:
            modelled = [f"{m:.1f} ({m / d:.2f})"
                        for m, d in zip(entry["modelled"], ddp["modelled"])]
        compute = "-" if entry["compute"] is None else f"{entry['compute']:.1f}"
        row(name, f"{entry['ms']:.1f}", f"{entry['ms'] / ddp['ms']:.2f}",
            human_bytes(entry["sent"]), human_bytes(entry["payload"]),
            human_bytes(entry["state"]), human_bytes(entry["grads"]), compute, *modelled)
    lines.extend(table_lines(table, md))
    lines.append("")
    if "DDP + Adam(fused) + GradScaler" not in rows:
        return lines + [_NOTE]
    lines.append(
        "GradScaler (scaler.scale(loss).backward(); scaler.step(opt); scaler.update(), "
        "float32 forward): each row against the same configuration without the scaler, and "
        "against DDP + Adam(fused) + GradScaler (the kernel DataParallelOptimizer runs)"
    )
    lines.append("")
    scaled_table = [["config", "step ms", "/ without GradScaler",
                     "/ DDP + Adam(fused) + GradScaler"]]
    reference = rows["DDP + Adam(fused) + GradScaler"]["ms"]
    for name, entry in rows.items():
        if name.endswith(" + GradScaler"):
            plain = rows[name[:-len(" + GradScaler")]]["ms"]
            scaled_table.append([name, f"{entry['ms']:.1f}", f"{entry['ms'] / plain:.2f}",
                                 f"{entry['ms'] / reference:.2f}"])
    lines.extend(table_lines(scaled_table, md))
    lines.append("")
    lines.append(_NOTE)
    return lines


_NOTE = (
    "sent: wchar change per timed step, mean of the ranks; payload: the modelled bytes "
    "(bytes_per_step; DDP 2(W-1)/W x 4 x numel; RoundRobin: parameter + exp_avg + "
    "exp_avg_sq of one of 4 partitions, mean over the rounds; ZeRO and shard: plus the "
    "parameters' gather, (W-1)/W x 4 x numel for ZeRO's broadcasts, each bucket's padded "
    "part for shard; shard_gradients: (W-1)/W x 4 x numel for the all_to_all); state: "
    "optimizer state bytes on the rank holding most; grad: gradient bytes held after "
    "backward and its reduction (DDP, local: .grad only); compute: the same configuration "
    "with each rank alone in its own process group (both at once); modelled = compute + "
    "payload x 8 / bandwidth, no overlap."
)


def main(argv: Optional[List[str]] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=32, help="timed steps per configuration")
    parser.add_argument("--warmup", type=int, default=4, help="untimed steps first")
    parser.add_argument("--params-millions", type=float, default=8.0,
                        help="model size (rounded to whole 1024 x 1024 layers)")
    parser.add_argument("--batch", type=int, default=32, help="rows per rank")
    parser.add_argument("--markdown", action="store_true", help="print a markdown table")
    parser.add_argument("--only", nargs="+", metavar="PART", default=None,
                        help="only the configurations whose names contain one of these "
                             "(and DDP + Adam(foreach), the reference), e.g. --only shard=")
    parser.add_argument("-q", "--quiet", dest="verbose", action="store_false",
                        help="log no progress")
    parser.add_argument("--arrival", action="store_true",
                        help="measure the buckets' order instead (ReversedMLP): backward start "
                             "to first reduction, and step time, before and after the rebuild")
    parser.add_argument("--timeline", metavar="FILE.png", default=None,
                        help="instead, profile a few steps of DataParallelOptimizer and of "
                             "DDP + Adam on both ranks and draw one lane per thread per rank "
                             "into FILE.png (needs matplotlib: pip install -e \".[bench]\")")
    options = parser.parse_args(argv)
    if options.arrival and options.timeline:
        parser.error("Invalid options: --arrival and --timeline (expected one of them)")
    if options.timeline:
        pyplot("--timeline")  # before minutes of measuring, not after
    for name in ("steps", "batch"):
        if getattr(options, name) < 1:
            parser.error(f"Invalid --{name}: {getattr(options, name)!r} (expected >= 1)")
    if options.warmup < 1:
        parser.error(f"Invalid --warmup: {options.warmup!r} (expected >= 1: the first step "
                     f"creates the optimizer state)")
    if options.params_millions <= 0:
        parser.error(f"Invalid --params-millions: {options.params_millions!r} (expected > 0)")
    logging.basicConfig(level=logging.INFO if options.verbose else logging.WARNING,
                        stream=sys.stderr)
    start = time.perf_counter()
    logger.info("spawning %d ranks", WORLD_SIZE)
    ranks = run_world(options)
    for line in _mode(options)[1](ranks, options):
        print(line, flush=True)
    if options.markdown:
        print()
    print(f"run time: {time.perf_counter() - start:.0f} s on {machine()}", flush=True)


if __name__ == "__main__":
    main()
