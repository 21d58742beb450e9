"""distopt.DistributedOptimizer against torch.distributed.optim.DistributedOptimizer, one run.

Three processes on this machine: ``trainer`` (this one) and two parameter owners, one
intra-op thread each (``--intra-op-threads``). Adam (lr 1e-3) unless said otherwise; only ``opt.step(ctx)`` is timed,
each step in a fresh autograd context after a cheap forward/backward (the sum of every
parameter, so every gradient is ones).

- large: one 4M-element parameter on owner1.
- small: 64 parameters of 1,024 elements on each owner.
- many: 2,000 parameters of 32 elements, half on each owner.
- concurrent: ``--threads`` trainer threads, each with its own DistributedOptimizer (SGD,
  lr 1) over the same 64 x 1,024 parameters of ones on owner1, each taking
  ``--concurrent-steps`` steps: throughput (steps/s over the whole run, forward and backward
  included) and lost updates (elements short of the expected value, summed).
- busy owner: the ``many`` and ``small`` parameter counts, all on owner1, stepped while a
  thread on owner1 spins in pure Python; the slowdown busy/idle for distopt, torch's
  functional (TorchScript) path, and torch's eager path (``EagerAdam``, an unmapped
  subclass of torch.optim.Adam).

The floor of a case: a local fused Adam step over the largest share one owner updates, as
one flat tensor (what flat parameter buffers can reach), plus the round trip of an empty
TorchScript RPC.

The empty-context check, per case: the work distopt adds to each step so that ``step`` can
warn when its context holds no gradient of any parameter (``distopt.optimizer``), beside the
case's step time. On the owner, ``any_gradient`` over the largest share one owner updates,
compiled as the owner's step runs it (timed in a TorchScript loop, the call's own cost taken
off): in a normal step it stops at the first parameter, in an empty context it looks at every
one; on the trainer, the look at each owner's reply.

``--device cuda``: the same cases with every parameter on ``cuda:0``, the one GPU both owners
share (the trainer uses it for the floor's local step). Only parameters, gradients and
optimizer state are on the GPU: a set's loss leaves its owner on the CPU and its gradient
comes back there (autograd's copy on the owner takes it to the GPU), so no CUDA tensor
crosses RPC and TensorPipe needs no device map (see ``benchmarks/_rpc_world.py``). GPU work
outlives the RPC that queued it, so each timed step ends with a ``torch.cuda.synchronize()``
RPC to every owner of the set, in parallel (a TorchScript target, which a busy owner answers
without the GIL; the owners are synchronized, untimed, before the step starts); the floor
adds that RPC's idle round trip. The owner-side column is timed from an
idle GPU to the step's last kernel. The targets are the CPU's and are not applied. This is
the issue's "DistributedOptimizer step with owners on one GPU": the distopt/torch column.

``--plot FILE.png``: instead of the cases above, a sweep: Adam's step time for both libraries
with 2 to 2,048 parameters of 1,024 elements, half on each owner (a table, and the picture in
FILE.png, log-log; matplotlib: ``pip install -e ".[bench]"``).

Run: ``python benchmarks/rpc_step.py [--device cpu|cuda] [--repeats N] [--threads N]
[--intra-op-threads N] [--markdown] [--plot FILE.png]`` (``--intra-op-threads 0``: torch's
default threads in all three processes, instead of one each); the report
(with ``--markdown``, markdown only) goes to stdout and ends with the run time, logs and
warnings go to stderr. ``--repeats 3 --concurrent-steps 10`` gives a rough run in about
40 s on 2 cores; the defaults take a few minutes.
"""
import argparse
import logging
import multiprocessing
import os
import statistics
import sys
import threading
import time
import timeit
import warnings
from typing import Callable, Dict, List, Optional, Sequence, Tuple

# The folder of this file holds functional.py, which would hide the ``functional`` package;
# import this folder's helpers as ``benchmarks._rpc_world`` from the repository root instead.
_HERE = os.path.dirname(os.path.abspath(__file__))
_ROOT = os.path.dirname(_HERE)
sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != _HERE]
if _ROOT not in [os.path.abspath(p or os.curdir) for p in sys.path]:
    sys.path.insert(0, _ROOT)

import torch  # noqa: E402
import torch.distributed.autograd as dist_autograd  # noqa: E402
import torch.distributed.optim as torch_dist_optim  # noqa: E402
import torch.distributed.rpc as rpc  # noqa: E402

import distopt  # noqa: E402
from benchmarks import _rpc_world as world  # noqa: E402
from distopt.local_optimizer import any_gradient  # noqa: E402
from benchmarks._machine import (  # noqa: E402
    add_device_argument,
    check_device,
    device_clock,
    free_port,
    machine,
)
from benchmarks._plot import pyplot  # noqa: E402

logger = logging.getLogger("benchmarks.rpc_step")

LIBRARIES = {"distopt": distopt.DistributedOptimizer, "torch": torch_dist_optim.DistributedOptimizer}
ADAM = {"lr": 1e-3}

# name -> [(owner, count, numel)]
CASES: Dict[str, List[Tuple[str, int, int]]] = {
    "large": [("owner1", 1, 4 * 1024 * 1024)],
    "small": [("owner1", 64, 1024), ("owner2", 64, 1024)],
    "many": [("owner1", 1000, 32), ("owner2", 1000, 32)],
}
BUSY_CASES: Dict[str, List[Tuple[str, int, int]]] = {
    "many": [("owner1", 2000, 32)],
    "small": [("owner1", 64, 1024)],
}
#: distopt/torch targets of the flat-buffer work (issue 10).
TARGETS = {"large": 0.35, "small": 0.3, "many": 0.05}
BUSY_TARGET = 1.5


class ParamSets:
    """Parameter sets created on owners, each known there by a name, on ``device`` ("cpu" or
    "cuda:0")."""

    def __init__(self, tag: str, layout: List[Tuple[str, int, int]], fill: Optional[float] = None,
                 device: str = "cpu"):
        self.names: List[Tuple[str, str]] = []
        self.rrefs: List[rpc.RRef] = []
        self.device = device
        for owner, count, numel in layout:
            name = f"{tag}@{owner}"
            self.rrefs += rpc.rpc_sync(owner, world.create, args=(name, count, numel, fill, device))
            self.names.append((owner, name))

    def synchronize(self) -> None:
        """On a GPU, wait until every owner's queued kernels are done (one RPC each, in
        parallel); nothing on the CPU, where a step is done when its RPC returns."""
        if self.device == "cpu":
            return
        torch.futures.wait_all(
            [rpc.rpc_async(owner, world.cuda_synchronize, args=(0,)) for owner, _ in self.names]
        )

    def forward_backward(self, ctx: int) -> None:
        """The cheap loss: every element summed; each gradient is ones."""
        losses = [rpc.rpc_sync(owner, world.set_sum, args=(name,)) for owner, name in self.names]
        dist_autograd.backward(ctx, [torch.stack(losses).sum()])

    def values(self) -> List[torch.Tensor]:
        out: List[torch.Tensor] = []
        for owner, name in self.names:
            out += rpc.rpc_sync(owner, world.set_values, args=(name,))
        return out

    def drop(self) -> None:
        for owner, name in self.names:
            rpc.rpc_sync(owner, world.drop, args=(name,))
        self.rrefs = []


def median_ms(samples: Sequence[float]) -> float:
    return statistics.median(samples) * 1e3


def time_steps(lib: type, optim_cls: type, sets: ParamSets, repeats: int, warmup: int = 3) -> float:
    """Median wall time of ``opt.step(ctx)`` in ms, a fresh context per step (on a GPU, from
    idle owners until their kernels are done: ``ParamSets.synchronize``)."""
    opt = lib(optim_cls, sets.rrefs, **ADAM)
    samples = []
    for i in range(warmup + repeats):
        with dist_autograd.context() as ctx:
            sets.forward_backward(ctx)
            sets.synchronize()
            start = time.perf_counter()
            opt.step(ctx)
            sets.synchronize()
            elapsed = time.perf_counter() - start
        if i >= warmup:
            samples.append(elapsed)
    del opt
    return median_ms(samples)


def try_time_steps(lib: type, optim_cls: type, sets: ParamSets, repeats: int) -> float:
    """``time_steps``, or NaN (logged) when that optimizer fails: the report goes on."""
    try:
        return time_steps(lib, optim_cls, sets, repeats)
    except Exception as exc:  # a broken path must not hide the other measurements
        logger.error("%s(%s) failed: %s", lib.__module__, optim_cls.__name__, exc)
        return float("nan")


def owner_side_ms(sets: ParamSets, repeats: int, warmup: int = 3) -> float:
    """Median time of distopt's owner-side step on owner1 alone (its RPC and trainer excluded).

    Uses distopt internals (``remote_optimizers``); NaN when they are not there.
    """
    try:
        opt = distopt.DistributedOptimizer(torch.optim.Adam, sets.rrefs, **ADAM)
        local = [r for r in opt.remote_optimizers if r.owner_name() == "owner1"][0]
        samples = []
        for i in range(warmup + repeats):
            with dist_autograd.context() as ctx:
                sets.forward_backward(ctx)
                seconds = rpc.rpc_sync("owner1", world.timed_owner_step,
                                       args=(local, ctx, sets.device))
            if i >= warmup:
                samples.append(seconds)
        return median_ms(samples)
    except Exception as exc:
        logger.error("owner-side probe failed: %s", exc)
        return float("nan")


def local_fused_adam_ms(count: int, numel: int, repeats: int, device: str = "cpu") -> float:
    """Median fused torch.optim.Adam step over ``count`` x ``numel`` elements on ``device``, in
    this process (on a GPU, from an idle device until the step's kernels are done)."""
    params = [torch.randn(numel).to(device).requires_grad_() for _ in range(count)]
    for p in params:
        p.grad = torch.ones(numel, device=device)
    opt = torch.optim.Adam(params, fused=True, **ADAM)
    opt.step()
    clock = device_clock(torch.device(device))
    samples = []
    for _ in range(repeats):
        start = clock()
        opt.step()
        samples.append(clock() - start)
    return median_ms(samples)


@torch.jit.script
def _any_gradient_times(grads: List[List[Optional[torch.Tensor]]], times: int) -> bool:
    """``any_gradient(grads)`` ``times`` times in one TorchScript call (inlined there, as
    in the owner's compiled step)."""
    found = False
    for _ in range(times):
        found = any_gradient(grads)
    return found


def check_cost_us(count: int, owners: int, repeats: int, loops: int = 1000) -> Dict[str, float]:
    """Median microseconds of the empty-context check's work in one step: ``owner``, the
    owner's ``any_gradient`` over ``count`` parameters of which the first has a gradient
    (a normal step); ``owner_empty``, over ``count`` without any (an empty context);
    ``trainer``, the trainer's look at ``owners`` replies before it ever warned."""
    grad = torch.zeros(1)
    cases: Dict[str, List[List[Optional[torch.Tensor]]]] = {
        "owner": [[grad] * count],
        "owner_empty": [[None] * count],
    }
    out: Dict[str, float] = {}
    for name, grads in cases.items():
        _any_gradient_times(grads, loops)  # warm-up: TorchScript profiles the first calls
        samples = []
        for _ in range(repeats):
            start = time.perf_counter()
            _any_gradient_times(grads, 0)  # the call and its arguments' conversion
            overhead = time.perf_counter() - start
            start = time.perf_counter()
            _any_gradient_times(grads, loops)
            samples.append(max(0.0, time.perf_counter() - start - overhead) / loops)
        out[name] = statistics.median(samples) * 1e6
    found = {f"owner{i}": True for i in range(owners)}
    warned = False
    timer = timeit.Timer("not warned and not any(found.values())",
                         globals={"warned": warned, "found": found})
    empty = timeit.Timer("pass")
    out["trainer"] = statistics.median(
        max(0.0, a - b) / loops
        for a, b in zip(timer.repeat(repeats, loops), empty.repeat(repeats, loops))
    ) * 1e6
    return out


def round_trip_ms(func: Callable[[int], int], repeats: int = 200) -> float:
    """Median round trip of an RPC to owner1 that does nothing."""
    for _ in range(10):
        rpc.rpc_sync("owner1", func, args=(0,))
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        rpc.rpc_sync("owner1", func, args=(0,))
        samples.append(time.perf_counter() - start)
    return median_ms(samples)


def concurrent_run(lib: type, threads: int, steps: int, device: str = "cpu") -> Dict[str, float]:
    """``threads`` trainers stepping the same parameters of ones with SGD lr=1, on ``device``."""
    count, numel = 64, 1024
    sets = ParamSets(f"conc-{lib.__module__}", [("owner1", count, numel)], fill=1.0,
                     device=device)
    opts = [lib(torch.optim.SGD, sets.rrefs, lr=1.0) for _ in range(threads)]
    errors: List[BaseException] = []
    barrier = threading.Barrier(threads + 1)

    def trainer(opt) -> None:
        try:
            barrier.wait()
            for _ in range(steps):
                with dist_autograd.context() as ctx:
                    sets.forward_backward(ctx)
                    opt.step(ctx)
        except BaseException as exc:  # reported below, not lost in the thread
            errors.append(exc)

    workers = [threading.Thread(target=trainer, args=(o,)) for o in opts]
    for w in workers:
        w.start()
    barrier.wait()
    start = time.perf_counter()
    for w in workers:
        w.join()
    sets.synchronize()
    wall = time.perf_counter() - start
    if errors:
        raise errors[0]
    expected = 1.0 - threads * steps
    values = sets.values()
    short = sum(float((v - expected).sum()) for v in values)
    elements_short = sum(int((v != expected).sum()) for v in values)
    total = threads * steps * count * numel
    sets.drop()
    return {
        "steps_per_s": threads * steps / wall,
        "lost": short,
        "lost_pct": 100.0 * short / total,
        "elements_short_pct": 100.0 * elements_short / (count * numel),
    }


def busy_ratio(lib: type, optim_cls: type, sets: ParamSets, repeats: int) -> Tuple[float, float]:
    """(idle ms, busy ms): the step without and with a spinning Python thread on owner1."""
    idle = try_time_steps(lib, optim_cls, sets, repeats)
    rpc.rpc_sync("owner1", world.start_spinner)
    try:
        busy = try_time_steps(lib, optim_cls, sets, repeats)
    finally:
        rpc.rpc_sync("owner1", world.stop_spinner)
    return idle, busy





def threads_label(threads: int) -> str:
    """How many intra-op threads each process runs, for the report."""
    if threads == 0:
        return f"torch's default intra-op threads ({torch.get_num_threads()})"
    return f"{threads} intra-op thread{'s' if threads > 1 else ''}"


class _Report(list):
    """The report's lines, printed as they come so that a failure keeps what was measured."""

    def append(self, line: str) -> None:
        super().append(line)
        print(line, flush=True)


def run(options: argparse.Namespace) -> List[str]:
    """Every measurement; prints the report's lines as they come, and returns them."""
    lines: List[str] = _Report()
    md = options.markdown
    device = "cuda:0" if options.device == "cuda" else "cpu"
    echo_script = round_trip_ms(world.script_echo)
    echo_python = round_trip_ms(world.python_echo)
    # On a GPU every timed step ends with this RPC (ParamSets.synchronize); the floor has it.
    echo_sync = round_trip_ms(world.cuda_synchronize) if device != "cpu" else 0.0

    def row(*cells: str) -> None:
        lines.append("| " + " | ".join(cells) + " |" if md else "  ".join(cells))

    def gap() -> None:
        if lines and lines[-1] != "":
            lines.append("")

    def say(text: str) -> None:
        """A line of text; in markdown its own paragraph, apart from the tables."""
        if md:
            gap()
        lines.append(text)
        if md:
            gap()

    say(
        f"machine: {machine(options.device)}; torch {torch.__version__}; "
        f"3 processes, {threads_label(options.intra_op_threads)} each; Adam lr=1e-3; "
        f"medians of {options.repeats} steps"
    )
    if device != "cpu":
        say(
            f"parameters on {device}, shared by both owners; losses and their gradients cross "
            f"RPC on the CPU; every timed step ends with a torch.cuda.synchronize() RPC to each "
            f"owner (idle round trip {echo_sync * 1e3:.0f} us, in the floor); CPU targets not "
            f"applied"
        )
    say(
        f"empty RPC round trip: TorchScript {echo_script * 1e3:.0f} us, Python "
        f"{echo_python * 1e3:.0f} us"
    )
    gap()
    if md:
        row("case", "distopt ms", "torch ms", "distopt/torch", "target", "floor ms",
            "distopt owner1 ms", "met")
        row("---", "---:", "---:", "---:", "---:", "---:", "---:", "---")
    else:
        row(f"{'case':8}", f"{'distopt ms':>10}", f"{'torch ms':>9}", f"{'ratio':>6}",
            f"{'target':>7}", f"{'floor ms':>9}", f"{'owner1 ms':>9}", "met")
    #: case -> (distopt's step ms, the check's costs in us: ``check_cost_us``)
    checks: Dict[str, Tuple[float, Dict[str, float]]] = {}
    for case, layout in CASES.items():
        if options.only and case not in options.only:
            continue
        sets = ParamSets(case, layout, device=device)
        ms = {name: try_time_steps(lib, torch.optim.Adam, sets, options.repeats)
              for name, lib in LIBRARIES.items()}
        sets.drop()
        # Fresh parameters: the timed DistributedOptimizer flattened the others, and a
        # parameter that is already a view of a buffer is not flattened again.
        probe = ParamSets(f"{case}-probe", layout, device=device)
        owner_ms = owner_side_ms(probe, options.repeats)
        probe.drop()
        count, numel = max(((c, n) for _, c, n in layout), key=lambda cn: cn[0] * cn[1])
        # The floor: one local fused step over that share as one flat tensor, plus an RPC
        # (and on a GPU the synchronizing RPC that ends every timed step).
        floor = (local_fused_adam_ms(1, count * numel, options.repeats, device) + echo_script
                 + echo_sync)
        ratio = ms["distopt"] / ms["torch"]
        if device != "cpu":
            target, met = "n/a", "n/a"
        else:
            target, met = f"<= {TARGETS[case]:.2f}", "yes" if ratio <= TARGETS[case] else "NO"
        shape = " + ".join(f"{c}x{n}@{o}" for o, c, n in layout)
        label = f"{case} ({shape})" if md else f"{case:8}"
        row(label, f"{ms['distopt']:10.2f}", f"{ms['torch']:9.2f}", f"{ratio:6.2f}",
            target, f"{floor:9.2f}", f"{owner_ms:9.2f}", met)
        checks[case] = (ms["distopt"], check_cost_us(count, len(layout), options.repeats))
        logger.info("%s done", case)

    if checks:
        gap()
        say(
            "empty-context check (distopt's warning when a step's context holds no gradient): "
            "the work it adds to a step, medians; owner: any_gradient over the largest share "
            "one owner updates, in a normal step and in an empty context; trainer: the look "
            "at every owner's reply"
        )
        if md:
            row("case", "distopt step ms", "owner us", "owner us, empty context",
                "trainer us", "(owner + trainer) / step")
            row("---", "---:", "---:", "---:", "---:", "---:")
        else:
            row(f"{'case':8}", f"{'step ms':>8}", f"{'owner us':>9}", f"{'empty us':>9}",
                f"{'trainer us':>10}", f"{'share':>8}")
        for case, (step_ms, us) in checks.items():
            share = (us["owner"] + us["trainer"]) / (step_ms * 1e3)
            row(f"{case:8}", f"{step_ms:8.2f}", f"{us['owner']:9.3f}",
                f"{us['owner_empty']:9.3f}", f"{us['trainer']:10.3f}", f"{share:8.4%}")

    if not options.only or "concurrent" in options.only:
        gap()
        say(
            f"concurrent: {options.threads} trainer threads x {options.concurrent_steps} SGD "
            f"steps (lr=1) on the same 64x1024 ones on owner1"
        )
        results = {name: concurrent_run(lib, options.threads, options.concurrent_steps, device)
                   for name, lib in LIBRARIES.items()}
        if md:
            row("library", "steps/s", "lost element updates", "% of updates",
                "% of elements short")
            row("---", "---:", "---:", "---:", "---:")
        else:
            row(f"{'library':8}", f"{'steps/s':>8}", f"{'lost':>12}", f"{'% upd':>7}",
                f"{'% elem short':>12}")
        for name, r in results.items():
            row(f"{name:8}", f"{r['steps_per_s']:8.1f}", f"{r['lost']:12.0f}",
                f"{r['lost_pct']:7.3f}", f"{r['elements_short_pct']:12.2f}")
        d, t = results["distopt"], results["torch"]
        met = d["steps_per_s"] >= t["steps_per_s"] and d["lost"] == 0
        say(
            f"throughput distopt/torch {d['steps_per_s'] / t['steps_per_s']:.2f} "
            f"(target >= 1 with 0 lost): {'yes' if met else 'NO'}"
        )
        logger.info("concurrent done")

    if not options.only or "busy" in options.only:
        gap()
        if options.owner_switch_interval is not None:
            for owner in ("owner1", "owner2"):
                rpc.rpc_sync(owner, world.set_switch_interval,
                             args=(options.owner_switch_interval,))
        say(
            "busy owner: a pure-Python thread spins on owner1 (all parameters there); "
            f"owner GIL switch interval "
            f"{options.owner_switch_interval or sys.getswitchinterval()} s"
        )
        rpc.rpc_sync("owner1", world.start_spinner)
        try:
            busy_script, busy_python = round_trip_ms(world.script_echo, 50), \
                round_trip_ms(world.python_echo, 50)
        finally:
            rpc.rpc_sync("owner1", world.stop_spinner)
        say(
            f"empty RPC round trip idle -> busy: TorchScript {echo_script:.2f} -> "
            f"{busy_script:.2f} ms, Python {echo_python:.2f} -> {busy_python:.2f} ms"
        )
        if md:
            row("case", "path", "idle ms", "busy ms", "busy/idle", "target")
            row("---", "---", "---:", "---:", "---:", "---:")
        paths = [
            ("distopt", distopt.DistributedOptimizer, torch.optim.Adam),
            ("distopt eager", distopt.DistributedOptimizer, world.EagerAdam),
            ("torch functional", torch_dist_optim.DistributedOptimizer, torch.optim.Adam),
            ("torch eager", torch_dist_optim.DistributedOptimizer, world.EagerAdam),
        ]
        for case, layout in BUSY_CASES.items():
            sets = ParamSets(f"busy-{case}", layout, device=device)
            for label, lib, cls in paths:
                idle, busy = busy_ratio(lib, cls, sets, options.repeats)
                target = f"<= {BUSY_TARGET}" if label == "distopt" else ""
                shape = f"{layout[0][1]}x{layout[0][2]}"
                row(f"{case} ({shape})", f"{label:16}", f"{idle:8.2f}", f"{busy:8.2f}",
                    f"{busy / idle:5.2f}x", target)
            sets.drop()
        logger.info("busy done")
    return lines


#: ``--plot``: the numbers of parameters swept, each of ``SWEEP_NUMEL`` elements, half on
#: each owner.
SWEEP_COUNTS = (2, 8, 32, 128, 512, 2048)
SWEEP_NUMEL = 1024


def sweep(options: argparse.Namespace) -> List[str]:
    """``--plot``: the step time of both libraries against the number of parameters; the
    table's lines (printed as they come), and the picture in ``options.plot``."""
    lines: List[str] = _Report()
    md = options.markdown
    device = "cuda:0" if options.device == "cuda" else "cpu"
    lines.append(
        f"machine: {machine(options.device)}; torch {torch.__version__}; 3 processes, "
        f"{threads_label(options.intra_op_threads)} each; Adam lr=1e-3; parameters of "
        f"{SWEEP_NUMEL} elements on {device}, half on each owner; medians of "
        f"{options.repeats} steps (opt.step(ctx) only)"
    )
    lines.append("")
    header = ["parameters", "elements", "distopt ms", "torch ms", "torch / distopt"]
    lines.append("| " + " | ".join(header) + " |" if md else "  ".join(header))
    if md:
        lines.append("| " + " | ".join(["---:"] * len(header)) + " |")
    times: Dict[str, List[float]] = {label: [] for label in LIBRARIES}
    for count in SWEEP_COUNTS:
        layout = [("owner1", count // 2, SWEEP_NUMEL), ("owner2", count - count // 2, SWEEP_NUMEL)]
        for label, lib in LIBRARIES.items():
            sets = ParamSets(f"sweep-{label}-{count}", layout, device=device)
            times[label].append(try_time_steps(lib, torch.optim.Adam, sets, options.repeats))
            sets.drop()
        ours, theirs = times["distopt"][-1], times["torch"][-1]
        cells = [str(count), str(count * SWEEP_NUMEL), f"{ours:.2f}", f"{theirs:.2f}",
                 f"{theirs / ours:.1f}x"]
        lines.append("| " + " | ".join(cells) + " |" if md else "  ".join(cells))
        logger.info("sweep: %d parameters done", count)
    plt = pyplot("--plot")
    fig, ax = plt.subplots(figsize=(7, 4.5))
    names = {"distopt": "distopt.DistributedOptimizer",
             "torch": "torch.distributed.optim.DistributedOptimizer"}
    for label, marker in (("distopt", "o"), ("torch", "s")):
        ax.plot(SWEEP_COUNTS, times[label], marker=marker, label=names[label])
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xticks(SWEEP_COUNTS, [f"{c:,}" for c in SWEEP_COUNTS])
    ax.minorticks_off()
    ax.set_xlabel(f"parameters ({SWEEP_NUMEL} elements each, half on each of 2 owners)")
    ax.set_ylabel("opt.step(ctx) ms (median)")
    ax.set_title(f"Adam step over RPC: {machine(options.device)}, torch {torch.__version__}, "
                 f"{options.repeats} steps each", fontsize=9)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(options.plot, dpi=110)
    plt.close(fig)
    lines.append("")
    lines.append(f"plot: {options.plot}")
    return lines


def main(argv: Optional[List[str]] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=30, help="timed steps per measurement")
    parser.add_argument("--threads", type=int, default=4, help="concurrent trainer threads")
    parser.add_argument("--concurrent-steps", type=int, default=100, help="steps per thread")
    parser.add_argument("--only", default="", help="comma-separated: large,small,many,concurrent,busy")
    parser.add_argument("--markdown", action="store_true", help="print markdown tables")
    parser.add_argument(
        "--intra-op-threads", type=int, default=1,
        help="torch intra-op threads in every process (0: torch's default)",
    )
    parser.add_argument(
        "--owner-switch-interval", type=float, default=None,
        help="set the owners' sys.setswitchinterval (seconds) before the busy-owner runs",
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="log progress")
    parser.add_argument(
        "--plot", metavar="FILE.png", default=None,
        help="instead, sweep the number of parameters and draw both libraries' step time "
             "against it into FILE.png (needs matplotlib: pip install -e \".[bench]\")",
    )
    add_device_argument(parser)
    options = parser.parse_args(argv)
    check_device(parser, options.device)
    if options.plot:
        pyplot("--plot")  # before the measuring, not after
    options.only = [s for s in options.only.split(",") if s]
    for name in ("repeats", "threads", "concurrent_steps"):
        if getattr(options, name) < 1:
            parser.error(f"Invalid --{name.replace('_', '-')}: {getattr(options, name)!r} (expected >= 1)")
    if options.intra_op_threads < 0:
        parser.error(f"Invalid --intra-op-threads: {options.intra_op_threads!r} (expected >= 0)")
    # stdout is the report (pure markdown with --markdown); logs and warnings go to stderr.
    # torch's warning for every eager optimizer its baseline creates is dropped; its
    # DeprecationWarning for the TorchScript path is raised on the owners under
    # simplefilter("always"), which no filter can undo, so it stays on their stderr.
    logging.basicConfig(
        level=logging.INFO if options.verbose else logging.WARNING, stream=sys.stderr
    )
    logging.getLogger("torch.distributed.optim.optimizer").setLevel(logging.ERROR)
    warnings.filterwarnings("ignore", message="You are using a Backend")
    warnings.filterwarnings("ignore", message=".*torch.jit.script.*deprecated")

    start = time.perf_counter()
    port = free_port()
    ctx = multiprocessing.get_context("spawn")
    threads = options.intra_op_threads
    owners = [ctx.Process(target=world.run_owner, args=(rank, 3, port, threads), daemon=True)
              for rank in (1, 2)]
    for proc in owners:
        proc.start()
    if threads > 0:
        torch.set_num_threads(threads)
    rpc.init_rpc("trainer", rank=0, world_size=3, rpc_backend_options=world.backend_options(port))
    try:
        (sweep if options.plot else run)(options)
    finally:
        rpc.shutdown()
        for proc in owners:
            proc.join(timeout=30)
            if proc.is_alive():
                proc.kill()
    if options.markdown:
        print()
    print(f"run time: {time.perf_counter() - start:.0f} s on {machine(options.device)}",
          flush=True)


if __name__ == "__main__":
    main()
