"""What goes wrong on owners, and how the trainer reports it: one error naming every worker."""
import dataclasses
import functools
import logging
import pickle
from typing import Any, Callable, Dict, List, Optional, Tuple

logger = logging.getLogger(__name__)


class DistributedOptimizerError(RuntimeError):
    """One or more workers failed to create or step their local optimizer.

    The message has one line per failing worker, ``<worker>: <remote message>``; the same
    pairs are in ``failures``. The first worker's exception is chained as ``__cause__``.
    ``succeeded`` names the workers whose part of the same round succeeded: after a failed
    ``step`` those owners have applied it. ``applied`` says what each failing owner of a
    step did: ``"none"`` (nothing stepped there: its gradients were refused before any
    group stepped, or its step was refused), ``"part"`` (its line says which param groups
    or parameters stepped), ``"maybe"`` (an eager optimizer raised inside its step() and no
    version counter moved: changes through ``.data`` would not show); an owner missing from
    it gave no word (it did not reply, and may have stepped). The step's last line sums this up; wherever it says the parameters
    mix two steps, loading the last checkpoint gets back to one consistent state.

    Args:
        message: the whole message.
        failures: worker name -> that worker's one-line message.
        succeeded: the workers whose call of the round succeeded.
        applied: failing worker name -> ``"none"``, ``"part"`` or ``"maybe"``, for a step.
    """

    def __init__(self, message: str, failures: Optional[Dict[str, str]] = None,
                 succeeded: Optional[List[str]] = None,
                 applied: Optional[Dict[str, str]] = None) -> None:
        super().__init__(message)
        self.failures: Dict[str, str] = dict(failures or {})
        self.succeeded: List[str] = list(succeeded or [])
        self.applied: Dict[str, str] = dict(applied or {})

    def __reduce__(
        self,
    ) -> Tuple[type, Tuple[str, Dict[str, str], List[str], Dict[str, str]]]:
        # Keep ``failures`` when the error itself crosses an RPC (a trainer run remotely).
        return (type(self), (str(self), self.failures, self.succeeded, self.applied))


class InvalidStateError(DistributedOptimizerError, ValueError):
    """Owners refused a state (``load_state_dict``, ``load``): a key missing, or a tensor of
    another shape, dtype or device. A ValueError, as for a bad state checked on the trainer,
    and a DistributedOptimizerError naming every refusing worker; nothing was changed."""


def compose_error(action: str, failures: Dict[str, str],
                  succeeded: Optional[List[str]] = None,
                  applied: Optional[Dict[str, str]] = None) -> DistributedOptimizerError:
    """The error for ``failures`` (worker name -> message), e.g. action ``"step"``;
    ``succeeded``: the workers whose call of the round succeeded; ``applied``: what each
    failing owner of a step applied (see DistributedOptimizerError).

    An InvalidStateError when every worker refused its input with a ValueError in a round
    that loads state.
    """
    succeeded = list(succeeded or [])
    applied = {w: a for w, a in (applied or {}).items() if w in failures}
    lines = [f"DistributedOptimizer {action} failed on {len(failures)} worker(s):"]
    lines.extend(f"  {worker}: {message}" for worker, message in failures.items())
    if action == "step":
        lines.append(_step_summary(list(failures), succeeded, applied))
    refused = action in ("load", "load_state_dict") and all(
        m.startswith("ValueError") for m in failures.values()
    )
    cls = InvalidStateError if refused else DistributedOptimizerError
    return cls("\n".join(lines), failures, succeeded, applied)


def _step_summary(failed: List[str], succeeded: List[str], applied: Dict[str, str]) -> str:
    """The last line of a failed step's error: what each owner applied, and what that
    leaves the parameters in."""
    none = [w for w in failed if applied.get(w) == "none"]
    part = [w for w in failed if applied.get(w) == "part"]
    maybe = [w for w in failed if applied.get(w) == "maybe"]
    unknown = [w for w in failed if w not in applied]
    said = []
    if succeeded:
        said.append(f"applied on {succeeded} (every parameter there with a gradient stepped)")
    if part:
        lines = "its line" if len(part) == 1 else "their lines"
        said.append(f"partly applied on {part} (see {lines})")
    if none:
        said.append(f"not applied on {none} (their parameters hold the previous step)")
    if maybe:
        lines = "its line" if len(maybe) == 1 else "their lines"
        said.append(f"perhaps partly applied on {maybe} (see {lines})")
    if unknown:
        said.append(f"perhaps applied on {unknown} (no word from there on what it did)")
    unknown = unknown + maybe
    if succeeded or part:
        outcome = ("the parameters now mix this step and the previous one; load() the last "
                   "checkpoint to get back to one consistent state")
    elif unknown:
        outcome = ("the parameters may mix this step and the previous one; load() the last "
                   "checkpoint to get back to one consistent state")
    else:
        outcome = "nothing was stepped anywhere"
    return f"  {'; '.join(said)}: {outcome}"


def one_line(exc: BaseException) -> str:
    """``Type: message`` for ``exc``, its message folded onto one line."""
    text = " ".join(part.strip() for part in str(exc).splitlines() if part.strip())
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def exception_message(exc: BaseException) -> str:
    """``one_line(exc)``; for an error raised in TorchScript code (a compiled step), the
    ``Type: message`` its traceback ends with, as ``transport_message`` gives it."""
    if str(exc).startswith(_TORCHSCRIPT_FAILURE):
        return transport_message(exc)
    return one_line(exc)


def transport_message(exc: BaseException) -> str:
    """One line for an exception from an RPC future that the owner's code did not return.

    RPC folds an exception raised on the callee into ``On WorkerInfo(...):``, its repr and
    its traceback; the traceback's last line is the ``Type: message`` wanted here. A
    TorchScript target's error arrives as TorchScript's traceback, ending the same way.
    """
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    if len(lines) > 1 and lines[0].startswith("On WorkerInfo("):
        return lines[-1]
    if len(lines) > 1 and lines[0].startswith(_TORCHSCRIPT_FAILURE):
        # A TorchScript RPC target's error: its traceback, then ``builtins.Type: message``.
        last = lines[-1]
        return last[len("builtins."):] if last.startswith("builtins.") else last
    return one_line(exc)


_TORCHSCRIPT_FAILURE = "The following operation failed in the TorchScript interpreter."


@dataclasses.dataclass
class RemoteFailure:
    """An owner's failure, returned (not raised) over RPC so that its message arrives intact.

    An exception raised in an RPC function reaches the caller with the owner's traceback
    folded into its message; returning this instead keeps the message exact.

    Attributes:
        message: ``Type: message`` on one line (for an error raised in TorchScript code, the
            ``Type: message`` its traceback ends with).
        exception: the owner's exception itself when it survives pickling, else None.
        applied: for a failed step, what the owner applied: ``"none"``, ``"part"`` or
            ``"maybe"`` (see DistributedOptimizerError); None for other calls.
    """

    message: str
    exception: Optional[BaseException] = None
    applied: Optional[str] = None

    @classmethod
    def from_exception(cls, exc: BaseException, applied: Optional[str] = None,
                       message: Optional[str] = None) -> "RemoteFailure":
        """Describe ``exc`` (as ``message``, if given); called on the owner inside an
        ``except`` block."""
        logger.debug("local optimizer failed", exc_info=exc)
        kept: Optional[BaseException] = None
        try:
            kept = pickle.loads(pickle.dumps(exc))
        except Exception:  # some exception classes cannot be rebuilt from their args
            kept = None
        return cls(message if message is not None else exception_message(exc), kept, applied)

    def as_exception(self) -> BaseException:
        """The owner's exception, or a RuntimeError carrying its message."""
        return self.exception if self.exception is not None else RuntimeError(self.message)


def returns_failure(func: Callable[..., Any]) -> Callable[..., Any]:
    """Decorate an RPC target so that any exception it raises comes back as a RemoteFailure.

    The wrapper keeps the target's name, so RPC still pickles it by reference.
    """

    @functools.wraps(func)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return func(*args, **kwargs)
        except Exception as exc:
            return RemoteFailure.from_exception(exc)

    return wrapper
