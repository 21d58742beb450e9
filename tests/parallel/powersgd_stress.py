"""The world of ``test_powersgd``, many times: counts the runs that hang or fail.

    python tests/parallel/powersgd_stress.py --runs 50 --parallel 2
    python tests/parallel/powersgd_stress.py --runs 50 --only many_runs --logs /tmp/psgd

Each run is a fresh process that starts a 2-rank world (``tests.worlds.World``) and runs on
it, in order, what the test module runs on its world: ``against_ddp`` (the DDP cases),
``many_runs`` (10 trainings of 50 steps, 3 buckets) and ``state_world``; with ``--fresh``
each in a world of its own, as the module ran them before it shared one. A run hangs when a
scenario gives no result within ``--limit`` seconds (every rank's threads' stacks are then
printed to the run's output, 15 s before) or the run does not end within its limit; it fails
when it ends in any other way than 0. ``--logs DIR`` keeps every run's output (each
scenario's seconds, and what went wrong). Prints the hangs and failures per run and in
total; exits 1 if any.
"""
import argparse
import concurrent.futures
import os
import sys
import tempfile
import time
from typing import List, Optional, Sequence, Tuple

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if not __package__:  # run as a script: tests.* from this checkout
    sys.path.insert(0, ROOT)
from tests.worlds import Job  # noqa: E402

SCENARIOS = ("against_ddp", "many_runs", "state_world")
#: The most one scenario may take (they take about 15, 10 and 3 s on 2 idle cores).
LIMIT_S = 90.0
#: What a hung scenario says (``tests.worlds.World``).
HUNG = "gave no result in"


def _one(scenarios: Sequence[str], limit_s: float, fresh: bool) -> None:
    """One run: a world, the scenarios in order (``fresh``: each in a world of its own);
    raises at the first that fails."""
    from tests.parallel import powersgd_scenarios
    from tests.parallel.test_powersgd import DDP_CASES
    from tests.worlds import World

    world = World(2, limit_s=limit_s)
    with tempfile.TemporaryDirectory(prefix="psgd-stress-") as path:
        args = {
            "against_ddp": ([DDP_CASES[n] for n in sorted(DDP_CASES)],),
            "many_runs": (10, 50),
            "state_world": (path,),
        }
        try:
            for name in scenarios:
                started = time.monotonic()
                world.run(getattr(powersgd_scenarios, name), *args[name])
                if fresh:
                    world.close()
                print(f"{name}: {time.monotonic() - started:.1f} s", flush=True)
        finally:
            world.close()


def run_once(scenarios: Sequence[str], limit_s: float, fresh: bool, logs: Optional[str],
             number: int) -> Tuple[str, str]:
    """One run in a process of its own: ("passed" | "hung" | "failed", its last line)."""
    job = Job()
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [ROOT, os.environ.get(
        "PYTHONPATH")])))
    job.start([sys.executable, os.path.abspath(__file__), "--one", ",".join(scenarios),
               "--limit", str(limit_s)] + (["--fresh"] if fresh else []), env=env, cwd=ROOT,
              session=True)
    code = job.wait(limit_s * len(scenarios) + 60.0)[0]
    text = job.text(0)
    outcome = "passed" if code == 0 else "hung" if code is None or HUNG in text else "failed"
    if logs:
        os.makedirs(logs, exist_ok=True)
        with open(os.path.join(logs, f"run{number:03d}-{outcome}.log"), "w") as f:
            f.write(text)
    if outcome == "passed":
        return outcome, ""
    said = [line for line in text.splitlines() if "Error" in line or HUNG in line] or [""]
    return outcome, said[-1].strip()


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=50)
    parser.add_argument("--parallel", type=int, default=1, help="runs at a time (2 ranks each)")
    parser.add_argument("--only", default=",".join(SCENARIOS),
                        help=f"comma-separated, in order, among {', '.join(SCENARIOS)}")
    parser.add_argument("--limit", type=float, default=LIMIT_S, help="seconds per scenario")
    parser.add_argument("--logs", help="a folder for the output of every run")
    parser.add_argument("--fresh", action="store_true",
                        help="each scenario in a world of its own (three worlds a run)")
    parser.add_argument("--one", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.one:
        _one(args.one.split(","), args.limit, args.fresh)
        return 0
    scenarios = [s for s in args.only.split(",") if s]
    for s in scenarios:
        if s not in SCENARIOS:
            parser.error(f"unknown scenario {s!r} (expected among {', '.join(SCENARIOS)})")
    start = time.monotonic()
    outcomes: List[Tuple[str, str]] = []
    with concurrent.futures.ThreadPoolExecutor(max(1, args.parallel)) as pool:
        for k, (outcome, said) in enumerate(pool.map(
                lambda n: run_once(scenarios, args.limit, args.fresh, args.logs, n),
                range(args.runs))):
            outcomes.append((outcome, said))
            if outcome != "passed":
                print(f"run {k}: {outcome}: {said}", flush=True)
    hung = sum(o == "hung" for o, _ in outcomes)
    failed = sum(o == "failed" for o, _ in outcomes)
    layout = "a world per scenario" if args.fresh else "one world"
    print(f"{','.join(scenarios)} ({layout}): {hung}/{len(outcomes)} hung, {failed}/{len(outcomes)} "
          f"failed otherwise ({time.monotonic() - start:.0f} s)")
    return 1 if hung or failed else 0


if __name__ == "__main__":
    sys.exit(main())
