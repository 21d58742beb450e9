"""What the test folders share: exact equality of nested values (state dicts, checkpoints),
the tolerances of the comparisons with torch.optim, errors as plain data, and threads whose
errors reach the test.

Light to import: the ranks of a gloo world (tests/worlds.py) import it too.
"""
import threading
from typing import Any, Callable, List, Sequence

import torch

#: The tolerances of the parity tests against torch.optim (``torch.testing.assert_close``).
RTOL, ATOL = 1e-5, 1e-6


def assert_identical(got: Any, want: Any, where: str = "") -> None:
    """Equal structure, equal tensors bit for bit (layout, dtype, shape, values; a sparse
    COO tensor's indices and values once coalesced); the first difference is named by its
    path in ``where``."""
    if isinstance(want, torch.Tensor):
        assert isinstance(got, torch.Tensor), where
        assert (got.layout, got.dtype, got.shape) == (want.layout, want.dtype, want.shape), (
            f"{where}: {got.layout}, {got.dtype}, {tuple(got.shape)} (expected {want.layout}, "
            f"{want.dtype}, {tuple(want.shape)})")
        if want.layout == torch.sparse_coo:
            got, want = got.coalesce(), want.coalesce()
            assert torch.equal(got.indices(), want.indices()), f"{where}: indices differ"
            got, want = got.values(), want.values()
        elif want.layout != torch.strided:
            got, want = got.to_dense(), want.to_dense()
        assert torch.equal(got, want), f"{where}: tensors differ"
    elif isinstance(want, dict):
        assert isinstance(got, dict) and got.keys() == want.keys(), (where, got, want)
        for key in want:
            assert_identical(got[key], want[key], f"{where}/{key}")
    elif isinstance(want, (list, tuple)):
        assert isinstance(got, (list, tuple)) and len(got) == len(want), where
        for i, (g, w) in enumerate(zip(got, want)):
            assert_identical(g, w, f"{where}[{i}]")
    else:
        assert got == want, f"{where}: {got!r} != {want!r}"


def identical(got: Any, want: Any) -> bool:
    """``assert_identical`` as a truth value (for code that reports rather than asserts)."""
    try:
        assert_identical(got, want)
    except AssertionError:
        return False
    return True


def assert_all_close(actual: Sequence[torch.Tensor], expected: Sequence[torch.Tensor],
                     what: str) -> None:
    """Each tensor of ``actual`` close to its peer in ``expected`` (``RTOL``, ``ATOL``),
    the first that is not named ``what[i]``."""
    for i, (a, e) in enumerate(zip(actual, expected)):
        torch.testing.assert_close(a.detach(), e.detach(), rtol=RTOL, atol=ATOL, msg=f"{what}[{i}]")


def max_close(a: torch.Tensor, b: torch.Tensor, tol: float = 1e-5) -> bool:
    """Whether the largest difference of ``a`` from ``b`` is within ``tol`` plus ``tol``
    times the largest magnitude in ``b``."""
    return float((a - b).abs().max()) <= tol + tol * float(b.abs().max())


def error_of(call: Callable[[], Any]) -> str:
    """What ``call()`` raised, as ``"<class name>: <message>"``, or "no error"."""
    try:
        call()
    except Exception as exc:  # noqa: B902 - reported to the test
        return f"{type(exc).__name__}: {exc}"
    return "no error"


def assert_named_error(message: str, kind: str, words: str) -> None:
    """``message`` (``error_of``'s) is an error of class ``kind`` whose text holds ``words``."""
    assert message.startswith(kind + ":"), message
    assert words in message, message


def run_in_threads(targets: List[Callable[[], Any]]) -> None:
    """Run each target in its own thread; re-raise the first error once all are done."""
    errors: List[BaseException] = []

    def guarded(target: Callable[[], Any]) -> None:
        try:
            target()
        except BaseException as exc:  # reported below, in the test's thread
            errors.append(exc)

    threads = [threading.Thread(target=guarded, args=(t,)) for t in targets]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
