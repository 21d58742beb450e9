"""Compiled functional optimizers against torch.optim's implementations, in one run.

For every algorithm in ``functional.functional_optim_map``, times one optimizer step on
(a) one 4M-element parameter and (b) 2,000 parameters of 32 elements, for torch.optim's default
(for-loop on CPU), foreach and fused implementations where they exist, and for the compiled
functional optimizer (``functional.script_optimizer``), and for (b) the compiled optimizer with
flat parameter buffers (``functional.flatten_parameters``; the elementwise classes; the 4M
parameter is not flattened). Prints medians, the ratio of the
functional step to torch's fastest, and for (a) a memory-bandwidth floor: the bytes the update
must read and write divided by the measured copy bandwidth.

Run: ``python benchmarks/functional.py [--repeats N] [--only Adam,SGD] [--markdown]``
"""
import argparse
import logging
import os
import platform
import statistics
import sys
import time
from typing import Callable, Dict, List, Optional, Tuple

# This file shares its name with the package it measures: drop its own folder from the import
# path so that ``import functional`` finds the package, not this script.
_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != _HERE]

import torch  # noqa: E402

from functional import (  # noqa: E402
    FLAT_CLASSES,
    flatten_parameters,
    functional_optim_map,
    script_optimizer,
)

logger = logging.getLogger("benchmarks.functional")

LARGE = ((64, 65536),)  # 4,194,304 elements, 2-D so that Muon and Adafactor's factoring apply
MANY = ((4, 8),) * 2000  # 2,000 parameters of 32 elements
KWARGS: Dict[type, Dict[str, object]] = {
    torch.optim.SGD: {"lr": 1e-3, "momentum": 0.9},
}


def median_ms(fn: Callable[[], None], repeats: int) -> float:
    """Median wall time of ``fn`` in milliseconds, after one warm-up call."""
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def copy_bandwidth_gbs(numel: int = 1 << 23, repeats: int = 20) -> float:
    """Measured memory bandwidth of a float32 copy (bytes read + written per second).

    The default copies 32 MB into 32 MB: the footprint of the large case's parameter and
    gradient, so that caches help the copy as much as they help the update.
    """
    src, dst = torch.randn(numel), torch.empty(numel)
    ms = median_ms(lambda: dst.copy_(src), repeats)
    return 2 * numel * 4 / (ms / 1e3) / 1e9


def _gradients(shapes, sparse: bool, gen: torch.Generator) -> List[torch.Tensor]:
    grads = [torch.randn(s, generator=gen) for s in shapes]
    return [g.to_sparse() for g in grads] if sparse else grads


def torch_step(cls: type, shapes, kwargs, impl: Dict[str, bool]) -> Optional[Callable[[], None]]:
    """One step of torch.optim ``cls`` with implementation flags ``impl``; None if n/a."""
    gen = torch.Generator().manual_seed(0)
    params = [torch.randn(s, generator=gen).requires_grad_() for s in shapes]
    for p, g in zip(params, _gradients(shapes, cls is torch.optim.SparseAdam, gen)):
        p.grad = g
    try:
        opt = cls(params, **kwargs, **impl)
        opt.step()
    except (RuntimeError, TypeError, ValueError) as exc:
        logger.debug("%s %s not available: %s", cls.__name__, impl, exc)
        return None
    return opt.step


def functional_step(cls: type, shapes, kwargs, flat: bool = False) -> Tuple[Callable[[], None], int]:
    """One compiled functional step, and the bytes of optimizer state it updates; ``flat``:
    with ``flatten_parameters`` (the gathering of the gradients into the flat buffer is part
    of every step)."""
    gen = torch.Generator().manual_seed(0)
    params = [torch.randn(s, generator=gen) for s in shapes]
    grads = _gradients(shapes, cls is torch.optim.SparseAdam, gen)
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


def interleaved_medians(steps: Dict[str, Callable[[], None]], repeats: int) -> Dict[str, float]:
    """Median ms of each step, timed in turns (one of each per round) so that every
    implementation sees the same machine and allocator state."""
    times: Dict[str, List[float]] = {name: [] for name in steps}
    for _ in range(repeats):
        for name, step in steps.items():
            start = time.perf_counter()
            step()
            times[name].append((time.perf_counter() - start) * 1e3)
    return {name: statistics.median(t) for name, t in times.items()}


def _fmt(ms: Optional[float]) -> str:
    return "n/a" if ms is None else f"{ms:.2f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--only", default="", help="comma-separated torch.optim class names")
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    torch.set_num_threads(args.threads)

    bandwidth = copy_bandwidth_gbs()
    print(f"machine: {platform.machine()} {platform.processor() or ''} "
          f"{torch.get_num_threads()} threads, torch {torch.__version__}, "
          f"copy bandwidth {bandwidth:.1f} GB/s")
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
        for label, shapes in (("1 x 4M", LARGE), ("2000 x 32", MANY)):
            repeats = max(3, args.repeats // 5) if cls is torch.optim.Muon else args.repeats
            steps: Dict[str, Callable[[], None]] = {}
            for name, impl in (("default", {}), ("foreach", {"foreach": True}),
                               ("fused", {"fused": True})):
                step = torch_step(cls, shapes, kwargs, impl)
                if step is not None:
                    steps[name] = step
            steps["distopt"], state_bytes = functional_step(cls, shapes, kwargs)
            if functional_optim_map[cls].__name__ in FLAT_CLASSES and shapes is MANY:
                steps["flat"], _ = functional_step(cls, shapes, kwargs, flat=True)
            medians = interleaved_medians(steps, repeats)
            ours = medians.pop("distopt")
            flat_ms = medians.pop("flat", None)
            torch_ms = {name: medians.get(name) for name in ("default", "foreach", "fused")}
            fastest = min(medians.values())
            floor = ratio_floor = None
            if shapes is LARGE:
                numel = sum(torch.Size(s).numel() for s in shapes)
                # param read + write, gradient read, every state tensor read + written
                touched = numel * 4 * 3 + 2 * state_bytes
                floor = touched / (bandwidth * 1e9) * 1e3
                ratio_floor = ours / floor
            print(f"| {cls.__name__} | {label} | {_fmt(torch_ms['default'])} | "
                  f"{_fmt(torch_ms['foreach'])} | {_fmt(torch_ms['fused'])} | {ours:.2f} | "
                  f"{ours / fastest:.2f}x | {_fmt(flat_ms)} | "
                  f"{'n/a' if flat_ms is None else f'{flat_ms / fastest:.2f}x'} | {_fmt(floor)} | "
                  f"{'' if ratio_floor is None else f'{ratio_floor:.2f}x'} |", flush=True)


if __name__ == "__main__":
    main()
