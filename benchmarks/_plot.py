"""matplotlib for the benchmarks' pictures, imported only when one is asked for.

Plotting is an extra (``pip install -e ".[bench]"``), never a dependency of the library or
of the benchmarks' tables.
"""
from typing import Any

#: What a benchmark says when ``--timeline`` / ``--plot`` is given without matplotlib.
MISSING = ("{option} needs matplotlib, which is not installed (expected: "
           "pip install -e \".[bench]\" from the repository root)")


def pyplot(option: str) -> Any:
    """``matplotlib.pyplot`` on the file-only Agg backend.

    Args:
        option: the command-line option that wants it, for the error.

    Raises:
        SystemExit: matplotlib is not installed; the message names the extra to install.
    """
    try:
        import matplotlib
    except ImportError:
        raise SystemExit(MISSING.format(option=option)) from None
    matplotlib.use("Agg")  # files only: no display here
    import matplotlib.pyplot as plt

    return plt
