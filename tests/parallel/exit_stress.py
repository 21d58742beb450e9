"""How a training process ends: runs a short script on 2 gloo ranks, many times, and counts
the runs in which a rank did not exit with its own status (an abort).

    python tests/parallel/exit_stress.py --runs 200          # every scenario in turn
    python tests/parallel/exit_stress.py --runs 40 --only plain:clean,powersgd:raise
    python tests/parallel/exit_stress.py --runs 200 --parallel 2   # 2 runs at a time

Each run starts 2 fresh Python processes (``python this_file --child ...``, the
interpreter's own teardown, no ``os._exit``) that train 3 steps, inside a function as a
``main()`` would, with ``DataParallelOptimizer`` (``plain``: 4 buckets, no
compression; ``powersgd``: ``PowerSGD(rank=1, start_iter=2)`` over the same buckets, the
third step compressed) or ``optimizer_hook`` on a DDP model (``hook``; ``hook-powersgd``
with that PowerSGD), and then end without ``close()`` in one of three ways:

- ``clean``: the script ends; expected exit status 0.
- ``raise``: an exception escapes the training loop after the last backward pass (before
  ``step()``); expected exit status 1 and the exception's traceback on stderr.
- ``destroy``: ``dist.destroy_process_group()``, then the script ends; expected 0.

A run aborts when a rank is killed by a signal (SIGABRT from ``std::terminate``: status
-6 here, 134 under a shell), prints ``terminate called`` or hangs past the run's limit; it
fails when a rank ends in any way but the expected one (abort included). Prints, per
scenario and in total, ``aborts/runs`` and ``failed/runs``; the exit status is 1 when any
run failed.
"""
import argparse
import concurrent.futures
import itertools
import os
import sys
import time
from typing import Dict, List, Optional, Sequence, Tuple

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if not __package__:  # run as a script: tests.worlds from this checkout
    sys.path.insert(0, ROOT)
from tests.worlds import Job, free_port  # noqa: E402

KINDS = ("plain", "powersgd", "hook", "hook-powersgd")
ENDINGS = ("clean", "raise", "destroy")
SCENARIOS = tuple(f"{k}:{e}" for k in KINDS for e in ENDINGS)
#: What an escaping exception says (the test looks for it in the traceback).
MESSAGE = "escaping the training loop"
#: The most one run (2 processes, start to exit) may take before it counts as a hang.
RUN_LIMIT_S = 60.0
STEPS = 3


# ---------------------------------------------------------------- one rank


def _child(kind: str, ending: str) -> None:
    import torch
    import torch.distributed as dist

    from distopt.parallel import DataParallelOptimizer, PowerSGD, optimizer_hook

    torch.set_num_threads(1)
    dist.init_process_group("gloo")  # env://: MASTER_ADDR, MASTER_PORT, RANK, WORLD_SIZE
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(32, 32), torch.nn.ReLU(), torch.nn.Linear(32, 32), torch.nn.ReLU(),
        torch.nn.Linear(32, 4),
    )
    compression = PowerSGD(rank=1, start_iter=2) if kind.endswith("powersgd") else None
    if kind.startswith("hook"):
        net = torch.nn.parallel.DistributedDataParallel(model)
        opt = optimizer_hook(net, torch.optim.SGD, model.parameters(), lr=0.1, momentum=0.9,
                             compression=compression)
    else:
        net = model
        # 4 buckets of about 4 kB at most: the 32 x 32 weights in buckets of their own.
        opt = DataParallelOptimizer(torch.optim.SGD, model.parameters(), lr=0.1,
                                    momentum=0.9, bucket_cap_mb=0.004,
                                    compression=compression)
    for step in range(STEPS):
        x = torch.randn(16, 32)
        net(x).square().mean().backward()
        if ending == "raise" and step == STEPS - 1:
            raise RuntimeError(MESSAGE)
        opt.step()
        opt.zero_grad()
    if ending == "destroy":
        dist.destroy_process_group()
    # No close(): the interpreter's teardown ends the optimizer.


# ---------------------------------------------------------------- one run


def run_once(scenario: str, limit_s: float = RUN_LIMIT_S) -> Tuple[bool, bool, List[str]]:
    """One run of ``scenario`` (``kind:ending``) on 2 ranks.

    Returns:
        (whether a rank aborted: a signal, ``terminate called`` or a hang; whether a rank
        ended otherwise than expected in any way, abort included; one line per such rank).
    """
    kind, ending = scenario.split(":")
    port = free_port()
    job = Job()
    for rank in range(2):
        env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                   RANK=str(rank), WORLD_SIZE="2", CUDA_VISIBLE_DEVICES="",
                   OMP_NUM_THREADS="1")
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [ROOT, env.get("PYTHONPATH")]))
        job.start([sys.executable, os.path.abspath(__file__), "--child", kind, ending],
                  env=env, cwd=ROOT)
    codes = job.wait(limit_s)
    aborted, problems = False, []
    expected = 1 if ending == "raise" else 0
    for rank, code in enumerate(codes):
        if code is None:
            aborted = True
            problems.append(f"{scenario} rank {rank}: no exit in {limit_s:.0f} s")
            continue
        text = job.text(rank)
        lines = text.strip().splitlines()
        said = ([line for line in lines if "Error" in line or "terminate" in line] or lines
                or [""])[-1].strip()
        if code < 0 or code == 134 or "terminate called" in text:
            aborted = True
            problems.append(f"{scenario} rank {rank}: aborted, exit status {code}: {said}")
        elif code != expected:
            problems.append(f"{scenario} rank {rank}: exit status {code} "
                            f"(expected {expected}): {said}")
        elif ending == "raise" and not (
            "Traceback (most recent call last)" in text and f"RuntimeError: {MESSAGE}" in text
        ):
            problems.append(f"{scenario} rank {rank}: the exception's traceback is missing")
    return aborted, bool(problems), problems


def run_many(runs: int, scenarios: Sequence[str] = SCENARIOS, limit_s: float = RUN_LIMIT_S,
             parallel: int = 1) -> Dict[str, Tuple[int, int, int, List[str]]]:
    """``runs`` runs, the scenarios in turn, ``parallel`` runs at a time: scenario -> (runs
    with an abort, runs that ended otherwise than expected, abort included, runs, what went
    wrong)."""
    counts: Dict[str, Tuple[int, int, int, List[str]]] = {s: (0, 0, 0, []) for s in scenarios}
    order = list(itertools.islice(itertools.cycle(scenarios), runs))
    with concurrent.futures.ThreadPoolExecutor(max(1, parallel)) as pool:
        outcomes = pool.map(lambda scenario: run_once(scenario, limit_s), order)
        for scenario, (aborted, failed, problems) in zip(order, outcomes):
            aborts, failures, done, seen = counts[scenario]
            counts[scenario] = (aborts + aborted, failures + failed, done + 1, seen + problems)
    return counts


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=len(SCENARIOS))
    parser.add_argument("--parallel", type=int, default=1,
                        help="runs at a time (each is 2 processes)")
    parser.add_argument("--only", default=",".join(SCENARIOS),
                        help=f"comma-separated scenarios among {', '.join(SCENARIOS)}")
    parser.add_argument("--child", nargs=2, metavar=("KIND", "ENDING"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        _child(*args.child)
        return 0
    scenarios = [s for s in args.only.split(",") if s]
    for s in scenarios:
        if s not in SCENARIOS:
            parser.error(f"unknown scenario {s!r} (expected one of {', '.join(SCENARIOS)})")
    start = time.monotonic()
    counts = run_many(args.runs, scenarios, parallel=args.parallel)
    print(f"{'scenario':22} {'aborts/runs':>12} {'failed/runs':>12}")
    for scenario, (aborts, failures, done, problems) in counts.items():
        print(f"{scenario:22} {f'{aborts}/{done}':>12} {f'{failures}/{done}':>12}")
        for line in problems[:5]:
            print(f"    {line}")
    aborts = sum(c[0] for c in counts.values())
    failures = sum(c[1] for c in counts.values())
    done = sum(c[2] for c in counts.values())
    print(f"{'total':22} {f'{aborts}/{done}':>12} {f'{failures}/{done}':>12}   "
          f"({time.monotonic() - start:.0f} s)")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
