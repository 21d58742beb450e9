"""Where a DataParallelOptimizer is between steps: one status object instead of flags.

``StepStatus`` is the one place the engine (``distopt.parallel.engine``) keeps what decides
its next step: whether the next window's buckets may step during backward (``Overlap``,
with the reason when they may not), whether this window's do, whether any state exists yet,
whether the buckets are still to be cut again after the first step, whether the optimizer
is closed, and how many steps and loads have changed the state. The reducer keeps the
window's own bookkeeping (reducing, broken, poisoned: ``distopt.parallel.reducer``).
"""
import enum

__all__ = ["Overlap", "StepStatus"]


class Overlap(enum.Enum):
    """Whether the next window's buckets step as they arrive, during backward; the value
    says why they wait for ``step()`` when they do not."""

    #: No ``step()`` has yet shown the gradients unscaled (the first step waits).
    FIRST_STEP = "no step() has yet come without a GradScaler"
    #: The last ``step()`` came from a GradScaler: the next waits for its inf/NaN check.
    SCALED = "the last step() came from a GradScaler"
    #: The buckets step during backward.
    DURING_BACKWARD = "steps during backward"
    #: A step found ``.grad`` changed between backward and ``step()`` on some rank
    #: (clipping): every later step waits and steps what ``.grad`` holds. Final.
    GRADS_EDITED = "the loop changes .grad between backward and step()"
    #: ``overlap=False`` or an eager class: every step waits. Final.
    OFF = "overlap=False, or a class that steps eagerly"

    def final(self) -> bool:
        """Whether no later step changes it."""
        return self in (Overlap.GRADS_EDITED, Overlap.OFF)


class StepStatus:
    """The engine's status between and during steps.

    Attributes:
        overlap: whether the next window steps during backward (``Overlap``).
        in_backward: whether the window now open steps (stepped) its buckets during backward,
            decided as it opened.
        fresh: no step taken and no state loaded yet: there is no optimizer state anywhere.
        rebuild_pending: the buckets are cut again, in the order of the first step's
            gradients, at the end of that step.
        closed: ``close()`` was called (or a newer optimizer took the parameters).
        generation: counts the steps and loads: what a consolidated state_dict was taken at.
    """

    __slots__ = ("overlap", "in_backward", "fresh", "rebuild_pending", "closed", "generation")

    def __init__(self, overlaps: bool) -> None:
        self.overlap = Overlap.FIRST_STEP if overlaps else Overlap.OFF
        self.in_backward = False
        self.fresh = True
        self.rebuild_pending = False  # set once the reducer exists
        self.closed = False
        self.generation = 0

    def steps_in_backward(self) -> bool:
        """Whether a window that opens now steps its buckets during backward."""
        return self.overlap is Overlap.DURING_BACKWARD

    def stepped(self, scaled: bool) -> None:
        """A ``step()`` came, from a GradScaler (``scaled``) or not: what the next window
        may do."""
        if not self.overlap.final():
            self.overlap = Overlap.SCALED if scaled else Overlap.DURING_BACKWARD

    def grads_edited(self) -> None:
        """Some rank changed ``.grad`` between backward and ``step()``: every later step
        waits."""
        if self.overlap is not Overlap.OFF:
            self.overlap = Overlap.GRADS_EDITED

    def __repr__(self) -> str:
        return (f"StepStatus(overlap={self.overlap.name}, in_backward={self.in_backward}, "
                f"fresh={self.fresh}, rebuild_pending={self.rebuild_pending}, "
                f"closed={self.closed}, generation={self.generation})")
