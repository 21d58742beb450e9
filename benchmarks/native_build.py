"""How long the first ``import distopt`` takes to build the native libraries, a cached import,
and an import after a build that was killed half way (``functional/_native.py``).

Each run uses a fresh ``TORCH_EXTENSIONS_DIR`` under a temporary directory, so the machine's
own cache is left alone:

- "fresh": ``import distopt`` with an empty cache (both libraries compiled);
- "cached": the same import again (both loaded);
- "after kill": an import is started with an empty cache and killed (SIGKILL, the Python
  process alone, as the OOM killer does: its ninja and compiler run on) once its first
  compile has started; then ``import distopt`` is timed until it returns. With torch
  2.13's lock file alone that import never returned.

Prints each run as it goes, then the median of each. ``--runs N`` (default 1),
``--bound S`` (seconds any one import may take before the script gives up, default 600).
Run: ``python benchmarks/native_build.py``.
"""
import argparse
import os
import select
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Dict, List

_HERE = os.path.dirname(os.path.abspath(__file__))
_ROOT = os.path.dirname(_HERE)
sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != _HERE]
if _ROOT not in [os.path.abspath(p or os.curdir) for p in sys.path]:
    sys.path.insert(0, _ROOT)

from benchmarks._machine import machine  # noqa: E402

IMPORT = "import distopt, functional._native as n; assert n.AVAILABLE and n.KERNELS, 'not built'"


def _import(env: Dict[str, str], bound: float) -> float:
    started = time.perf_counter()
    done = subprocess.run([sys.executable, "-c", IMPORT], env=env, cwd=_ROOT, capture_output=True,
                          text=True, timeout=bound)
    took = time.perf_counter() - started
    if done.returncode != 0:
        raise SystemExit(f"import failed:\n{done.stderr}")
    return took


def _killed_then_import(env: Dict[str, str], bound: float) -> float:
    """Start an import, kill it once it compiles, and time the next one."""
    first = subprocess.Popen([sys.executable, "-c", IMPORT], env=env, cwd=_ROOT,
                             stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    seen = ""
    deadline = time.monotonic() + bound
    while "compiling" not in seen:
        left = deadline - time.monotonic()
        if left <= 0 or not select.select([first.stderr], [], [], left)[0]:
            first.kill()
            raise SystemExit(f"the first import never started compiling: {seen}")
        line = first.stderr.readline()
        if not line:
            raise SystemExit(f"the first import ended before compiling: {seen}")
        seen += line
    # The message comes before torch's load takes its lock file and starts ninja: wait for
    # the lock file, so that the kill lands in the compile.
    root = env["TORCH_EXTENSIONS_DIR"]
    while not any(os.path.exists(os.path.join(d, "lock")) for d, _, _ in os.walk(root)):
        if time.monotonic() > deadline or first.poll() is not None:
            raise SystemExit("the first import never took torch's build lock")
        time.sleep(0.01)
    os.kill(first.pid, signal.SIGKILL)
    first.wait()
    return _import(env, bound)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=1)
    parser.add_argument("--bound", type=float, default=600.0)
    args = parser.parse_args()
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    print(f"# native build: {machine()}, load average {load:.1f}, {args.runs} run(s)", flush=True)
    times: Dict[str, List[float]] = {"fresh": [], "cached": [], "after kill": []}
    for run in range(args.runs):
        with tempfile.TemporaryDirectory() as cache:
            env = dict(os.environ, TORCH_EXTENSIONS_DIR=os.path.join(cache, "fresh"))
            times["fresh"].append(_import(env, args.bound))
            times["cached"].append(_import(env, args.bound))
            env["TORCH_EXTENSIONS_DIR"] = os.path.join(cache, "killed")
            times["after kill"].append(_killed_then_import(env, args.bound))
        print(f"run {run + 1}: " + ", ".join(f"{k} {v[-1]:.1f} s" for k, v in times.items()), flush=True)
    print("| import | median s |\n|---|---|")
    for what, values in times.items():
        print(f"| {what} | {statistics.median(values):.1f} |")


if __name__ == "__main__":
    main()
