"""``benchmarks/gpu_check.py``, the prepared GPU check, run as its CPU dry run: the same
steps, files and summary, the tests collected and skipped ("no CUDA device"), the
benchmarks on the CPU, small. About 20 s on 2 cores; nothing here needs a GPU."""
import os
import subprocess
import sys

from benchmarks import gpu_check

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_the_dry_run_writes_every_steps_log_and_the_summary(tmp_path):
    out = tmp_path / "check"
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}  # the script sets it
    done = subprocess.run([sys.executable, "benchmarks/gpu_check.py", "--dry-run", str(out)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stdout + done.stderr
    assert sorted(os.listdir(out)) == ["env.log", "functional.log", "rpc_step.log",
                                       "summary.md", "tests.log", "tests.xml"]
    summary = (out / "summary.md").read_text()
    assert summary.startswith("# GPU check (dry run, CPU)")
    assert "- GPU: none" in summary and "torch 2." in summary
    for name in ("env", "tests", "functional", "rpc_step"):
        assert f"| {name} | 0 |" in summary
    counts = gpu_check.test_counts(str(out / "tests.xml"))
    assert counts["passed"] == counts["failed"] == counts["errors"] == 0
    assert counts["skipped"] > 100  # every CUDA test, skipped: "no CUDA device"
    assert f"0 passed, 0 failed, 0 errors, {counts['skipped']} skipped" in summary
    assert "no CUDA device" in (out / "tests.log").read_text()
    # each benchmark's table, in its log and in the summary
    assert "| SGD | 1 x 4M |" in summary and "| SGD | 2000 x 32 |" in summary
    assert "| small (64x1024@owner1" in summary
    assert "--device cpu" in (out / "functional.log").read_text().splitlines()[0]


def test_the_gpu_run_asks_for_the_gpu_within_nine_minutes(tmp_path):
    steps = gpu_check.steps(str(tmp_path), dry_run=False)
    assert [s.name for s in steps] == ["env", "tests", "functional", "rpc_step"]
    commands = {s.name: " ".join(s.argv) for s in steps}
    assert "-m pytest -m cuda tests/cuda" in commands["tests"]
    assert "benchmarks/functional.py --device cuda" in commands["functional"]
    assert "benchmarks/rpc_step.py --device cuda" in commands["rpc_step"]
    # Every step killed at its limit: each later limit is cut to what is left of TOTAL_S,
    # so only the last kill's grace comes on top (and a few seconds for the summary).
    assert sum(s.limit_s for s in steps) <= gpu_check.TOTAL_S
    assert gpu_check.TOTAL_S + 2 * gpu_check.GRACE_S + 10 < 9 * 60


def test_test_counts_read_pytests_junit_xml(tmp_path):
    xml = tmp_path / "t.xml"
    xml.write_text('<?xml version="1.0"?><testsuites><testsuite name="pytest" errors="1" '
                   'failures="2" skipped="3" tests="10"></testsuite></testsuites>')
    assert gpu_check.test_counts(str(xml)) == {"passed": 4, "failed": 2, "errors": 1,
                                               "skipped": 3}
    assert gpu_check.test_counts(str(tmp_path / "missing.xml")) is None


def test_progress_counts_stand_in_for_a_killed_run():
    log = "$ python -m pytest\n..F.s          [ 40%]\nsssE.          [100%]\nFAILED x\n"
    assert gpu_check.progress_counts(log) == {"passed": 4, "failed": 1, "errors": 1,
                                             "skipped": 4}
    assert gpu_check.progress_counts("no progress here") is None
