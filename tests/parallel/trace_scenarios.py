"""A rank's side of the profiler-range tests: a few real steps under ``torch.profiler``, and
the ranges the trace holds, as plain data (``distopt.profiling`` names them).

Called from existing worlds (``tests.parallel.feature_scenarios.integration`` and
``tests.parallel.hook_scenarios.hook_ranks``); the tests read what they return in
``tests/parallel/test_features.py`` and ``tests/parallel/test_hooks.py``.
"""
from typing import Any, Dict, List, Tuple

import torch

from distopt.parallel import DataParallelOptimizer
from distopt.profiling import all_threads_config

#: Layers of the profiled model: one bucket each (``BUCKET_MB``), so that backward has
#: several layers left to compute when the last layer's bucket is sent.
LAYERS = 8
WIDTH = 256
BATCH = 128
BUCKET_MB = (WIDTH * WIDTH + WIDTH) * 4 / 2**20
#: Steps before the profiler starts (the first step's buckets wait for step()) and under it.
WARMUP = 1
STEPS = 3
#: The configurations profiled: name -> DataParallelOptimizer options.
CONFIGS = {
    "overlap": {"overlap": True},
    "no-overlap": {"overlap": False},
    "shard-overlap": {"overlap": True, "shard": "flat"},
    "shard-no-overlap": {"overlap": False, "shard": "flat"},
}

#: One recorded range: (name, thread, start us, end us); thread as the profiler numbers them.
Range = Tuple[str, int, float, float]


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    layers: List[torch.nn.Module] = []
    for _ in range(LAYERS):
        layers += [torch.nn.Linear(WIDTH, WIDTH), torch.nn.Tanh()]
    return torch.nn.Sequential(*layers)


def _kept(name: str) -> bool:
    return name.startswith(("distopt.", "test.", "autograd::engine::evaluate_function"))


def profiled_run(rank: int, world_size: int, options: Dict[str, Any]) -> Dict[str, Any]:
    """``STEPS`` steps of a ``LAYERS``-layer MLP under a profiler that sees every thread.

    Returns:
        ``ranges`` (the distopt ranges, the test's own ``test.backward`` and
        ``test.step`` and the autograd engine's evaluate_function ranges) and ``buckets``.
    """
    model = _model()
    opt = DataParallelOptimizer(torch.optim.Adam, model.parameters(), lr=1e-3,
                                bucket_cap_mb=BUCKET_MB, **options)
    g = torch.Generator().manual_seed(rank)
    x, y = torch.randn(BATCH, WIDTH, generator=g), torch.randn(BATCH, WIDTH, generator=g)

    def step() -> None:
        loss = ((model(x) - y) ** 2).mean()
        with torch.profiler.record_function("test.backward"):
            loss.backward()
        with torch.profiler.record_function("test.step"):
            opt.step()
        opt.zero_grad()

    ranges = _profiled_steps(step)  # the warm-up starts distopt's threads, as in a user's loop
    buckets = len(opt.bucket_layout())
    opt.close()
    return {"ranges": ranges, "buckets": buckets}


def profiled(rank: int, world_size: int) -> Dict[str, Any]:
    """Every configuration of ``CONFIGS``, in turn."""
    return {name: profiled_run(rank, world_size, options) for name, options in CONFIGS.items()}


def _profiled_steps(step: Any) -> List[Range]:
    """``WARMUP`` calls of ``step``, then ``STEPS`` under a profiler that sees every thread;
    the ranges kept."""
    for _ in range(WARMUP):
        step()
    config = all_threads_config()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU],
                                experimental_config=config) as prof:
        for _ in range(STEPS):
            step()
    return [(e.name, e.thread, e.time_range.start, e.time_range.end)
            for e in prof.events() if _kept(e.name)]


def hook_profiled(rank: int, world_size: int) -> Dict[str, Any]:
    """``distopt.parallel.optimizer_hook`` on DDP: ``STEPS`` steps of the MLP, profiled
    (after ``WARMUP`` + 1 steps: DDP rebuilds its buckets after the first)."""
    from torch.nn.parallel import DistributedDataParallel

    from distopt.parallel import optimizer_hook

    model = _model()
    ddp = DistributedDataParallel(model, bucket_cap_mb=BUCKET_MB)
    opt = optimizer_hook(ddp, torch.optim.SGD, model.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(rank)
    x, y = torch.randn(BATCH, WIDTH, generator=g), torch.randn(BATCH, WIDTH, generator=g)

    def step() -> None:
        loss = ((ddp(x) - y) ** 2).mean()
        with torch.profiler.record_function("test.backward"):
            loss.backward()
        opt.step()
        opt.zero_grad()

    step()
    ranges = _profiled_steps(step)
    buckets = len(opt.hook_state.buckets)
    opt.close()
    return {"ranges": ranges, "buckets": buckets}
