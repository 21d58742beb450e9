"""examples/sparse_embedding.py runs end to end, as a user would start it, and its loss falls."""
import re
import subprocess
import sys

import pytest

from tests.examples.test_examples import ROOT, TIMEOUT_S, run_example


@pytest.mark.parametrize(
    "extra",
    [[], ["--optimizer", "SparseAdagrad", "--duplicates", "mean"]],
    ids=["adam-sum", "adagrad-mean"],
)
def test_sparse_embedding_loss_falls(extra):
    out = run_example("sparse_embedding.py", ["--steps", "100", "--log-every", "25", *extra])
    assert "compiled: True" in out, out
    assert re.search(r"^ 100 ", out, re.MULTILINE), out
    match = re.search(r"loss: first ([\d.]+) -> final ([\d.]+)", out)
    assert match, out
    assert float(match.group(2)) < float(match.group(1)), out


def test_bad_table_size_is_rejected():
    proc = subprocess.run(
        [sys.executable, "examples/sparse_embedding.py", "--users", "0"],
        cwd=ROOT, capture_output=True, text=True, timeout=TIMEOUT_S,
    )
    assert proc.returncode == 2
    assert "Invalid --users: 0" in proc.stderr
