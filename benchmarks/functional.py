"""Compiled functional optimizers against torch.optim's implementations, in one run.

For every algorithm in ``functional.functional_optim_map``, times one optimizer step on
(a) one large parameter and (b) many small ones, for torch.optim's default (for-loop on CPU,
foreach on CUDA), foreach and fused implementations where they exist, and for the compiled
functional optimizer (``functional.script_optimizer``), and for (b) the compiled optimizer with
flat parameter buffers (``functional.flatten_parameters``; the elementwise classes; the large
parameter is not flattened). Prints medians, the ratio of the functional step to torch's
fastest measured in the same run, and for (a) a memory-bandwidth floor: the bytes the update
must read and write divided by the copy bandwidth measured on the same device.

``--device cpu`` (the default): (a) one 4M-element parameter (64 x 65,536), (b) 2,000
parameters of 32 elements (4 x 8); the bandwidth from a 32 MiB into 32 MiB copy.

``--device cuda``: parameters, gradients and optimizers on the current GPU, where
torch.optim's default is foreach and the functional optimizers run torch's fused CUDA kernel
where they have one (Adam, AdamW, SGD; Adagrad where the installed torch fuses it) and
foreach ops otherwise. (a) is one 100M-element parameter (1,000 x 100,000), (b) 10,000
parameters of 1,024 elements (32 x 32); the bandwidth comes from a device-to-device copy of
(a)'s parameter and gradient (763 MiB into 763 MiB). Every candidate first takes a few untimed
steps, then each timed step lies between two ``torch.cuda.synchronize()`` calls (launch and
kernels both counted). The machine line names the GPU, torch and CUDA. The issue's GPU
figures are Adam's rows: on 1 x 100M "distopt compiled ms" against "torch fused ms" and
"vs floor", on 10000 x 1024 "flat vs torch fastest".

``--kernels``: the functional optimizers of ``functional._kernels.INEXACT_KERNELS``
(Adafactor), whose fused CPU kernel is off by default, built with ``foreach=False``, which
turns it on (the other classes run theirs by default).

Run: ``python benchmarks/functional.py [--device cpu|cuda] [--repeats N] [--only Adam,SGD]
[--threads N] [--kernels] [--markdown]``; the report goes to stdout (with ``--markdown``, the
machine line is a paragraph apart from the table), logs to stderr.
"""
import argparse
import logging
import os
import statistics
import sys
import time
from typing import Callable, Dict, List, NamedTuple, Optional, Tuple

# This file shares its name with the package it measures: drop its own folder from the import
# path so that ``import functional`` finds the package, not this script, and put the
# repository root first (this checkout's packages, and ``benchmarks._machine``).
_HERE = os.path.dirname(os.path.abspath(__file__))
_ROOT = os.path.dirname(_HERE)
sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != _HERE]
if _ROOT not in [os.path.abspath(p or os.curdir) for p in sys.path]:
    sys.path.insert(0, _ROOT)

import torch  # noqa: E402

from benchmarks._machine import (  # noqa: E402
    add_device_argument,
    check_device,
    device_clock,
    machine,
)
from functional import (  # noqa: E402
    FLAT_CLASSES,
    flatten_parameters,
    functional_optim_map,
    script_optimizer,
)
from functional._kernels import INEXACT_KERNELS  # noqa: E402

logger = logging.getLogger("benchmarks.functional")


class Case(NamedTuple):
    """One measured case: its label in the table and its parameters' shapes."""

    label: str
    shapes: Tuple[Tuple[int, ...], ...]


#: --device -> (large, many). The large parameter is 2-D so that Muon and Adafactor's
#: factoring apply; its parameter and gradient are what the bandwidth copy copies.
CASES: Dict[str, Tuple[Case, Case]] = {
    "cpu": (Case("1 x 4M", ((64, 65536),)), Case("2000 x 32", ((4, 8),) * 2000)),
    "cuda": (Case("1 x 100M", ((1000, 100000),)), Case("10000 x 1024", ((32, 32),) * 10000)),
}
#: Untimed rounds of every candidate before the timed ones on a GPU (lazy kernel loading,
#: cuBLAS handles and TorchScript's profiling runs happen in the first calls). On the CPU the
#: step each candidate takes when it is built is its only warm-up, as before.
CUDA_WARMUP = 3
KWARGS: Dict[type, Dict[str, object]] = {
    torch.optim.SGD: {"lr": 1e-3, "momentum": 0.9},
}


def median_ms(fn: Callable[[], None], repeats: int,
              clock: Callable[[], float] = time.perf_counter) -> float:
    """Median time of ``fn`` in milliseconds on ``clock`` (``device_clock``), after one
    warm-up call."""
    fn()
    times = []
    for _ in range(repeats):
        start = clock()
        fn()
        times.append((clock() - start) * 1e3)
    return statistics.median(times)


def elements(shapes) -> int:
    """Elements in parameters of ``shapes``."""
    return sum(torch.Size(s).numel() for s in shapes)


def copy_bandwidth_gbs(numel: int, device: torch.device, repeats: int = 20) -> float:
    """Measured memory bandwidth of a float32 copy of ``numel`` elements on ``device``
    (bytes read + written per second).

    ``main`` copies as many elements as the large case's parameter and gradient hold (32 MiB
    on the CPU, 763 MiB on a GPU, into as many): that footprint, so that caches help the
    copy as much as they help the update.
    """
    src, dst = torch.randn(numel, device=device), torch.empty(numel, device=device)
    ms = median_ms(lambda: dst.copy_(src), repeats, device_clock(device))
    return 2 * numel * 4 / (ms / 1e3) / 1e9


def floor_ms(shapes, state_bytes: int, bandwidth_gbs: float) -> float:
    """The memory-bandwidth floor of a float32 update: parameter read and written, gradient
    read, every state tensor (``state_bytes``) read and written, at ``bandwidth_gbs``."""
    touched = elements(shapes) * 4 * 3 + 2 * state_bytes
    return touched / (bandwidth_gbs * 1e9) * 1e3


def _gradients(shapes, sparse: bool, gen: torch.Generator,
               device: torch.device) -> List[torch.Tensor]:
    grads = [torch.randn(s, generator=gen, device=device) for s in shapes]
    return [g.to_sparse() for g in grads] if sparse else grads


def torch_step(cls: type, shapes, kwargs, impl: Dict[str, bool],
               device: torch.device) -> Optional[Callable[[], None]]:
    """One step of torch.optim ``cls`` on ``device`` with implementation flags ``impl``; None
    if n/a."""
    gen = torch.Generator(device=device).manual_seed(0)
    params = [torch.randn(s, generator=gen, device=device).requires_grad_() for s in shapes]
    for p, g in zip(params, _gradients(shapes, cls is torch.optim.SparseAdam, gen, device)):
        p.grad = g
    try:
        opt = cls(params, **kwargs, **impl)
        opt.step()
    except (RuntimeError, TypeError, ValueError) as exc:
        logger.debug("%s %s not available: %s", cls.__name__, impl, exc)
        return None
    return opt.step


def functional_step(cls: type, shapes, kwargs, device: torch.device,
                    flat: bool = False, kernels: bool = False) -> Tuple[Callable[[], None], int]:
    """One compiled functional step on ``device``, and the bytes of optimizer state it
    updates; ``flat``: with ``flatten_parameters`` (the gathering of the gradients into the
    flat buffer is part of every step); ``kernels``: ``foreach=False`` for the classes of
    ``INEXACT_KERNELS`` (their fused CPU kernel)."""
    gen = torch.Generator(device=device).manual_seed(0)
    params = [torch.randn(s, generator=gen, device=device) for s in shapes]
    grads = _gradients(shapes, cls is torch.optim.SparseAdam, gen, device)
    if kernels and cls.__name__ in INEXACT_KERNELS:
        kwargs = dict(kwargs, foreach=False)
    optim = functional_optim_map[cls](params, **kwargs)
    if flat:
        flatten_parameters(optim)
    optim = script_optimizer(optim)
    optim.step(grads)
    state_bytes = sum(
        t.numel() * t.element_size()
        for entry in optim.get_state().values()
        for key, t in entry.items()
        if key != "step"
    )
    return (lambda: optim.step(grads)), state_bytes


def interleaved_medians(steps: Dict[str, Callable[[], None]], repeats: int,
                        clock: Callable[[], float] = time.perf_counter,
                        warmup: int = 0) -> Dict[str, float]:
    """Median ms of each step on ``clock`` (``device_clock``), timed in turns (one of each per
    round) so that every implementation sees the same machine and allocator state, after
    ``warmup`` untimed rounds."""
    for _ in range(warmup):
        for step in steps.values():
            step()
    times: Dict[str, List[float]] = {name: [] for name in steps}
    for _ in range(repeats):
        for name, step in steps.items():
            start = clock()
            step()
            times[name].append((clock() - start) * 1e3)
    return {name: statistics.median(t) for name, t in times.items()}


def _fmt(ms: Optional[float]) -> str:
    return "n/a" if ms is None else f"{ms:.2f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--only", default="", help="comma-separated torch.optim class names")
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--markdown", action="store_true",
                        help="markdown only: the machine line a paragraph apart from the table")
    parser.add_argument("--kernels", action="store_true",
                        help="foreach=False for the classes of functional._kernels.INEXACT_KERNELS "
                             "(Adafactor): their fused CPU kernels, off by default")
    add_device_argument(parser)
    args = parser.parse_args()
    check_device(parser, args.device)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    torch.set_num_threads(args.threads)
    if args.device == "cuda":
        device = torch.device("cuda", torch.cuda.current_device())
        warmup = CUDA_WARMUP
    else:
        device, warmup = torch.device("cpu"), 0
    clock = device_clock(device)
    large, many = CASES[args.device]

    copied = 2 * elements(large.shapes)  # the large case's parameter and gradient
    bandwidth = copy_bandwidth_gbs(copied, device)
    print(f"machine: {machine(args.device)}; torch {torch.__version__}; "
          f"{torch.get_num_threads()} threads; {device.type} copy bandwidth {bandwidth:.1f} GB/s "
          f"({copied * 4 / 2**20:.0f} MiB into as many)"
          f"{'; --kernels (foreach=False for ' + ', '.join(INEXACT_KERNELS) + ')' if args.kernels else ''}")
    if args.markdown:
        print()
    header = ("| algorithm | params | torch default ms | torch foreach ms | torch fused ms "
              "| distopt compiled ms | vs torch fastest | distopt flat ms | flat vs torch fastest "
              "| floor ms | vs floor |")
    print(header)
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    only = {n for n in args.only.split(",") if n}
    for cls in functional_optim_map:
        if only and cls.__name__ not in only:
            continue
        kwargs = KWARGS.get(cls, {})
        for case in (large, many):
            shapes = case.shapes
            repeats = max(3, args.repeats // 5) if cls is torch.optim.Muon else args.repeats
            steps: Dict[str, Callable[[], None]] = {}
            for name, impl in (("default", {}), ("foreach", {"foreach": True}),
                               ("fused", {"fused": True})):
                step = torch_step(cls, shapes, kwargs, impl, device)
                if step is not None:
                    steps[name] = step
            steps["distopt"], state_bytes = functional_step(cls, shapes, kwargs, device,
                                                            kernels=args.kernels)
            if functional_optim_map[cls].__name__ in FLAT_CLASSES and case is many:
                steps["flat"], _ = functional_step(cls, shapes, kwargs, device, flat=True,
                                                   kernels=args.kernels)
            medians = interleaved_medians(steps, repeats, clock, warmup)
            ours = medians.pop("distopt")
            flat_ms = medians.pop("flat", None)
            torch_ms = {name: medians.get(name) for name in ("default", "foreach", "fused")}
            fastest = min(medians.values())
            floor = ratio_floor = None
            if case is large:
                floor = floor_ms(shapes, state_bytes, bandwidth)
                ratio_floor = ours / floor
            print(f"| {cls.__name__} | {case.label} | {_fmt(torch_ms['default'])} | "
                  f"{_fmt(torch_ms['foreach'])} | {_fmt(torch_ms['fused'])} | {ours:.2f} | "
                  f"{ours / fastest:.2f}x | {_fmt(flat_ms)} | "
                  f"{'n/a' if flat_ms is None else f'{flat_ms / fastest:.2f}x'} | {_fmt(floor)} | "
                  f"{'' if ratio_floor is None else f'{ratio_floor:.2f}x'} |", flush=True)
            # Let the candidates go before the next case builds its own (a 100M-element
            # case holds several GB on a GPU).
            del steps, step


if __name__ == "__main__":
    main()
