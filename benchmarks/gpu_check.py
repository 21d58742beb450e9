"""The prepared GPU check: the CUDA tests and the ``--device cuda`` benchmarks, one command.

    python benchmarks/gpu_check.py OUTDIR              # on a machine with one GPU
    python benchmarks/gpu_check.py --dry-run OUTDIR    # the same steps on the CPU, small

Made for the GPU machine a session is sometimes lent: one GPU, torch 2.11 with CUDA, no
network, the project copied there as a working tree (not installed). Nothing is installed
or downloaded: every step runs ``sys.executable`` with ``PYTHONPATH`` set to this checkout.
The steps, each in its own process group and bounded (killed at its limit, and every step's
limit cut to what is left of ``TOTAL_S``, 510 s: with the kills' grace the whole stays
under 9 minutes):

==============  ===================================================================  ======
step            command                                                              limit
==============  ===================================================================  ======
env             torch, CUDA and the GPU's name and memory; ``nvidia-smi``             30 s
tests           ``python -m pytest -m cuda tests/cuda -rs`` (junit XML beside it)    260 s
functional      ``benchmarks/functional.py --device cuda --repeats 3 --markdown``   140 s
rpc_step        ``benchmarks/rpc_step.py --device cuda --repeats 3
                --concurrent-steps 10 --markdown``                                    80 s
==============  ===================================================================  ======

Each step writes ``OUTDIR/<step>.log`` (its stdout and stderr); ``OUTDIR/summary.md`` gathers
the GPU, torch's version, each step's exit status and time, the tests' passed / failed /
skipped / error counts (from the junit XML) and each benchmark's table. The exit status is
0 when every step exited 0 in time, 1 otherwise.

``--dry-run`` runs the same steps with ``CUDA_VISIBLE_DEVICES=""``: the tests are collected
and skip ("no CUDA device"), and the benchmarks run with ``--device cpu`` on one class
(SGD) and one case (``small``), once: a check of this script, the commands' options and the
summary, in about 20 s (``tests/benchmarks/test_gpu_check.py``), not of the GPU.
"""
import argparse
import os
import re
import signal
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from typing import Dict, List, NamedTuple, Optional, Sequence

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
#: The whole check's budget: every step's limit is cut to what is left of it.
TOTAL_S = 510.0
#: After a step's limit, SIGTERM to its process group, then this long before SIGKILL.
GRACE_S = 5.0

ENV_SCRIPT = r"""
import platform, sys
import torch
print(f"python {platform.python_version()}; torch {torch.__version__}; "
      f"CUDA {torch.version.cuda}; cuda available: {torch.cuda.is_available()}")
if torch.cuda.is_available():
    p = torch.cuda.get_device_properties(0)
    print(f"GPU: {torch.cuda.get_device_name(0)}, {p.total_memory / 2**30:.0f} GiB, "
          f"compute capability {p.major}.{p.minor}, {torch.cuda.device_count()} device(s)")
else:
    print("GPU: none")
for name in ("numpy", "pytest"):
    try:
        module = __import__(name)
        print(f"{name} {module.__version__}")
    except ImportError:
        print(f"{name}: not installed")
"""


class Step(NamedTuple):
    """One step: its name (and log file), its command, its limit in seconds."""

    name: str
    argv: List[str]
    limit_s: float


def steps(outdir: str, dry_run: bool) -> List[Step]:
    """The check's steps, in order (``--dry-run``: on the CPU, small)."""
    py = sys.executable
    # In this one process (no xdist workers, installed or not): one GPU, and the progress
    # line that ``progress_counts`` reads when the step is killed before its junit XML.
    tests = [py, "-m", "pytest", "-m", "cuda", "tests/cuda", "-q", "-rs", "-p", "no:xdist",
             "-p", "no:cacheprovider", f"--junitxml={os.path.join(outdir, 'tests.xml')}"]
    if dry_run:
        functional = ["--device", "cpu", "--repeats", "1", "--only", "SGD"]
        rpc_step = ["--device", "cpu", "--repeats", "1", "--only", "small"]
    else:
        functional = ["--device", "cuda", "--repeats", "3"]
        rpc_step = ["--device", "cuda", "--repeats", "3", "--concurrent-steps", "10"]
    return [
        Step("env", [py, "-c", ENV_SCRIPT], 30.0),
        Step("tests", tests, 260.0),
        Step("functional", [py, "benchmarks/functional.py", *functional, "--markdown"], 140.0),
        Step("rpc_step", [py, "benchmarks/rpc_step.py", *rpc_step, "--markdown"], 80.0),
    ]


class Outcome(NamedTuple):
    status: Optional[int]  #: the exit status; None: killed at its limit
    seconds: float


def run_step(step: Step, outdir: str, env: Dict[str, str], limit_s: float) -> Outcome:
    """Run ``step`` in the checkout, its output into ``OUTDIR/<name>.log``, killed (its
    whole process group: pytest's and the benchmarks' worker processes too) at ``limit_s``."""
    log_path = os.path.join(outdir, f"{step.name}.log")
    start = time.monotonic()
    with open(log_path, "w") as log:
        log.write(f"$ {' '.join(step.argv)}\n(limit {limit_s:.0f} s)\n\n")
        log.flush()
        proc = subprocess.Popen(step.argv, cwd=ROOT, env=env, stdout=log,
                                stderr=subprocess.STDOUT, start_new_session=True)
        try:
            status: Optional[int] = proc.wait(timeout=max(1.0, limit_s))
        except subprocess.TimeoutExpired:
            status = None
            _kill_group(proc)
        seconds = time.monotonic() - start
        if status is None:
            log.write(f"\n[gpu_check: killed at its limit of {limit_s:.0f} s]\n")
        if step.name == "env" and env.get("CUDA_VISIBLE_DEVICES") != "":
            log.flush()
            _append_nvidia_smi(log)
    return Outcome(status, seconds)


def _kill_group(proc: "subprocess.Popen[bytes]") -> None:
    for sig, wait_s in ((signal.SIGTERM, GRACE_S), (signal.SIGKILL, GRACE_S)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=wait_s)
            return
        except subprocess.TimeoutExpired:
            continue


def _append_nvidia_smi(log) -> None:
    try:
        out = subprocess.run(["nvidia-smi"], capture_output=True, text=True, timeout=15)
        log.write("\n$ nvidia-smi\n" + out.stdout + out.stderr)
    except (OSError, subprocess.TimeoutExpired) as error:
        log.write(f"\nnvidia-smi: {type(error).__name__}: {error}\n")


def test_counts(xml_path: str) -> Optional[Dict[str, int]]:
    """passed / failed / errors / skipped from pytest's junit XML (None: no readable file)."""
    try:
        root = ET.parse(xml_path).getroot()
    except (OSError, ET.ParseError):
        return None
    suites = [root] if root.tag == "testsuite" else list(root.iter("testsuite"))
    counts = {"tests": 0, "failures": 0, "errors": 0, "skipped": 0}
    for suite in suites:
        for key in counts:
            counts[key] += int(suite.get(key, 0))
    passed = counts["tests"] - counts["failures"] - counts["errors"] - counts["skipped"]
    return {"passed": passed, "failed": counts["failures"], "errors": counts["errors"],
            "skipped": counts["skipped"]}


def progress_counts(log_text: str) -> Optional[Dict[str, int]]:
    """passed / failed / errors / skipped counted from ``pytest -q``'s progress lines
    (``..F.s  [ 42%]``), for a run killed before it wrote its junit XML (None: none)."""
    marks = "".join(m.group(1) for m in re.finditer(r"^([.FEsxX]+)\s*\[\s*\d+%\]\s*$",
                                                    log_text, re.M))
    if not marks:
        return None
    return {"passed": marks.count(".") + marks.count("X"), "failed": marks.count("F"),
            "errors": marks.count("E"), "skipped": marks.count("s") + marks.count("x")}


def _table(log_text: str) -> str:
    """A benchmark's report: its output from the machine line on, without the logs
    (lines of a markdown table, the machine line and the run time)."""
    keep = [line for line in log_text.splitlines()
            if line.startswith("|") or line.startswith("machine:") or line.startswith("run time")
            or line.startswith("#")]
    return "\n".join(keep) if keep else "(no table: see the log)"


def summary(outdir: str, dry_run: bool, run: Sequence[Step],
            outcomes: Dict[str, Outcome], total_s: float) -> str:
    """``summary.md``'s text."""
    def read(name: str) -> str:
        try:
            with open(os.path.join(outdir, f"{name}.log")) as f:
                return f.read()
        except OSError:
            return ""

    env_text = read("env")
    versions = re.search(r"^python .*$", env_text, re.M)
    gpu = re.search(r"^GPU: .*$", env_text, re.M)
    lines = [f"# GPU check{' (dry run, CPU)' if dry_run else ''}", "",
             f"- {gpu.group(0) if gpu else 'GPU: unknown (see env.log)'}",
             f"- {versions.group(0) if versions else 'torch: unknown (see env.log)'}",
             f"- total {total_s:.0f} s (budget {TOTAL_S:.0f} s)", "",
             "| step | exit status | seconds | log |", "|---|---|---:|---|"]
    for step in run:
        outcome = outcomes.get(step.name)
        if outcome is None:
            lines.append(f"| {step.name} | not run (no time left) | | |")
            continue
        status = "killed at its limit" if outcome.status is None else str(outcome.status)
        lines.append(f"| {step.name} | {status} | {outcome.seconds:.0f} | {step.name}.log |")
    counts = test_counts(os.path.join(outdir, "tests.xml"))
    lines += ["", "## tests", ""]
    if counts is None:  # killed before pytest wrote it: count its progress characters
        counts = progress_counts(read("tests"))
        lines.append("no junit XML (killed at its limit?); from pytest's progress lines:")
    if counts is not None:
        lines.append(", ".join(f"{v} {k}" for k, v in counts.items()))
        tail = [ln for ln in read("tests").splitlines() if ln.startswith(("FAILED", "ERROR"))]
        lines += [""] + [f"    {ln}" for ln in tail[:40]]
    for name in ("functional", "rpc_step"):
        if any(s.name == name for s in run):
            lines += ["", f"## {name}", "", _table(read(name))]
    return "\n".join(lines) + "\n"


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("outdir", help="where the logs and summary.md go (created)")
    parser.add_argument("--dry-run", action="store_true",
                        help="the same steps on the CPU, small (checks the script, not a GPU)")
    args = parser.parse_args(argv)
    outdir = os.path.abspath(args.outdir)
    os.makedirs(outdir, exist_ok=True)
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [ROOT, env.get("PYTHONPATH")]))
    env["PYTHONUNBUFFERED"] = "1"
    if args.dry_run:
        env["CUDA_VISIBLE_DEVICES"] = ""
    start = time.monotonic()
    run = steps(outdir, args.dry_run)
    outcomes: Dict[str, Outcome] = {}
    for step in run:
        left = TOTAL_S - (time.monotonic() - start)
        if left < 5.0:
            break
        outcomes[step.name] = run_step(step, outdir, env, min(step.limit_s, left))
        print(f"{step.name}: exit status {outcomes[step.name].status} in "
              f"{outcomes[step.name].seconds:.0f} s", flush=True)
    total = time.monotonic() - start
    text = summary(outdir, args.dry_run, run, outcomes, total)
    with open(os.path.join(outdir, "summary.md"), "w") as f:
        f.write(text)
    print(text, flush=True)
    ok = len(outcomes) == len(run) and all(o.status == 0 for o in outcomes.values())
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
